"""The plain Fabric SAM loop, with no ``plugin.setup_optimizers``: the plugin meets the optimizer at its first
``optimizer.step()``, after ``first_step`` wrote the weights in the first iteration. That write is judged there
(engine/raw_steps.py ``UnheldParams.judge``): a SAM-style optimizer's first_step trains as Fabric's own precision
(tests/test_fabric_raw_step_optimizer_habits.py), while a raw torch optimizer stepped by hand in the first iteration is
still refused, at that iteration's Fabric step at the latest."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin
from tests.test_fabric_raw_step_optimizer_habits import _SAM, _assert_close, _batch


def _setup(**precision: Any) -> tuple[Fabric, Any, Any]:
    """``fabric.setup_module`` and ``fabric.setup_optimizers``: the plugin meets the optimizer at its first step
    (``fabric.setup(model, optimizer)`` registers it at set-up)."""
    fabric = Fabric(accelerator="cpu", devices=1, **precision)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model = fabric.setup_module(net)
    return fabric, model, fabric.setup_optimizers(torch.optim.SGD(net.parameters(), lr=0.1))


def _loss(model: Any, i: int) -> torch.Tensor:
    x, y = _batch(i)
    return F.mse_loss(model(x).float(), y)


def _o2() -> FabricMixedPrecisionPlugin:
    return FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")


@pytest.mark.parametrize("second_backward", [True, False], ids=["sam_shaped", "one_backward"])
def test_a_raw_sgd_in_the_first_iteration_is_refused_at_fabrics_step(second_backward: bool) -> None:
    """A torch SGD over the model that the plugin never meets, stepped by hand after the first backward (with a
    second backward after it, as SAM's first_step has, or not): refused at the iteration's Fabric step, before the
    prepared optimizer steps and before a second raw write."""
    fabric, model, optimizer = _setup(plugins=[_o2()])
    raw = torch.optim.SGD(model.parameters(), lr=0.1)
    fabric.backward(_loss(model, 0))
    raw.step()
    raw.zero_grad()
    if second_backward:
        fabric.backward(_loss(model, 0))
    with pytest.raises(RuntimeError, match="were written and their gradients cleared.*torch optimizer that "):
        optimizer.step()


def test_a_raw_sgd_stepped_by_hand_with_no_fabric_step_is_refused_at_its_second_write() -> None:
    """No Fabric step at all (the plugin never meets an optimizer): the first raw write is noted at the next
    backward, and the next backward after a second one refuses both."""
    fabric, model, _ = _setup(plugins=[_o2()])
    raw = torch.optim.SGD(model.parameters(), lr=0.1)
    fabric.backward(_loss(model, 0))
    raw.step()
    raw.zero_grad()
    fabric.backward(_loss(model, 1))
    raw.step()
    raw.zero_grad()
    with pytest.raises(RuntimeError, match="which no optimizer prepared by lightning_mpx holds, were written"):
        fabric.backward(_loss(model, 2))


def _fit_loaded_sam(**precision: Any) -> dict[str, torch.Tensor]:
    """SAM, plain Fabric loop, with weights loaded into the set-up model before the first backward."""
    fabric = Fabric(accelerator="cpu", devices=1, **precision)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model, optimizer = fabric.setup(model, _SAM(model.parameters()))
    torch.manual_seed(1)
    model.load_state_dict(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).state_dict())
    for i in range(4):
        fabric.backward(_loss(model, i))
        optimizer.first_step(True)
        fabric.backward(_loss(model, i))
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().float() for k, v in model.state_dict().items()}


def test_o2_sam_after_weights_loaded_past_setup_trains_as_fabrics_bf16_mixed() -> None:
    """At O2 the FP32 masters start from the weights at the first backward (those loaded after fabric.setup), not
    from those first_step perturbed nor those before the load."""
    want = _fit_loaded_sam(precision="bf16-mixed")
    got = _fit_loaded_sam(plugins=[_o2()])
    _assert_close(got, want, 3e-3)


def _fit_sam_masters(told: bool) -> dict[str, torch.Tensor]:
    plugin = _o2()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model, optimizer = fabric.setup(model, _SAM(model.parameters(), rho=0.5))
    if told:
        plugin.setup_optimizers(optimizer)
    for i in range(2):
        fabric.backward(_loss(model, i))
        optimizer.first_step(True)
        fabric.backward(_loss(model, i))
        optimizer.step()
        optimizer.zero_grad()
    return plugin.fp32_state_dict(model)


def test_o2_sam_plain_loop_keeps_the_same_fp32_masters_as_the_plugin_told() -> None:
    """The FP32 masters after the plain loop are those of the loop that told the plugin of the optimizer first:
    first_step's half copies of the weights (old_p) are not restored into them (a rounding to bfloat16)."""
    want = _fit_sam_masters(told=True)
    got = _fit_sam_masters(told=False)
    _assert_close(got, want, 1e-6)
