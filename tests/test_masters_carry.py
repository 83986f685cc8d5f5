"""An O2 model's FP32 masters carried to a second engine (lightning_mpx/masters/watch.py): taken over by a new engine
that prepares the model (the old one refuses a later step on them), and copied by ``copy.deepcopy``."""

from __future__ import annotations

import copy
import gc
import pickle

import pytest
import torch
from torch import nn

from lightning_mpx import Amp

HALF = torch.bfloat16


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def _batch(i: int) -> torch.Tensor:
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(i))


def _step(amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer, i: int) -> None:
    optimizer.zero_grad()
    with amp.forward_context():
        out = amp.cast_outputs(model(amp.cast_inputs(_batch(i))))
    amp.backward(out.float().pow(2).mean())
    amp.step(optimizer)
    amp.update()


def _stage(amp: Amp, model: nn.Module, steps: range) -> torch.optim.Optimizer:
    """Prepare ``model`` with ``amp`` and train it ``steps`` (batch seeds) with a new AdamW."""
    amp.prepare_model(model)
    optimizer = amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for i in steps:
        _step(amp, model, optimizer, i)
    return optimizer


def _masters(amp: Amp, model: nn.Module) -> list[torch.Tensor]:
    return [amp.master_of(p, refresh=False).detach().clone() for p in model.parameters()]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_new_engine_takes_the_masters_over_and_a_later_step_of_the_old_one_is_refused_leaving_the_run_as_it_was() -> (
    None
):
    """Two stages, a new engine for the second: its masters started from the half weights (rounded); they are the
    first engine's masters now, taken over without a copy, and the second stage is bit for bit the one the first
    engine runs with a new optimizer. One owner: a step of the first engine's optimizer afterwards raises, before
    anything is stepped (also before the new engine's first step), and the second run goes on as if it had not been
    tried."""
    reference = _net()
    first = Amp("O2", half_dtype=HALF)
    _stage(first, reference, range(3))
    _stage(first, reference, range(3, 8))  # the same engine, a new optimizer: the path of a second stage
    want = _masters(first, reference)

    model = _net()
    old = Amp("O2", half_dtype=HALF)
    old_optimizer = _stage(old, model, range(3))
    trained = _masters(old, model)
    assert any(not torch.equal(m, p.float()) for m, p in zip(trained, model.parameters()))  # more than the half
    masters_ids = [id(old.master_of(p, refresh=False)) for p in model.parameters()]
    new = Amp("O2", half_dtype=HALF)
    optimizer = _stage(new, model, range(3, 3))
    _same(_masters(new, model), trained)  # exactly, not rounded
    assert [id(new.master_of(p, refresh=False)) for p in model.parameters()] == masters_ids  # no copy
    assert all(old.master_of(p, refresh=False) is p for p in model.parameters())  # the old engine let them go
    with pytest.raises(RuntimeError, match=r"'0\.weight' was handed to another engine"):
        _step(old, model, old_optimizer, 99)  # before the new engine's first step: nothing moved the weights yet
    _same(_masters(new, model), trained)
    for i in range(3, 8):
        _step(new, model, optimizer, i)
    _same(_masters(new, model), want)


def test_a_deep_copy_carries_its_own_fp32_masters_through_float_and_a_new_engine() -> None:
    """``copy.deepcopy`` of an O2 model gave half parameters only: its ``.float()`` held the rounded weights and a new
    engine's masters started from them, without a word. A deep copy carries its own copy of the FP32 values now,
    as a deep copy of a model trained in FP32 is FP32-exact; the original keeps its masters with its engine."""
    model = _net()
    amp = Amp("O2", half_dtype=HALF)
    optimizer = _stage(amp, model, range(3))
    trained = _masters(amp, model)

    as_fp32 = copy.deepcopy(model).float()
    assert all(type(p) is nn.Parameter for p in as_fp32.parameters())  # the carried values dropped into the weights
    _same([p.detach() for p in as_fp32.parameters()], trained)

    twin = copy.deepcopy(copy.deepcopy(model))  # a copy of a copy carries them too
    other = Amp("O2", half_dtype=HALF)
    twin_optimizer = _stage(other, twin, range(0))
    _same(_masters(other, twin), trained)
    assert all(amp.master_of(p, refresh=False) is not p for p in model.parameters())  # the original's stay
    _step(amp, model, optimizer, 3)  # each its own masters: a step of one leaves the other's as they were
    _same(_masters(other, twin), trained)
    stepped = _masters(amp, model)
    _step(other, twin, twin_optimizer, 3)
    _same(_masters(amp, model), stepped)
    assert any(not torch.equal(a, b) for a, b in zip(_masters(other, twin), trained))

    pickled = pickle.loads(pickle.dumps(copy.deepcopy(model)))  # pickling carries the half weights alone
    assert all(type(p) is nn.Parameter and not p.__dict__ for p in pickled.parameters())


def test_the_masters_outlive_their_engine_while_the_model_lives_and_go_with_it() -> None:
    """The link from the parameters keeps the masters (not the engine) while the model lives, so that a second stage
    does not depend on whether the garbage collector has taken the first stage's engine; the model let go takes
    them with it."""
    model = _net()
    amp = Amp("O2", half_dtype=HALF)
    _stage(amp, model, range(2))
    trained = _masters(amp, model)
    masters = amp.master_weights[0]
    del amp
    gc.collect()
    new = Amp("O2", half_dtype=HALF)
    _stage(new, model, range(0))
    _same(_masters(new, model), trained)
    held = new.master_weights[0]
    del model, new
    gc.collect()
    assert not masters.alive and not held.alive


@pytest.mark.parametrize("write", ["averaged_model", "data_ema"])
def test_a_deep_copy_written_since_it_was_made_keeps_its_own_values_through_float(write: str) -> None:
    """The habit the carried value must not break: an EMA/SWA copy (``AveragedModel`` deep-copies the model) whose
    half values are averaged in place, then made FP32 for export. Its ``.float()`` must hold the averaged values, not
    the masters of the moment the copy was made (a stale carry was 0.02 off the average here)."""
    model, amp = _net(), Amp("O2", half_dtype=HALF)
    optimizer = _stage(amp, model, range(3))
    if write == "averaged_model":
        ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.5))
        copied = ema.module
    else:
        copied = copy.deepcopy(model)
    start = [p.detach().clone() for p in copied.parameters()]
    for i in range(3, 6):
        _step(amp, model, optimizer, i)
        if write == "averaged_model":
            ema.update_parameters(model)
        else:
            with torch.no_grad():
                for e, p in zip(copied.parameters(), model.parameters()):
                    e.data.mul_(0.5).add_(p.data, alpha=0.5)  # invisible to the version counter
    averaged = [p.detach().float().clone() for p in copied.parameters()]
    assert any(not torch.equal(a, s.float()) for a, s in zip(averaged, start))  # the copy did move
    copied.float()
    for got, want in zip(copied.parameters(), averaged):
        assert got.dtype == torch.float32
        if write == "averaged_model":  # written through the parameters: the carry is dropped, the values kept
            assert torch.equal(got, want)
        else:  # through .data: where the half value moved, its own value; elsewhere within its rounding
            assert torch.equal(got.to(HALF), want.to(HALF))
