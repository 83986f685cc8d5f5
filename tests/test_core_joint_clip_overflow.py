"""The core loop at O2 float16 with two optimizers (two models, one loss) and one clip of both optimizers' masters with
torch's ``clip_grad_norm_(amp.master_params(o1) + amp.master_params(o2), ...)`` (the Apex habit over two
optimizers), model ``b``'s gradients overflowing on one iteration: the joint norm is NaN, and torch's clip makes ``a``'s
finite master gradients NaN after ``amp.unscale_`` checked them. Before, ``amp.step(o1)`` stepped on them: NaN weights,
silently (``torch.amp.GradScaler`` does the same: it reads the flags at ``unscale_``). Now both skip, as the Accelerate
adapter's own joint clip makes them (``tests/test_accelerate_clip_after_writes.py``) and as the run that calls
``amp.share_overflow([o1, o2])`` when ``amp.overflowed(o2)`` (the way out before) does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mpx import Amp


def _run(share: bool, first: str = "o1") -> tuple[list[bool], torch.Tensor]:
    torch.manual_seed(0)
    amp = Amp("O2", half_dtype="float16", init_scale=2.0**8)
    a, b = amp.prepare_model(nn.Linear(4, 2)), amp.prepare_model(nn.Linear(4, 2))
    o1 = amp.prepare_optimizer(torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9))
    o2 = amp.prepare_optimizer(torch.optim.SGD(b.parameters(), lr=0.1))
    stepped = []
    for i in range(3):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i))
        with amp.forward_context():
            out_a = amp.cast_outputs(a(amp.cast_inputs(x)))
            out_b = amp.cast_outputs(b(amp.cast_inputs(x * (1e6 if i == 2 else 1.0))))
            loss = out_a.float().pow(2).mean() + out_b.float().pow(2).mean()
        amp.backward(loss)
        amp.unscale_(o1)
        amp.unscale_(o2)
        if share and (amp.overflowed(o1) or amp.overflowed(o2)):
            amp.share_overflow([o1, o2])
        torch.nn.utils.clip_grad_norm_(amp.master_params(o1) + amp.master_params(o2), 0.5)
        if first == "o2":  # the overflowing optimizer steps (skips) first
            amp.step(o2)
        stepped.append(bool(amp.step(o1)))
        if first == "o1":
            amp.step(o2)
        amp.update()
        o1.zero_grad()
        o2.zero_grad()
    return stepped, amp.master_of(a.weight).detach().clone()


@pytest.mark.parametrize("first", ["o1", "o2"])
def test_a_joint_torch_clip_with_one_optimizer_overflowing_skips_both(first: str) -> None:
    stepped, weight = _run(share=False, first=first)
    shared_stepped, shared_weight = _run(share=True, first=first)
    # before: model a's FP32 masters NaN after the third iteration (amp.step(o1) applied the NaN the clip made)
    assert torch.isfinite(weight).all()
    assert stepped == shared_stepped == [True, True, False]
    torch.testing.assert_close(weight, shared_weight, rtol=0, atol=0)


def test_share_overflow_skips_both_and_keeps_the_weights_finite() -> None:
    stepped, weight = _run(share=True)
    assert stepped == [True, True, False]
    assert torch.isfinite(weight).all()
