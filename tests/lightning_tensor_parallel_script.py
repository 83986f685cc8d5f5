"""Run by tests/test_lightning_tensor_parallel.py: tensor parallelism under the Trainer, two CPU processes (gloo), one
launch.

``ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)``; ``configure_model`` applies Lightning's TP
recipe (``parallelize_module(self.model, self.device_mesh["tensor_parallel"], {"w1": ColwiseParallel(), "w2":
RowwiseParallel()})``, the norm left replicated) and, for the plugin, ``shard_model`` over the one-rank
``device_mesh["data_parallel"]`` after it (FSDP's FP32 parameters are the masters). Cases: O2 (bfloat16) and Lightning's
``"bf16-mixed"`` and ``"32-true"`` on the TP model alone; O2 and O1 (bfloat16) with ``gradient_clip_val``; O2
resumed from Lightning's distributed checkpoint saved after two of four steps; O2 on the TP model without
``shard_model`` (refused at set-up). Every rank writes ``$MPX_OUT/rank{r}.json``."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.launch import case_error, end_ranks, launch_ranks, write_rank_results

STEPS = 4
SAVE_AT = 2  # the checkpoint: saved after this many steps
CLIP = 0.05  # below every step's gradient norm: each step is clipped
LR, MOMENTUM = 0.1, 0.9


class MLP(nn.Module):
    """A norm (replicated), a colwise and a rowwise ``Linear``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(8)
        self.w1 = nn.Linear(8, 32)
        self.w2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.tanh(self.w1(self.norm(x))))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch, the same on both ranks (tensor parallelism: one data-parallel replica)."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(16, 8, generator=g) * 2
    return x, x.sin()


def global_norm(tensors: list[torch.Tensor]) -> float:
    """The norm of ``tensors``' full values (a ``DTensor`` gathered)."""
    from torch.distributed.tensor import DTensor

    full = [(t.full_tensor() if isinstance(t, DTensor) else t).double() for t in tensors]
    return float(torch.linalg.vector_norm(torch.stack([t.norm() for t in full])))


class Recording(torch.optim.SGD):
    """SGD that records the global norm of the gradients it steps with (after any clipping)."""

    def __init__(self, params: Any, norms: list[float]) -> None:
        super().__init__(params, lr=LR, momentum=MOMENTUM)
        self.norms = norms

    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        self.norms.append(global_norm([p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]))
        super().step()
        return loss


def full(module: nn.Module) -> dict[str, list[float]]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().double().flatten().tolist()
            for n, p in module.named_parameters()}  # fmt: skip


def fit(precision: str, out: str, *, clip: bool = False, resume: bool = False, save: bool = False,
        fsdp: bool = True) -> dict[str, Any]:  # fmt: skip
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from lightning_mpx import MixedPrecisionPlugin
    from lightning_mpx.integrations.fsdp import shard_model
    from tests.lightning_helpers import make_trainer

    path = os.path.join(out, f"ckpt_{precision}")
    plugin = MixedPrecisionPlugin(precision, half_dtype=torch.bfloat16) if precision.startswith("O") else None

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = MLP()
            self.losses: list[float] = []
            self.norms: list[float] = []

        def configure_model(self) -> None:
            plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
            parallelize_module(self.model, self.device_mesh["tensor_parallel"], plan)
            if plugin is not None and fsdp:
                shard_model(self.model, self.trainer.precision_plugin, mesh=self.device_mesh["data_parallel"])

        def training_step(self, _: Any, __: int) -> Any:
            x, y = batch(self.global_step)
            loss = F.mse_loss(self.model(x).float(), y)
            self.losses.append(loss.item())
            return loss

        def on_train_batch_start(self, _: Any, __: int) -> None:
            if save and self.global_step == SAVE_AT:
                self.trainer.save_checkpoint(path)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return Recording(self.parameters(), self.norms)

    extra: dict[str, Any] = {} if plugin else {"precision": precision}
    if clip:
        extra["gradient_clip_val"] = CLIP
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
    trainer = make_trainer(plugin, strategy=strategy, devices=2, max_steps=STEPS, use_distributed_sampler=False,
                           **extra)  # fmt: skip
    model = Lit()
    data = torch.utils.data.DataLoader(range(STEPS), batch_size=None)
    trainer.fit(model, data, ckpt_path=path if resume else None)
    return {"losses": model.losses, "norms": model.norms, "params": full(model.model),
            "global_step": trainer.global_step, "sharded": bool(plugin and plugin.amp.sharded)}  # fmt: skip


CASES = {
    "O2": dict(precision="O2", save=True),
    "O2_resumed": dict(precision="O2", resume=True),
    "bf16-mixed": dict(precision="bf16-mixed"),
    "32-true": dict(precision="32-true"),
    "O2_clip": dict(precision="O2", clip=True),
    "O1_clip": dict(precision="O1", clip=True),
    "O2_tp_only": dict(precision="O2", fsdp=False),
}


def main() -> int:
    if "RANK" not in os.environ:
        return launch_ranks(__file__, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    out, rank = os.environ["MPX_OUT"], int(os.environ["RANK"])
    results: dict[str, Any] = {}
    for name, case in CASES.items():
        with case_error(results.setdefault(name, {})) as record:
            record.update(fit(out=out, **case))  # type: ignore[arg-type]
        dist.barrier()
    write_rank_results(results, rank=rank)
    end_ranks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
