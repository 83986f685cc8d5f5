"""Start the ranks of a test's multi-process script by forking one interpreter that has imported the heavy modules:
``python tests/fork_ranks.py SCRIPT WORLD_SIZE`` (what :func:`tests.launch.run_script` runs).

Each rank of a script started its own interpreter before (Lightning's and Fabric's launchers run ``sys.executable
SCRIPT`` again for rank 1; ``launch_ranks`` once per rank, after the parent had imported everything too), and each
paid ``import lightning`` again: about 6.5 s of CPU per process on these machines, most of it torchmetrics importing
transformers and scipy. Forking after the imports pays it once per launch. The ranks get torchrun's environment, so
that Lightning, Fabric and the scripts' own ``launch_ranks`` see processes made outside them and start none.

Forking a process that has imported torch (not used it: no thread pool started, no process group) is what
``DataLoader``'s workers do on Linux. Each rank runs the script as ``__main__`` and leaves with ``os._exit``: it never
returns into this file's frames. When a rank fails, the others get a little time to fail on their own (a collective
with a dead peer) and are then killed, so that a failure ends the launch instead of a hang to the test's timeout.

``python tests/fork_ranks.py --serve`` (what ``run_script`` keeps one of per test process): the same, with the imports
paid once per test process rather than once per launch (~7 s of CPU each, over the suite's ~30 launches);
see :func:`serve`.
"""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import signal
import sys
import tempfile
import time
import traceback

# What the scripts import: paid once, here, before the fork.
_PRELOAD = ("torch", "torch.distributed", "lightning.pytorch", "lightning.fabric", "lightning_mpx")
_GRACE_S = 20.0  # after a rank fails, how long the others have to end before they are killed


def _run_rank(script: str, rank: int, world: int, port: int) -> None:
    """Run ``script`` as ``__main__`` in this (forked) process, as rank ``rank`` of ``world`` (world 0: as it is,
    without torchrun's environment), and leave with its exit code."""
    if world:
        os.environ.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip
    code = 0
    try:
        sys.argv = [script]
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - shown on the test's stderr, then the rank fails
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _preload() -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for name in _PRELOAD:
        __import__(name)


def main() -> int:
    script, world = os.path.abspath(sys.argv[1]), int(sys.argv[2])
    _preload()
    return launch(script, world)


def launch(script: str, world: int, rank_stderr: str | None = None) -> int:
    """Fork the ``world`` ranks of ``script`` from this (preloaded) interpreter; their worst exit code. ``world`` 0:
    one process without torchrun's environment, its stderr this process's (a script that starts its processes
    itself: ``strategy="ddp_spawn"``).

    ``rank_stderr``: each rank's stderr (file descriptor 2: Python's tracebacks, the fault handler's stacks, native
    messages such as gloo's) goes to a file of its own, ``{rank_stderr}.rank{r}``, instead of this process's
    (:func:`tests.launch.run_script` quotes the start and the end of each: one rank's first error is not lost among
    the lines the others print after it)."""
    from tests.launch import free_port

    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    ranks: dict[int, int] = {}
    for rank in range(max(world, 1)):
        pid = os.fork()
        if pid == 0:
            if rank_stderr is not None and world:
                err = os.open(f"{rank_stderr}.rank{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(err, 2)
                os.close(err)
            _run_rank(script, rank, world, port)
        ranks[pid] = rank
    worst, deadline = 0, None
    while ranks:
        if deadline is not None and time.monotonic() > deadline:
            for pid in ranks:
                os.kill(pid, signal.SIGKILL)
        pid, status = os.waitpid(-1, os.WNOHANG if deadline is not None else 0)
        if pid == 0:
            time.sleep(0.2)
            continue
        rank = ranks.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            print(f"fork_ranks: rank {rank} of {script} ended with {code}", file=sys.stderr, flush=True)
            worst = worst or (code if code > 0 else 128 - code)
            if deadline is None:
                deadline = time.monotonic() + _GRACE_S
    return worst


def serve() -> int:
    """``fork_ranks.py --serve``: preload once, then for each request line on stdin (JSON: ``script``, ``world``,
    ``cwd``, ``env``, ``stderr``: a file for the launch's stderr, ``{stderr}.rank{r}`` for each rank's) fork a launcher
    in a session of its own, in ``cwd`` with exactly ``env``, that forks the ranks as :func:`main` does; answer ``pid
    N`` at once and ``exit CODE`` when it ends. One launch at a time (a pytest worker runs one test at a time); the
    server itself never runs a script, so every launch forks from the same freshly imported interpreter, as a launch
    of its own did. It ends at stdin's end (the pytest worker that started it exited). :func:`tests.launch.run_script`
    keeps one per worker: the import of the heavy modules (about 7 s of CPU) is paid once per worker instead of once
    per launch."""
    _preload()
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(reply.fileno())  # the answers' reader sees EOF when the server dies, not when a rank does
            _launcher(request)
        reply.write(f"pid {pid}\n")
        _, status = os.waitpid(pid, 0)
        reply.write(f"exit {os.waitstatus_to_exitcode(status)}\n")
    return 0


def _launcher(request: dict) -> None:
    code = 1
    try:
        os.setsid()  # run_script kills the session on a timeout: this launcher and its ranks
        null = os.open(os.devnull, os.O_RDWR)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.dup2(err, 2)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # the launch's TMPDIR, as a started process reads it
        faulthandler.enable()  # what PYTHONFAULTHANDLER=1 gives a launch started as a process
        if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # read at startup by OpenMP: set it as a start would
            import torch

            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        code = launch(os.path.abspath(request["script"]), int(request["world"]), rank_stderr=request["stderr"])
    except BaseException:  # noqa: BLE001 - on the launch's stderr, then it fails
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(serve() if sys.argv[1:] == ["--serve"] else main())
