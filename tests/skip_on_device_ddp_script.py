"""Run by tests/test_step_outcome_reads.py: ``skip_on_device=True`` under DDP, two CPU processes (gloo), with the
pending step outcomes read on rank 0 only, the way people log.

``$MPX_FRONT`` picks the front doors (``fabric,trainer``: both, in that order, in the same two processes):

- ``fabric``: ``Fabric(strategy="ddp", devices=2)`` with ``FabricMixedPrecisionPlugin("O1", half_dtype="bfloat16",
  loss_scale="dynamic", skip_on_device=...)`` and a fused AdamW; then, in the same processes, the core ``Amp`` over a
  torch ``DistributedDataParallel`` model with ``found_inf_reducer`` set. For each read habit (``step_was_skipped``,
  ``metrics``; for the core engine ``bool``, ``sum`` and ``metrics``) rank 0 alone reads after every step, and the
  run is made with ``skip_on_device`` off (the reference) and on.
- ``trainer``: a ``Trainer(strategy="ddp", devices=2)`` with the ``MixedPrecisionPlugin`` and a callback that reads
  ``step_was_skipped`` and ``metrics()`` on rank 0 only (``if trainer.is_global_zero``), skip off and on.

The model holds a BatchNorm (DDP broadcasts its buffers at every forward: a collective inside the forward). An inf is
written into a gradient after DDP's all-reduce, on the ranks of :data:`OVERFLOWS` (rank 0 only, rank 1 only, both),
the last step included. Each rank writes what it saw to ``$MPX_OUT/{front}_rank{r}.json``; a read that runs a
collective on rank 0 alone hangs, and the test's timeout turns that into a failure.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.launch import end_ranks, write_rank_results

STEPS = 6
#: step -> the ranks whose gradient gets an inf (after DDP's all-reduce: the ranks agree only through the engine)
OVERFLOWS = {1: (0,), 3: (1,), 4: (0, 1), 5: (0,)}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own data
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def _inject(first: nn.Module, step: int, rank: int) -> None:
    if rank in OVERFLOWS.get(step, ()):
        first.weight.grad[0, 0] = float("inf")


def _say(*parts: Any) -> None:
    """Progress on stderr: a timeout's message then says which run hung."""
    print(f"[rank {dist.get_rank() if dist.is_initialized() else '?'}]", *parts, file=sys.stderr, flush=True)


def _plain(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


def _last(amp: Any) -> dict[str, Any] | None:
    """The latest overflow's record (merged across the ranks), as JSON."""
    record = amp.last_overflow
    if record is None:
        return None
    return {"step": record.step, "ranks": list(record.ranks), "parameters": sorted(record.parameters)}


def _fabric_run(fabric: Any, skip: bool, habit: str) -> dict[str, Any]:
    from lightning_mpx import FabricMixedPrecisionPlugin

    mpx = fabric._precision
    assert isinstance(mpx, FabricMixedPrecisionPlugin)
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model, optimizer = fabric.setup(model, optimizer)
    rank = fabric.global_rank
    seen: list[Any] = []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        fabric.backward(F.cross_entropy(model(x), y))
        _inject(model.module[0], step, rank)
        optimizer.step()
        if fabric.is_global_zero:  # the usual rank-0-only logging, before zero_grad
            if habit == "step_was_skipped":
                seen.append(mpx.step_was_skipped(optimizer))
            elif habit == "metrics":
                seen.append(_plain(mpx.metrics()))
        optimizer.zero_grad()
    end = _plain(mpx.metrics())  # every rank: what each has counted when the loop ends
    mpx.amp.settle_step_outcomes()  # every rank together: the last step's record, merged across the ranks
    return {
        "seen": seen,
        "end": end,
        "last": _last(mpx.amp),
        "params": [p.detach().float().flatten().tolist() for p in model.parameters()],
        "buffers": [b.detach().float().flatten().tolist() for b in model.buffers()],
    }


def _amp_run(skip: bool, habit: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    from lightning_mpx import Amp

    rank = dist.get_rank()
    amp = Amp("O1", half_dtype="bfloat16", loss_scale="dynamic", skip_on_device=skip)
    amp.found_inf_reducer = lambda flag: dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    amp.log_overflows = rank == 0
    model = DistributedDataParallel(amp.prepare_model(_net()))
    optimizer = amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    outcomes: list[Any] = []
    seen: list[Any] = []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        with amp.forward_context():
            loss = F.cross_entropy(amp.cast_outputs(model(x)).float(), y)
        amp.backward(loss)
        _inject(model.module[0], step, rank)
        outcomes.append(amp.step(optimizer))
        amp.update()
        if rank == 0:
            if habit == "bool":
                seen.append(bool(outcomes[-1]))
            elif habit == "sum":
                seen.append(sum(outcomes))  # steps taken so far
            elif habit == "metrics":
                amp.read_step_outcomes()  # the core engine's metrics() does not read (no wait): read first
                seen.append(_plain(amp.metrics()))
        optimizer.zero_grad()
    amp.read_step_outcomes()
    end = _plain(amp.metrics())
    amp.settle_step_outcomes()  # every rank together
    return {
        "seen": seen,
        "end": end,
        "last": _last(amp),
        "params": [p.detach().float().flatten().tolist() for p in model.parameters()],
        "buffers": [b.detach().float().flatten().tolist() for b in model.buffers()],
    }


def fabric_main() -> None:
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    results: dict[str, Any] = {}
    for habit in ("step_was_skipped", "metrics"):
        for skip in (False, True):
            mpx = FabricMixedPrecisionPlugin("O1", half_dtype="bfloat16", loss_scale="dynamic", skip_on_device=skip)
            fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[mpx])
            fabric.launch()  # the first run starts the second process; later ones find the process group running
            _say("fabric", habit, skip)
            results[f"fabric/{habit}/{skip}"] = _fabric_run(fabric, skip, habit)
    for habit in ("bool", "sum", "metrics"):
        for skip in (False, True):
            _say("amp", habit, skip)
            results[f"amp/{habit}/{skip}"] = _amp_run(skip, habit)
    write_rank_results(results, "fabric_")


def trainer_main() -> None:
    import lightning.pytorch as pl

    from lightning_mpx import MixedPrecisionPlugin
    from tests.lightning_helpers import make_trainer

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = _batch(batch_idx, self.global_rank)  # each rank its own data, as in the Fabric run
            return F.cross_entropy(self.net(x), y)

        def on_after_backward(self) -> None:
            _inject(self.net[0], self.trainer.global_step, self.global_rank)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)

    class RankZeroReads(pl.Callback):
        """Rank-0-only logging: what a step did, and the plugin's metrics."""

        def __init__(self) -> None:
            self.seen: list[Any] = []

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if trainer.is_global_zero:
                plugin = trainer.precision_plugin
                skipped = plugin.step_was_skipped(trainer.optimizers[0])
                self.seen.append({"skipped": skipped, **plugin.metrics()})

    results: dict[str, Any] = {}
    rank = 0
    for skip in (False, True):
        plugin = MixedPrecisionPlugin("O1", half_dtype="bfloat16", loss_scale="dynamic", skip_on_device=skip)
        module, reads = Module(), RankZeroReads()
        trainer = make_trainer(plugin, strategy="ddp", devices=2, max_steps=STEPS, callbacks=[reads])
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(2 * STEPS, 1)), batch_size=1)
        trainer.fit(module, data)
        rank = trainer.global_rank
        _say("trainer", skip)
        results[f"trainer/{skip}"] = {
            "seen": reads.seen,
            "end": plugin.metrics(),
            "last": _last(plugin.amp),  # the Trainer tore the plugin down on every rank: the last step is settled
            "params": [p.detach().float().flatten().tolist() for p in module.parameters()],
            "buffers": [b.detach().float().flatten().tolist() for b in module.buffers()],
        }
    write_rank_results(results, "trainer_", rank)


def main() -> None:
    for front in os.environ["MPX_FRONT"].split(","):  # one launch for both: Fabric's starts the processes
        {"fabric": fabric_main, "trainer": trainer_main}[front]()
    end_ranks()


if __name__ == "__main__":
    main()
