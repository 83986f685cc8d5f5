"""Run by tests/test_fabric_fsdp_clipping.py: clipping and overflow under FSDP through every door, two CPU processes
(gloo), one launch. Every rank writes ``$MPX_OUT/rank{r}.json``: ``{case: {...}}`` (``error`` when a case raised).

* ``clip:<strategy>:<precision>``: Fabric with ``FSDPStrategy`` (``fsdp1``, FSDP1's own ``clip_grad_norm_``) or
  ``ModelParallelStrategy`` (``fsdp2``, ``fully_shard``/``shard_model``; torch's clip over the DTensors), the plugin
  at O1 bfloat16 with a dynamic scale of 2**12 (a norm taken on scaled gradients is 4096 times too large) or
  Fabric's own ``bf16-mixed``; :data:`STEPS` steps clipped by norm, by value (``clip_val=``), then by norm again (each
  clip called twice: a second unscale would divide again); the norms and the gathered weights.
* ``ref``: the same steps unsharded in FP32 on the global batch in this process (torch's clips): the reference.
* ``o2:<strategy>``: ``FabricMixedPrecisionPlugin("O2")`` under each strategy: the refusal's message.
* ``inf:<strategy>:<precision>:<strict|lenient>``: float16, O1 with a dynamic scale, or Fabric's own ``16-mixed``
  (on CPU Fabric turns the string into ``bf16-mixed``: built here with a CPU scaler, ``ShardedGradScaler`` for
  FSDP1, ``GradScaler`` for FSDP2); rank 1 alone writes an inf into its shard at step :data:`INF_AT`; one clip by
  norm a step with ``error_if_nonfinite=True`` (``strict``, Fabric's default: the value or the error) or ``False``
  (``lenient``); the norms, the scales, the skips and the weights.
* ``trainer_value:<precision>``: the Trainer under ``ModelParallelStrategy`` (``shard_model``/``fully_shard`` in
  ``configure_model``), ``gradient_clip_algorithm="value"``: the plugin at O2 bfloat16 or Lightning's ``bf16-mixed``;
  ``ref_value``: the same steps unsharded in FP32.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.launch import case_error, end_ranks, launch_ranks, write_rank_results

STEPS = 3
INF_AT = 1
CLIP = 0.05  # below every step's norm: every clip by norm scales
CLIP_VALUE = 0.004  # below the largest gradient entries: every clip by value clips some
KINDS = ("norm", "value", "norm")
BATCH = 8  # global
SETTINGS: dict[str, Any] = {"loss_scale": "dynamic", "init_scale": 2.0**12, "growth_interval": 1000}


def build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Sequential(nn.Linear(32, 32), nn.Tanh()),
                         nn.Linear(32, 4))  # fmt: skip


def data(step: int, rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)
    if rank is None:
        return x, y
    per = BATCH // 2
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5)


def weights(model: nn.Module) -> list[float]:
    """Every parameter gathered whole, in FP64, in the unwrapped model's order."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    roots = [m for m in model.modules() if isinstance(m, FSDP1)]
    if roots:
        with FSDP1.summon_full_params(roots[0], writeback=False):
            return torch.cat([p.detach().double().flatten() for p in roots[0].parameters()]).tolist()
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return torch.cat([p.detach().double().flatten() for p in full]).tolist()


def local_shard(model: nn.Module) -> torch.Tensor:
    """This rank's own, non-empty piece of a weight gradient (FSDP1: a ``use_orig_params`` view; FSDP2: the local
    tensor of the DTensor)."""
    from lightning_mpx.engine.sharding import local_tensor

    for p in model.parameters():
        if p.grad is not None and local_tensor(p.grad).numel() > 1:
            return local_tensor(p.grad)
    raise AssertionError("no local gradient on this rank")


def fabric_for(strategy: str, precision: str, half: str = "bfloat16") -> tuple[Any, Any]:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    from lightning_mpx import FabricMixedPrecisionPlugin
    from lightning_mpx.integrations.fsdp import shard_model

    plugin = FabricMixedPrecisionPlugin(precision, half_dtype=half, **SETTINGS) if precision[0] == "O" else None
    plugins: list[Any] = [plugin] if plugin is not None else []
    kwargs: dict[str, Any] = {}
    if precision == "16-mixed" and strategy == "fsdp1":
        from lightning.fabric.plugins.precision.fsdp import FSDPPrecision
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        plugins = [FSDPPrecision("16-mixed")]  # its check refuses a scaler passed in (Lightning 2.6): set it after
        plugins[0].scaler = ShardedGradScaler(device="cpu", init_scale=2.0**12)
    elif precision == "16-mixed":
        from lightning.fabric.plugins.precision.amp import MixedPrecision

        plugins = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**12))]
    elif plugin is None:
        kwargs["precision"] = precision
    if strategy == "fsdp1":
        from tests.fabric_fsdp1_script import CPUFSDPStrategy

        chosen: Any = CPUFSDPStrategy(auto_wrap_policy={nn.Sequential})
    else:

        def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
            from torch.distributed.fsdp import fully_shard

            if plugin is not None:
                return shard_model(model, plugin, mesh=mesh["data_parallel"], blocks=[model[2]])
            fully_shard(model[2], mesh=mesh["data_parallel"])
            return fully_shard(model, mesh=mesh["data_parallel"])

        chosen = ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=chosen, plugins=plugins or None, **kwargs)
    fabric.launch()
    return fabric, plugin


def run_clip(strategy: str, precision: str, out: dict[str, Any]) -> None:
    fabric, _ = fabric_for(strategy, precision)
    model = fabric.setup_module(build())
    optimizer = fabric.setup_optimizers(sgd(model.parameters()))
    out["norms"] = []
    for step, kind in enumerate(KINDS):
        x, y = data(step, fabric.global_rank)
        fabric.backward(F.mse_loss(model(x).float(), y))
        for _ in range(2):  # twice: the plugin unscales once a step; the second clip finds nothing above the bound
            if kind == "norm":
                out["norms"].append(float(fabric.clip_gradients(model, optimizer, max_norm=CLIP)))
            else:
                fabric.clip_gradients(model, optimizer, clip_val=CLIP_VALUE)
        optimizer.step()
        optimizer.zero_grad()
    out["weights"] = weights(model)


def run_ref(out: dict[str, Any]) -> None:
    model = build()
    optimizer = sgd(model.parameters())
    out["norms"] = []
    for step, kind in enumerate(KINDS):
        x, y = data(step, None)
        F.mse_loss(model(x), y).backward()
        if kind == "norm":
            out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        else:
            torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUE)
        optimizer.step()
        optimizer.zero_grad()
    out["weights"] = weights(model)


def run_o2(strategy: str, out: dict[str, Any]) -> None:
    try:
        fabric, _ = fabric_for(strategy, "O2")
        model = fabric.setup_module(build())
        fabric.setup_optimizers(sgd(model.parameters()))
        out["refusal"] = None
    except (ValueError, TypeError, RuntimeError) as error:
        out["refusal"] = f"{type(error).__name__}: {error}"


def run_inf(strategy: str, precision: str, lenient: bool, out: dict[str, Any]) -> None:
    fabric, plugin = fabric_for(strategy, precision, "float16")
    model = fabric.setup_module(build())
    optimizer = fabric.setup_optimizers(sgd(model.parameters()))
    out.update(norms=[], scales=[], skipped=[])
    for step in range(STEPS):
        x, y = data(step, fabric.global_rank)
        fabric.backward(F.mse_loss(model(x).float(), y))
        if step == INF_AT and fabric.global_rank == 1:
            local_shard(model).view(-1)[0] = float("inf")
        try:  # one clip a step (Fabric's "16-mixed" refuses a second unscale)
            norm = fabric.clip_gradients(model, optimizer, max_norm=CLIP, error_if_nonfinite=not lenient)
            out["norms"].append(float(norm))
        except RuntimeError as error:
            out["norms"].append(f"RuntimeError: {str(error)[:60]}")
        before = weights(model)
        optimizer.step()  # "16-mixed": Fabric steps and updates its scaler
        optimizer.zero_grad()
        out["skipped"].append(weights(model) == before)
        scale = plugin.metrics()["mpx/loss_scale"] if plugin is not None else fabric._precision.scaler.get_scale()
        out["scales"].append(float(scale))
    out["weights"] = weights(model)


def run_trainer_value(precision: str, out: dict[str, Any]) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard

    from lightning_mpx import MixedPrecisionPlugin
    from lightning_mpx.integrations.fsdp import shard_model
    from tests.lightning_helpers import make_trainer

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = build()

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            if isinstance(self.trainer.precision_plugin, MixedPrecisionPlugin):
                shard_model(self.net, self.trainer.precision_plugin, mesh=mesh, blocks=[self.net[2]])
            else:
                fully_shard(self.net[2], mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = data(batch_idx, self.global_rank)
            return F.mse_loss(self.net(x).float(), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return sgd(self.parameters())

        def train_dataloader(self) -> Any:
            return [0] * STEPS

    plugins = [MixedPrecisionPlugin(precision, half_dtype="bfloat16", loss_scale=1.0)] if precision[0] == "O" else []
    extra: dict[str, Any] = {} if plugins else {"precision": precision}
    # data_parallel_size=2: the strategy's default ("auto") is tensor parallel over the devices, a data-parallel
    # mesh of one rank (no sharding, no gradient reduction)
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = make_trainer(*plugins, strategy=strategy, devices=2, max_steps=STEPS, gradient_clip_val=CLIP_VALUE,
                           gradient_clip_algorithm="value", **extra)  # fmt: skip
    lit = Lit()
    trainer.fit(lit)
    out["weights"] = weights(lit.net)


def run_ref_value(out: dict[str, Any]) -> None:
    model = build()
    optimizer = sgd(model.parameters())
    for step in range(STEPS):
        x, y = data(step, None)
        F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUE)
        optimizer.step()
        optimizer.zero_grad()
    out["weights"] = weights(model)


CASES: dict[str, Any] = {
    "ref": run_ref,
    "ref_value": run_ref_value,
    **{
        f"clip:{s}:{p}": (lambda o, s=s, p=p: run_clip(s, p, o))
        for s in ("fsdp1", "fsdp2")
        for p in ("O1", "bf16-mixed")
    },
    **{f"o2:{s}": (lambda o, s=s: run_o2(s, o)) for s in ("fsdp1", "fsdp2")},
    **{
        f"inf:{s}:{p}:{m}": (lambda o, s=s, p=p, m=m: run_inf(s, p, m == "lenient", o))
        for s in ("fsdp1", "fsdp2")
        for p in ("O1", "16-mixed")
        for m in ("strict", "lenient")
    },
    **{f"trainer_value:{p}": (lambda o, p=p: run_trainer_value(p, o)) for p in ("O2", "bf16-mixed")},
}


def main() -> None:
    if "RANK" not in os.environ:
        sys.exit(launch_ranks(__file__))
    results: dict[str, Any] = {}
    only = os.environ.get("MPX_CASES")
    for name, case in CASES.items():
        if only and name not in only.split(","):
            continue
        with case_error(results.setdefault(name, {})) as out:
            case(out)
    write_rank_results(results, rank=dist.get_rank())
    end_ranks()


if __name__ == "__main__":
    main()
