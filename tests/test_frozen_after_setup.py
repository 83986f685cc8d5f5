"""A layer frozen after the model was prepared (``model[0].requires_grad_(False)`` after ``fabric.setup``,
``accelerator.prepare`` or ``prepare_model``), which the optimizer may still hold: at O2 its FP32 weights were kept
from preparing, so the FP32 export (``fp32_state_dict``) and ``master_params`` must give them exactly, whether the
front door registers its optimizers at set-up (the Trainer, Accelerate, ``mpx.setup_optimizers``) or at their first
step (Fabric without ``setup_optimizers``), and the layer unfrozen later must train from them. Each test compares
with the FP32 weights given (values bfloat16 cannot hold, so the rounding would fail it)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import Amp, FabricMixedPrecisionPlugin

HALF = "bfloat16"


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _frozen_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The FP32 weights of ``model[0]`` (the layer to freeze), checked to be values bfloat16 cannot hold."""
    weights = {f"0.{k}": v.detach().clone() for k, v in model[0].state_dict().items()}
    assert all(not torch.equal(v.to(torch.bfloat16).float(), v) for v in weights.values())
    return weights


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def _assert_exported(exported: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> None:
    for name, value in weights.items():
        assert exported[name].dtype == torch.float32, name
        assert torch.equal(exported[name], value), f"{name}: the export is not the FP32 weight given (its rounding?)"


def _assert_masters(masters: list[torch.Tensor], frozen: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """The optimizer's masters of the frozen layer (its first two parameters) are the FP32 weights given."""
    for master, name in zip(masters[:2], ("0.weight", "0.bias")):
        assert master.dtype == torch.float32, f"{name}: master_params gave the half parameter itself"
        assert torch.equal(master, weights[name]), name


# -- Fabric ------------------------------------------------------------------------------------------------------------
def _fabric_run(setup_optimizers: bool, steps: int = 3) -> tuple[Any, ...]:
    mpx = FabricMixedPrecisionPlugin("O2", half_dtype=HALF)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx])
    model = _net()
    weights = _frozen_weights(model)
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    if setup_optimizers:
        mpx.setup_optimizers(optimizer)
    model.module[0].requires_grad_(False)  # frozen after setup; the optimizer still holds it
    for step in range(steps):
        x, y = _batch(step)
        fabric.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return mpx, fabric, model, optimizer, weights


@pytest.mark.parametrize("setup_optimizers", [False, True])
def test_fabric_a_layer_frozen_after_setup_exports_its_exact_fp32_weights(setup_optimizers):
    mpx, _, model, optimizer, weights = _fabric_run(setup_optimizers)
    _assert_exported(mpx.fp32_state_dict(model), weights)  # the wrapper fabric.setup returned
    _assert_exported(mpx.amp.fp32_state_dict(model.module), weights)
    _assert_masters(mpx.master_params(optimizer), model.module[0], weights)
    _assert_masters(mpx.amp.master_params(optimizer.optimizer), model.module[0], weights)


def test_fabric_a_layer_unfrozen_later_trains_from_its_fp32_weights_with_or_without_setup_optimizers():
    """Unfrozen after three steps: both runs step the layer from its kept FP32 weights (the run that registered its
    optimizer at set-up made its master then), so the two agree bit for bit, and the layer has moved."""
    runs = [_fabric_run(setup_optimizers) for setup_optimizers in (False, True)]
    for mpx, fabric, model, optimizer, weights in runs:
        model.module[0].requires_grad_(True)
        x, y = _batch(10)
        fabric.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    (lazy, _, lazy_model, _, weights), (eager, _, eager_model, _, _) = runs
    lazy_export, eager_export = lazy.fp32_state_dict(lazy_model), eager.fp32_state_dict(eager_model)
    assert not torch.equal(lazy_export["0.weight"], weights["0.weight"])  # it trained
    for name in eager_export:
        assert torch.equal(lazy_export[name], eager_export[name]), name


def test_fabric_master_params_before_the_first_step_names_setup_optimizers():
    """``mpx.amp.master_params(optimizer)`` before the plugin met the optimizer: the message names Fabric's call
    (``mpx.setup_optimizers`` after ``fabric.setup``); the plugin's own ``master_params`` registers it and answers."""
    mpx = FabricMixedPrecisionPlugin("O2", half_dtype=HALF)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx])
    net = _net()  # the optimizer set up apart: the plugin meets it at its first step (fabric.setup meets it there)
    fabric.setup_module(net)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match=r"optimizer=SGD was not registered.*setup_optimizers\(optimizer\)"
                       r".*after fabric\.setup\(\)") as raised:  # fmt: skip
        mpx.amp.master_params(optimizer.optimizer)
    assert "prepare_optimizer" not in str(raised.value)
    assert [m.dtype for m in mpx.master_params(optimizer)] == [torch.float32] * 4


def test_the_core_engine_names_prepare_optimizer_when_an_optimizer_was_not_registered():
    amp = Amp("O2", half_dtype=HALF)
    model = amp.prepare_model(_net())
    with pytest.raises(RuntimeError, match=r"optimizer=SGD was not registered; call prepare_optimizer\(\) on it first"):
        amp.master_params(torch.optim.SGD(model.parameters(), lr=0.1))


# -- Accelerate --------------------------------------------------------------------------------------------------------
def test_accelerate_a_layer_frozen_after_prepare_exports_its_exact_fp32_weights():
    pytest.importorskip("accelerate")
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import accelerate_state_reset

    with accelerate_state_reset():
        accelerator = Accelerator(mixed_precision="O2", kwargs_handlers=[MixedPrecisionKwargs(half_dtype=HALF)])
        model = _net()
        weights = _frozen_weights(model)
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        unwrapped = accelerator.unwrap_model(model)
        unwrapped[0].requires_grad_(False)
        for step in range(3):
            x, y = _batch(step)
            accelerator.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        _assert_exported(accelerator.amp.fp32_state_dict(unwrapped), weights)
        _assert_masters(accelerator.amp.master_params(optimizer.optimizer), unwrapped[0], weights)


# -- the core engine ---------------------------------------------------------------------------------------------------
def _core_run(freeze_before_optimizer: bool, held: str) -> tuple[Amp, nn.Module, torch.optim.Optimizer, Any]:
    amp = Amp("O2", half_dtype=HALF)
    model = _net()
    weights = _frozen_weights(model)
    amp.prepare_model(model)
    params = model.parameters() if held == "all" else model[2].parameters()
    if freeze_before_optimizer:
        model[0].requires_grad_(False)
    optimizer = amp.prepare_optimizer(torch.optim.AdamW(params, lr=1e-2))
    if not freeze_before_optimizer:
        model[0].requires_grad_(False)
    for step in range(3):
        _core_step(amp, model, optimizer, step)
    return amp, model, optimizer, weights


def _core_step(amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    x, y = _batch(step)
    with amp.forward_context():
        loss = F.cross_entropy(model(amp.cast_inputs(x)).float(), y)
    amp.backward(loss)
    amp.step(optimizer)
    amp.update()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("held", ["all", "head only"])
@pytest.mark.parametrize("freeze_before_optimizer", [True, False])
def test_core_a_layer_frozen_after_prepare_model_exports_its_exact_fp32_weights(freeze_before_optimizer, held):
    """prepare_model, freeze, prepare_optimizer (or prepare_optimizer, then freeze), steps: the frozen layer's export
    is its FP32 weights, whether the optimizer holds it or not; the optimizer's masters of it too."""
    amp, model, optimizer, weights = _core_run(freeze_before_optimizer, held)
    _assert_exported(amp.fp32_state_dict(model), weights)
    if held == "all":
        _assert_masters(amp.master_params(optimizer), model[0], weights)


def test_core_a_layer_unfrozen_later_trains_as_when_it_was_frozen_after_prepare_optimizer():
    runs = [_core_run(freeze_before_optimizer, "all") for freeze_before_optimizer in (True, False)]
    for amp, model, optimizer, _ in runs:
        model[0].requires_grad_(True)
        _core_step(amp, model, optimizer, 10)
    (late, late_model, _, weights), (early, early_model, _, _) = runs
    late_export, early_export = late.fp32_state_dict(late_model), early.fp32_state_dict(early_model)
    assert not torch.equal(late_export["0.weight"], weights["0.weight"])  # it trained
    for name in early_export:
        assert torch.equal(late_export[name], early_export[name]), name
