"""What the stateful machines (tests/test_*_stateful.py) found under ``HYPOTHESIS_PROFILE=explore`` at stop 66, each
sequence written out as a user's script (tests/test_apex_stateful.py's machine replays them too)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx.apex import _amp_state, amp


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


@pytest.fixture
def apex_run(request):
    """``amp.initialize`` of a small model and SGD with momentum (two losses), reset after the test."""
    _amp_state.reset()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5)
    model, opt = amp.initialize(net, opt, opt_level=request.param, loss_scale="dynamic", num_losses=2,
                                max_loss_scale=2.0**6, verbosity=0)  # fmt: skip
    yield model, opt
    _amp_state.reset()


def _block(model: nn.Module, opt: torch.optim.Optimizer, seed: int, delay: bool, loss_id: int = 0) -> None:
    x, y = _batch(seed)
    with amp.scale_loss(F.cross_entropy(model(x).float(), y), opt, loss_id=loss_id, delay_unscale=delay) as scaled:
        scaled.backward()


@pytest.mark.parametrize("set_to_none", [False, True])
@pytest.mark.parametrize("apex_run", ["O1", "O2"], indirect=True)
def test_a_delayed_chain_zeroed_through_the_model_right_before_the_step_takes_the_earlier_blocks_along(
    apex_run, set_to_none
):
    """A block, a ``delay_unscale`` block, ``model.zero_grad()`` (the batch dropped mid-accumulation), then
    ``optimizer.step()``. Before: the step added back the first block's gradients, which the delayed block had kept
    aside (Apex's stash) and the zero_grad had cleared, and trained on them (at O1 and O2, ``set_to_none`` either
    way). Only a next block looked for the clear. Now the step does: it steps on the zeroed (or absent) gradients,
    as FP32 does, and the weights stay where they were (SGD's first step, no momentum yet)."""
    model, opt = apex_run
    _block(model, opt, seed=0, delay=False)
    _block(model, opt, seed=1, delay=True)
    model.zero_grad(set_to_none=set_to_none)
    before = [m.detach().clone() for m in amp.master_params(opt)]
    opt.step()
    for master, was in zip(amp.master_params(opt), before, strict=True):
        assert torch.equal(master.detach(), was)
    assert all(torch.equal(p.detach(), m.detach().to(p.dtype)) for p, m in zip(model.parameters(), before))


@pytest.mark.parametrize("apex_run", ["O1"], indirect=True)
def test_a_step_right_after_a_dropped_delayed_chain_counts_for_no_loss_scale(apex_run):
    model, opt = apex_run
    _block(model, opt, seed=0, delay=True, loss_id=1)
    opt.zero_grad()
    opt.step()
    state = amp.state_dict()
    assert [state[f"loss_scaler{i}"]["unskipped"] for i in (0, 1)] == [0, 0]
