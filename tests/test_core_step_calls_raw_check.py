"""Host work per step the raw-step check (engine/raw_steps.py) does only where a raw step would harm (stop 56).

Every engine backward noted each registered optimizer's parameter versions, so that a torch optimizer lightning_mpx
never prepared, stepping the parameters before the next backward, is refused there. Where such a step cannot harm (no
FP32 masters and a loss scale of exactly 1: O0, or O1 in bfloat16) that note is never compared, so the backward now
skips it (a read of every parameter's version per backward). The check must still fire as soon as the scale leaves 1
(a checkpoint's scale loaded) or at O2, where masters exist.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp

REFUSED = r"(?s)'0\.weight'.*were written and their gradients cleared after a backward of lightning_mpx"


def _prepared(opt_level: str, **kw: object) -> tuple[Amp, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    amp = Amp(opt_level=opt_level, half_dtype=torch.bfloat16, **kw)
    model = amp.prepare_model(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)))
    return amp, model, amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def _backward(amp: Amp, model: nn.Module, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    dtype = next(p.dtype for p in model.parameters())
    amp.backward(F.mse_loss(model(x.to(dtype)).float(), y))


def _raw_step(model: nn.Module) -> None:
    raw = torch.optim.SGD(model.parameters(), lr=0.1)  # never prepared by lightning_mpx
    raw.step()
    raw.zero_grad()


def _noted(amp: Amp, optimizer: torch.optim.Optimizer) -> object:
    return amp._machine.state(optimizer).backward_versions  # engine.raw_steps' marks of the last backward


def test_o1_unit_scale_notes_nothing_and_the_check_fires_once_the_scale_leaves_1() -> None:
    amp, model, optimizer = _prepared("O1")
    for i in range(2):  # an engine step between: every branch of the backward's bookkeeping (stepped, then ready)
        _backward(amp, model, i)
        assert _noted(amp, optimizer) is None  # a raw step here would be a plain step: nothing read for it
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()
    _backward(amp, model, 2)
    _backward(amp, model, 3)  # accumulation: the pending branch
    assert _noted(amp, optimizer) is None
    _raw_step(model)
    _backward(amp, model, 4)  # a unit scale, no masters: left alone, as before
    amp.step(optimizer)
    amp.update()
    optimizer.zero_grad()

    # the scale leaves 1: a checkpoint of a run at a static scale of 128 loaded into this one
    other, other_model, other_opt = _prepared("O1", loss_scale=128.0)
    _backward(other, other_model, 0)
    other.step(other_opt)
    other.update()
    amp.load_state_dict(other.state_dict())
    _backward(amp, model, 5)
    assert _noted(amp, optimizer) is not None  # watched from this backward on
    _raw_step(model)  # gradients x128 applied by hand
    with pytest.raises(RuntimeError, match=REFUSED):
        _backward(amp, model, 6)


def test_o2_masters_keep_the_check_at_a_unit_scale() -> None:
    amp, model, optimizer = _prepared("O2")
    _backward(amp, model, 0)
    amp.step(optimizer)
    amp.update()
    optimizer.zero_grad()
    _backward(amp, model, 1)
    _raw_step(model)  # the half parameters stepped with no FP32 master update
    with pytest.raises(RuntimeError, match=REFUSED):
        _backward(amp, model, 2)


def _calls_in_unscale(opt_level: str) -> int:
    """Python calls of ``amp.unscale_`` at the fourth step (what the Trainer does before its hooks and clip)."""
    import gc
    import sys

    amp, model, optimizer = _prepared(opt_level)
    counted = 0

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        nonlocal counted
        counted += event == "call"

    for i in range(4):
        _backward(amp, model, i)
        if i == 3:
            gc.collect()
            gc.disable()
            sys.setprofile(profile)
        try:
            amp.unscale_(optimizer)
        finally:
            sys.setprofile(None)
            gc.enable()
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()
    return counted


# Stop 56: unscale_ at O2 noted the half gradients it read (grad_marks, param_pairs) and show_unscaled noted them again
# after its copies at once; noted once now: 15 calls to 13 (torch 2.13, CPU).
O2_UNSCALE_CALLS = 13


def test_o2_unscale_notes_the_half_gradients_once() -> None:
    calls = _calls_in_unscale("O2")
    assert calls <= O2_UNSCALE_CALLS, f"amp.unscale_ at O2 makes {calls} Python calls (stop 56 left {O2_UNSCALE_CALLS})"


def test_o2_unscale_then_a_cleared_gradient_is_followed_by_the_step() -> None:
    # the marks noted after the copies: a gradient the user clears between unscale_ and the step is not stepped
    amp, model, optimizer = _prepared("O2")
    _backward(amp, model, 0)
    amp.unscale_(optimizer)
    model[0].weight.grad = None  # cleared after the unscale
    before = [amp.master_of(p).clone() for p in (model[0].weight, model[2].weight)]
    amp.step(optimizer)
    assert torch.equal(amp.master_of(model[0].weight), before[0])  # not stepped
    assert not torch.equal(amp.master_of(model[2].weight), before[1])  # stepped
