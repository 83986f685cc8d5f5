"""Ranks of tests/test_lightning_rank_zero_reads.py (gloo, ONE launch): rank-0-only reads of the loss scale under DDP,
float16 with an overflow on rank 1 only, fused AdamW (its steps skipped on the device, the default: where a rank-0-only
collective would hang).

Each rank writes, per case, the engine's live scale at each batch (Trainer) or after each ``fabric.backward``
(Fabric), what rank 0 read, and the final weights:

* ``trainer_auto/{O1,16-mixed}``: automatic optimization with ``accumulate_grad_batches=3``, a per-step ``StepLR``
  and ``LearningRateMonitor``, ``ModelCheckpoint(
  every_n_train_steps=1)``, a CSV logger at every step, and a callback reading ``precision_plugin.scaler.get_scale()``,
  ``metrics()`` and ``state_dict()`` in ``on_before_optimizer_step`` and ``on_train_batch_end`` on rank 0 only;
  ``16-mixed`` is Lightning's ``MixedPrecision`` with a ``GradScaler`` (the reference: its scale after each step);
* ``trainer_gan/O2``: manual optimization, two optimizers with ``toggle_optimizer``, the same reads on rank 0 between
  the discriminator's step and the generator's and at the batch's end, ``ModelCheckpoint(every_n_train_steps=1)``;
* ``fabric_gan/{O1,16-mixed}``: inside ``fabric.launch(fn)``, the generator set up in pieces (``setup_module``, then
  ``setup_optimizers``) and the discriminator with ``fabric.setup``, ``mpx.metrics()``, ``mpx.scaler.get_scale()`` and
  ``mpx.state_dict()`` read on rank 0 between the two steps (each step ends an iteration there, as each step
  updates a ``GradScaler``: the reference, Fabric's ``MixedPrecision("16-mixed")``).
"""

from __future__ import annotations

import datetime
import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import MixedPrecision as FabricMixedPrecision
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin
from tests.launch import case_error, finish_cases

SCALING = {"init_scale": 2.0**10, "growth_interval": 2}
OVERFLOW_AT = (4, 7)  # batches whose loss is inf on rank 1 only


def _loader(rank: int, n: int = 96) -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(n, 8, generator=gen)  # 12 batches of 4 per rank (the Trainer's DistributedSampler: 48 samples)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long()), batch_size=4)


def _values(modules: Any) -> list[float]:
    return torch.cat([v.detach().float().flatten() for m in modules for v in m.state_dict().values()]).tolist()


def _reads(plugin: Any) -> list[float]:
    """What a ported callback reads: the ``GradScaler`` view's scale, ``metrics()``'s and ``state_dict()``'s."""
    return [plugin.scaler.get_scale(), plugin.metrics()["mpx/loss_scale"], plugin.state_dict()["scalers"][0]["scale"]]


class RankZeroReads(pl.Callback):
    """The reads, on rank 0 only; under ``"16-mixed"`` its ``GradScaler``'s ``get_scale()`` (the reference)."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def _read(self, trainer: pl.Trainer, where: str) -> None:
        if trainer.is_global_zero:
            plugin = trainer.precision_plugin
            reads = _reads(plugin) if isinstance(plugin, MixedPrecisionPlugin) else [plugin.scaler.get_scale()] * 3
            self.seen.append([where, *reads])

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        self._read(trainer, "before_step")

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._read(trainer, "batch_end")


class Scales(pl.Callback):
    """The scale each batch starts with (every rank): after the previous iteration's update."""

    def __init__(self) -> None:
        self.live: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        plugin = trainer.precision_plugin
        mpx = isinstance(plugin, MixedPrecisionPlugin)
        self.live.append(float(plugin.amp.scalers[0].scale_tensor) if mpx else plugin.scaler.get_scale())


class Auto(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self.net(batch[0]), batch[1])
        self.log("loss", loss)
        return loss * float("inf") if self.global_rank == 1 and batch_idx in OVERFLOW_AT else loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)
        schedule = torch.optim.lr_scheduler.StepLR(opt, 1, 1.0)  # constant: "16-mixed" steps it on a skip too
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _adamw(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(module.parameters(), lr=1e-2, fused=True)  # skipped on the device by default


def _gan() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
    return generator, nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _gan_losses(g: nn.Module, d: nn.Module, real: torch.Tensor, step: int) -> tuple[Any, Any]:
    """The discriminator's loss and a function giving the generator's (after the discriminator's step)."""
    n = real.shape[0]
    z = torch.randn(n, 4, generator=torch.Generator().manual_seed(step))
    labels = torch.cat([torch.ones(n, 1), torch.zeros(n, 1)])
    d_loss = F.binary_cross_entropy_with_logits(d(torch.cat([real, g(z).detach()])), labels)
    return d_loss, lambda: F.binary_cross_entropy_with_logits(d(g(z)), torch.ones(n, 1))


class Gan(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.g, self.d = _gan()
        self.seen: list[Any] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        self.toggle_optimizer(opt_d)
        d_loss, g_loss = _gan_losses(self.g, self.d, batch[0], batch_idx)
        self.manual_backward(d_loss * float("inf") if self.global_rank == 1 and batch_idx in OVERFLOW_AT else d_loss)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        if self.trainer.is_global_zero:
            self.seen.append(["between", *_reads(self.trainer.precision_plugin)])
        self.toggle_optimizer(opt_g)
        self.manual_backward(g_loss())
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

    def configure_optimizers(self) -> Any:
        return _adamw(self.g), _adamw(self.d)


def run_trainer(case: str, out: Path) -> dict[str, Any]:
    kind, precision = case.split("/")
    if precision == "16-mixed":
        plugin: Any = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **SCALING))
    else:
        plugin = MixedPrecisionPlugin(precision, half_dtype="float16", **SCALING)
    reads, scales = RankZeroReads(), Scales()
    folder = out / case.replace("/", "_")
    callbacks: list[Any] = [reads, scales, ModelCheckpoint(dirpath=str(folder), every_n_train_steps=1, save_top_k=-1)]
    if kind == "trainer_auto":
        model: Any = Auto()
        callbacks.append(LearningRateMonitor(logging_interval="step"))
        extra: dict[str, Any] = dict(strategy="ddp", accumulate_grad_batches=3)
    else:
        model = Gan()
        extra = dict(strategy="ddp_find_unused_parameters_true")
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, plugins=[plugin], max_epochs=1, logger=CSVLogger(str(folder), version=0),
        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **extra,
    )  # fmt: skip
    trainer.fit(model, _loader(dist.get_rank()))
    return {"live": scales.live, "seen": reads.seen + getattr(model, "seen", []), "final": _values([model])}


def run_fabric(precision: str) -> dict[str, Any]:
    if precision == "16-mixed":
        mpx: Any = None
        plugin: Any = FabricMixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **SCALING))
    else:
        mpx = plugin = FabricMixedPrecisionPlugin(precision, half_dtype="float16", **SCALING)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[plugin])

    def scale() -> float:
        return float(mpx.amp.scalers[0].scale_tensor) if mpx is not None else plugin.scaler.get_scale()

    def train(fabric: Fabric) -> dict[str, Any]:
        rank = fabric.global_rank
        g, d = _gan()
        g_model = fabric.setup_module(g)
        opt_g = fabric.setup_optimizers(_adamw(g))
        d_model, opt_d = fabric.setup(d, _adamw(d))
        out: dict[str, Any] = {"live": [], "seen": []}
        for step, (real, _) in enumerate(_loader(rank, 48)):
            d_loss, g_loss = _gan_losses(g_model, d_model, real, step)
            fabric.backward(d_loss)
            out["live"].append(scale())  # the previous optimizer step's update done
            opt_d.step()
            opt_d.zero_grad()
            if rank == 0:
                out["seen"].append(["between", *(_reads(mpx) if mpx is not None else [plugin.scaler.get_scale()] * 3)])
            loss = g_loss()
            fabric.backward(loss * float("inf") if rank == 1 and step in OVERFLOW_AT else loss)
            opt_g.step()
            opt_g.zero_grad()
            opt_d.zero_grad()
        fabric.backward(d_model(torch.zeros(1, 8)).sum() * 0)  # on every rank: ends the last iteration
        out["live"].append(scale())
        out["final"] = _values([g, d])
        return out

    return fabric.launch(train)


CASES = ("trainer_auto/O1", "trainer_auto/16-mixed", "trainer_gan/O2", "fabric_gan/O1", "fabric_gan/16-mixed")


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a stray collective: an error, no hang
    torch.set_num_threads(1)
    out = Path(os.environ["MPX_OUT"])
    results: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for case in CASES:
            with case_error(results.setdefault(case, {})) as result:
                result.update(run_fabric(case.split("/")[1]) if case.startswith("fabric") else run_trainer(case, out))
    finish_cases(results)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    main()
