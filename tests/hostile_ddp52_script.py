"""Ranks of tests/test_ddp52.py (two CPU processes, gloo, one launch): stop 51's surfaces under Lightning's
``strategy="ddp"`` as users train with it, each against a "32-true" DDP twin: a regression head's float targets passed
into the forward at O2 and O3 (the exact targets), rank-zero-only and synced logging, accumulation (``no_sync``),
``find_unused_parameters=True`` and an inf gradient on rank 1 only; a checkpoint saved before the first step and
resumed; a second ``fit`` with a new plugin; complex parameters at every level; ``release_masters`` on rank 0 only
between two stages (Trainer and Fabric). Every rank writes ``$MPX_OUT/rank{r}.json``."""

from __future__ import annotations

import os
import warnings

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

from lightning_mpx import MixedPrecisionPlugin, release_masters
from tests.launch import case_error, end_ranks, write_rank_results
from tests.test_complex_params import Spectral
from tests.test_fp32_buffers import _HFRotaryEmbedding

SETTINGS = {"half_dtype": "bfloat16", "loss_scale": "dynamic", "init_scale": 2.0**10}
INF_AT = 3  # the batch (rank 1's only) whose backward leaves an inf: the last micro-batch of optimizer step 1


def _regression() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(48, 4, generator=g), 300 + 3 * torch.rand(48, generator=g)  # bfloat16 rounds y by up to 1
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


class Regressor(pl.LightningModule):
    """A regression head whose forward takes the float targets and computes the loss (a Hugging Face habit)."""

    def __init__(self, inf: bool = False, reference: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.spare = nn.Linear(4, 4)  # never used: find_unused_parameters=True
        self.rotary = _HFRotaryEmbedding()  # FP32 inverse frequencies, kept FP32 at O2/O3 (DDP broadcasts buffers)
        self.inf, self.reference, self.index, self.exact = inf, reference, -1, []

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = x[:, :1].float() * self.rotary.inv_freq  # FP32 angles, as a rotary module computes them
        pred = self.net(x).squeeze(-1).float() + 300.0 + 1e-3 * angles.cos().sum(-1)
        return F.mse_loss(pred, labels), pred

    def training_step(self, batch, index):
        self.index = index
        loss, pred = self(*batch)
        want = F.mse_loss(pred.detach(), batch[1])
        self.exact.append(abs(loss.item() - want.item()) / want.item())
        self.log("loss0", loss, rank_zero_only=True)
        self.log("loss", loss, sync_dist=True)
        return loss

    def on_after_backward(self) -> None:
        if self.inf and self.index == INF_AT and self.trainer.global_rank == 1:
            self.net[2].weight.grad[0, 0] = float("inf")

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.reference and self.inf and self.index == INF_AT:  # the FP32 twin skips the step as well
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.zero_()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Complex(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Spectral()

    def training_step(self, batch, index):
        return F.cross_entropy(self.net(batch[0]).float(), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _complex_data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


class _Stopped(Exception):
    pass


class SaveAtStart(pl.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:
        trainer.save_checkpoint(self.path)
        raise _Stopped  # a run stopped after saving, before its first step


def _fit(module, data, plugin=None, ckpt_path=None, callbacks=(), **kwargs) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=DDPStrategy(find_unused_parameters=True), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        plugins=[plugin] if plugin is not None else None, precision=None if plugin is not None else "32-true",
        callbacks=list(callbacks), **{"max_epochs": 1, "accumulate_grad_batches": 2, **kwargs},
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer


def _weights(module, trainer, plugin=None) -> list[float]:
    """The FP32 weights trained: the masters at O2, else the parameters."""
    params = list(module.parameters())
    if plugin is not None and plugin.amp.properties.master_weights:
        params = plugin.amp.master_params(trainer.optimizers[0])
    return torch.cat([torch.view_as_real(p).flatten() if p.is_complex() else p.detach().float().flatten()
                      for p in params]).tolist()  # fmt: skip


def _fabric(module: Regressor, level: str | None) -> dict:
    """A Fabric DDP loop over ``module`` (accumulating two batches under ``no_backward_sync``); the plugin at
    ``level`` or "32-true" (then zero gradients at ``INF_AT``: the skip the plugin makes there)."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy as FabricDDP

    from lightning_mpx import FabricMixedPrecisionPlugin

    plugin = None if level is None else FabricMixedPrecisionPlugin(level, **SETTINGS)
    strategy = FabricDDP(find_unused_parameters=True)
    precision = None if plugin else "32-true"
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=plugin, precision=precision)
    fabric.launch()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
    model, optimizer = fabric.setup(module, optimizer)
    for index, (x, y) in enumerate(fabric.setup_dataloaders(_regression())):
        with fabric.no_backward_sync(model, enabled=index % 2 == 0):
            loss, pred = model(x, labels=y)
            module.exact.append(abs(loss.item() - F.mse_loss(pred.detach(), y).item()) / loss.item())
            fabric.backward(loss)
        if module.inf and index == INF_AT and (level is None or fabric.global_rank == 1):
            for p in module.parameters():
                if p.grad is not None:
                    p.grad.zero_() if level is None else p.grad.fill_(float("inf"))
        if index % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()
    params = list(module.parameters())
    if plugin is not None and plugin.amp.properties.master_weights:
        params = plugin.master_params(optimizer)
    scale = plugin.amp.scalers[0].get_scale() if plugin is not None else None
    return {"w": torch.cat([p.detach().float().flatten() for p in params]).tolist(), "exact": max(module.exact),
            "scale": scale}  # fmt: skip


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    results: dict = {}
    out = os.environ["MPX_OUT"]

    ref = Regressor(inf=True, reference=True)
    with case_error(results.setdefault("ref", {})) as r:
        r["w"] = _weights(ref, _fit(ref, _regression()))
    with case_error(results.setdefault("o2", {})) as r:
        plugin, module = MixedPrecisionPlugin("O2", **SETTINGS), Regressor(inf=True)
        trainer = _fit(module, _regression(), plugin)
        r["w"], r["exact"] = _weights(module, trainer, plugin), max(module.exact)
        r["loss"] = float(trainer.callback_metrics["loss"])
        r["inv_freq"] = [str(module.rotary.inv_freq.dtype), module.rotary.inv_freq.tolist()]
        r["scale"] = plugin.amp.scalers[0].get_scale()
    with case_error(results.setdefault("o3", {})) as r:
        plugin, module = MixedPrecisionPlugin("O3", **SETTINGS), Regressor(inf=True)
        trainer = _fit(module, _regression(), plugin)
        r["w"], r["exact"] = _weights(module, trainer, plugin), max(module.exact)
        r["scale"], r["dtype"] = plugin.amp.scalers[0].get_scale(), str(module.net[0].weight.dtype)
        r["inv_freq"] = [str(module.rotary.inv_freq.dtype), module.rotary.inv_freq.tolist()]
    with case_error(results.setdefault("resume", {})) as r:
        path = os.path.join(out, "start.ckpt")
        try:
            plugin = MixedPrecisionPlugin("O2", **SETTINGS)
            _fit(Regressor(inf=True), _regression(), plugin, callbacks=[SaveAtStart(path)])
        except _Stopped:
            pass
        plugin, module = MixedPrecisionPlugin("O2", **SETTINGS), Regressor(inf=True)
        r["w"] = _weights(module, _fit(module, _regression(), plugin, ckpt_path=path), plugin)

    with case_error(results.setdefault("stages_ref", {})) as r:
        module = Regressor()
        _fit(module, _regression())
        r["w"] = _weights(module, _fit(module, _regression()))
    with case_error(results.setdefault("stages", {})) as r:
        first, module = MixedPrecisionPlugin("O2", **SETTINGS), Regressor()
        trainer = _fit(module, _regression(), first)
        second = MixedPrecisionPlugin("O2", **SETTINGS)
        r["w"] = _weights(module, _fit(module, _regression(), second), second)
        try:
            first.amp.master_params(trainer.optimizers[0])
            r["refused"] = False
        except RuntimeError:
            r["refused"] = True
    with case_error(results.setdefault("released", {})) as r:
        first, module = MixedPrecisionPlugin("O2", **SETTINGS), Regressor()
        _fit(module, _regression(), first)
        if dist.get_rank() == 0:  # export on rank 0: the model kept in half, its masters let go
            release_masters(module)
        second = MixedPrecisionPlugin("O2", **SETTINGS)
        r["w"] = _weights(module, _fit(module, _regression(), second), second)

    with case_error(results.setdefault("fabric_ref", {})) as r:
        module = Regressor(inf=True)
        r["first"], r["second"] = _fabric(module, None), _fabric(module, None)
    with case_error(results.setdefault("fabric", {})) as r:
        module = Regressor(inf=True)
        r["first"] = _fabric(module, "O2")
        if dist.get_rank() == 0:  # export on rank 0, then a second stage on both
            release_masters(module)
        r["second"] = _fabric(module, "O2")

    for level in ("32", "O1", "O2", "O3"):
        with case_error(results.setdefault(f"complex/{level}", {})) as r:
            plugin = None if level == "32" else MixedPrecisionPlugin(level, **SETTINGS)
            module = Complex()
            r["w"] = _weights(module, _fit(module, _complex_data(), plugin), plugin)
            r["dtype"] = str(module.net.phase.dtype)
    write_rank_results(results)
    end_ranks()


if __name__ == "__main__":
    main()
