"""Run by tests/test_lightning_fsdp.py: ``MixedPrecisionPlugin`` under Lightning's FSDP strategies, two CPU processes
(gloo): ``ModelParallelStrategy`` (FSDP2, sharded in ``configure_model`` with
``lightning_mpx.integrations.fsdp.shard_model``) and ``FSDPStrategy`` (FSDP1, wrapped by Lightning with the plugin's
``mixed_precision_config``; on CPU through a subclass that passes ``device_id=cpu``).

``$MPX_CASES`` lists the fits, comma-separated, each ``<strategy>:<level>:<dtype>:<kind>`` with strategy ``fsdp2`` or
``fsdp1`` and kind ``train`` (``STEPS`` steps, ``gradient_clip_val``, an inf on rank 0 only at step ``INF_AT``),
``accum`` (the same with ``accumulate_grad_batches=2`` over twice the batches) or ``resume`` (2 epochs with a
checkpoint after the first, then a second run resumed from it with ``ckpt_path=``). Lightning's launcher starts the
second process by running this script again; later fits find the process group running. Every rank writes
``$MPX_OUT/<case>_rank<r>.json``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_mpx import MixedPrecisionPlugin
from lightning_mpx.integrations.fsdp import shard_model
from tests.launch import end_ranks
from tests.lightning_helpers import classification_data, loader, make_trainer

BATCH = 8  # per rank: the global batch is 16
STEPS = 10  # 20 until stop 64: the same checks, half the steps (the 13 fits were most of the launch)
INF_AT = 3  # the global step whose gradient gets an inf, on rank 0 only
CLIP = 0.5


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy`` on CPU. It passes ``device_id=root_device.index`` to FSDP, ``None`` on CPU, where
    FSDP1 then looks for a GPU; FSDP1 runs on CPU with ``device_id=torch.device("cpu")``. Wrapping the model here
    with Lightning's own arguments (the plugin's ``mixed_precision_config`` among them) leaves the rest to Lightning,
    which finds the model wrapped."""

    def _setup_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            kwargs = dict(self.kwargs)
            model = FullyShardedDataParallel(
                model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=torch.device("cpu"),
                **kwargs,
            )
            self.kwargs.pop("auto_wrap_policy", None)  # applied above
        return super()._setup_model(model)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A rank's own part of a parameter or gradient: a DTensor's local shard (FSDP2); FSDP1's ``use_orig_params``
    views are local already."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def gathered_norm(tensors: list[torch.Tensor]) -> float:
    """The 2-norm of every rank's local pieces, all-gathered and computed in FP64 (the reference for the clip)."""
    mine = torch.cat([local(t).detach().double().flatten() for t in tensors] or [torch.zeros(0, dtype=torch.float64)])
    if not dist.is_initialized():  # the single-process reference run
        return float(mine.norm())
    pieces: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, mine)
    return float(torch.cat(pieces).norm())


class Net(pl.LightningModule):
    """An MLP classifier (no batch norm: its statistics are per rank) that records what the test compares.

    ``inf_at``: the global steps whose gradient gets an inf on rank 0 only (after FSDP's reduce-scatter), so the
    ranks skip together only if the engine agrees across them."""

    def __init__(self, inf_at: tuple[int, ...] = (), lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        self.inf_at, self.lr = set(inf_at), lr
        self.fused = False  # AdamW(fused=True) instead of SGD (the "fused" kinds)
        self.losses: list[float] = []
        self.grad_norms: list[float] = []  # the gathered FP64 norm of the unscaled gradients, before the clip
        self.stepped_norms: list[float] = []  # the same, of the gradients the optimizer steps with
        self.engine_norms: list[float] = []  # mpx/grad_norm: the norm the engine clipped by
        self.logits_dtypes: set[str] = set()

    def configure_model(self) -> None:
        if isinstance(self.trainer.strategy, ModelParallelStrategy):
            shard_model(self, self.trainer.precision_plugin, mesh=self.device_mesh["data_parallel"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        self.logits_dtypes.add(str(logits.dtype))
        loss = F.cross_entropy(logits, y)
        self.losses.append(loss.item())
        return loss

    def on_after_backward(self) -> None:
        if self.trainer.global_step in self.inf_at and self.global_rank == 0:
            with torch.no_grad():
                grad = next(local(p.grad) for p in self.parameters() if p.grad is not None and local(p.grad).numel())
                grad.view(-1)[0] = float("inf")

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # The plugin unscales before this hook: the true gradients (the inf's step gives inf).
        self.grad_norms.append(gathered_norm([p.grad for p in self.parameters() if p.grad is not None]))

    def on_fit_start(self) -> None:
        def record(optimizer: torch.optim.Optimizer, *args: Any) -> None:
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            self.stepped_norms.append(gathered_norm(grads))

        self._hook = self.trainer.optimizers[0].register_step_pre_hook(record)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.trainer.gradient_clip_val and (batch_idx + 1) % self.trainer.accumulate_grad_batches == 0:
            self.engine_norms.append(self.trainer.precision_plugin.metrics().get("mpx/grad_norm", float("nan")))

    def on_fit_end(self) -> None:
        self._hook.remove()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.fused:
            return torch.optim.AdamW(self.parameters(), lr=0.01, fused=True)
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def full_params(trainer: pl.Trainer, model: Net) -> list[list[float]]:
    """The whole FP32 parameters (gathered from the shards), in the module's order."""
    if isinstance(trainer.strategy, ModelParallelStrategy):
        return [p.full_tensor().float().flatten().tolist() for p in model.parameters()]
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(trainer.strategy.model, writeback=False):
        return [p.detach().float().flatten().tolist() for p in model.parameters()]


def make_plugin(level: str, dtype: str, skip_on_device: bool | None = None) -> MixedPrecisionPlugin:
    # bfloat16's scale is static (1): its floor, where an overflow raises by default; "continue" skips the step.
    return MixedPrecisionPlugin(level, half_dtype=dtype, init_scale=1024.0, growth_interval=4, on_floor="continue",
                                skip_on_device=skip_on_device)


def make_strategy(name: str) -> pl.strategies.Strategy:
    if name == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    # The distributed checkpoint (each rank saves its shards). FSDP1's "full" state dict, gathered on rank 0,
    # crashes on CPU (a segmentation fault cloning the gathered parameters, torch 2.13).
    return CPUFSDPStrategy(auto_wrap_policy={nn.Linear}, state_dict_type="sharded")


def data(kind: str) -> torch.utils.data.Dataset:
    return classification_data(n=BATCH * 2 * batches(kind), seed=1)


def batches(kind: str) -> int:
    """Batches per rank in a fit of ``kind`` (its first epoch for ``resume``)."""
    return {"resume": 5, "accum": 2 * STEPS}.get(kind, STEPS)


def global_batches(dataset: torch.utils.data.Dataset) -> torch.utils.data.Dataset:
    """The samples in the order that makes batch k of ``2 * BATCH`` hold what the two ranks' batch k hold together.

    Lightning gives each rank of a training run a shuffling ``DistributedSampler`` (seed ``PL_GLOBAL_SEED``, else
    0): the same sampler, asked for each rank's order, gives them."""
    seed = int(os.getenv("PL_GLOBAL_SEED", 0))
    ranks = [
        list(torch.utils.data.DistributedSampler(dataset, num_replicas=2, rank=r, shuffle=True, seed=seed))
        for r in (0, 1)
    ]
    steps = len(ranks[0]) // BATCH
    order = [i for k in range(steps) for r in (0, 1) for i in ranks[r][k * BATCH : (k + 1) * BATCH]]
    return torch.utils.data.Subset(dataset, order)


def reference(level: str, dtype: str, kind: str) -> dict[str, Any]:
    """The same training in one process on one device, each batch the two ranks' batches together."""
    plugin = make_plugin(level, dtype)
    model = Net(inf_at=(INF_AT,))
    settings: dict[str, Any] = dict(max_epochs=1, gradient_clip_val=CLIP)
    if kind == "accum":
        settings["accumulate_grad_batches"] = 2
    trainer = make_trainer(plugin, **settings)
    trainer.fit(model, loader(global_batches(data(kind)), 2 * BATCH))
    return dict(
        losses=model.losses,
        grad_norms=model.grad_norms,
        skipped=plugin.amp.skipped_steps,
        scale=plugin.amp.scalers[0].get_scale(),
        params=[p.detach().float().flatten().tolist() for p in model.parameters()],
    )


def fit(case: str, out: str) -> dict[str, Any]:
    strategy, level, dtype, kind = case.split(":")
    # "fused": AdamW(fused=True), which skips on the device by default; "fusedhost": the same, read on the host.
    plugin = make_plugin(level, dtype, skip_on_device=False if kind == "fusedhost" else None)
    settings: dict[str, Any] = dict(strategy=make_strategy(strategy), devices=2, max_epochs=1, gradient_clip_val=CLIP)
    if kind == "accum":
        settings["accumulate_grad_batches"] = 2
    record: dict[str, Any] = {}
    if kind == "resume":
        ckpt_dir = os.path.join(out, case.replace(":", "_"))
        model = Net(inf_at=(2,))
        settings["max_epochs"] = 2  # the checkpoint after the first epoch; resumed, the second epoch again
        checkpoint = ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, filename="{epoch}")
        trainer = make_trainer(plugin, **settings, callbacks=[checkpoint], enable_checkpointing=True)
        trainer.fit(model, loader(data(kind), BATCH))
        record["straight"] = full_params(trainer, model)
        record["straight_state"] = plugin.amp.state_dict()["scalers"]
        record["straight_skipped"] = plugin.amp.skipped_steps
        plugin = make_plugin(level, dtype)
        model = Net(inf_at=(2,))
        trainer = make_trainer(plugin, **dict(settings, strategy=make_strategy(strategy)))
        trainer.fit(model, loader(data(kind), BATCH), ckpt_path=os.path.join(ckpt_dir, "epoch=0.ckpt"))
        record["checkpoint"] = os.path.join(ckpt_dir, "epoch=0.ckpt")
    else:
        model = Net(inf_at=(INF_AT,))
        model.fused = kind.startswith("fused")
        trainer = make_trainer(plugin, **settings)
        trainer.fit(model, loader(data(kind), BATCH))
        record["on_device"] = sorted(bool(s.on_device) for s in plugin.amp._machine.optimizers.values())
    scalers = plugin.amp.state_dict()["scalers"]
    record.update(
        world_size=trainer.world_size,
        global_step=trainer.global_step,
        losses=model.losses,
        grad_norms=model.grad_norms,
        stepped_norms=model.stepped_norms,
        engine_norms=model.engine_norms,
        skipped=plugin.amp.skipped_steps,
        scale=plugin.amp.scalers[0].get_scale(),
        scalers=scalers,
        logits_dtypes=sorted(model.logits_dtypes),
        params=full_params(trainer, model),
        local_param_bytes=sum(local(p).numel() * local(p).element_size() for p in model.parameters()),
        full_param_bytes=sum(p.numel() * 4 for p in Net().parameters()),
        local_param_dtypes=sorted({str(local(p).dtype) for p in model.parameters()}),
        masters=len(plugin.amp.master_weights),
        state_keys=sorted(plugin.amp.state_dict()),
    )
    if kind == "resume":
        record["resumed_state"] = scalers
    return record


def main() -> None:
    out = os.environ["MPX_OUT"]
    for case in os.environ["MPX_CASES"].split(","):
        record = fit(case, out)
        with open(os.path.join(out, f"{case.replace(':', '_')}_rank{dist.get_rank()}.json"), "w") as f:
            json.dump(record, f, default=str)
    end_ranks()


if __name__ == "__main__":
    main()
