"""Fabric's and the Trainer's plugins at four edges: the norm ``fabric.clip_gradients`` returns on an overflow step,
frozen parameters in an O2 checkpoint, ``AsyncCheckpointIO``'s copies of the FP32 masters, and
``torch.__future__.set_swap_module_params_on_conversion(True)`` with gradients left from a step."""

from __future__ import annotations

import math
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch import nn

from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
from lightning_mpx.integrations.fabric import FabricMixedPrecisionPlugin
from lightning_mpx.integrations.lightning import MixedPrecisionPlugin
from tests.accelerate_helpers import reset_accelerate_state


def _fabric(level: str) -> tuple[Fabric, FabricMixedPrecisionPlugin]:
    plugin = FabricMixedPrecisionPlugin(level, half_dtype="bfloat16", loss_scale="dynamic", init_scale=1024.0)
    return Fabric(accelerator="cpu", devices=1, plugins=[plugin]), plugin


def _overflowing_step(fabric: Fabric, value: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    module = nn.Linear(4, 3)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    fabric.backward(model(torch.randn(2, 4)).sum())
    model.weight.grad[0, 0] = value
    return model, optimizer


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_clip_gradients_returns_the_non_finite_norm_of_an_overflow_step(level, value):
    """With ``error_if_nonfinite=False`` an overflow step's norm is what Fabric's own precision returns (torch's clip
    of the same gradients: inf, or NaN for a NaN), not a stand-in 0.0; nothing is clipped and the step is skipped.
    With Fabric's default (``error_if_nonfinite=True``) the routine overflow of a dynamic scale does not raise (a
    deliberate difference from ``"16-mixed"``): 0.0, the step skipped."""
    reference = Fabric(accelerator="cpu", devices=1, precision="32-true")
    ref_model, ref_opt = _overflowing_step(reference, value)
    expected = reference.clip_gradients(ref_model, ref_opt, max_norm=1.0, error_if_nonfinite=False)
    for lenient in (True, False):
        fabric, plugin = _fabric(level)
        model, optimizer = _overflowing_step(fabric, value)
        before = [p.detach().clone() for p in model.parameters()]
        norm = fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=not lenient)
        optimizer.step()
        assert plugin.step_was_skipped(optimizer)
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
        if lenient:
            torch.testing.assert_close(norm, expected, equal_nan=True)
        else:
            assert float(norm) == 0.0


class _Frozen(pl.LightningModule):
    """A tiny classifier whose first layer is frozen: FP32 (``frozen_dtype=None``) or loaded by the user in half."""

    def __init__(self, frozen_dtype: torch.dtype | None = None, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Linear(8, width)
        self.head = nn.Linear(width, 2)
        self.base.requires_grad_(False)
        if frozen_dtype is not None:
            self.base.to(frozen_dtype)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.head(torch.relu(self.base(x.to(self.base.weight.dtype)))).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def _frozen_fit(tmp_path: Any, frozen_dtype: torch.dtype | None, save_every: int = 1) -> list[str]:
    """Fit 2 epochs of 2 steps saving a checkpoint each epoch; the messages of the frozen-parameter warnings."""
    data = torch.utils.data.TensorDataset(torch.randn(8, 8), torch.randint(0, 2, (8,)))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path),
        plugins=[MixedPrecisionPlugin("O2", half_dtype="bfloat16")],
        callbacks=[ModelCheckpoint(dirpath=str(tmp_path), save_top_k=-1, every_n_epochs=save_every)],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_Frozen(frozen_dtype), torch.utils.data.DataLoader(data, batch_size=4))
    saved = torch.load(sorted(tmp_path.glob("*.ckpt"))[-1], weights_only=False)["state_dict"]
    assert saved["head.weight"].dtype == torch.float32  # a trained parameter: its FP32 master
    return [str(w.message) for w in caught if "frozen parameter" in str(w.message)]


def test_trainer_o2_checkpoint_warns_once_per_fit_about_frozen_parameters_it_rounded(tmp_path):
    """An O2 Trainer checkpoint holds a frozen FP32 parameter as its bfloat16 rounding (no master keeps it): it
    warns, as the Accelerate export does, once per fit, naming the parameters and ``fp32_modules``; a frozen base
    the user loaded in bfloat16 lost nothing to the plugin: no warning."""
    messages = _frozen_fit(tmp_path / "fp32", None)
    assert len(messages) == 1, messages
    assert "'base.weight'" in messages[0] and "MixedPrecisionPlugin(fp32_modules=['base'])" in messages[0]
    assert _frozen_fit(tmp_path / "bf16", torch.bfloat16) == []


def test_accelerate_o2_export_does_not_warn_about_a_frozen_parameter_loaded_in_half():
    """``accelerator.get_state_dict`` at O2 warned about every frozen half parameter, also a bfloat16 base the user
    loaded (exported exactly as given); it warns only about those the engine converted from FP32."""

    for frozen_dtype, warns in ((torch.bfloat16, False), (None, True)):
        module = _Frozen(frozen_dtype)
        given = module.base.weight.detach().clone()
        reset_accelerate_state()
        acc = Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")])
        model, _ = acc.prepare(module, torch.optim.SGD(module.head.parameters(), lr=0.1))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state = acc.get_state_dict(model)
        assert any("frozen parameter" in str(w.message) for w in caught) == warns
        if not warns:
            assert torch.equal(state["base.weight"], given)


def test_async_checkpoint_io_writes_each_o2_master_once(tmp_path):
    """With ``AsyncCheckpointIO`` an O2 checkpoint is as large as one without it (and as ``"bf16-mixed"``'s)."""
    sizes = []
    for plugins in ([], [AsyncCheckpointIO()]):
        torch.manual_seed(0)
        model = _Frozen(width=4096)  # 45k parameters: the masters' bytes dominate the file
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False,
            plugins=[MixedPrecisionPlugin("O2", half_dtype="bfloat16"), *plugins],
        )
        data = torch.utils.data.TensorDataset(torch.randn(4, 8), torch.randint(0, 2, (4,)))
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
        path = tmp_path / f"{len(plugins)}.ckpt"
        trainer.save_checkpoint(path)
        trainer.strategy.checkpoint_io.teardown()  # waits for the asynchronous write
        sizes.append(path.stat().st_size)
    assert sizes[1] <= sizes[0] * 1.05, sizes


@pytest.mark.parametrize("level", ["O1", "O3"])
def test_swap_on_conversion_moves_a_model_whose_gradients_a_step_left(level):
    """``model.to()`` under ``torch.__future__.set_swap_module_params_on_conversion(True)`` after a step that left
    its gradients (no ``zero_grad``) moves the model as it does without the engine. Was: "Couldn't swap
    Linear.weight.grad" until ``optimizer.zero_grad()`` (the engine held a weak reference to each gradient a step
    left, which ``torch.utils.swap_tensors`` refuses; it holds one to a mark in the gradient's ``__dict__`` now)."""
    from lightning_mpx import Amp

    torch.manual_seed(0)
    amp = Amp(level, half_dtype="bfloat16")
    model = amp.prepare_model(nn.Linear(4, 3))
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with amp.forward_context():
        loss = amp.cast_outputs(model(amp.cast_inputs(torch.randn(2, 4)))).float().sum()
    amp.backward(loss)
    amp.step(optimizer)
    amp.update()
    grads = [p.grad.clone() for p in model.parameters()]
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(torch.device("cpu"))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


@pytest.mark.parametrize("level", ["O1", "O3"])
def test_swap_on_conversion_moves_a_prepared_model_after_zero_grad(level):
    """What works today, and what the engine's own records must not break (a weak reference to a parameter, as the
    record of the parameters it made half, would): after ``zero_grad()`` the swap moves the prepared model."""
    from lightning_mpx import Amp

    amp = Amp(level, half_dtype="bfloat16")
    model = amp.prepare_model(nn.Linear(4, 3))
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    amp.backward(amp.cast_outputs(model(amp.cast_inputs(torch.randn(2, 4)))).float().sum())
    amp.step(optimizer)
    amp.update()
    optimizer.zero_grad()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(torch.device("cpu"))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert model.weight.dtype == (torch.bfloat16 if level == "O3" else torch.float32)
