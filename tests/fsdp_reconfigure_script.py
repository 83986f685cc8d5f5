"""Run by tests/test_fsdp_reconfigure.py: the README's FSDP2 pattern (``configure_model`` calling
``lightning_mpx.integrations.fsdp.shard_model``) through a real Trainer with ``ModelParallelStrategy`` on two CPU
processes (gloo), across stages of one Trainer: Lightning calls ``configure_model`` at every stage (``fit``,
``validate``, ``test``), so the second stage calls ``shard_model`` on a model the first one sharded.

``$MPX_CASES`` lists the runs, comma-separated, each ``<level>:<order>`` with order ``fit_test`` (``trainer.fit``
then ``trainer.test``) or ``validate_fit`` (``trainer.validate`` then ``trainer.fit``); ``gathered/<level>:<order>``
runs a case of tests/hostile_root_gathered_script.py in the same launch. Every rank writes
``$MPX_OUT/<file_prefix(case)>rank<r>.json``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_mpx import MixedPrecisionPlugin
from lightning_mpx.integrations.fsdp import shard_model
from tests.launch import end_ranks
from tests.lightning_helpers import classification_data, loader, make_trainer

BATCH = 8
STEPS = 2
#: The prefix of a case of the root-kept-gathered runs (``gathered/<level>:<order>``:
#: tests/hostile_root_gathered_script.py).
GATHERED = "gathered/"


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.linear(x))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.Sequential(Block(32), Block(32))
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(F.relu(self.inp(x))))


class LitModel(pl.LightningModule):
    """The README's pattern: ``configure_model`` shards the module the steps call, with blocks of their own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Model()
        self.configure_calls = 0
        self.stages: list[str] = []
        self.val_losses: list[float] = []
        self.test_losses: list[float] = []
        self.train_losses: list[float] = []

    def configure_model(self) -> None:
        self.configure_calls += 1
        shard_model(self.model, self.trainer.precision_plugin, mesh=self.device_mesh["data_parallel"], blocks=Block)

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.train_losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_losses.append(self._loss(batch).item())

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.test_losses.append(self._loss(batch).item())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def run(case: str) -> dict[str, Any]:
    level, order = case.split(":")
    plugin = MixedPrecisionPlugin(level, half_dtype="bfloat16")
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = make_trainer(plugin, strategy=strategy, devices=2, max_steps=STEPS, limit_val_batches=1,
                           num_sanity_val_steps=0)  # fmt: skip
    model = LitModel()
    data = loader(classification_data(n=BATCH * 2 * STEPS, seed=1), BATCH)
    stages = ["fit", "test"] if order == "fit_test" else ["validate", "fit"]
    for stage in stages:
        if stage == "fit":
            trainer.fit(model, data, data)
        else:
            getattr(trainer, stage)(model, data)
    units = [name for name, m in model.model.named_modules() if isinstance(m, FSDPModule)]
    # The hook changed between stages (another level's plugin): refused, naming what differs.
    other = MixedPrecisionPlugin("O1" if level != "O1" else "O2", half_dtype="bfloat16")
    try:
        shard_model(model.model, other, mesh=model.device_mesh["data_parallel"], blocks=Block)
        conflict = ""
    except ValueError as error:
        conflict = str(error)
    # The last stage's evaluation forward left the root gathered (FSDP's default for the root): read the shards.
    for unit in model.model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()
    param_dtypes = sorted({str(p.to_local().dtype) for p in model.model.parameters()})
    return dict(
        configure_calls=model.configure_calls,
        conflict=conflict,
        global_step=trainer.global_step,
        units=units,
        train_losses=model.train_losses,
        val_losses=model.val_losses,
        test_losses=model.test_losses,
        param_dtypes=param_dtypes,
    )


def file_prefix(case: str) -> str:
    """Where each rank writes a case: ``$MPX_OUT/<file_prefix(case)>rank<r>.json``."""
    return case.replace(":", "_").replace("/", "_") + "_"


def main() -> None:
    out = os.environ["MPX_OUT"]
    for case in os.environ["MPX_CASES"].split(","):
        if case.startswith(GATHERED):
            # The root-kept-gathered runs (tests/hostile_root_gathered_script.py), in this launch rather than their own.
            from tests.hostile_root_gathered_script import run_case

            record = run_case(case[len(GATHERED):])
        else:
            record = run(case)
        with open(os.path.join(out, f"{file_prefix(case)}rank{dist.get_rank()}.json"), "w") as f:
            json.dump(record, f)
    end_ranks()


if __name__ == "__main__":
    main()
