"""O2 under the Lightning callbacks that write the model or change the optimizer: StochasticWeightAveraging and
BackboneFinetuning, through a real Trainer."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import BackboneFinetuning, StochasticWeightAveraging
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
