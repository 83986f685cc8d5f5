"""Run by tests/test_fabric_fsdp.py: ``FabricMixedPrecisionPlugin`` under Fabric's ``ModelParallelStrategy`` (FSDP2,
``shard_model`` in ``parallelize_fn``), two CPU processes (gloo), bfloat16 with a dynamic scale.

``$MPX_CASES`` lists the runs, comma-separated: ``plugin:<level>`` (the plugin), ``core:<level>`` (the core ``Amp``
with ``shard_model``, the same loop), ``fabric`` (Fabric's own ``"bf16-mixed"`` with ``fully_shard`` on the same
units; it skips step ``INF_AT`` by hand, where its clip would raise) and ``refused:<level>`` (the plugin's error at
the first forward). The loop: steps 0-1 plain (telemetry requested at step 1), from step 2 ``clip_gradients`` by norm,
at ``INF_AT`` an inf in rank 0's own shard of one gradient, from ``ACCUMULATE_FROM`` two micro-batches under
``no_backward_sync``. Fabric's launcher starts the second process by running this script again; later runs find
the process group running. ``hostile/<case>`` runs a case of tests/hostile_fabric_fsdp_script.py (the loop a Fabric
user writes) in the same launch. Every rank writes ``$MPX_OUT/rank<r>.json``, an entry per case (``error`` when it
raised).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard

from lightning_mpx import Amp, FabricMixedPrecisionPlugin
from lightning_mpx.engine.sharding import local_tensor
from lightning_mpx.integrations.fsdp import shard_model
from tests.launch import case_error, end_ranks, write_rank_results

BATCH = 16  # global
STEPS = 7
CLIP = 0.05  # below every step's norm: every clip scales
INF_AT = 4
ACCUMULATE_FROM = 5
#: The prefix of a case of the user's loop (``hostile/<case>``: tests/hostile_fabric_fsdp_script.py).
USER_LOOP = "hostile/"
SETTINGS: dict[str, Any] = {"half_dtype": "bfloat16", "loss_scale": "dynamic", "init_scale": 2.0**12,
                            "growth_interval": 1000, "on_floor": "continue"}  # fmt: skip


def build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )


def units(model: nn.Sequential) -> list[nn.Module]:
    return [model[0], model[3], model[5]]


def batches() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)) for _ in range(2)]
            for _ in range(STEPS)]  # fmt: skip


def full_norm(model: nn.Module, scale: float) -> float:
    """The reference: the norm of the whole gradient (every rank's shards), in FP64, unscaled."""
    full = [p.grad.full_tensor().double() for p in model.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in full]))) / scale


def train(loop: Any, model: nn.Module, inner: nn.Sequential, rank: int, out: dict[str, Any]) -> None:
    amp = loop.amp
    per = BATCH // 2
    for step, micro in enumerate(batches()):
        n = 2 if step >= ACCUMULATE_FROM else 1
        if step == 1 and amp is not None:
            loop.telemetry()
        total = 0.0
        for i in range(n):
            x, y = (t[rank * per:(rank + 1) * per] for t in micro[i])
            with loop.no_sync(i < n - 1):
                loss = F.mse_loss(loop.forward(model, x).float(), y) / n
                loop.backward(loss)
            total += float(loss.detach())
        scale = float(amp.scalers[0].scale_tensor) if amp is not None else 1.0
        if step == INF_AT:
            if amp is None:  # Fabric's own precision: its clip would raise; the step is skipped by hand
                loop.zero_grad()
                for key in ("losses", "norms", "ref_norms"):
                    out[key].append(None)
                continue
            if rank == 0:
                local_tensor(inner[3].weight.grad).view(-1)[0] = float("inf")
        out["ref_norms"].append(full_norm(model, scale) if step != INF_AT else None)
        out["norms"].append(loop.clip() if step >= 2 else None)
        out["skipped"].append(loop.step())
        loop.zero_grad()
        reduced = torch.tensor([total])
        dist.all_reduce(reduced)
        out["losses"].append(float(reduced) / 2)
        if amp is not None:
            metrics = loop.metrics()
            out["scales"].append(float(metrics["mpx/loss_scale"]))
            if step == 1:
                out["telemetry"] = {k: float(v) for k, v in metrics.items()
                                    if k.startswith(("mpx/underflow", "mpx/zeros", "mpx/headroom"))}  # fmt: skip
            if step == INF_AT:
                record = amp.last_overflow
                out["overflow_parameters"] = sorted(record.parameters) if record is not None else None
                out["overflow_ranks"] = list(record.ranks) if record is not None else None
    out["weights"] = [p.full_tensor().double().flatten().tolist() for p in model.parameters()]
    out["sharded"] = amp.sharded if amp is not None else None


class FabricLoop:
    """The loop's parts with Fabric (the plugin or Fabric's own precision)."""

    def __init__(self, fabric: Fabric, model: Any, optimizer: Any, plugin: FabricMixedPrecisionPlugin | None) -> None:
        self.fabric, self.model, self.optimizer, self.plugin = fabric, model, optimizer, plugin
        self.amp = plugin.amp if plugin is not None else None

    def forward(self, model: Any, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    def telemetry(self) -> None:
        self.plugin.request_telemetry()

    def backward(self, loss: torch.Tensor) -> None:
        self.fabric.backward(loss)

    def no_sync(self, enabled: bool) -> Any:
        return self.fabric.no_backward_sync(self.model, enabled=enabled)

    def clip(self) -> float:
        norm = self.fabric.clip_gradients(self.model, self.optimizer, max_norm=CLIP)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def step(self) -> bool | None:
        self.optimizer.step()
        return self.plugin.step_was_skipped(self.optimizer) if self.plugin is not None else None

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def metrics(self) -> dict[str, float]:
        return self.plugin.metrics()


class CoreLoop:
    """The loop's parts with the core ``Amp``."""

    def __init__(self, amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.amp, self.model, self.optimizer = amp, model, optimizer

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with self.amp.forward_context():
            return self.amp.cast_outputs(model(self.amp.cast_inputs(x)))

    def telemetry(self) -> None:
        self.amp.request_telemetry()

    def backward(self, loss: torch.Tensor) -> None:
        self.amp.backward(loss)

    def no_sync(self, enabled: bool) -> Any:
        self.model.set_requires_gradient_sync(not enabled)
        return torch.enable_grad()

    def clip(self) -> float:
        return float(self.amp.clip_grad_norm_(self.optimizer, CLIP))

    def step(self) -> bool:
        stepped = self.amp.step(self.optimizer)
        self.amp.update()
        return not stepped

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def metrics(self) -> dict[str, Any]:
        return self.amp.metrics()


def run_fabric(level: str | None, out: dict[str, Any]) -> None:
    plugin = FabricMixedPrecisionPlugin(level, **SETTINGS) if level is not None else None

    def parallelize(model: nn.Sequential, mesh: Any) -> nn.Module:
        if plugin is not None:
            return shard_model(model, plugin, mesh=mesh["data_parallel"], blocks=units(model))
        for unit in units(model):
            fully_shard(unit, mesh=mesh["data_parallel"])
        return fully_shard(model, mesh=mesh["data_parallel"])

    strategy = ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1)
    kwargs: dict[str, Any] = {"plugins": [plugin]} if plugin is not None else {"precision": "bf16-mixed"}
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, **kwargs)
    fabric.launch()  # the first run starts the second process; later ones find the process group running
    inner = build()
    model = fabric.setup_module(inner)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    train(FabricLoop(fabric, model, optimizer, plugin), model, inner, fabric.global_rank, out)


def run_core(level: str, out: dict[str, Any]) -> None:
    amp = Amp(level, **SETTINGS)
    model = build()
    shard_model(model, amp, blocks=units(model))
    amp.prepare_model(model)
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    train(CoreLoop(amp, model, optimizer), model, model, dist.get_rank(), out)


def run_refused(level: str, out: dict[str, Any]) -> None:
    """The plugin at a level it refuses under the strategy: what it says, and at which call (``refused_at``)."""
    plugin = FabricMixedPrecisionPlugin(level, **SETTINGS)

    def parallelize(model: nn.Sequential, mesh: Any) -> nn.Module:
        return shard_model(model, plugin, mesh=mesh["data_parallel"], blocks=units(model))

    strategy = ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin])
    fabric.launch()
    out["refused_at"] = "fabric.setup_module"
    try:
        model = fabric.setup_module(build())
        out["refused_at"] = "the first call after fabric.setup"
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05))
        fabric.backward(model(torch.randn(4, 16)).float().sum())
        optimizer.step()
        out["refused_at"] = None
    except Exception as error:  # noqa: BLE001 - the message is the result
        out["refusal"] = f"{type(error).__name__}: {error}"


def main() -> None:
    results: dict[str, Any] = {}
    for case in os.environ["MPX_CASES"].split(","):
        if case.startswith(USER_LOOP):
            # The user's loop (tests/hostile_fabric_fsdp_script.py), in this launch rather than one of its own.
            from tests.hostile_fabric_fsdp_script import run_case

            results[case] = run_case(case[len(USER_LOOP):])
            continue
        kind, _, level = case.partition(":")
        with case_error({"losses": [], "norms": [], "ref_norms": [], "skipped": [], "scales": []}) as out:
            if kind == "plugin":
                run_fabric(level, out)
            elif kind == "fabric":
                run_fabric(None, out)
            elif kind == "core":
                run_core(level, out)
            else:
                run_refused(level, out)
        results[case] = out
    # Fabric's launch in the first case started the process group, and no case ends it.
    write_rank_results(results)
    end_ranks()


if __name__ == "__main__":
    main()
