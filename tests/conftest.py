"""Shared test set-up (torch's threads shared out among pytest-xdist's workers; the fixtures ``fresh_dynamo``,
``fresh_accelerate_state``, ``one_rank`` and ``launched_alone`` are at the end; ``_launch_environment``, for every
test, keeps the variables of a launched rank out of the next tests).

The fused unscale kernels are Triton kernels. Without a GPU they are tested in triton's interpreter, which runs them
on CPU tensors; triton reads ``TRITON_INTERPRET`` when a kernel is decorated, so it is set here, before any test
module imports the kernels. With a GPU the kernels are compiled and the CUDA tests run instead (run
``TRITON_INTERPRET=1 python -m pytest -k triton`` there to run the interpreter tests too). Nothing else in the
suite uses triton.
"""

import gc
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _threads_per_worker() -> None:
    """Under pytest-xdist (the README's command: one worker per core), each worker and the processes its tests
    start get an equal share of the cores for torch's intra-op threads (``OMP_NUM_THREADS`` and
    ``torch.set_num_threads``), unless ``OMP_NUM_THREADS`` is set already. torch's default is a thread per core in
    every process: two workers on two cores, and the ranks their multi-process tests launch, then ran several spinning
    OpenMP threads per core, and small operations waited on threads that were not running (a small model's test file
    took 61 s in the suite and 6.5 s alone; the suite, 560-594 s on two cores, took 493 s with the share). Not a
    setting of the library: a single-process run (``python -m pytest -q``) keeps torch's default."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // max(1, int(workers)))
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the ranks and scripts the tests launch inherit it
    torch.set_num_threads(threads)


_threads_per_worker()


# Hypothesis draws the same examples on every run (a randomized run that fails once in a while is a flaky test, and
# CI must be deterministic); HYPOTHESIS_PROFILE=explore draws new ones, to search for bugs.
from hypothesis import settings  # noqa: E402

settings.register_profile("deterministic", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))


@pytest.fixture(scope="module", autouse=True)
def _frozen_heap():
    """Every object alive when a test module starts is frozen (``gc.freeze()``, after a collection): the garbage
    collector's full collections in the module walk only the objects made since. A worker holds the modules of the
    whole suite it collected (800,000 objects), and a full collection walked all of them: Accelerate runs three in
    each ``load_checkpoint_in_model`` and one in each ``free_memory`` (every HF ``Trainer.train()``), the tests' leak
    checks run their own, and Python runs them as the heap grows (about half a second each, on these machines:
    test_upstream_accelerate_accelerator.py spent most of its time in them). What a module makes and drops is still
    collected, in it or in the next module's collection here; only cycles that outlive a module's start and die after
    it are never collected. ``gc.get_objects()`` and ``gc.get_referrers()`` do not see frozen objects."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters emptied before and after the test: the graph breaks and recompiles counted are
    its own."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps process-wide singleton state; the test starts from none and leaves none (skipped without
    Accelerate)."""
    pytest.importorskip("accelerate")
    from tests.accelerate_helpers import accelerate_state_reset

    with accelerate_state_reset():
        yield


@pytest.fixture
def one_rank():
    """A gloo process group of one process for the test (FSDP2 in one process: ``fully_shard`` needs a group),
    destroyed after it (``tests.launch.one_process_group``); skipped when the process already has one."""
    import torch.distributed as dist

    from tests.launch import one_process_group

    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    with one_process_group():
        yield


@pytest.fixture
def launched_alone(monkeypatch):
    """The environment of a gloo group of one process, this one, for a test whose framework starts the group itself
    (Lightning's strategies, Accelerate's state); the group and Accelerate's state undone after."""
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    from tests.accelerate_helpers import accelerate_state_reset

    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_network_port()), RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", NODE_RANK="0")  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with accelerate_state_reset():
        try:
            yield
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


#: What a launched rank finds in its environment. Lightning's strategies and Accelerate write them into
#: ``os.environ`` when a test runs them in the test's own process: left there, a later test in the same worker takes
#: itself for a launched rank (Accelerate's state initializes ``torch.distributed``; a script launched with this
#: environment has Lightning start no second process, and its one rank waits for the other until the test's timeout).
_LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
                     "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED", "PL_SEED_WORKERS")  # fmt: skip


@pytest.fixture(autouse=True)
def _launch_environment():
    """Put the launch variables back as they were before the test (a test that sets them for itself may)."""
    saved = {name: os.environ.get(name) for name in _LAUNCH_VARIABLES}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
