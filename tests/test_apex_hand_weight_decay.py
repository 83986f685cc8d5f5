"""Stop 69, the lead's own regression tests (cases covered before only by a hypothesis machine)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx.apex import _amp_state, amp
from tests.test_apex_delayed_chain_fixes import _batches, _Net  # a trunk and a head


@pytest.fixture(autouse=True)
def _reset():
    _amp_state.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    _amp_state.reset()


def _decay_between_blocks(apex: bool) -> list[torch.Tensor]:
    """Two ``scale_loss`` blocks per iteration (half a batch each, not delayed), a hand weight decay
    ``p.mul_(1 - 1e-2)`` between them, one SGD step; Apex O1 with a dynamic scale, or FP32 (``apex=False``)."""
    torch.manual_seed(0)
    model: nn.Module = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if apex:
        model, opt = amp.initialize(model, opt, opt_level="O1", loss_scale="dynamic", verbosity=0)
    for x, y in _batches(4):
        opt.zero_grad()
        for block, (xb, yb) in enumerate(((x[:4], y[:4]), (x[4:], y[4:]))):
            loss = F.cross_entropy(model(xb).float(), yb)
            if apex:
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            else:
                loss.backward()
            if block == 0:
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(1 - 1e-2)
        opt.step()
    return [p.detach().float().clone() for p in model.parameters()]


def test_apex_o1_hand_weight_decay_between_blocks_trains_as_fp32() -> None:
    """stateful68's note-only backward after an unscale (``engine/optimizers.py``, ``_look_for_raw_step(look=False)``
    at O1): the first block unscales at its end, the hand decay then writes the weights, the second block's backward
    must take it as the user's write, not a raw step. Looked for at O1 too, it was refused at the step ("written and
    their gradients cleared after a backward ... no step between")."""
    got, want = _decay_between_blocks(apex=True), _decay_between_blocks(apex=False)
    for mine, ref in zip(got, want, strict=True):
        torch.testing.assert_close(mine, ref, rtol=0, atol=5e-4)
