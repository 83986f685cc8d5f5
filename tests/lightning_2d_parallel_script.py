"""Run by tests/test_lightning_2d_parallel.py: two-dimensional (data x tensor) parallelism under the Trainer, four CPU
processes (gloo), one launch.

``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)``: ranks 0 and 1 are data-parallel replica 0,
ranks 2 and 3 replica 1. ``configure_model`` applies tp59's plan (a colwise and a rowwise ``Linear`` over
``device_mesh["tensor_parallel"]``, the norm left whole) and then FSDP2 over ``device_mesh["data_parallel"]``: for the
plugin ``shard_model``, for Lightning's own precisions ``fully_shard`` (their recipe). The norm's weight is then
sharded over the data-parallel mesh and held alike by both tensor-parallel ranks; a ``Linear``'s is sharded over both
dimensions. Each replica trains on its half of the global batch. Cases: O2 (bfloat16, saving the distributed
checkpoint after two steps) and Lightning's ``"bf16-mixed"`` and ``"32-true"``; O2 resumed from that checkpoint; O2
and O1 (bfloat16) with ``gradient_clip_val``; O2 in float16 with an ``inf`` in rank 1's gradient shard at one step;
O3 (bfloat16). Every rank writes ``$MPX_OUT/rank{r}.json``."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.launch import case_error, end_ranks, launch_ranks, write_rank_results

# tp59's model (norm, colwise w1, rowwise w2), SGD that records the gathered gradient norm, gathered weights
from tests.lightning_tensor_parallel_script import LR, MLP, MOMENTUM, Recording, full, global_norm  # noqa: F401

STEPS = 4
SAVE_AT = 2  # the checkpoint: saved after this many steps
CLIP = 0.05  # below every step's gradient norm: each step is clipped
INF_AT = 1  # the float16 case's step with an inf in rank 1's gradient shard
WORLD, DP = 4, 2


def batch(step: int, replica: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch (16 rows), or data-parallel ``replica``'s half of it."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(16, 8, generator=g) * 2
    if replica is not None:
        x = x.chunk(DP)[replica]
    return x, x.sin()


def fit(precision: str, out: str, *, clip: bool = False, resume: bool = False, save: bool = False,
        half: torch.dtype = torch.bfloat16, inf_at: int | None = None) -> dict[str, Any]:  # fmt: skip
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from lightning_mpx import MixedPrecisionPlugin
    from lightning_mpx.integrations.fsdp import shard_model
    from tests.lightning_helpers import make_trainer

    path = os.path.join(out, f"ckpt_{precision}")
    plugin = MixedPrecisionPlugin(precision, half_dtype=half) if precision.startswith("O") else None
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = MLP()
            self.losses: list[float] = []
            self.norms: list[float] = []  # after clipping: what the optimizer steps with
            self.true_norms: list[float] = []  # before clipping, gathered here
            self.clip_norms: list[float] = []  # the norm the plugin clipped by (mpx/grad_norm)
            self.scales: list[float] = []

        def configure_model(self) -> None:
            plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
            parallelize_module(self.model, self.device_mesh["tensor_parallel"], plan)
            if plugin is not None:
                shard_model(self.model, self.trainer.precision_plugin, mesh=self.device_mesh["data_parallel"])
            else:
                fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

        def training_step(self, _: Any, __: int) -> Any:
            x, y = batch(self.global_step, self.device_mesh["data_parallel"].get_local_rank())
            loss = F.mse_loss(self.model(x).float(), y)
            self.losses.append(loss.item())
            return loss

        def on_after_backward(self) -> None:
            if self.global_step == inf_at and rank == 1:  # one rank's shard alone: all four must skip
                with torch.no_grad():
                    self.model.w1.weight.grad.to_local().view(-1)[0] = float("inf")

        def on_before_optimizer_step(self, optimizer: Any) -> None:  # Lightning: before clipping, unscaled
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.true_norms.append(global_norm(grads))

        def on_train_batch_start(self, _: Any, __: int) -> None:
            if save and self.global_step == SAVE_AT:
                self.trainer.save_checkpoint(path)

        def on_train_batch_end(self, *_: Any) -> None:
            if plugin is not None:
                self.scales.append(plugin.amp.scalers[0].get_scale())
                norm = plugin.amp.metrics(reader="tp60").get("mpx/grad_norm")
                if norm is not None:
                    self.clip_norms.append(float(norm))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return Recording(self.parameters(), self.norms)

    extra: dict[str, Any] = {} if plugin else {"precision": precision}
    if clip:
        extra["gradient_clip_val"] = CLIP
    strategy = ModelParallelStrategy(data_parallel_size=DP, tensor_parallel_size=WORLD // DP)
    trainer = make_trainer(plugin, strategy=strategy, devices=WORLD, max_steps=STEPS, use_distributed_sampler=False,
                           **extra)  # fmt: skip
    model = Lit()
    data = torch.utils.data.DataLoader(range(STEPS), batch_size=None)
    trainer.fit(model, data, ckpt_path=path if resume else None)
    from torch.distributed.tensor import DTensor

    norm_w, w1 = model.model.norm.weight, model.model.w1.weight
    return {"losses": model.losses, "norms": model.norms, "true_norms": model.true_norms,
            "clip_norms": model.clip_norms, "scales": model.scales, "params": full(model.model),
            "skipped": plugin.amp.metrics(reader="skips")["mpx/skipped_steps"] if plugin else None,
            "layout": {n: str(p.placements) if isinstance(p, DTensor) else "" for n, p in (("norm", norm_w),
                                                                                           ("w1", w1))},
            "dtype": str(w1.dtype), "global_step": trainer.global_step,
            "sharded": bool(plugin and plugin.amp.sharded)}  # fmt: skip


CASES = {
    "O2": dict(precision="O2", save=True),
    "O2_resumed": dict(precision="O2", resume=True),
    "bf16-mixed": dict(precision="bf16-mixed"),
    "32-true": dict(precision="32-true"),
    "O2_clip": dict(precision="O2", clip=True),
    "O1_clip": dict(precision="O1", clip=True),
    "O2_fp16_inf": dict(precision="O2", half=torch.float16, inf_at=INF_AT),
    "O3": dict(precision="O3"),
}


def main() -> int:
    if "RANK" not in os.environ:
        return launch_ranks(__file__, WORLD, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    out, rank = os.environ["MPX_OUT"], int(os.environ["RANK"])
    only = os.environ.get("TP60_CASES")
    results: dict[str, Any] = {}
    for name, case in CASES.items():
        if only and name not in only.split(","):
            continue
        with case_error(results.setdefault(name, {})) as record:
            record.update(fit(out=out, **case))  # type: ignore[arg-type]
        dist.barrier()
    write_rank_results(results, rank=rank)
    end_ranks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
