"""O2 under the Lightning callbacks that write the model or change the optimizer: StochasticWeightAveraging,
EMAWeightAveraging, BackboneFinetuning, through a real Trainer."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    EMAWeightAveraging,
    ModelCheckpoint,
    StochasticWeightAveraging,
)
from torch import nn

from lightning_mpx import MixedPrecisionPlugin

from .lightning_helpers import Classifier, classification_data, loader, make_trainer


@pytest.mark.parametrize("precision", ["O2", "O1", "32-true"])
def test_swa_average_is_what_the_model_holds_after_fit(precision):
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1, annealing_epochs=1)
    plugin = MixedPrecisionPlugin(precision, half_dtype="bfloat16") if precision != "32-true" else None
    model = Classifier(optimizer="sgd", lr=0.1)
    trainer = make_trainer(plugin, max_epochs=4, callbacks=[swa])  # no plugin: Lightning's FP32
    data = loader(classification_data(n=64))
    trainer.fit(model, data)
    average = dict(swa._average_model.named_parameters())
    for name, param in model.named_parameters():
        want = average[name].to(param.dtype)
        assert torch.equal(param, want), name  # the averaged weights, not the last step's
        if plugin is not None and precision == "O2":
            master = plugin.amp.master_of(param)
            plugin.amp.refresh_masters()  # what the next step or a checkpoint does first
            assert torch.equal(master.to(param.dtype), want)


class _Finetuned(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = nn.Linear(32, 4)
        self.backbone_seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def on_train_epoch_end(self) -> None:
        self.backbone_seen.append(self.backbone[0].weight.detach().clone())

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(filter(lambda p: p.requires_grad, self.parameters()), lr=1e-2)


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_backbone_finetuning_unfreezes_into_fp32_masters(half):
    plugin = MixedPrecisionPlugin("O2", half_dtype=half)
    model = _Finetuned()
    finetuning = BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_ratio_lr=1.0)
    trainer = make_trainer(plugin, max_epochs=3, callbacks=[finetuning])
    trainer.fit(model, loader(classification_data(n=64)))
    first, *later = model.backbone_seen
    assert all(not torch.equal(first, seen) for seen in later)  # the backbone trained once unfrozen
    assert torch.isfinite(model.backbone[0].weight).all()
    optimizer = trainer.optimizers[0]
    assert len(optimizer.param_groups) == 2  # the callback's group, of the model's own parameters
    for param in model.backbone.parameters():
        master = plugin.amp.master_of(param)
        assert master is not param and master.dtype == torch.float32
        assert optimizer.state[master]["exp_avg_sq"].dtype == torch.float32
        assert torch.equal(param, master.to(param.dtype))
    assert plugin.amp.skipped_steps == [0] or half == "float16"  # fp16 may probe the scale once


class _Manual(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.skipped: list[bool] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()  # a LightningOptimizer
        x, y = batch
        self.manual_backward(F.cross_entropy(self.net(x), y))
        if batch_idx == 2:
            self.net[0].weight.grad.view(-1)[0] = float("inf")
        self.clip_gradients(opt, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt.step()
        opt.zero_grad()
        self.skipped.append(self.trainer.precision_plugin.step_was_skipped(opt))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_manual_optimization_passes_the_lightning_optimizer_itself(level):
    # clip_gradients and step_was_skipped take what self.optimizers() returns, a LightningOptimizer.
    plugin = MixedPrecisionPlugin(level, half_dtype="bfloat16", loss_scale="dynamic", on_floor="continue")
    model = _Manual()
    make_trainer(plugin, max_epochs=1).fit(model, loader(classification_data(n=64)))
    assert model.skipped == [False, False, True, False]


class _FreezeSchedule(pl.Callback):
    """Freezes the first layer at one global step and unfreezes it at a later one (progressive freezing, then a
    final fine-tune of everything), as a user's callback does at the start of a training batch."""

    def __init__(self, freeze_at: int, unfreeze_at: int) -> None:
        self.freeze_at, self.unfreeze_at = freeze_at, unfreeze_at

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, index: int) -> None:
        if trainer.global_step == self.freeze_at:
            module.net[0].requires_grad_(False)
        elif trainer.global_step == self.unfreeze_at:
            module.net[0].requires_grad_(True)


class _Frozen(Classifier):
    """The classifier built as resuming code builds it when it knows the first layer was frozen at the checkpoint."""

    def __init__(self, frozen: bool) -> None:
        super().__init__(optimizer="adamw", lr=0.01)
        self.net[0].requires_grad_(not frozen)


def test_a_fit_resumed_with_a_trained_layer_frozen_goes_on_as_the_straight_fit(tmp_path):
    """O2 bfloat16 through the Trainer: the first layer trains for two epochs, is frozen, the run is checkpointed
    while it is frozen, and a new Trainer resumes it (``fit(ckpt_path=...)``) with a model built with that layer
    frozen; the layer is unfrozen later. Every parameter, master and Adam moment equals the fit that was never
    interrupted, bit for bit: the frozen layer's moments came back in FP32 and stayed its own."""
    data = loader(classification_data(n=32), batch_size=16)  # 2 steps per epoch

    def fit(epochs: int, frozen: bool, ckpt: Any = None) -> tuple[_Frozen, MixedPrecisionPlugin, pl.Trainer]:
        plugin = MixedPrecisionPlugin("O2", half_dtype="bfloat16")
        module = _Frozen(frozen)
        trainer = make_trainer(plugin, max_epochs=epochs, callbacks=[_FreezeSchedule(freeze_at=4, unfreeze_at=10)])
        trainer.fit(module, data, ckpt_path=ckpt)
        return module, plugin, trainer

    straight, straight_plugin, straight_trainer = fit(7, frozen=False)
    _, _, first_trainer = fit(3, frozen=False)  # the layer trains at steps 0-3, frozen at 4 and 5
    first_trainer.save_checkpoint(tmp_path / "frozen.ckpt")
    resumed, resumed_plugin, resumed_trainer = fit(7, frozen=True, ckpt=tmp_path / "frozen.ckpt")
    assert resumed_trainer.global_step == straight_trainer.global_step == 14
    assert all(p.dtype == torch.bfloat16 for p in resumed.net.parameters())
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
        assert torch.equal(straight_plugin.amp.master_of(a), resumed_plugin.amp.master_of(b)), name
    states = [t.optimizers[0].state_dict()["state"] for t in (straight_trainer, resumed_trainer)]
    assert states[0].keys() == states[1].keys()
    for key in states[0]:
        for k in states[0][key]:
            assert torch.equal(states[0][key][k], states[1][key][k]), (key, k)


class _Trajectory(pl.Callback):
    """Keeps, after every training batch, the loss and the weights the optimizer trains (FP32 masters at O2)."""

    def __init__(self, plugin: MixedPrecisionPlugin | None) -> None:
        self.plugin, self.seen = plugin, []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, *args: Any) -> None:
        amp = self.plugin.amp if self.plugin is not None else None
        weights = [amp.master_of(p) if amp is not None else p for p in module.parameters()]
        self.seen.append((outputs["loss"].detach().clone(), [w.detach().clone() for w in weights]))


def _ema_fit(precision: str, ema: bool, checkpoints: Any = None, ckpt: Any = None) -> Any:
    """Four epochs of 3 steps, each followed by one validation batch (where the EMA callback swaps the weights);
    with ``checkpoints`` (a folder), Lightning's ``ModelCheckpoint`` saves one after every epoch."""
    plugin = MixedPrecisionPlugin(precision, half_dtype="bfloat16") if precision != "32-true" else None
    model = Classifier(optimizer="adamw", lr=0.01)
    trajectory = _Trajectory(plugin)
    averaging = EMAWeightAveraging(decay=0.8)
    callbacks: list[pl.Callback] = [averaging, trajectory] if ema else [trajectory]
    if checkpoints is not None:
        callbacks.append(ModelCheckpoint(dirpath=checkpoints, filename="{epoch}", save_top_k=-1, every_n_epochs=1))
    data = loader(classification_data(n=48))
    trainer = make_trainer(plugin, max_epochs=4, callbacks=callbacks, num_sanity_val_steps=0, limit_val_batches=1,
                           enable_checkpointing=checkpoints is not None)  # fmt: skip
    trainer.fit(model, data, data, ckpt_path=ckpt)
    return model, plugin, trainer, trajectory, averaging


@pytest.mark.parametrize("precision", ["O2", "O1"])
def test_ema_averaging_with_validation_leaves_the_training_untouched(precision):
    """Lightning's ``EMAWeightAveraging`` writes its average into the model for every validation and puts the
    trained weights back afterwards, through ``p.data``. Training must go on from the trained FP32 masters, bit for
    bit as without the callback; after ``fit`` the model holds the average, as the callback promises."""
    model, plugin, _, with_ema, averaging = _ema_fit(precision, ema=True)
    _, _, _, without, _ = _ema_fit(precision, ema=False)
    assert len(with_ema.seen) == len(without.seen) == 12
    for step, ((loss_a, weights_a), (loss_b, weights_b)) in enumerate(zip(with_ema.seen, without.seen)):
        assert torch.equal(loss_a, loss_b), step
        for a, b in zip(weights_a, weights_b):
            assert a.dtype == torch.float32 and torch.equal(a, b), step
    average = dict(averaging._average_model.module.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, average[name].to(param.dtype)), name
        plugin.amp.refresh_masters()  # what an export or a next step takes first
        assert torch.equal(plugin.amp.master_of(param).to(param.dtype), param), name


@pytest.mark.parametrize("precision", ["O2", "32-true"])
def test_ema_averaging_resumed_from_a_checkpoint_goes_on_as_the_straight_fit(precision, tmp_path):
    """A checkpoint ``ModelCheckpoint`` saved mid-run holds the average as its ``state_dict`` (the callback moves the
    trained weights to ``current_model_state``) and, at O2, the plugin's FP32 masters; resumed in a new Trainer,
    losses, trained weights and the average equal the fit that was never interrupted, as with Lightning's FP32."""
    _, _, _, straight, straight_avg = _ema_fit(precision, ema=True, checkpoints=tmp_path)
    resumed_from = tmp_path / "epoch=1.ckpt"  # after 6 steps and the second validation
    _, _, _, resumed, resumed_avg = _ema_fit(precision, ema=True, ckpt=resumed_from)
    assert len(resumed.seen) == 6
    for step, ((loss_a, weights_a), (loss_b, weights_b)) in enumerate(zip(straight.seen[6:], resumed.seen)):
        assert torch.equal(loss_a, loss_b), step
        for a, b in zip(weights_a, weights_b):
            assert a.dtype == torch.float32 and torch.equal(a, b), step
    for a, b in zip(straight_avg._average_model.parameters(), resumed_avg._average_model.parameters()):
        assert torch.equal(a, b)
