"""Stop 68's strict xfails made to pass (xfails69): what the fixes also cover, from the user's side, against FP32."""

from __future__ import annotations

import pytest
import torch

from lightning_mpx import Amp
from tests.test_review68a import _shared  # the whole model's optimizer and the head's own, a sequence of calls


# -- 1. a load between two backwards keeps the backward's note --------------------------------------------------------
def _load_between_accumulated_backwards(raw: bool) -> torch.Tensor:
    """O2 bfloat16, two micro-batches per step; between the two backwards of the second step the whole model loaded
    from an FP32 copy, then (``raw``) a torch SGD step over the model with the gradients kept (no ``zero_grad``)."""
    import tests.test_gaps68 as gaps

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


# -- 3. Apex num_losses=2: one loss's overflow reaching the gradients another loss's block names ----------------------
def test_apex_other_loss_block_over_charged_gradients_skips_their_step() -> None:
    """O1, ``num_losses=2``: loss 0's block (naming the trunk's optimizer) is inf and reaches the head's gradients;
    loss 1's block names the head's optimizer. Its check counts loss 0's inf for none, and the head's step is still
    skipped (Apex, checking the block's own gradients only, stepped the inf into the head): the head's weights are
    unchanged by that iteration and finite, and only loss 0's scale backs off."""
    import math
    import warnings

    import torch.nn.functional as F

    from lightning_mpx.apex import _amp_state, amp
    from tests.test_xfails68 import _batches, _Net

    _amp_state.reset()
    torch.manual_seed(0)
    model = _Net()
    trunk = torch.optim.SGD(model.trunk.parameters(), lr=0.1)
    head = torch.optim.SGD(model.head.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, (trunk, head) = amp.initialize(
            model, [trunk, head], opt_level="O1", loss_scale="dynamic", verbosity=0, num_losses=2
        )
        try:
            for i, (x, y) in enumerate(_batches(3)):
                before = model.head.weight.detach().clone()
                trunk.zero_grad()
                head.zero_grad()
                for loss_id, named in ((0, trunk), (1, head)):
                    loss = F.cross_entropy(model(x), y) * (math.inf if (i, loss_id) == (1, 0) else 1.0)
                    with amp.scale_loss(loss, named, loss_id=loss_id) as scaled:
                        scaled.backward()
                trunk.step()
                head.step()
                if i == 1:
                    assert torch.equal(model.head.weight, before)
            scales = [s.loss_scale() for s in _amp_state.loss_scalers]
        finally:
            _amp_state.reset()
    assert torch.isfinite(model.head.weight).all() and scales == [32768.0, 65536.0]
