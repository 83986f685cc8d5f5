"""A torch optimizer lightning_mpx never prepared, stepped by hand after the engine's backward at O2 (the core ``Amp``,
Fabric): refused at the next backward, naming the parameters and the fix, instead of silently training the half
weights with scaled gradients and no FP32 master update. What a user legitimately does between backwards (gradient
accumulation with a weight clamp, a skipped batch) still trains as FP32 does."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp

HALF = "bfloat16"


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def _core() -> tuple[Amp, nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    amp = Amp(opt_level="O2", half_dtype=HALF)
    model = amp.prepare_model(model)
    return amp, model, amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def _loss(model: nn.Module, i: int) -> torch.Tensor:
    x, y = _batch(i)
    return F.mse_loss(model(x.to(model.weight.dtype)).float(), y)


def test_core_raw_optimizer_after_amp_backward_is_refused_naming_the_fix() -> None:
    amp, model, _ = _core()
    raw = torch.optim.SGD(model.parameters(), lr=0.1)  # the user's own, never given to prepare_optimizer
    raw.zero_grad()
    amp.backward(_loss(model, 0))
    raw.step()
    raw.zero_grad()
    with pytest.raises(RuntimeError, match=r"'weight'.*did not\s+prepare.*amp\.prepare_optimizer\(optimizer\)"):
        amp.backward(_loss(model, 1))


@pytest.mark.parametrize(
    "registered",
    [
        True,
        pytest.param(False, marks=pytest.mark.xfail(
            strict=True,
            reason="integrations/fabric.py: Fabric hands optimizers to the plugin only at their first step "
            "(_register, lazily), so before any fabric step the engine tracks no optimizer whose pending gradients "
            "engine/raw_steps.py could check; a model-level note at backward when no optimizer is known is not done",
        )),
    ],
)
def test_fabric_raw_optimizer_not_given_to_setup_is_refused(registered: bool) -> None:
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    plugin = FabricMixedPrecisionPlugin("O2", half_dtype=HALF)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))  # set up, never stepped
    if registered:
        plugin.setup_optimizers(opt)
    raw = torch.optim.SGD(model.parameters(), lr=0.1)  # the user's own, never given to fabric.setup
    with pytest.raises(RuntimeError, match=r"fabric\.setup\(model, optimizer\)"):
        for i in range(2):
            raw.zero_grad()
            fabric.backward(_loss(model, i))
            raw.step()


def test_accumulation_with_a_clamp_and_a_skipped_batch_still_train_as_fp32() -> None:
    """Between backwards with no step: a weight clamp while gradients accumulate, and a skipped batch (``zero_grad``
    without a step) are the user's, not a raw optimizer's: kept, as FP32 keeps them."""
    amp, model, opt = _core()
    torch.manual_seed(0)
    ref = nn.Linear(4, 1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for net, backward, step, zero in (
        (ref, lambda loss: loss.backward(), ref_opt.step, ref_opt.zero_grad),
        (model, amp.backward, lambda: amp.step(opt), opt.zero_grad),
    ):
        for it in range(3):
            backward(_loss(net, 2 * it))
            with torch.no_grad():
                net.weight.clamp_(-0.3, 0.3)  # between accumulated backwards
            backward(_loss(net, 2 * it + 1))
            step()
            zero()
            backward(_loss(net, 10 + it))  # a skipped batch: no step, then cleared
            zero()
        if net is model:
            amp.update()
    got = amp.fp32_state_dict(model)
    assert all(torch.allclose(got[k], v, atol=1e-2) for k, v in ref.state_dict().items())
