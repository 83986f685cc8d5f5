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
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time
import traceback

# What the scripts import: paid once, here, before the fork.
_PRELOAD = ("torch", "torch.distributed", "lightning.pytorch", "lightning.fabric", "lightning_mpx")
_GRACE_S = 20.0  # after a rank fails, how long the others have to end before they are killed


def _run_rank(script: str, rank: int, world: int, port: int) -> None:
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


def main() -> int:
    script, world = os.path.abspath(sys.argv[1]), int(sys.argv[2])
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.launch import free_port

    for name in _PRELOAD:
        __import__(name)
    port = free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    ranks: dict[int, int] = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
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


if __name__ == "__main__":
    sys.exit(main())
