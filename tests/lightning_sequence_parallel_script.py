"""Run by tests/test_lightning_sequence_parallel.py: sequence parallelism and loss parallelism under the Trainer, two
CPU processes (gloo), one launch.

``ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)``; ``configure_model`` applies a
torchtitan-style plan: a rowwise embedding with sequence-sharded output, ``SequenceParallel()`` LayerNorm and RMSNorm
(their weights ``Replicate()`` DTensors on the TP mesh, gradients ``Partial`` until reduced), ``PrepareModuleInput``
before a colwise/rowwise MLP whose rowwise output is sequence-sharded again, and a vocab-parallel head
(``ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)``) whose cross-entropy
runs on the sharded logits inside ``loss_parallel()`` (backward too, in ``LightningModule.backward``). For the plugin
``shard_model`` over the one-rank ``device_mesh["data_parallel"]`` follows. Cases: O2 (bfloat16, the loss in the
model's own forward: O2's loss region, whose policy casts the bfloat16 DTensor logits), Lightning's ``"bf16-mixed"``
and ``"32-true"``, O2 and O1 (bfloat16) with ``gradient_clip_val``, and O2 in float16 with an ``inf`` in one rank's
gradient shard, and O2 in manual optimization (``loss_parallel()`` around ``manual_backward``, then
``clip_gradients``); these compute the loss in ``training_step``. Every rank
writes ``$MPX_OUT/rank{r}.json``."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.launch import case_error, end_ranks, launch_ranks, write_rank_results

# tp59's SGD that records the gathered gradient norm, its LR and momentum (test_lightning_sequence_parallel reads them),
# gathered weights
from tests.lightning_tensor_parallel_script import LR, MOMENTUM, Recording, full  # noqa: F401

STEPS = 4
CLIP = 0.05  # below every step's gradient norm: each step is clipped
VOCAB, DIM, BATCH, SEQ = 16, 8, 4, 8


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, 4 * DIM)
        self.w2 = nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.tanh(self.w1(x)))


class Block(nn.Module):
    """An embedding, a LayerNorm, a residual MLP, an RMSNorm and a head over the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.mlp = MLP()
        self.norm2 = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        with torch.no_grad():  # norms away from their initial values: a wrong gradient shows
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)
            self.norm2.weight.uniform_(0.5, 1.5)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok(idx)
        h = h + self.mlp(self.norm(h))
        logits = self.head(self.norm2(h))
        if targets is None:
            return logits
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():  # the loss on the vocab-sharded logits, in the model's own code (O2's loss region)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
        self.seen = f"{type(logits).__name__}:{logits.dtype}->{type(loss).__name__}:{loss.dtype}"
        return loss


def plan() -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    return {
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.w1": ColwiseParallel(),
        "mlp.w2": RowwiseParallel(output_layouts=Shard(1)),
        "norm2": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s tokens and targets, the same on both ranks (one data-parallel replica)."""
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return idx, (idx * 3 + 1) % VOCAB


def local_norms(module: nn.Module) -> dict[str, list[float]]:
    """The norms' weights as this rank holds them (its local shard: the whole weight, replicated)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().double().flatten().tolist()
            for n, p in module.named_parameters() if n.startswith("norm")}  # fmt: skip


def fit(
    precision: str, *, clip: bool = False, inner: bool = False, inf_at: int | None = None, manual: bool = False
) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

    from lightning_mpx import MixedPrecisionPlugin
    from lightning_mpx.integrations.fsdp import shard_model
    from tests.lightning_helpers import make_trainer

    half = torch.float16 if inf_at is not None else torch.bfloat16
    plugin = MixedPrecisionPlugin(precision, half_dtype=half) if precision.startswith("O") else None
    rank = int(os.environ["RANK"])

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Block()
            self.losses: list[float] = []
            self.norms: list[float] = []
            self.loss_types: list[str] = []
            self.scales: list[float] = []

        def on_fit_start(self) -> None:
            self.automatic_optimization = not manual

        def configure_model(self) -> None:
            parallelize_module(self.model, self.device_mesh["tensor_parallel"], plan())
            if plugin is not None:
                shard_model(self.model, self.trainer.precision_plugin, mesh=self.device_mesh["data_parallel"])

        def training_step(self, _: Any, __: int) -> Any:
            idx, y = batch(self.global_step)
            if inner:
                loss = self.model(idx, y)
                self.loss_types.append(f"{self.model.seen}, returned {type(loss).__name__}:{loss.dtype}")
            else:
                logits = self.model(idx)
                with loss_parallel():
                    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(0, 1))
                self.loss_types.append(f"{type(logits).__name__}:{logits.dtype}->{type(loss).__name__}:{loss.dtype}")
            self.losses.append(loss.item())
            if manual:  # loss_parallel() around manual_backward, the backward hook not used
                opt = self.optimizers()
                opt.zero_grad()
                with loss_parallel():
                    self.manual_backward(loss)
                self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
                opt.step()
                return None
            return loss

        def on_after_backward(self) -> None:
            # An overflow in rank 1's shard of the head's gradient alone: both ranks must skip the step.
            if self.global_step == inf_at and rank == 1:
                with torch.no_grad():
                    self.model.head.weight.grad.to_local().view(-1)[0] = float("inf")

        def on_train_batch_end(self, *_: Any) -> None:
            if plugin is not None:
                self.scales.append(plugin.amp.scalers[0].get_scale())

        if not manual:  # manual optimization runs loss_parallel() around manual_backward itself, with no hook

            def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
                with loss_parallel():
                    loss.backward(*args, **kwargs)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return Recording(self.parameters(), self.norms)

    extra: dict[str, Any] = {} if plugin else {"precision": precision}
    if clip and not manual:
        extra["gradient_clip_val"] = CLIP
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
    trainer = make_trainer(plugin, strategy=strategy, devices=2, max_steps=STEPS, use_distributed_sampler=False,
                           **extra)  # fmt: skip
    model = Lit()
    data = torch.utils.data.DataLoader(range(STEPS), batch_size=None)
    trainer.fit(model, data)
    norm_w = model.model.norm.weight
    return {"losses": model.losses, "norms": model.norms, "params": full(model.model),
            "local_norms": local_norms(model.model), "loss_types": model.loss_types, "scales": model.scales,
            "norm_placements": str(norm_w.placements) if isinstance(norm_w, DTensor) else "",
            "global_step": trainer.global_step, "sharded": bool(plugin and plugin.amp.sharded)}  # fmt: skip


CASES = {
    "O2": dict(precision="O2", inner=True),
    "bf16-mixed": dict(precision="bf16-mixed"),
    "32-true": dict(precision="32-true"),
    "O2_clip": dict(precision="O2", clip=True),
    "O1_clip": dict(precision="O1", clip=True),
    "O2_fp16_inf": dict(precision="O2", inf_at=1),
    "O2_manual_clip": dict(precision="O2", manual=True),
}


def main() -> int:
    if "RANK" not in os.environ:
        return launch_ranks(__file__, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    rank = int(os.environ["RANK"])
    results: dict[str, Any] = {}
    for name, case in CASES.items():
        with case_error(results.setdefault(name, {})) as record:
            record.update(fit(**case))  # type: ignore[arg-type]
        dist.barrier()
    write_rank_results(results, rank=rank)
    end_ranks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
