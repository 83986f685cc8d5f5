"""The Apex layer's edge cases of stop 52: what an O2/O3 ``initialize`` hooks on the model, and the stash of earlier
blocks' gradients (O1 and O2) across ``delay_unscale`` blocks of another optimizer and a chain given up through the
model. The references are the same run without the blocks in question (the same kernels: equal bit for bit) and the
sequences' machine of ``tests/test_apex_stateful.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx.apex import _amp_state, amp
from lightning_mpx.engine.amp import Amp
from tests import test_apex_stateful as stateful


@pytest.fixture(autouse=True)
def _fresh_apex_state():
    _amp_state.reset()
    yield
    _amp_state.reset()


def _net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), nn.Linear(8, 3))


def _hooks(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Forward pre-hooks and forward hooks of each submodule that has any."""
    found = {name: (len(m._forward_pre_hooks), len(m._forward_hooks)) for name, m in model.named_modules()}
    return {name: counts for name, counts in found.items() if counts != (0, 0)}


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_o2_o3_initialize_hooks_no_submodule(level):
    """Apex patched nothing for losses at O2/O3 and this layer never enters the core's O2 loss policy: its models
    carry the input and output casts on the model itself and nothing on the submodules (the core's own O2 hooks its
    submodules' loss regions, each a Python call per forward, here never used). Training still works."""
    core = _net(0)
    Amp("O2", half_dtype=torch.bfloat16).prepare_model(core)
    assert len(_hooks(core)) > 1  # the core's regions: what this test would see if the layer kept them

    model = _net(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, cast_model_type=torch.bfloat16, verbosity=0)
    assert _hooks(model) == {"": (1, 1)}
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert _hooks(model) == {"": (1, 1)}


def _two_optimizers(level: str, **scaling):
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    opts = [torch.optim.SGD(a.parameters(), lr=0.5), torch.optim.SGD(b.parameters(), lr=0.5)]
    half = {"cast_model_type": torch.bfloat16} if level == "O2" else {}
    models, opts = amp.initialize([a, b], opts, opt_level=level, num_losses=2, verbosity=0,
                                  **(scaling or {"loss_scale": 128.0}), **half)  # fmt: skip
    return models, opts


def _loss(model: nn.Module, seed: int) -> torch.Tensor:
    torch.manual_seed(100 + seed)
    return model(torch.randn(8, 4)).float().pow(2).mean()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_block_kept_aside_survives_another_optimizers_delayed_blocks(level):
    """A's block, then a delay_unscale block of B's loss and B's final block (a GAN loop accumulating the second
    network), then both steps: A's update is the one A's block alone gives. The delayed block does not reach A's
    parameters; the stash of A's gradients taken at its start was read as "cleared by the script" at the next block
    (no gradient on A's parameters) and dropped: A did not step."""
    (a, b), (opt_a, opt_b) = _two_optimizers(level)
    with amp.scale_loss(_loss(a, 0), opt_a, loss_id=0) as scaled:
        scaled.backward()
    with amp.scale_loss(_loss(b, 1), opt_b, loss_id=1, delay_unscale=True) as scaled:
        scaled.backward()
    with amp.scale_loss(_loss(b, 2), opt_b, loss_id=1) as scaled:
        scaled.backward()
    opt_a.step()
    opt_b.step()
    got = [p.detach().clone() for p in amp.master_params(opt_a)]

    _amp_state.reset()
    (a, b), (opt_a, opt_b) = _two_optimizers(level)
    before = [p.detach().clone() for p in amp.master_params(opt_a)]
    with amp.scale_loss(_loss(a, 0), opt_a, loss_id=0) as scaled:
        scaled.backward()
    opt_a.step()
    want = list(amp.master_params(opt_a))
    assert any(not torch.equal(w, p) for w, p in zip(want, before))  # A trains
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize(("through_model", "set_to_none"), [(True, False), (True, True), (False, False)])
def test_o1_a_chain_given_up_after_a_block_leaves_that_block_out(through_model, set_to_none):
    """O1 keeps earlier blocks' gradients aside as O2 does: a block, a delay_unscale block, ``zero_grad`` (a batch
    dropped mid-accumulation, through the model or the optimizer, either way), a new block and the step train on
    the new block alone, as the FP32 reference; the given-up chain counts no iteration for its loss."""
    with stateful.replayed("O1") as machine:
        machine.block(seed=0, loss_id=0, delay=False, poison=None)
        machine.block(seed=1, loss_id=0, delay=True, poison=None)
        machine.zero_grad(set_to_none=set_to_none, through_model=through_model)
        machine.block(seed=2, loss_id=0, delay=False, poison=None)
        machine.step()
        machine.scales_steps_and_learning_rates_agree()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_chain_given_up_through_the_model_counts_nothing_for_its_loss(level):
    """``model.zero_grad(set_to_none=False)`` after a delay_unscale block of loss 0, then a block of loss 1 and the
    step: loss 0's scale counts no iteration without overflow (Apex updated a scaler only at the end of a block it
    unscaled); loss 1's counts one."""
    with stateful.replayed(level) as machine:
        machine.block(seed=0, loss_id=0, delay=True, poison=None)
        machine.zero_grad(set_to_none=False, through_model=True)
        machine.block(seed=1, loss_id=1, delay=False, poison=None)
        machine.step()
        machine.scales_steps_and_learning_rates_agree()


def test_a_scaling_of_a_delayed_blocks_gradients_reaches_the_earlier_blocks():
    """A write to every gradient between delayed blocks that does not zero them (here a halving) is no clear, and it
    halves the earlier block's gradients too, as FP32's: at O1 a delayed block after a block without delay_unscale is
    unscaled at its end with the earlier gradients added back (since stop 68; they were kept aside past the halving,
    where Apex's chain added into the same tensors). The same as the run whose second block is not delayed."""

    def run(delay: bool) -> list[torch.Tensor]:
        _amp_state.reset()
        (a, _), (opt_a, _) = _two_optimizers("O1")
        with amp.scale_loss(_loss(a, 0), opt_a, loss_id=0) as scaled:
            scaled.backward()
        with amp.scale_loss(_loss(a, 1), opt_a, loss_id=0, delay_unscale=delay) as scaled:
            scaled.backward()
        for p in a.parameters():
            p.grad.mul_(0.5)
        with amp.scale_loss(_loss(a, 2), opt_a, loss_id=0) as scaled:
            scaled.backward()
        return [p.grad.clone() for p in a.parameters()]

    for g, want in zip(run(True), run(False), strict=True):
        torch.testing.assert_close(g, want)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_block_overflowing_after_another_losss_overflow_says_so(level, caplog):
    """Loss 1's block overflows, then loss 0's overflows too: both losses' scales back off at the step and Apex's
    message names each (loss 0's was taken for loss 1's overflow seen again, and not logged)."""
    (a, _), (opt_a, _) = _two_optimizers(level, loss_scale="dynamic", max_loss_scale=128.0)
    _amp_state.verbosity = 1
    for loss_id in (1, 0):
        with caplog.at_level("INFO", logger="lightning_mpx.apex"):
            with amp.scale_loss(_loss(a, loss_id), opt_a, loss_id=loss_id) as scaled:
                scaled.backward()
                next(a.parameters()).grad[0, 0] = float("inf")
    opt_a.step()
    said = [r.getMessage() for r in caplog.records if "Gradient overflow" in r.getMessage()]
    assert [m.split("loss scaler ")[1][0] for m in said] == ["1", "0"]
    assert [s.loss_scale() for s in _amp_state.loss_scalers] == [64.0, 64.0]
