"""The Accelerate adapter driven with habits the earlier hostile rounds left out, each checked against a reference:
the same script prepared in one call, or Accelerate's own ``mixed_precision="no"``.

Habits covered: a model prepared in a later ``prepare`` call than the optimizer that trains it (alone after
``prepare(model, optimizer)``, or model, optimizer and model in three calls).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("accelerate")

from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs  # noqa: E402
from tests.accelerate_helpers import reset_accelerate_state  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def _accelerator(level, half="bfloat16", **kwargs):
    reset_accelerate_state()  # a fresh Accelerator, as in a new process
    handlers = [MixedPrecisionKwargs(half_dtype=half, init_scale=2.0**8)] if level.startswith("O") else None
    return Accelerator(mixed_precision=level, kwargs_handlers=handlers, cpu=True, **kwargs)


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# -- a model prepared after the optimizer that trains it ----------------------------------------------------------------
def _encoder_head_run(calls, level="O2"):
    """An encoder and a head trained by one SGD (lr 1e-3, 8 steps), prepared as ``calls`` says; returns the FP32
    weights training produced (each model's ``fp32_state_dict`` at O2) and the head's master dtypes."""
    accelerator = _accelerator(level)
    encoder = _net()
    torch.manual_seed(1)
    head = nn.Linear(3, 3)
    opt = torch.optim.SGD([*encoder.parameters(), *head.parameters()], lr=1e-3)
    if calls == "one":
        encoder, head, opt = accelerator.prepare(encoder, head, opt)
    elif calls == "head after":
        encoder, opt = accelerator.prepare(encoder, opt)
        head = accelerator.prepare(head)
    else:  # encoder, optimizer, head: three calls
        encoder = accelerator.prepare(encoder)
        opt = accelerator.prepare(opt)
        head = accelerator.prepare(head)
    for step in range(8):
        x, y = _batch(step)
        accelerator.backward(F.cross_entropy(head(encoder(x)), y))
        opt.step()
        opt.zero_grad()
    weights = []
    for model in (encoder, head):
        inner = accelerator.unwrap_model(model)
        state = accelerator.amp.fp32_state_dict(inner) if level == "O2" else inner.state_dict()
        weights += [v.float() for v in state.values()]
    dtypes = {p.dtype for p in accelerator.amp.master_params(opt.optimizer)} if level != "no" else set()
    return weights, dtypes


@pytest.mark.parametrize("calls", ["head after", "three calls"])
def test_a_model_prepared_after_its_optimizer_trains_on_fp32_masters(calls):
    """Found at stop 50: at O2 a model prepared in a later ``prepare`` call than the optimizer that trains it got no
    FP32 masters (its parameters were FP32, paired with themselves, when the optimizer was registered; the conversion
    to half came after), so the optimizer stepped its bfloat16 weights directly: at lr 1e-3 each update rounded away
    and the head never moved (0.0 after 8 steps). Now the optimizer is registered again once its model is converted:
    the run is the one prepared in a single call, bit for bit, and follows Accelerate's ``"no"``."""
    weights, dtypes = _encoder_head_run(calls)
    reference, _ = _encoder_head_run("one")
    assert dtypes == {torch.float32}
    assert _same(weights, reference)
    native, _ = _encoder_head_run("one", level="no")
    torch.testing.assert_close(weights, native, atol=1e-3, rtol=0)
    torch.manual_seed(1)
    assert (weights[-2] - nn.Linear(3, 3).weight).abs().max() > 5e-4  # the head trained (not at all before the fix)
