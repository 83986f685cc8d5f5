"""A backbone frozen before set-up and unfrozen later at O2. With a ``BaseFinetuning`` callback
(``BackboneFinetuning``, which freezes in its ``setup`` hook, before the plugin converts the model) the Trainer keeps
the frozen parameters' FP32 values, so the unfrozen backbone trains as under ``"bf16-mixed"`` and ``"32-true"``, not
from its bfloat16 rounding. Elsewhere (a LightningModule freezing in ``__init__``; the core ``Amp``; Fabric; the
Accelerate adapter) a master made from that rounding is warned about once, naming the parameters and the remedy; never
for a LoRA base that stays frozen, a part frozen after set-up, or a run restored from a checkpoint with its masters.
bfloat16, tiny."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import MixedPrecisionPlugin
from lightning_mpx.engine.amp import Amp
from tests.lightning_helpers import classification_data, loader, make_trainer

# a backbone and a head (each subclass here picks its optimizer)
from tests.test_accelerate_o2_saves_and_generate import Net, _mlp

HALF = torch.bfloat16
SIGN = "frozen when the model was cast to half"


class Finetuned(Net):
    """``BackboneFinetuning``'s recipe: the head alone, the backbone added to the optimizer at epoch 1."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


class MyFinetuning(pl.callbacks.BaseFinetuning):
    """A user's subclass: the backbone frozen before training, unfrozen into the optimizer at epoch 1."""

    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: Any) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, lr=0.1, initial_denom_lr=1.0)


class FrozenInInit(Net):
    """Frozen in ``__init__``, unfrozen in place at epoch 1 (the optimizer holds every parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone.requires_grad_(False)

    def on_train_epoch_start(self) -> None:
        if self.current_epoch >= 1:
            self.backbone.requires_grad_(True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _fit(model: pl.LightningModule, precision: str, callbacks: list[Any], epochs: int = 2,
         **kwargs: Any) -> tuple[list[str], dict[str, torch.Tensor]]:
    ckpt = kwargs.pop("ckpt", None)
    plugin = MixedPrecisionPlugin("O2", half_dtype=HALF) if precision == "O2" else None
    settings: dict[str, Any] = {} if plugin else {"precision": precision}
    trainer = make_trainer(plugin, max_epochs=epochs, callbacks=callbacks, **settings, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader(classification_data(n=32)), ckpt_path=ckpt)
    return [str(w.message) for w in caught if SIGN in str(w.message)], {
        k: v.float().clone() for k, v in model.state_dict().items()}


def _backbone_gap(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max((got[k] - want[k]).abs().max().item() for k in want if k.startswith("backbone."))


@pytest.mark.parametrize("which", ["backbone_finetuning", "subclass"])
def test_o2_base_finetuning_trains_the_unfrozen_backbone_as_bf16_mixed_and_fp32(which: str) -> None:
    """The backbone, frozen in the callback's ``setup`` before the cast, keeps its FP32 values: unfrozen at epoch 1
    it ends as under ``"bf16-mixed"`` (2e-6 apart there) and ``"32-true"``, where its bfloat16 start ended 4.9e-4
    away (as large as the fine-tune's own moves, 4.5e-4 to 1.8e-3). No warning: the FP32 values were kept."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    def callbacks() -> list[Any]:
        return [BackboneFinetuning(unfreeze_backbone_at_epoch=1) if which == "backbone_finetuning" else MyFinetuning()]

    messages, ours = _fit(Finetuned(), "O2", callbacks())
    assert messages == []
    _, mixed = _fit(Finetuned(), "bf16-mixed", callbacks())
    _, fp32 = _fit(Finetuned(), "32-true", callbacks())
    start = {f"backbone.{k}": v for k, v in _mlp().state_dict().items()}
    assert _backbone_gap(mixed, start) > 2e-4  # the fine-tune moved the backbone
    rounding = max((v.to(HALF).float() - v).abs().max().item() for v in start.values())
    assert rounding > 2e-4  # what a start from the half rounding was off by
    assert _backbone_gap(ours, mixed) <= 5e-5 and _backbone_gap(ours, fp32) <= 5e-5


def test_o2_trainer_frozen_in_init_warns_once_and_a_restored_run_does_not(tmp_path: Path) -> None:
    """A backbone frozen in ``__init__`` (before set-up) and unfrozen in ``on_train_epoch_start``: one warning at its
    first gradient, naming a few parameters, the count and the remedy. The run resumed from that run's checkpoint (its
    masters, FP32) warns no more and ends where the unbroken run does."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    saver = ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_epochs=1, save_top_k=-1)
    messages, unbroken = _fit(FrozenInInit(), "O2", [saver], epochs=3, enable_checkpointing=True)
    assert len(messages) == 1, messages
    (message,) = messages
    assert "4 parameter(s) (backbone.0.weight, backbone.0.bias, backbone.2.weight and 1 more)" in message
    assert "on_fit_start" in message and "fabric.setup" in message and "fp32_modules" in message
    resumed_messages, resumed = _fit(FrozenInInit(), "O2", [], epochs=3, ckpt=str(tmp_path / "epoch=1-step=4.ckpt"))
    assert resumed_messages == []
    assert max((resumed[k] - unbroken[k]).abs().max().item() for k in unbroken) <= 1e-6


def _core(freeze: str, steps: int = 4) -> tuple[list[str], nn.Module]:
    """The core ``Amp``: a backbone frozen before ``prepare_model`` (``"before"``), after it (``"after"``), or a
    LoRA-like base that stays frozen (``"stays"``); unfrozen in place after step 1 unless it stays."""
    model = nn.Sequential(_mlp(), nn.Linear(4, 4))
    amp = Amp(opt_level="O2", half_dtype=HALF)
    if freeze in ("before", "stays"):
        model[0].requires_grad_(False)
    amp.prepare_model(model)
    if freeze == "after":
        model[0].requires_grad_(False)
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    data = classification_data(n=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            if step == 1 and freeze != "stays":
                model[0].requires_grad_(True)
            with amp.forward_context():
                loss = F.cross_entropy(model(amp.cast_inputs(data.tensors[0])).float(), data.tensors[1])
            amp.backward(loss)
            amp.step(optimizer)
            amp.update()
            optimizer.zero_grad()
    return [str(w.message) for w in caught if SIGN in str(w.message)], model


def test_core_warns_once_for_a_master_from_the_rounding_never_for_a_lora_base_or_a_freeze_after_set_up() -> None:
    messages, _ = _core("before")
    assert len(messages) == 1 and "amp.prepare_model" in messages[0]  # once, not per step
    assert _core("stays")[0] == [] and _core("after")[0] == []


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_fabric_and_accelerate_warn_once_for_a_backbone_frozen_before_set_up() -> None:
    pytest.importorskip("accelerate")
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    data = classification_data(n=16)

    def run(door: str, freeze_before: bool) -> list[str]:
        model = nn.Sequential(_mlp(), nn.Linear(4, 4))
        if freeze_before:
            model[0].requires_grad_(False)
        if door == "fabric":
            fabric = Fabric(accelerator="cpu", devices=1, plugins=[FabricMixedPrecisionPlugin("O2", half_dtype=HALF)])
            model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
            backward = fabric.backward
        else:
            reset_accelerate_state()
            accelerator = Accelerator(mixed_precision="O2", kwargs_handlers=[MixedPrecisionKwargs(half_dtype=HALF)])
            model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
            backward = accelerator.backward
        if not freeze_before:
            model.module[0].requires_grad_(False) if door == "fabric" else model[0].requires_grad_(False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                if step == 1:
                    (model.module if door == "fabric" else model)[0].requires_grad_(True)
                backward(F.cross_entropy(model(data.tensors[0]).float(), data.tensors[1]))
                optimizer.step()
                optimizer.zero_grad()
        ours = [w for w in caught if SIGN in str(w.message)]
        assert all(w.filename == __file__ for w in ours), [w.filename for w in ours]  # the user's line
        return [str(w.message) for w in ours]

    for door in ("fabric", "accelerate"):
        assert len(run(door, freeze_before=True)) == 1, door
        assert run(door, freeze_before=False) == [], door
