"""Two-process cases of tests/test_lightning_scaler_view_reads.py (gloo, one launch): ``plugin.scaler`` read on rank 0
only (a ``@rank_zero_only`` callback, ``if fabric.global_rank == 0``) under DDP with float16 and overflows on rank 1
only, with and without ``skip_on_device``, against Lightning's/Fabric's own ``"16-mixed"`` (a ``torch.amp.GradScaler``).

Each rank writes ``$MPX_OUT/rank{r}.json``: per case the scales rank 0 read (empty on rank 1), the final scale
(``metrics()``/the GradScaler's, read on every rank after the run) and the final weights' sum.
"""

from __future__ import annotations

import os
import sys

if "RANK" not in os.environ:  # the launcher
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.launch import launch_ranks

    raise SystemExit(launch_ranks(__file__))

from typing import Any  # noqa: E402

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.utilities import rank_zero_only  # noqa: E402
from torch import nn  # noqa: E402

from tests.launch import end_ranks, write_rank_results  # noqa: E402

SCALING = {"init_scale": 256.0, "growth_interval": 2}
OVERFLOW_AT = (1, 2, 5)  # steps whose loss is inf on rank 1 only
STEPS = 7


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * step + rank))


def _loss(out: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    loss = out.float().pow(2).mean()
    return loss * float("inf") if rank == 1 and step in OVERFLOW_AT else loss


def _plugin(kind: str, fabric: bool) -> Any:
    from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin

    if kind == "native":
        if fabric:
            from lightning.fabric.plugins.precision import MixedPrecision
        else:
            from lightning.pytorch.plugins.precision import MixedPrecision
        return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **SCALING))
    cls = FabricMixedPrecisionPlugin if fabric else MixedPrecisionPlugin
    return cls("O2", half_dtype="float16", skip_on_device=kind == "skip_on_device", **SCALING)


def _fabric(kind: str, rank: int) -> dict[str, Any]:
    from lightning.fabric import Fabric

    plugin = _plugin(kind, fabric=True)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[plugin])
    fabric.launch()
    net = _net()
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True))
    seen = []
    for step in range(STEPS):
        fabric.backward(_loss(model(_batch(step, rank)), step, rank))
        optimizer.step()
        optimizer.zero_grad()
        if fabric.global_rank == 0:
            seen.append(fabric._precision.scaler.get_scale())
    final = fabric._precision.scaler.get_scale()  # every rank, after the run
    return {"seen": seen, "final": final, "weights": sum(p.detach().double().sum().item() for p in net.parameters())}


class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return _loss(self.net(batch[0]), batch_idx, self.global_rank)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)


class _RankZeroReader(pl.Callback):
    """Reads the scale on rank 0 only, in two hooks, as a callback ported from ``"16-mixed"`` does."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, float]] = []

    @rank_zero_only
    def on_before_optimizer_step(self, trainer: pl.Trainer, module: Any, optimizer: Any) -> None:
        self.seen.append(("before_step", trainer.precision_plugin.scaler.get_scale()))

    @rank_zero_only
    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.seen.append(("batch_end", trainer.scaler.get_scale()))


def _trainer(kind: str, rank: int) -> dict[str, Any]:
    data = torch.utils.data.TensorDataset(torch.cat([_batch(i // 2, i % 2) for i in range(2 * STEPS)]))
    reader = _RankZeroReader()
    module = _Module()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, plugins=[_plugin(kind, fabric=False)],
        callbacks=[reader], use_distributed_sampler=False,
    )  # fmt: skip
    # rank r's batches: its own (no sampler), 4 rows each
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(data, [
        j for i in range(STEPS) for j in range((2 * i + rank) * 4, (2 * i + rank + 1) * 4)]), batch_size=4)
    trainer.fit(module, loader)
    final = trainer.scaler.get_scale()  # every rank, after fit
    return {"seen": reader.seen, "final": final,
            "weights": sum(p.detach().double().sum().item() for p in module.parameters())}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    results = {}
    for kind in ("native", "plain", "skip_on_device"):
        results[f"fabric-{kind}"] = _fabric(kind, rank)
    for kind in ("native", "plain", "skip_on_device"):
        results[f"trainer-{kind}"] = _trainer(kind, rank)
    write_rank_results(results)
    end_ranks()


if __name__ == "__main__":
    main()
