"""Running the tests' multi-process scripts (``tests/*_script.py``) from a test, with clean exits."""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
_END_WAIT_S = 120  # how long end_ranks waits for the other ranks
# A failed launch quotes each stderr bounded: from its first error, and its end (a rank's first error was cut off
# when only the last 8000 characters of the ranks' stderr, interleaved, were shown).
_HEAD_CHARS = 3000
_TAIL_CHARS = 5000
_FIRST_ERROR = re.compile(r"^(Traceback \(most recent call last\)|Fatal Python error|terminate called)", re.MULTILINE)


def excerpt(text: str, *, head: int = _HEAD_CHARS, tail: int = _TAIL_CHARS) -> str:
    """``text`` in at most ``head + tail`` characters and two notes: all of it when it fits; else ``head`` characters
    from its start, or from its first error when that comes later (a Python traceback, a fault handler's "Fatal Python
    error", C++'s "terminate called"), a note of what was left out, and its last ``tail`` characters (cut at lines)."""
    if len(text) <= head + tail:
        return text
    found = _FIRST_ERROR.search(text)
    start = found.start() if found is not None and head // 3 < found.start() < len(text) - tail else 0
    head_end = text.rfind("\n", start, start + head) + 1 or start + head
    tail_start = text.find("\n", len(text) - tail) + 1 or len(text) - tail
    if head_end >= tail_start:
        return (f"[{start} characters before the first error left out]\n" if start else "") + text[start:]
    skipped = f"[the first {start} characters left out; from the first error:]\n" if start else ""
    return f"{skipped}{text[start:head_end]}[... {tail_start - head_end} characters left out ...]\n{text[tail_start:]}"


def failure_report(what: str, launch_stderr: str, ranks_stderr: list[str] | None = None) -> str:
    """A failed launch's message: ``what``, then the launch's stderr and each rank's (from :func:`excerpt`)."""
    parts = [what]
    if ranks_stderr is None:
        parts.append(f"stderr:\n{excerpt(launch_stderr)}")
    else:
        if launch_stderr.strip():
            parts.append(f"the launcher's stderr:\n{excerpt(launch_stderr)}")
        for rank, text in enumerate(ranks_stderr):
            parts.append(f"rank {rank}'s stderr ({len(text)} characters):\n{excerpt(text)}" if text
                         else f"rank {rank}'s stderr: empty")  # fmt: skip
    return "\n---- ".join(parts)


def run_script(name: str, out: Path, *, timeout: float, ranks: int | None = 2, **env: str) -> None:
    """Run ``tests/<name>`` in ``out`` with ``MPX_OUT=out`` and ``env`` set; fail when it exits non-zero or runs past
    ``timeout`` seconds, quoting its stderr (each rank's, forked) from the first error and its end (:func:`excerpt`).

    ``ranks``: the script runs once per rank with torchrun's environment, forked from one interpreter that imported
    the heavy modules once for this whole test process (``tests/fork_ranks.py --serve``); ``None``: run once as it
    is, forked from the same interpreter without torchrun's environment (a script that spawns its processes itself,
    with ``torch.multiprocessing.spawn`` or ``strategy="ddp_spawn"``: those start fresh interpreters still; it paid
    the imports in a process of its own until stop 64).

    The script runs in a session of its own: on a timeout the processes it spawned are killed with it (by its group).
    """
    script = str(ROOT / "tests" / name)
    # PYTHONFAULTHANDLER: a rank that dies natively (a signal, heap corruption) prints every thread's Python stack
    # to the stderr quoted on failure, so that a one-off crash says where it happened.
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), MPX_OUT=str(out), PYTHONFAULTHANDLER="1", **env)
    _run_forked(name, script, 0 if ranks is None else ranks, out, full_env, timeout)


@functools.lru_cache(maxsize=1)
def _fork_server() -> subprocess.Popen:
    """This process's ``tests/fork_ranks.py --serve``: the interpreter with the heavy modules imported that every
    launch of :func:`run_script` forks its ranks from (started at the first launch; it exits with this process, at
    the end of its stdin). It is itself a fork of this process's warm interpreter (``tests/warm_python.py``, which
    preloads the same modules), so that a test process pays those imports once for both: a worker that ran a launch
    and a benchmark script paid them twice before stop 64 (about 7 s of CPU)."""
    from tests.warm_python import warm_python

    server = subprocess.Popen(
        [warm_python(), str(ROOT / "tests" / "fork_ranks.py"), "--serve"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), PYTHONFAULTHANDLER="1"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a timeout's kill of a launch's session never reaches the server
    )
    atexit.register(server.kill)
    return server


def _run_forked(name: str, script: str, ranks: int, out: Path, env: dict[str, str], timeout: float) -> None:
    """:func:`run_script`'s ranks, forked by the server from a launcher of their own (a session: killed whole on a
    timeout), with ``env`` and ``out`` as the working directory; the launcher's stderr and each rank's go to files
    read on failure."""
    server = _fork_server()
    if server.poll() is not None:  # it died (it never should): start another
        _fork_server.cache_clear()
        server = _fork_server()
    assert server.stdin is not None and server.stdout is not None
    fd, stderr_path = tempfile.mkstemp(prefix="fork_ranks_", suffix=".err")
    os.close(fd)
    pid, ended = None, None
    try:
        request = {"script": script, "world": ranks, "cwd": str(out), "env": env, "stderr": stderr_path}
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        started = server.stdout.readline().split()
        assert started[:1] == ["pid"], f"{name}: the fork server answered {started!r}"
        pid, timed_out = int(started[1]), False
        # The answer read by a thread, not select() on the pipe: its text reader may already hold the "exit" line
        # in its buffer (read with "pid"), where select() would wait out the timeout for data already there.
        answer: list[str] = []
        reader = threading.Thread(target=lambda: answer.append(server.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if reader.is_alive():
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            reader.join(60)
        ended = answer[0].split() if answer and answer[0] else None
        assert ended is not None and ended[:1] == ["exit"], f"{name}: the fork server answered {answer!r}"
        stderr = Path(stderr_path).read_text(errors="replace")
        ranks_stderr = [_read(f"{stderr_path}.rank{r}") for r in range(ranks)]
    finally:
        for path in (stderr_path, *(f"{stderr_path}.rank{r}" for r in range(ranks))):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if ended is None:  # interrupted (pytest-timeout, Ctrl-C) or a bad answer: no launch or server left behind
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
            server.kill()
            _fork_server.cache_clear()
    if timed_out:
        raise AssertionError(failure_report(f"{name} timed out after {timeout} s", stderr, ranks_stderr))
    code = int(ended[1])
    assert code == 0, failure_report(f"{name}: exit code {code}", stderr, ranks_stderr)


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except FileNotFoundError:  # the rank never started (the launcher failed first)
        return ""


def accelerate_launch(script: str, out: Path, *, timeout: float = 240) -> None:
    """Run ``tests/<script> <out>`` in two gloo processes with ``accelerate launch``, as Accelerate users start one;
    fail with the end of both outputs when it exits non-zero.

    ``--cpu --num_processes 2`` starts one process in accelerate 1.x unless an MPI hostfile is given; the torchrun
    launcher behind ``--multi_gpu`` runs the processes on CPU with gloo when no GPU is visible. The launcher starts
    from this process's warm interpreter (tests/warm_python.py), and so do the processes it starts (torchrun runs
    ``sys.executable -u SCRIPT``): each paid the imports of torch and Lightning before stop 64."""
    from tests.warm_python import warm_python

    command = [
        warm_python(), "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", "0",  # the launcher picks a free port just before torchrun binds it
        str(ROOT / "tests" / script), str(out),
    ]  # fmt: skip
    # TMPDIR: torchrun's log folder (a tempfile.mkdtemp it leaves behind) goes under ``out``, not /tmp
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT), PYTHONFAULTHANDLER="1", TMPDIR=str(out))
    run = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, failure_report(
        f"{script}: exit code {run.returncode}; stdout ends with:\n{run.stdout[-3000:]}", run.stderr
    )


def case_results(name: str, out: Path, *, timeout: float) -> list[dict[str, Any]]:
    """Run the 2-rank script ``tests/<name>`` (:func:`run_script`) whose cases ran under :func:`case_error` and
    return each rank's results (:func:`rank_results`), having checked that no case (nor :func:`finish_cases`'s check
    after them) raised on any rank."""
    run_script(name, out, timeout=timeout)
    ranks = rank_results(out)
    for case in ranks[0]:
        for rank in ranks:
            assert "error" not in rank[case], (case, rank[case].get("error"))
    return ranks


def rank_results(out: Path, prefix: str = "", world_size: int = 2) -> list[dict[str, Any]]:
    """What each rank wrote to ``out/{prefix}rank{r}.json``, by rank."""
    return [json.loads((out / f"{prefix}rank{r}.json").read_text()) for r in range(world_size)]


def write_rank_results(results: Any, prefix: str = "", rank: int | None = None) -> None:
    """In a script's rank: write ``results`` to ``$MPX_OUT/{prefix}rank{r}.json``, what :func:`rank_results` reads
    (``rank``: the process group's when not given)."""
    if rank is None:
        import torch.distributed as dist

        rank = dist.get_rank()
    (Path(os.environ["MPX_OUT"]) / f"{prefix}rank{rank}.json").write_text(json.dumps(results))


@contextlib.contextmanager
def case_error(out: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """In a script's rank: a case that raises leaves its traceback in ``out["error"]`` (the test names the case and
    shows it) instead of ending the launch with the cases after it."""
    try:
        yield out
    except Exception:  # noqa: BLE001 - reported by the test
        out["error"] = traceback.format_exc()[-3000:]


def finish_cases(results: dict[str, Any]) -> None:
    """The end of a rank of a script whose cases ran under :func:`case_error`: the process group still works after
    them (an all-reduce of ones, its sum in ``results["after"]["sum"]``, an error there in ``results["after"]``),
    then :func:`write_rank_results` and :func:`end_ranks`."""
    import torch
    import torch.distributed as dist

    with case_error(results.setdefault("after", {})) as r:
        total = torch.ones(1)
        dist.all_reduce(total)
        r["sum"] = total.item()
    write_rank_results(results)
    end_ranks()


def run_cases(cases: Mapping[str, Callable[[], dict[str, Any]]], *, timeout_s: float = 30) -> None:
    """A rank of a script of independent cases, from start to end: a gloo group whose collectives time out after
    ``timeout_s`` (a stray collective is an error, not a hang), one torch thread, each case's results under its name
    (:func:`case_error`), then :func:`finish_cases`. What the test reads with :func:`case_results`."""
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    for name, case in cases.items():
        with case_error(results.setdefault(name, {})) as out:
            out.update(case())
    finish_cases(results)


def quiet_case(run: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """``run`` as a case of :func:`run_cases` in a script: its warnings ignored, then a barrier, so that a rank that
    raised alone leaves the other at the group's timeout, not in a hang."""

    def case() -> dict[str, Any]:
        import warnings

        import torch.distributed as dist

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = run()
        dist.barrier()
        return out

    return case


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a process group's ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def one_process_group() -> Any:
    """A gloo process group of one process (FSDP's single-process tests), destroyed when the block ends."""
    import torch.distributed as dist

    dist.init_process_group("gloo", world_size=1, rank=0, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        yield
    finally:
        dist.destroy_process_group()


def launch_ranks(script: str, world_size: int = 2, **env: str) -> int:
    """Run ``script`` once per rank with torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) plus ``env``; returns the worst exit code. A script the
    test runs once calls this when ``RANK`` is not set; the test's timeout kills the whole process group on a hang."""
    common = dict(os.environ, WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **env)  # fmt: skip
    procs = [
        subprocess.Popen([sys.executable, script], env=dict(common, RANK=str(r), LOCAL_RANK=str(r)))
        for r in range(world_size)
    ]
    return max(p.wait() for p in procs)


def end_ranks() -> None:
    """End a rank of a multi-process script once its results are written: wait for every rank (no collective left
    behind), then leave without the interpreter's teardown.

    A script that made several DDP models in one gloo group was seen to finish its work (every rank's results
    written) and then hang in one rank's teardown, once in a loaded full run (never alone): the test then waited for
    its timeout; another, with Accelerate, aborted rank 0 in the gloo group's teardown ("terminate called without an
    active exception"). Skipping the teardown (the process group, the DDP reducers, Lightning's launcher) leaves
    nothing to race, and the barrier first makes sure no rank leaves while another still needs it. Every rank script
    ends here once its results are written."""
    import datetime

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if dist.get_backend() == "gloo":
            # A rank that died before this point fails the others here, by name, instead of a hang to the test's
            # timeout (a plain barrier waits for the group's 30 minutes).
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=_END_WAIT_S))
        else:
            dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
