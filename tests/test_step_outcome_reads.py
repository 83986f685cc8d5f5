"""Reading what a step skipped on the device did (``skip_on_device=True``), the ways people read it.

- Under DDP the usual logging reads on rank 0 only (``if fabric.is_global_zero: mpx.step_was_skipped(optimizer)``,
  ``mpx.metrics()``, ``bool(outcome)``, ``sum(outcomes)``): a read must never be a collective, or rank 0 waits for
  ranks that never come (tests/skip_on_device_ddp_script.py, two gloo processes, against the host path).
- A :class:`~lightning_mpx.StepOutcome` stands where the host path returns a ``bool``: each habit with a bool gives
  the same answer, of the same type, with the outcome.
"""

from __future__ import annotations

import collections
import copy
import io
import math
import pickle
from pathlib import Path
from typing import Any, Callable

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp, LossScaleFloorError, StepOutcome
from tests.launch import rank_results, run_script

STEPS = 6
SKIPPED = [False, True, False, True, True, True]  # the script's OVERFLOWS: steps 1 (rank 0), 3 (rank 1), 4, 5
RANK_ONE_ONLY = 3  # its inf is on rank 1 alone, whose gradients are zeroed before anything reads there (Fabric)
SCALAR_KEYS = ("mpx/loss_scale", "mpx/overflows", "mpx/skipped_steps")


def _close(a: list[list[float]], b: list[list[float]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.allclose(torch.tensor(x), torch.tensor(y), rtol=1e-5, atol=1e-6)


def _same_run(host: dict[str, Any], device: dict[str, Any], *, per_step_modules: Callable[[int], bool]) -> None:
    """What one rank saw and ended with, against the host path's run (``skip_on_device=False``)."""
    seen_host, seen_device = host["seen"], device["seen"]
    assert len(seen_host) == len(seen_device)
    for step, (h, d) in enumerate(zip(seen_host, seen_device)):
        if not isinstance(h, dict):  # a bool, or a count of the steps taken
            assert d == h and type(d) is type(h), (step, h, d)
            continue
        assert {k: d.get(k) for k in h if not k.startswith("mpx/overflow/")} == {
            k: v for k, v in h.items() if not k.startswith("mpx/overflow/")
        }, step
        if per_step_modules(step):
            assert {k: v for k, v in d.items() if k.startswith("mpx/overflow/")} == {
                k: v for k, v in h.items() if k.startswith("mpx/overflow/")
            }, step
    assert {k: device["end"][k] for k in SCALAR_KEYS} == {k: host["end"][k] for k in SCALAR_KEYS}
    assert device["last"] == host["last"]  # the last overflow's record, merged across the ranks
    _close(device["params"], host["params"])
    _close(device["buffers"], host["buffers"])


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One two-process launch for both front doors (a launch costs seconds of start-up on two cores)."""
    out = tmp_path_factory.mktemp("skip_on_device_ddp")
    run_script("skip_on_device_ddp_script.py", out, timeout=420, MPX_FRONT="fabric,trainer")
    return out


def test_fabric_and_core_engine_read_on_rank_zero_only_under_ddp_as_the_host_path(launched: Path) -> None:
    # A read that made a collective on rank 0 alone hung here (all_gather_object of the overflow records).
    ranks = rank_results(launched, "fabric_")
    for rank, results in enumerate(ranks):
        for run in ("fabric/step_was_skipped", "fabric/metrics", "amp/bool", "amp/sum", "amp/metrics"):
            host, device = results[f"{run}/False"], results[f"{run}/True"]
            # The rank-1-only overflow has no name on the device path: rank 1's gradients are zeroed before
            # anything reads its step there (docs/loss_scaling.md); the counts and the rest are the same.
            _same_run(host, device, per_step_modules=lambda step: step != RANK_ONE_ONLY)
            assert host["last"] == {"step": STEPS - 1, "ranks": [0], "parameters": ["0.weight"]}
            if rank == 0:
                if run.endswith("step_was_skipped"):
                    assert device["seen"] == SKIPPED
                elif run.endswith("bool"):
                    assert device["seen"] == [not s for s in SKIPPED]
                elif run.endswith("sum"):
                    assert device["seen"] == [sum(not s for s in SKIPPED[: i + 1]) for i in range(STEPS)]
            assert device["end"]["mpx/skipped_steps"] == SKIPPED.count(True)
        _close(results["fabric/metrics/True"]["params"], ranks[0]["fabric/metrics/True"]["params"])


def test_trainer_callback_reading_on_rank_zero_only_under_ddp_matches_the_host_path(launched: Path) -> None:
    for results in rank_results(launched, "trainer_"):
        host, device = results["trainer/False"], results["trainer/True"]
        # Every rank reads its step at the next batch, before Lightning zeroes the gradients: the rank-1-only
        # overflow is named too, counted in the next step's metrics on rank 0 (its record is merged there).
        _same_run(host, device, per_step_modules=lambda step: step not in (RANK_ONE_ONLY, RANK_ONE_ONLY + 1))
        for seen in (host["seen"], device["seen"]):
            assert [s["skipped"] for s in seen] == SKIPPED or not seen  # rank 1 reads nothing
            assert sum(s.get("mpx/overflow/net.0", 0.0) for s in seen) == (SKIPPED.count(True) if seen else 0)
        assert device["end"]["mpx/skipped_steps"] == SKIPPED.count(True)


# -- one process: what a read does and does not do ------------------------------------------------------------------
def _engine(skip: bool, **kwargs: Any) -> tuple[Amp, nn.Module, torch.optim.Optimizer]:
    amp = Amp("O1", half_dtype="bfloat16", skip_on_device=skip, **kwargs)
    torch.manual_seed(0)
    model = amp.prepare_model(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    optimizer = amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    return amp, model, optimizer


def _train_step(amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer, index: int, bad: bool) -> Any:
    g = torch.Generator().manual_seed(index)
    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
    with amp.forward_context():
        loss = F.cross_entropy(amp.cast_outputs(model(x)).float(), y)
    amp.backward(loss)
    if bad:
        model[0].weight.grad[0, 0] = float("inf")
    outcome = amp.step(optimizer)
    amp.update()
    return outcome


class _Gathers:
    """Counts the engine's merges of overflow records across ranks (the collective of a settle)."""

    def __init__(self, amp: Amp) -> None:
        self.calls = 0
        self._gather = amp.forensics.gather_noted  # the records and the ranks' kept refusals (engine/unsynced.py)

    def __call__(self, record: Any, note: Any = None) -> Any:
        self.calls += 1
        return self._gather(record, note)


@pytest.mark.parametrize("read", ["bool", "sum", "read_step_outcomes", "state_dict"])
def test_a_read_under_a_process_group_is_no_collective_and_the_next_backward_settles(read, monkeypatch):
    amp, model, optimizer = _engine(True, loss_scale="dynamic")
    amp.found_inf_reducer = lambda flag: None  # as under DDP: the flags are reduced, the records are merged
    gathers = _Gathers(amp)
    monkeypatch.setattr(amp.forensics, "gather_noted", gathers)
    outcomes = [_train_step(amp, model, optimizer, 0, bad=True)]  # the record names it while the gradient is there
    if read == "bool":
        assert not outcomes[0]
    elif read == "sum":
        assert sum(outcomes) == 0
    elif read == "read_step_outcomes":
        amp.read_step_outcomes()
    else:
        assert amp.state_dict()["skipped_steps"] == [1]  # rank 0 saving a checkpoint (Fabric saves on rank 0)
    assert outcomes[0].known and amp.skipped_steps == [1]
    assert gathers.calls == 0  # nothing that needs the other ranks
    assert amp.last_overflow is None  # the merged record comes where every rank is
    metrics = amp.metrics()
    assert metrics["mpx/overflow/0"] == 1.0  # this process's record, counted at the read
    optimizer.zero_grad()
    _train_step(amp, model, optimizer, 1, bad=False)  # every rank's next backward: the record is merged
    assert gathers.calls == 1 and amp.skipped_steps == [1]
    assert amp.last_overflow is not None and list(amp.last_overflow.parameters) == ["0.weight"]
    assert amp.metrics().get("mpx/overflow/0") == 0.0  # counted once


def test_at_the_floor_under_a_process_group_the_error_comes_where_every_rank_is():
    # bfloat16's static scale is its floor: an overflow raises by default. A read on rank 0 alone must not raise
    # (the other ranks would wait for it in the next collective); every rank raises at its next backward.
    amp, model, optimizer = _engine(True)
    amp.found_inf_reducer = lambda flag: None
    outcome = _train_step(amp, model, optimizer, 0, bad=True)
    weights = [p.detach().clone() for p in model.parameters()]
    assert not outcome and amp.skipped_steps == [1]
    optimizer.zero_grad()
    with pytest.raises(LossScaleFloorError):
        _train_step(amp, model, optimizer, 1, bad=False)
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
    # One process (no reducer): raised at the read, as before.
    amp, model, optimizer = _engine(True)
    outcome = _train_step(amp, model, optimizer, 0, bad=True)
    with pytest.raises(LossScaleFloorError):
        bool(outcome)


def test_settle_step_outcomes_merges_the_last_step():
    amp, model, optimizer = _engine(True, loss_scale="dynamic")
    amp.found_inf_reducer = lambda flag: None
    outcome = _train_step(amp, model, optimizer, 0, bad=True)
    assert not outcome and amp.last_overflow is None
    amp.settle_step_outcomes()  # every rank, after the loop (the plugins' teardown calls it)
    assert amp.last_overflow is not None and amp.last_overflow.step == 0 and amp.skipped_steps == [1]


# -- StepOutcome stands where a bool stands -------------------------------------------------------------------------
def _outcomes(skip: bool) -> list[Any]:
    """The same run (an overflow at the second step) on the host path (bools) and on the device (outcomes)."""
    amp, model, optimizer = _engine(skip, loss_scale="dynamic")
    outcomes = []
    for index, bad in enumerate([False, True, False, False]):
        outcomes.append(_train_step(amp, model, optimizer, index, bad))
        optimizer.zero_grad()
    return outcomes


HABITS: dict[str, Callable[[list[Any]], Any]] = {
    "sum": lambda o: sum(o),
    "sum_generator": lambda o: sum(x for x in o),
    "sum_float_start": lambda o: sum(o, 0.0),
    "len_minus_sum": lambda o: len(o) - sum(o),
    "count_not": lambda o: sum(not x for x in o),
    "int": lambda o: [int(x) for x in o],
    "float": lambda o: [float(x) for x in o],
    "complex": lambda o: complex(o[1]),
    "index_list": lambda o: [["skipped", "stepped"][x] for x in o],
    "range": lambda o: list(range(10))[o[0] : o[0] + 2],
    "add": lambda o: [x + 1 for x in o],
    "radd": lambda o: [1 + x for x in o],
    "add_outcomes": lambda o: o[0] + o[1],
    "sub": lambda o: [x - 1 for x in o],
    "rsub": lambda o: [1 - x for x in o],
    "mul": lambda o: [x * 3 for x in o],
    "rmul": lambda o: [0.5 * x for x in o],
    "truediv": lambda o: [x / 2 for x in o],
    "rtruediv": lambda o: 1 / o[0],
    "floordiv": lambda o: [x // 1 for x in o],
    "mod": lambda o: [x % 2 for x in o],
    "pow": lambda o: [x**2 for x in o],
    "divmod": lambda o: divmod(o[0], 1),
    "neg": lambda o: [-x for x in o],
    "pos": lambda o: [+x for x in o],
    "abs": lambda o: [abs(x) for x in o],
    "and": lambda o: [x & True for x in o],
    "rand": lambda o: [True & x for x in o],
    "or": lambda o: [x | False for x in o],
    "xor": lambda o: [x ^ True for x in o],
    "shift": lambda o: [(x << 2, 4 >> x) for x in o],
    "lt": lambda o: [x < 1 for x in o],
    "le": lambda o: [x <= 0 for x in o],
    "gt": lambda o: [x > 0 for x in o],
    "ge": lambda o: [x >= 1 for x in o],
    "eq_int": lambda o: [x == 1 for x in o],
    "eq_float": lambda o: [x == 1.0 for x in o],
    "ne": lambda o: [x != 0 for x in o],
    "eq_bool": lambda o: [x == True for x in o],  # noqa: E712
    "max": lambda o: bool(max(o)),
    "min": lambda o: bool(min(o)),
    "sorted": lambda o: [bool(x) for x in sorted(o)],
    "any_all": lambda o: (any(o), all(o)),
    "round": lambda o: [round(x) for x in o],
    "floor_ceil_trunc": lambda o: [(math.floor(x), math.ceil(x), math.trunc(x)) for x in o],
    "hash": lambda o: [hash(x) for x in o],
    "set": lambda o: len(set(o)),
    "dict_key": lambda o: {True: "stepped", False: "skipped"}[o[1]],
    "counter": lambda o: dict(collections.Counter(o)),
    "str": lambda o: [str(x) for x in o],
    "fstring": lambda o: [f"stepped={x} as int {x:d}" for x in o],
    "torch_tensor": lambda o: torch.tensor(o[0]),
    "torch_tensor_dtype": lambda o: torch.tensor(o[1], dtype=torch.float32),
    "torch_as_tensor": lambda o: torch.as_tensor(o[0]),
    "tensor_add": lambda o: torch.tensor(2.0) + o[1],
    "add_tensor": lambda o: o[0] + torch.tensor([1, 2]),
    "tensor_mul": lambda o: torch.ones(2) * o[1],
    "numpy_sum": lambda o: numpy.array(o).sum(),
    "numpy_mean": lambda o: numpy.mean(o),
    # A history of outcomes kept in a checkpoint or a logger's state, or copied with it.
    "pickle": lambda o: pickle.loads(pickle.dumps(o)),
    "torch_save": lambda o: _torch_round_trip({"history": o})["history"],
    "copy": lambda o: [copy.copy(x) for x in o],
    "deepcopy": lambda o: copy.deepcopy(o),
    "deepcopy_in_a_dict": lambda o: copy.deepcopy({"stepped": o[0]}),
}


def _torch_round_trip(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    # weights_only=False: torch's weights-only loader allows no call to builtins.bool (StepOutcome's docstring)
    return torch.load(buffer, weights_only=False)


def _same(host: Any, device: Any) -> None:
    if isinstance(host, torch.Tensor):
        assert isinstance(device, torch.Tensor) and device.dtype == host.dtype and torch.equal(device, host)
    elif isinstance(host, numpy.generic):
        assert type(device) is type(host) and device == host
    elif isinstance(host, (list, tuple)):
        assert type(device) is type(host) and len(device) == len(host)
        for h, d in zip(host, device):
            _same(h, d)
    elif isinstance(host, dict):
        assert device == host
    else:
        assert type(device) is type(host) and device == host, (host, device)


@pytest.fixture(scope="module")
def runs() -> tuple[list[bool], list[StepOutcome]]:
    return _outcomes(False), _outcomes(True)


@pytest.mark.parametrize("habit", sorted(HABITS))
def test_step_outcome_answers_each_habit_as_the_host_paths_bool(habit, runs):
    host, device = runs
    assert all(type(x) is bool for x in host) and all(isinstance(x, StepOutcome) for x in device)
    assert host == [True, False, True, True]
    # Fresh outcomes for every habit would read them; these were read by the next backward (the last one is not).
    _same(HABITS[habit](host), HABITS[habit](device))


def test_an_unread_outcome_is_read_by_a_number_habit_and_hashes_as_its_bool_for_good():
    amp, model, optimizer = _engine(True, loss_scale="dynamic")
    outcome = _train_step(amp, model, optimizer, 0, bad=True)
    assert not outcome.known
    assert int(outcome) == 0 and outcome.known and amp.skipped_steps == [1]
    assert hash(outcome) == hash(False) and {outcome: "skipped"}[False] == "skipped"


def test_a_copied_outcome_is_its_bool_and_leaves_the_engine_alone():
    """A deep copy of an outcome (in a history a callback keeps) reads it and copies nothing of the engine behind
    it: before, it followed the outcome's link into the engine and copied its masters."""
    amp, model, optimizer = _engine(True, loss_scale="dynamic")
    outcome = _train_step(amp, model, optimizer, 0, bad=True)
    assert not outcome.known
    copied = copy.deepcopy([outcome])
    assert copied == [False] and type(copied[0]) is bool and outcome.known and amp.skipped_steps == [1]
    assert pickle.loads(pickle.dumps(outcome)) is False
