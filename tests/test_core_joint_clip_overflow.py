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


def _three(share: bool) -> tuple[list[list[bool]], list[torch.Tensor]]:
    """As :func:`_run` with a third model ``c`` whose optimizer has no gradients after the first iteration (its loss
    term dropped: a branch not used), its masters in the joint clip all the same."""
    torch.manual_seed(0)
    amp = Amp("O2", half_dtype="float16", init_scale=2.0**8)
    models = [amp.prepare_model(nn.Linear(4, 2)) for _ in range(3)]
    opts = [amp.prepare_optimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)) for m in models]
    stepped = []
    for i in range(3):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(i))
        with amp.forward_context():
            outs = [amp.cast_outputs(m(amp.cast_inputs(x * (1e6 if i == 2 and k == 1 else 1.0))))
                    for k, m in enumerate(models[: 3 if i == 0 else 2])]  # fmt: skip
            loss = sum(out.float().pow(2).mean() for out in outs)
        amp.backward(loss)
        for opt in opts:
            amp.unscale_(opt)
        if share and any(amp.overflowed(opt) for opt in opts):
            amp.share_overflow(opts[:2])
        torch.nn.utils.clip_grad_norm_([m for opt in opts for m in amp.master_params(opt)], 0.5)
        stepped.append([bool(amp.step(opt)) for opt in opts])
        amp.update()
        for opt in opts:
            opt.zero_grad()
    return stepped, [amp.master_of(p).detach().clone() for m in models for p in m.parameters()]


def test_a_joint_clip_over_three_optimizers_one_without_gradients() -> None:
    """engine.master_writes.charge_written with a third optimizer that has no gradients this step: the two whose
    masters the NaN reached skip together (as with ``amp.share_overflow`` over them), the third's step moves nothing
    (no gradient: momentum alone never starts; ``torch.amp.GradScaler`` refuses to step it, 'No inf checks were
    recorded'), every weight finite."""
    stepped, weights = _three(share=False)
    shared_stepped, shared_weights = _three(share=True)
    assert stepped == shared_stepped
    assert [s[:2] for s in stepped] == [[True, True], [True, True], [False, False]]
    for got, want in zip(weights, shared_weights, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
