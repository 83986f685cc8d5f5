"""A warm ``python`` for the tests' processes (the benchmark scripts, the launchers, ``tests/launch.py``'s fork server):
each call of :func:`warm_python`'s executable runs its script (``SCRIPT ARGS``, ``-m MODULE ARGS`` or ``-c CODE
ARGS``, after the interpreter's options ``-u`` and ``-W`` if given) in a process forked from one interpreter that has
already imported torch, Lightning and lightning_mpx (``python tests/warm_python.py --serve SOCKET SHIM``).

A benchmark script run as a child process (``gpu_suite.py all --check`` runs nine, ``step.py`` one per variant) paid
``import lightning`` again each time: about 6.5 s of CPU on these machines. The scripts start their children with
``sys.executable``; in a process started through the warm executable ``sys.executable`` is that executable again, so
the children of a script started from it start warm as well, and so do the processes multiprocessing's ``spawn``
starts (``strategy="ddp_spawn"``: its executable is set to it). Each run is still a process of its own: ``__main__``
is the script, with its own ``sys.argv``, environment (replaced whole, as ``exec`` does), working directory,
descriptors (the caller's standard streams and those it passed down, at their numbers, over the socket) and exit
code; modules other than the preloaded ones are imported afresh (``TRITON_INTERPRET``, read when lightning_mpx's
Triton kernels are decorated, is the run's own).

The executable is a few lines of standard library (``python -I -S``): it hands its arguments, environment, working
directory and open descriptors to the server and exits with the run's code. The server forks a monitor in a session
of its own per run, which forks the run: when the caller dies (a timeout kills its process group), the monitor sees
the socket close and kills the run's session.
"""

from __future__ import annotations

import array
import atexit
import fcntl
import functools
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: What the benchmark scripts import: paid once, in the server, before the forks.
_PRELOAD = ("torch", "torch.distributed", "lightning.pytorch", "lightning.fabric", "lightning_mpx")
#: What those imports depend on in the environment: a run whose value differs starts cold (``--cold``).
_IMPORT_ENV = ("TRITON_INTERPRET",)
#: The most descriptors a run takes from its caller (0-2 and those passed down to it).
_MAX_FDS = 64
#: Interpreter options a run takes and has no use for here (``multiprocessing`` passes the parent's on): the process
#: is started already.
_IGNORED_OPTIONS = ("-b", "-bb", "-B", "-d", "-E", "-I", "-O", "-OO", "-P", "-q", "-R", "-s", "-S", "-v")

_SHIM = """#!{python} -IS
import array, json, os, socket, sys
fds = [0, 1, 2]  # and every other descriptor the caller passed down (multiprocessing's spawn passes its pipes)
for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
    try:
        if int(name) > 2 and os.fstat(int(name)):
            fds.append(int(name))
    except OSError:  # the listing's own descriptor, closed by now
        pass
if len(fds) > {max_fds}:
    sys.exit("warm_python: more than {max_fds} descriptors to pass on")
s = socket.socket(socket.AF_UNIX)
s.connect({socket!r})
s.sendmsg([json.dumps({{"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(), "fds": fds}}).encode()
           + b"\\n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
answer = b""
while not answer.endswith(b"\\n"):
    chunk = s.recv(64)
    if not chunk:
        sys.exit("warm_python: the server ended the run without an exit code")
    answer += chunk
sys.exit(int(answer))
"""


def warm_python(**env: str) -> str:
    """This test process's warm executable (its server started at the first call; it ends with this process).

    ``env``: set for the server's imports, one server per distinct import environment. ``TRITON_INTERPRET="1"`` for
    runs that all set it (``gpu_suite.py --check`` and its children): Triton decorates its own helpers when it is
    imported, in the interpreter's mode or not, and torch imports it. The runs' environment is their own all the same.
    A variable of :data:`_IMPORT_ENV` not in ``env`` takes this process's value: the runs inherit it (conftest.py
    sets ``TRITON_INTERPRET=1`` without a GPU), and a server imported without it would start every such run cold
    (stop 63: ``warm_python()`` in the CPU suite served only cold runs, each paying the imports again)."""
    mode = {k: os.environ[k] for k in _IMPORT_ENV if k in os.environ}
    return _server(tuple(sorted({**mode, **env}.items())))


@functools.lru_cache(maxsize=None)
def _server(items: tuple[tuple[str, str], ...]) -> str:
    """:func:`warm_python`'s server for the import environment ``items`` (started once per test process)."""
    env = dict(items)
    folder = tempfile.mkdtemp(prefix="warm_python_")
    sock, shim = os.path.join(folder, "s"), os.path.join(folder, "python")
    Path(shim).write_text(_SHIM.format(python=sys.executable, socket=sock, max_fds=_MAX_FDS))
    os.chmod(shim, 0o755)
    server_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the runs set their own
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", sock, shim], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        env=dict(server_env, PYTHONPATH=str(ROOT), **env), text=True, start_new_session=True,
    )  # fmt: skip
    atexit.register(server.kill)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # the socket and the shim (left in /tmp before)
    assert server.stdout is not None and server.stdout.readline().strip() == "ready", "warm_python: no server"
    return shim


def _serve(sock_path: str, shim: str) -> dict[str, Any]:
    """Accept runs until stdin ends (the test process exited); in a run's process, return its request."""
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(sock_path)
    listener.listen(16)
    print("ready", flush=True)  # runs wait in the backlog while the imports go on (the caller's own start with them)
    for name in _PRELOAD:  # from the repository: the server runs with PYTHONPATH=ROOT
        __import__(name)
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [])
        while True:  # reap the monitors that ended
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if sys.stdin in ready and not sys.stdin.readline():
            os._exit(0)
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        fds = array.array("i")
        message, ancillary, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(_MAX_FDS * fds.itemsize))
        for _level, _type, data in ancillary:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        while not message.endswith(b"\n"):
            message += conn.recv(1 << 20)
        if os.fork() == 0:
            listener.close()
            request = json.loads(message)
            request["python"] = sys.executable
            request["imported_with"] = {k: os.environ.get(k) for k in _IMPORT_ENV}
            return _monitor(conn, list(fds), request, shim)
        conn.close()
        for fd in fds:
            os.close(fd)


def _monitor(conn: socket.socket, fds: list[int], request: dict[str, Any], shim: str) -> dict[str, Any]:
    """A run's session leader: fork the run, answer its exit code, kill the session when the caller goes away."""
    os.setsid()
    sys.stdin.close()
    pid = os.fork()
    if pid == 0:
        conn.close()
        # Each descriptor at its number in the caller (0-2, and those passed down): first out of the way of the
        # numbers (the run has no descriptor of its own beyond 0-2), then into place.
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, 1024) for fd in fds]
        for fd in fds:
            os.close(fd)
        for target, fd in zip(request.get("fds", range(len(moved))), moved):
            os.dup2(fd, target)
            os.close(fd)
        request["shim"] = shim
        return request
    for fd in fds:
        os.close(fd)
    while True:
        if select.select([conn], [], [], 0.2)[0] and not conn.recv(64):  # the caller died: end the run
            os.killpg(0, signal.SIGKILL)
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            os._exit(0)


def _run(request: dict[str, Any]) -> None:
    """Run the request as ``python ARGV`` would, here (a fresh fork of the server) as ``__main__``."""
    import runpy
    import warnings

    argv, unbuffered, warn_options = list(request["argv"]), False, []
    while argv and argv[0].startswith("-") and argv[0] not in ("-m", "-c"):  # the interpreter's own options
        option = argv.pop(0)
        if option == "-u":  # what torchrun (Accelerate's launcher) starts each worker with
            unbuffered = True
        elif option in ("-W", "-X") and argv:
            value = argv.pop(0)
            warn_options += [value] if option == "-W" else []
        elif option.startswith(("-W", "-X")) and len(option) > 2:
            warn_options += [option[2:]] if option.startswith("-W") else []
        elif option not in _IGNORED_OPTIONS:
            sys.exit(f"warm_python: unsupported option {option!r} ([-u] [-W ...] SCRIPT, -m MODULE or -c CODE)")
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the caller's streams, as a start would open them
    sys.stdout = open(1, "w", closefd=False, **({"buffering": 1} if unbuffered else {}))  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    import tempfile

    tempfile.tempdir = None  # the run's TMPDIR, as a start reads it (the server's imports may have cached its own)
    if any(os.environ.get(k) != v for k, v in request["imported_with"].items()):
        # Imported in another mode than this run's (TRITON_INTERPRET): started cold, as the run's own python would,
        # its children still warm (a script that forgot to set the mode for itself fails as it would alone).
        os.execv(request["python"], [request["python"], __file__, "--cold", json.dumps(request)])
    sys.executable = request["shim"]  # the script's own children start warm too
    import multiprocessing.spawn

    multiprocessing.spawn.set_executable(request["shim"])  # and the processes it spawns (strategy="ddp_spawn")
    sys.path[:] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [
        p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)
    ]
    for option in [*filter(None, os.environ.get("PYTHONWARNINGS", "").split(",")), *warn_options]:
        warnings._setoption(option)  # noqa: SLF001 - what the interpreter does with PYTHONWARNINGS at start-up
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # read at start-up by OpenMP: set it as a start would
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if argv[:1] == ["-m"]:
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[:1] == ["-c"]:
        sys.argv = ["-c", *argv[2:]]
        sys.path.insert(0, "")
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    elif argv and not argv[0].startswith("-"):
        script = os.path.abspath(argv[0])
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(script))
        runpy.run_path(script, run_name="__main__")
    else:
        sys.exit(f"warm_python: unsupported arguments {argv!r} ([-u] SCRIPT, -m MODULE or -c CODE)")


def _exit_code(stop: SystemExit) -> int:
    """The exit status the interpreter gives ``raise SystemExit(code)`` (a message goes to stderr, status 1)."""
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    if sys.argv[1] == "--cold":
        _request = {**json.loads(sys.argv[2]), "imported_with": {}}
    else:
        _request = _serve(sys.argv[2], sys.argv[3])
    try:
        _run(_request)
        _code = 0
    except SystemExit as _stop:
        _code = _exit_code(_stop)
    except BaseException:  # noqa: BLE001 - shown as the interpreter shows an uncaught exception, then status 1
        sys.excepthook(*sys.exc_info())
        _code = 1
    # The interpreter's exit without its teardown of the preloaded modules (about 6 s of CPU here): the atexit
    # functions (logging, weakref.finalize, temporary folders) and the streams' flush are what a run can rely on.
    import atexit as _atexit

    _atexit._run_exitfuncs()  # noqa: SLF001
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_code)
