"""Stop 68's strict xfails made to pass (xfails69): what the fixes also cover, from the user's side, against FP32."""

from __future__ import annotations

import pytest
import torch

from lightning_mpx import Amp
from tests.test_core_shared_masters_clip import (
    _shared,  # the whole model's optimizer and the head's own, a sequence of calls
)


# -- 1. a load between two backwards keeps the backward's note --------------------------------------------------------
def _load_between_accumulated_backwards(raw: bool) -> torch.Tensor:
    """O2 bfloat16, two micro-batches per step; between the two backwards of the second step the whole model loaded
    from an FP32 copy, then (``raw``) a torch SGD step over the model with the gradients kept (no ``zero_grad``)."""
    import tests.test_core_shared_head_groups as gaps

    net = gaps._net()
    amp = Amp("O2", half_dtype="bfloat16")
    amp.prepare_model(net)
    opt = amp.prepare_optimizer(torch.optim.SGD(net.parameters(), lr=0.05))
    saved = {k: v.float().clone() for k, v in net.state_dict().items()}
    for step in range(2):
        gaps._forward_backward(amp, net, *gaps._batch(step))
        if step == 1:
            net.load_state_dict(saved)
            if raw:
                torch.optim.SGD(net.parameters(), lr=0.5).step()
        gaps._forward_backward(amp, net, *gaps._batch(step + 5))
        amp.step(opt)
        amp.update()
        opt.zero_grad()
    return torch.cat([v.flatten() for v in amp.fp32_state_dict(net).values()])


def test_o2_raw_step_after_a_load_between_accumulated_backwards_is_refused() -> None:
    """The load forgot the first backward's note, so the raw step after it (the half weights stepped along the kept
    gradients: the masters take only its bfloat16 rounding) was let through; now refused at the step. The load alone
    (a rollback inside the accumulation window) still trains on."""
    with pytest.raises(RuntimeError, match="stepped along their gradients between two backwards"):
        _load_between_accumulated_backwards(raw=True)
    assert torch.isfinite(_load_between_accumulated_backwards(raw=False)).all()


# -- 2. a shared parameter's gradient replaced after an unscale ------------------------------------------------------
@pytest.mark.parametrize(
    ("sequence", "half", "level"),
    [
        # O1: the other optimizer's clip takes the replaced gradient as true values (0.022 off FP32 before)
        (("unscale whole", "clone x", "clip head", "step whole", "step head"), "float16", "O1"),
        # O1: replaced after the first optimizer's step, which unscaled it in place (0.23 off before)
        (("step whole", "clone x", "step head"), "float16", "O1"),
        # O2: the masters' gradients replaced, then the other optimizer unscaled before either step (0.14 off before)
        (("unscale whole", "halve whole", "unscale head", "step head", "step whole"), "bfloat16", "O2"),
    ],
)
def test_shared_gradient_replaced_after_an_unscale_trains_as_fp32(
    sequence: tuple[str, ...], half: str, level: str
) -> None:
    got, _ = _shared(sequence, half, level=level)
    torch.testing.assert_close(got, _shared(sequence, None)[0], rtol=0, atol=2e-3)


def test_o2_shared_gradient_replaced_then_clipped_by_the_other_optimizer_trains_as_fp32() -> None:
    """At O2, after the whole model's ``unscale_`` showed the true values in the half gradients, ``p.grad =
    p.grad.clone()``, then the head's own ``amp.clip_grad_norm_`` (which clips the shared masters' FP32 gradients, the
    clones left unclipped): the whole model's step took the clones again as the user's write after its unscale and
    stepped the head unclipped (0.27 off FP32). The head's unscale, taking a clone, moves the other's marks to it."""
    sequence = ("unscale whole", "clone x", "clip head", "step whole", "step head")
    got, _ = _shared(sequence, "float16", level="O2")
    torch.testing.assert_close(got, _shared(sequence, None)[0], rtol=0, atol=2e-3)
