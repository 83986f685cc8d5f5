"""Ranks of tests/test_exactddp52.py (two CPU processes, gloo, one launch): O2 bfloat16 under DDP starts every rank's
masters from rank zero's exact FP32 weights. Rank 1 builds its model with another seed (its FP32 weights differ from
rank 0's); each case records the masters before the first step and at the end. Cases: Lightning's Trainer
(``strategy="ddp"``), a second stage with a new plugin, a model rank 0 made half before ``fit`` (rank 1's FP32: both
fall back to rank 0's half weights), the core ``Amp`` with and without ``rank_zero_fp32``, Fabric's ``setup`` and the
Accelerate adapter's ``prepare``. Every rank writes ``$MPX_OUT/rank{r}.json``."""

from __future__ import annotations

import os
import warnings

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp, FabricMixedPrecisionPlugin, MixedPrecisionPlugin
from tests.launch import case_error, end_ranks, write_rank_results

SETTINGS = {"half_dtype": "bfloat16", "loss_scale": "dynamic", "init_scale": 2.0**10}
LR = 0.01
PER_RANK = 4  # batch size per rank; a one-process run takes batches of 2 * PER_RANK (the same global batches)


def data(ranks: int = 2) -> torch.utils.data.DataLoader:
    """32 samples in order: with two ranks, rank r takes samples r, r + 2, ... (batches of ``PER_RANK``); with one,
    batches of ``2 * PER_RANK``: the same global batches."""
    g = torch.Generator().manual_seed(1)
    dataset = torch.utils.data.TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, generator=g))
    if ranks == 1:
        return torch.utils.data.DataLoader(dataset, batch_size=2 * PER_RANK)
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=False)  # Lightning's own would shuffle
    return torch.utils.data.DataLoader(dataset, batch_size=PER_RANK, sampler=sampler)


class Net(pl.LightningModule):
    """A small regressor whose FP32 weights (seed ``seed``) are not representable in bfloat16."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1).float()

    def training_step(self, batch, index):
        return F.mse_loss(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def flat(tensors) -> list[float]:
    return torch.cat([t.detach().float().flatten() for t in tensors]).tolist()


class AtStart(pl.Callback):
    """Records the masters when training starts (after DDP's set-up, before the first step)."""

    def __init__(self, plugin: MixedPrecisionPlugin) -> None:
        self.plugin, self.start = plugin, None

    def on_train_start(self, trainer, pl_module) -> None:
        self.start = flat(self.plugin.amp.master_params(trainer.optimizers[0]))


def fit(module: Net, plugin: MixedPrecisionPlugin, devices: int = 2) -> tuple[list[float], list[float]]:
    """A Trainer run at O2 (``strategy="ddp"`` on two ranks); the masters before the first step and at the end."""
    start = AtStart(plugin)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, plugins=[plugin],
        callbacks=[start], max_epochs=1, use_distributed_sampler=False,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, data(devices))
    return start.start, flat(plugin.amp.master_params(trainer.optimizers[0]))


def fabric_run(module: Net, devices: int = 2) -> tuple[list[float], list[float]]:
    """A Fabric loop at O2 (DDP on two ranks); the masters after ``setup`` (before the first step) and at the end."""
    from lightning.fabric import Fabric

    plugin = FabricMixedPrecisionPlugin("O2", **SETTINGS)
    fabric = Fabric(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", plugins=plugin)
    fabric.launch()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=LR))
    start = flat(plugin.master_params(optimizer))
    for x, y in fabric.setup_dataloaders(data(devices), use_distributed_sampler=False):
        fabric.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return start, flat(plugin.master_params(optimizer))


def _accelerate(module: Net) -> dict:
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    handlers = [MixedPrecisionKwargs(half_dtype="bfloat16", loss_scale="dynamic", init_scale=2.0**10)]
    accelerator = Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=handlers)
    model, optimizer = accelerator.prepare(module.net, torch.optim.SGD(module.net.parameters(), lr=LR))
    start = flat(accelerator.amp.master_params(optimizer.optimizer))
    for x, y in data():  # each rank its half of every global batch, as the Trainer and Fabric runs
        loss = F.mse_loss(model(x).squeeze(-1).float(), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return {"start": start, "end": flat(accelerator.amp.master_params(optimizer.optimizer))}


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    results: dict = {"world": dist.get_world_size()}

    with case_error(results.setdefault("trainer", {})) as r:
        module = Net(seed=rank)  # rank 1's FP32 weights differ from rank 0's
        r["start"], r["end"] = fit(module, MixedPrecisionPlugin("O2", **SETTINGS))
        r["stage2_start"], r["stage2_end"] = fit(module, MixedPrecisionPlugin("O2", **SETTINGS))
    with case_error(results.setdefault("half_on_rank0", {})) as r:
        module = Net(seed=0)
        if rank == 0:  # made half before set-up on rank 0 only: no FP32 value there, so none on any rank
            module.to(torch.bfloat16)
        else:  # rank 0's weights a little off (a load that differs in the last bits): the same bfloat16 rounding
            with torch.no_grad():
                for param in module.parameters():
                    param.mul_(1 + 2**-20)
        r["start"], r["end"] = fit(module, MixedPrecisionPlugin("O2", **SETTINGS))
    with case_error(results.setdefault("core", {})) as r:  # the core engine: a collective only when asked
        for key, agree in (("own", False), ("agreed", True)):
            amp, module = Amp("O2", half_dtype="bfloat16"), Net(seed=rank)
            amp.prepare_model(module, rank_zero_fp32=agree)
            optimizer = amp.prepare_optimizer(torch.optim.SGD(module.parameters(), lr=LR))
            r[key] = flat(amp.master_params(optimizer))
    with case_error(results.setdefault("fabric", {})) as r:
        r["start"], r["end"] = fabric_run(Net(seed=rank))
    with case_error(results.setdefault("accelerate", {})) as r:
        r.update(_accelerate(Net(seed=rank)))
    write_rank_results(results)
    end_ranks()


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    main()
