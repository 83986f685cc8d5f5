"""False refusals of the raw-step check (engine/raw_steps.py) in real training habits, each run through a real front
door and compared with the framework's own precision ("bf16-mixed"/"16-mixed"): a hand-written EMA swapped in for a
validation run mid-accumulation (``copy_`` under ``no_grad``, which bumps the parameters' versions, unlike Lightning's
``WeightAveraging`` that writes through ``.data``), over a model whose optimizer holds frozen parameters and a branch
the forward does not use; an EMA teacher in the optimizer's parameters (its output detached) updated every
micro-batch; and a Fabric loop whose backbone is left out of the optimizer but requires grad, its gradients cleared
with ``model.zero_grad()`` after the step. On a CPU "16-mixed" runs as bf16-mixed, so O1 float16 is compared with
FP32."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin

LEVELS = [("O2", "bfloat16", "bf16-mixed"), ("O1", "float16", "32-true")]


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(8, 4, generator=g)
    return x, x.sum(1, keepdim=True).tanh()


def _loader(n: int) -> torch.utils.data.DataLoader:
    xs, ys = zip(*(_batch(i) for i in range(n)))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=8)


def _swap(model: nn.Module, kept: list[torch.Tensor]) -> None:
    """Swap the model's parameters with ``kept`` in place (the versions of the parameters move)."""
    with torch.no_grad():
        for other, param in zip(kept, model.parameters()):
            tmp = param.detach().clone()
            param.copy_(other)
            other.copy_(tmp)


class _HandEMA(pl.Callback):
    """An EMA kept aside, updated after each batch, swapped into the model for each validation run during fit."""

    def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.avg = [p.detach().clone() for p in module.parameters()]

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        with torch.no_grad():
            for avg, param in zip(self.avg, module.parameters()):
                avg.lerp_(param.to(avg.dtype), 0.1)

    def on_validation_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        _swap(module, self.avg)

    def on_validation_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        _swap(module, self.avg)


class _FrozenAndUnused(pl.LightningModule):
    """configure_optimizers returns every parameter: a frozen backbone and an auxiliary head unused by this forward
    hold no gradient, the head does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.Tanh()).requires_grad_(False)
        self.head, self.aux = nn.Linear(8, 1), nn.Linear(8, 1)

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.head(self.backbone(x.to(self.head.weight.dtype))).float(), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(("opt_level", "half_dtype", "reference"), LEVELS)
def test_an_ema_swap_mid_accumulation_over_frozen_and_unused_held_params_trains_as_lightnings_precision(
    opt_level: str, half_dtype: str, reference: str
) -> None:
    """Was refused ("parameters 'backbone.0.weight', 'backbone.0.bias' were written and their gradients cleared"):
    the check took the frozen parameters' missing gradients for a raw optimizer's zero_grad."""

    def fit(**precision: Any) -> dict[str, torch.Tensor]:
        model = _FrozenAndUnused()
        settings: dict[str, Any] = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                                        enable_progress_bar=False, enable_model_summary=False, max_epochs=1,
                                        num_sanity_val_steps=0, limit_val_batches=1, accumulate_grad_batches=3,
                                        val_check_interval=2)  # fmt: skip
        pl.Trainer(callbacks=[_HandEMA()], **settings, **precision).fit(model, _loader(6), _loader(1))
        return {k: v.detach().float() for k, v in model.state_dict().items()}

    want = fit(precision=reference)
    got = fit(plugins=[MixedPrecisionPlugin(opt_level, half_dtype=half_dtype)])
    start = {k: v.detach() for k, v in _FrozenAndUnused().state_dict().items()}
    assert (want["head.weight"] - start["head.weight"]).abs().max() > 1e-2  # it trained
    assert all(torch.allclose(got[k], want[k], atol=3e-3) for k in want), {
        k: (got[k] - want[k]).abs().max().item() for k in want
    }


def _fabric_loop(precision: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Fabric, the backbone (``0``) left out of the optimizer but requiring grad; accumulation over three batches with
    an EMA swapped in and back mid-accumulation (a validation run); ``model.zero_grad()`` after each step."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, **precision)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model, optimizer = fabric.setup(net, torch.optim.SGD(net[2].parameters(), lr=0.1))
    avg = [p.detach().clone() for p in model.parameters()]
    for i in range(9):
        x, y = _batch(i)
        fabric.backward(F.mse_loss(model(x).float(), y) / 3)
        if i % 3 == 1:
            _swap(model, avg)  # validation with the EMA weights, then the trained ones back
            _swap(model, avg)
        if i % 3 == 2:
            optimizer.step()
            model.zero_grad()
            with torch.no_grad():
                for other, param in zip(avg, model.parameters()):
                    other.lerp_(param.to(other.dtype), 0.1)
    return {k: v.detach().float() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(("opt_level", "half_dtype", "reference"), LEVELS)
def test_fabric_an_ema_swap_kept_through_accumulation_then_model_zero_grad_trains_as_fabrics_precision(
    opt_level: str, half_dtype: str, reference: str
) -> None:
    """Was refused at the next iteration's first backward ("parameters '0.weight', '0.bias', which no optimizer
    prepared by lightning_mpx holds, were written and their gradients cleared"): the swap made the backbone a suspect
    and the model-wide zero_grad after the step looked like a raw optimizer's."""
    want = _fabric_loop(dict(precision=reference))
    got = _fabric_loop(dict(plugins=[FabricMixedPrecisionPlugin(opt_level, half_dtype=half_dtype)]))
    torch.manual_seed(0)
    start = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).state_dict()
    assert (want["2.weight"] - start["2.weight"]).abs().max() > 1e-2  # it trained
    assert all(torch.allclose(got[k], want[k], atol=3e-3) for k in want), {
        k: (got[k] - want[k]).abs().max().item() for k in want
    }


class _EMATeacher(pl.LightningModule):
    """A student and its EMA teacher, which requires grad and is in ``self.parameters()`` given to the optimizer but
    takes no gradient (its output is detached), updated after every batch, so between accumulated backwards too."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.student = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.teacher = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.teacher.load_state_dict(self.student.state_dict())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        x = x.to(self.student[0].weight.dtype)
        out = self.student(x).float()
        return F.mse_loss(out, y) + 0.1 * F.mse_loss(out, self.teacher(x).float().detach())

    def on_train_batch_end(self, *args: Any) -> None:
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.student.parameters()):
                t.lerp_(s, 0.5)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(("opt_level", "half_dtype", "reference"), LEVELS)
def test_an_ema_teacher_in_the_optimizer_updated_every_micro_batch_trains_as_lightnings_precision(
    opt_level: str, half_dtype: str, reference: str
) -> None:
    """Was refused ("parameters 'teacher.0.weight', ... were written and their gradients cleared"), frozen or not:
    the teacher's parameters hold no gradient because none reached them, not because a raw optimizer's zero_grad
    cleared them (the student's gradients are kept)."""

    def fit(**precision: Any) -> dict[str, torch.Tensor]:
        model = _EMATeacher()
        pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, max_epochs=1, accumulate_grad_batches=2, **precision).fit(
            model, _loader(6))  # fmt: skip
        return {k: v.detach().float() for k, v in model.state_dict().items()}

    want = fit(precision=reference)
    got = fit(plugins=[MixedPrecisionPlugin(opt_level, half_dtype=half_dtype)])
    start = {k: v.detach() for k, v in _EMATeacher().state_dict().items()}
    assert (want["teacher.2.weight"] - start["teacher.2.weight"]).abs().max() > 1e-2  # the EMA moved the teacher
    assert all(torch.allclose(got[k], want[k], atol=3e-3) for k in want), {
        k: (got[k] - want[k]).abs().max().item() for k in want
    }
