"""The Apex layer at O2: a write to the model's gradients after the optimizer's ``zero_grad()`` that followed a write to
``amp.master_params(opt)``'s gradients (torch's clip of them, the Apex habit), between a ``scale_loss`` block and the
step, against FP32 with the same calls. The zeroing clears both, so the model's write is the only one (FP32 steps with
it)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mpx.apex import _amp_state, amp


@pytest.fixture(autouse=True)
def _reset_amp_state():
    _amp_state.reset()
    yield
    _amp_state.reset()


def test_masters_clipped_then_zero_grad_then_the_models_written_trains_as_fp32() -> None:
    """Before: the step refused it ('both the FP32 master weights' gradients ... and the model's gradients ... were
    written'): the wrapper's ``zero_grad(set_to_none=False)`` zeroed the masters' gradients, which moved their counters
    as a write does, and the engine was not told (review70c's false refusal, at the Apex door). Now the step takes the
    model's write, as FP32 (engine.master_writes.cleared)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    ref = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    ref.load_state_dict(net.state_dict())
    net, opt = amp.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5), opt_level="O2",
                              loss_scale=8.0, verbosity=0)  # fmt: skip
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.5)
    for i in range(2):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(i))
        with amp.scale_loss(net(x.half()).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        ref(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.01)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
        for optimizer, model in ((opt, net), (ref_opt, ref)):
            optimizer.zero_grad(set_to_none=False)  # the iteration given up: a hand-made gradient instead
            for param in model.parameters():
                param.grad.add_(0.01 * (i + 1))
            optimizer.step()
            optimizer.zero_grad()
    for master, want in zip(amp.master_params(opt), ref.parameters(), strict=True):
        torch.testing.assert_close(master, want, rtol=0, atol=1e-5)  # the hand-made gradients alone: FP32 to rounding
