"""Accelerate's own ``tests/test_optimizer.py`` (1.15), ported to the adapter: the prepared optimizer pickles and
reports a skipped step, under ``mixed_precision`` O1 and O2 with float16 and bfloat16 (deliberate differences:
docs/testing.md, "Ported framework tests")."""

from __future__ import annotations

import pickle

import pytest
import torch

pytest.importorskip("accelerate")

from lightning_mpx import LossScaleFloorError  # noqa: E402
from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs  # noqa: E402
from tests.accelerate_helpers import reset_accelerate_state  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # Accelerate's singleton state: none at each start

LEVELS_AND_HALVES = [(level, half) for level in ("O1", "O2") for half in ("float16", "bfloat16")]


def _accelerator(level: str, half: str, **settings) -> Accelerator:
    return Accelerator(mixed_precision=level, kwargs_handlers=[MixedPrecisionKwargs(half_dtype=half, **settings)])


@pytest.mark.parametrize("level, half", LEVELS_AND_HALVES)
def test_accelerated_optimizer_pickling(level, half):
    """tests/test_optimizer.py::CPUOptimizerTester::test_accelerated_optimizer_pickling. Upstream prepares the
    optimizer alone; at O2 its model is prepared with it (O2's optimizer steps the FP32 masters that preparing the
    model makes). The copy holds the same hyper-parameters."""
    model = torch.nn.Linear(10, 10)
    optimizer = torch.optim.SGD(model.parameters(), 0.1)
    accelerator = _accelerator(level, half)
    if level == "O2":
        _, optimizer = accelerator.prepare(model, optimizer)
    else:
        optimizer = accelerator.prepare(optimizer)
    loaded = pickle.loads(pickle.dumps(optimizer))
    assert loaded.param_groups[0]["lr"] == 0.1


def _backward_with_grads(accelerator, model, *, nan):
    loss = model(torch.randn(2, 5, device=accelerator.device)).sum()
    accelerator.backward(loss)
    scale = accelerator.amp.scalers[0].get_scale()  # the gradients are scaled until the step unscales them
    for p in model.parameters():
        # Fake the gradients, as if there's no overflow
        p.grad.fill_(0.01 * scale)
    if nan:
        # Manually set the gradients to be NaN, as if there's an overflow
        p.grad[0] = torch.tensor(float("nan"))


def _values(accelerator, model):
    """``(parameters, FP32 values)``: the model's parameters and the FP32 values they train from (O2's masters, the
    parameters themselves at O1)."""
    fp32 = accelerator.amp.fp32_state_dict(model)
    return (
        [p.detach().clone() for p in model.parameters()],
        [fp32[name].clone() for name, _ in model.named_parameters()],
    )


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1]))


@pytest.mark.parametrize("level, half", LEVELS_AND_HALVES)
def test_accelerated_optimizer_step_was_skipped(level, half):
    """tests/test_optimizer.py::OptimizerTester::test_accelerated_optimizer_step_was_skipped (upstream:
    ``mixed_precision="fp16"`` on a GPU; here every opt level on CPU). The gradients filled in are 0.01 once
    unscaled (upstream fills the scaled gradients with 0.01: under a scale of 2**16 a step of 1.5e-8 that a
    half model does not show). Also: a skipped step leaves the model and its FP32 values as they were, a step
    taken changes the FP32 values. ``on_floor="continue"``: bfloat16's static scale of 1 is its floor, where an
    overflow raises by default, after skipping (the last part of this test)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 5)
    optimizer = torch.optim.SGD(model.parameters(), 0.1)
    accelerator = _accelerator(level, half, on_floor="continue")
    model, optimizer = accelerator.prepare(model, optimizer)

    for nan, skipped in [(False, False), (True, True), (True, True), (False, False)]:
        before = _values(accelerator, model)
        _backward_with_grads(accelerator, model, nan=nan)
        optimizer.step()
        assert optimizer.step_was_skipped is skipped
        after = _values(accelerator, model)
        if skipped:
            assert _same(before, after)
        else:
            assert all(not torch.equal(a, b) for a, b in zip(before[1], after[1]))  # every FP32 value moved
        optimizer.zero_grad()
    assert accelerator.mpx_metrics()["mpx/skipped_steps"] == 2

    if half == "bfloat16":  # the default on_floor="raise": the overflow at the floor skips the step, then raises
        reset_accelerate_state()
        torch.manual_seed(0)
        accelerator = _accelerator(level, half)
        model = torch.nn.Linear(5, 5)
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), 0.1))
        before = _values(accelerator, model)
        _backward_with_grads(accelerator, model, nan=True)
        with pytest.raises(LossScaleFloorError, match="static loss scale cannot be lowered"):
            optimizer.step()
        assert optimizer.step_was_skipped is True
        assert _same(before, _values(accelerator, model))
