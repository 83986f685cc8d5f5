"""Run by tests/test_fabric_fsdp1.py: ``FabricMixedPrecisionPlugin`` under Fabric's ``FSDPStrategy`` (FSDP1, Fabric
wraps the model with the plugin's ``mixed_precision_config`` and ``auto_wrap_policy={Block}``, as litgpt does), two CPU
processes (gloo), bfloat16 with a dynamic scale.

``$MPX_CASES`` lists the runs, comma-separated: ``plugin:<level>`` (the plugin; ``plugin:<level>:root_only`` without
``auto_wrap_policy``: the root is the only FSDP unit; ``plugin:<level>:empty_init``: built in
``fabric.init_module(empty_init=True)``, as litgpt does), ``core:<level>`` (the core ``Amp`` on the same FSDP1-wrapped
model, the same loop), ``fabric:<precision>`` (Fabric's own ``"bf16-mixed"`` or ``"32-true"`` under the same strategy;
it skips step ``INF_AT`` by hand, where its clip's norm is not finite), ``refused:<level>`` (the plugin's error at the
first call after ``fabric.setup``) and ``resume:<full|sharded>`` (the plugin's O1 loop with ``fabric.save`` after
``RESUME_AT`` steps in that ``state_dict_type``, then a fresh Fabric, plugin, model and optimizer that ``fabric.load``
it and run the remaining steps). The loop: steps 0-1 plain (telemetry requested at step 1), from step 2
``clip_gradients`` by norm, at ``INF_AT`` an inf in rank 0's own shard of one gradient, from ``ACCUMULATE_FROM`` two
micro-batches under ``no_backward_sync``. Fabric's launcher starts the second process by running this script again;
later runs find the process group running. Every rank writes ``$MPX_OUT/rank<r>.json``, an entry per case (``error``
when it raised).
"""

from __future__ import annotations

import os
from typing import Any
from unittest import mock

import lightning.fabric.strategies.fsdp as fabric_fsdp
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.strategies import FSDPStrategy
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from lightning_mpx import Amp, FabricMixedPrecisionPlugin
from lightning_mpx.integrations.fsdp import fsdp1_mixed_precision
from lightning_mpx.masters.weights import convert_module
from tests.launch import case_error, end_ranks, write_rank_results

#: The prefix of a case of the user's set-ups (``hostile/<kind>:<precision>``: tests/hostile_fabric_fsdp1_script.py).
USER_SETUPS = "hostile/"
BATCH = 16  # global
STEPS = 7
CLIP = 0.05  # below every step's norm: every clip scales
INF_AT = 4
ACCUMULATE_FROM = 5
RESUME_AT = 5  # past the overflow: a backed-off scale, a skip
SETTINGS: dict[str, Any] = {"half_dtype": "bfloat16", "loss_scale": "dynamic", "init_scale": 2.0**12,
                            "growth_interval": 1000, "on_floor": "continue"}  # fmt: skip


class Block(nn.Module):
    """An FSDP1 unit of its own (``auto_wrap_policy={Block}``, as litgpt wraps its transformer blocks)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def build() -> nn.Sequential:
    torch.manual_seed(0)
    # The root unit holds the first and last layers and the norm; each block is a unit.
    return nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), Block(64), Block(64), nn.Linear(64, 4))


class CPUFSDPStrategy(FSDPStrategy):
    """Fabric's ``FSDPStrategy`` on CPU (Fabric refuses the class itself there, and passes ``device_id=None``, where
    FSDP1 looks for a GPU): the model wrapped here with Fabric's own arguments (the plugin's ``mixed_precision_config``
    among them) and ``device_id=cpu``; Fabric then finds it wrapped.

    ``state_dict_type="full"``: Fabric gathers with ``offload_to_cpu=True``, whose clone segfaults on a CPU-only
    process in torch 2.13 (with Fabric's own ``"32-true"`` too); offloading means nothing there, so this strategy's
    save and load gather with it off (Fabric's own code otherwise)."""

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        with mock.patch.object(fabric_fsdp, "_get_full_state_dict_context", _full_state_dict_context_on_cpu):
            super().save_checkpoint(*args, **kwargs)

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        with mock.patch.object(fabric_fsdp, "_get_full_state_dict_context", _full_state_dict_context_on_cpu):
            return super().load_checkpoint(*args, **kwargs)

    def setup_module(self, module: nn.Module) -> nn.Module:
        if not any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
            kwargs = dict(self._fsdp_kwargs)
            module = FullyShardedDataParallel(
                module, cpu_offload=self.cpu_offload, mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"), **kwargs,
            )  # fmt: skip
        kwargs, self._fsdp_kwargs = self._fsdp_kwargs, {k: v for k, v in self._fsdp_kwargs.items()
                                                        if k != "auto_wrap_policy"}  # fmt: skip
        try:
            return super().setup_module(module)
        finally:
            self._fsdp_kwargs = kwargs


def _full_state_dict_context_on_cpu(module: nn.Module, world_size: int, rank0_only: bool = True) -> Any:
    """Fabric's full state-dict context without ``offload_to_cpu`` (see :class:`CPUFSDPStrategy`)."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp.api import FullOptimStateDictConfig

    return FullyShardedDataParallel.state_dict_type(
        module, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
        FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
    )


def batches() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)) for _ in range(2)]
            for _ in range(STEPS)]  # fmt: skip


def gathered(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Every rank's local pieces (FSDP1's ``use_orig_params`` views: each rank's own part), gathered in FP64."""
    mine = torch.cat([t.detach().double().flatten() for t in tensors] or [torch.zeros(0, dtype=torch.float64)])
    pieces: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, mine)
    return torch.cat(pieces)


def full_norm(model: nn.Module, scale: float) -> float:
    """The reference: the norm of the whole gradient (every rank's shards), in FP64, unscaled."""
    return float(gathered([p.grad for p in model.parameters() if p.grad is not None]).norm()) / scale


def full_weights(model: nn.Module) -> list[float]:
    """Every parameter, gathered whole in the model's order (whatever the units), in FP64."""
    root = next(m for m in model.modules() if isinstance(m, FullyShardedDataParallel))
    with FullyShardedDataParallel.summon_full_params(root, writeback=False):
        return torch.cat([p.detach().double().flatten() for p in root.parameters()]).tolist()


def inf_grad(model: nn.Module) -> torch.Tensor:
    """Rank 0's own shard of the first layer's weight gradient (a parameter of the root unit)."""
    return next(p.grad for n, p in model.named_parameters()
                if n.replace("_fsdp_wrapped_module.", "").endswith("0.weight") and p.grad.numel())


def train(loop: Any, model: nn.Module, rank: int, out: dict[str, Any], steps: range = range(STEPS)) -> None:
    amp = loop.amp
    per = BATCH // 2
    data = batches()
    for step in steps:
        micro = data[step]
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
            if amp is None:  # Fabric's own precision: the step is skipped by hand
                loop.zero_grad()
                for key in ("losses", "norms", "ref_norms"):
                    out[key].append(None)
                continue
            if rank == 0:
                inf_grad(model).view(-1)[0] = float("inf")
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
                                    if k.startswith(("mpx/underflow", "mpx/headroom"))}  # fmt: skip
            if step == INF_AT:
                record = amp.last_overflow
                out["overflow_parameters"] = sorted(record.parameters) if record is not None else None
                out["overflow_ranks"] = list(record.ranks) if record is not None else None
        loop.after_step(step)
    if amp is not None:
        out["skipped_steps"] = float(loop.metrics()["mpx/skipped_steps"])
    out["weights"] = full_weights(model)
    out["sharded"] = amp.sharded if amp is not None else None


class FabricLoop:
    """The loop's parts with Fabric (the plugin or Fabric's own precision)."""

    def __init__(self, fabric: Fabric, model: Any, optimizer: Any, plugin: FabricMixedPrecisionPlugin | None) -> None:
        self.fabric, self.model, self.optimizer, self.plugin = fabric, model, optimizer, plugin
        self.amp = plugin.amp if plugin is not None else None
        self.save_at: int | None = None
        self.path = ""

    def forward(self, model: Any, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    def telemetry(self) -> None:
        self.plugin.request_telemetry()

    def backward(self, loss: torch.Tensor) -> None:
        self.fabric.backward(loss)

    def no_sync(self, enabled: bool) -> Any:
        return self.fabric.no_backward_sync(self.model, enabled=enabled)

    def clip(self) -> float:
        return float(self.fabric.clip_gradients(self.model, self.optimizer, max_norm=CLIP))

    def step(self) -> bool | None:
        self.optimizer.step()
        return self.plugin.step_was_skipped(self.optimizer) if self.plugin is not None else None

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def metrics(self) -> dict[str, float]:
        return self.plugin.metrics()

    def after_step(self, step: int) -> None:
        if self.save_at is not None and step + 1 == self.save_at:
            self.fabric.save(self.path, {"model": self.model, "optimizer": self.optimizer, "mpx": self.plugin})


class CoreLoop:
    """The loop's parts with the core ``Amp``."""

    def __init__(self, amp: Amp, model: FullyShardedDataParallel, optimizer: torch.optim.Optimizer) -> None:
        self.amp, self.model, self.optimizer = amp, model, optimizer

    def forward(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with self.amp.forward_context():
            return self.amp.cast_outputs(model(self.amp.cast_inputs(x)))

    def telemetry(self) -> None:
        self.amp.request_telemetry()

    def backward(self, loss: torch.Tensor) -> None:
        self.amp.backward(loss)

    def no_sync(self, enabled: bool) -> Any:
        return self.model.no_sync() if enabled else torch.enable_grad()

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

    def after_step(self, step: int) -> None:
        pass


def make_fabric(plugin: FabricMixedPrecisionPlugin | None, precision: str = "bf16-mixed",
                state_dict_type: str = "sharded", wrap: bool = True) -> Fabric:  # fmt: skip
    policy = {"auto_wrap_policy": {Block}} if wrap else {}  # without: one unit, the root, holds every parameter
    strategy = CPUFSDPStrategy(state_dict_type=state_dict_type, **policy)
    kwargs: dict[str, Any] = {"plugins": [plugin]} if plugin is not None else {"precision": precision}
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, **kwargs)
    fabric.launch()  # the first run starts the second process; later ones find the process group running
    return fabric


def run_fabric(level: str, precision: str, out: dict[str, Any]) -> None:
    level, _, variant = (level or "").partition(":")
    plugin = FabricMixedPrecisionPlugin(level, **SETTINGS) if level else None
    fabric = make_fabric(plugin, precision, wrap=variant != "root_only")
    if variant == "empty_init":  # litgpt's way: built on the meta device, FSDP1 materializes it when it wraps
        with fabric.init_module(empty_init=True):
            inner = build()
        out["built_on"] = str(next(inner.parameters()).device)
    else:
        inner = build()
    model = fabric.setup_module(inner)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    out["wrapped"] = type(model._forward_module).__name__
    train(FabricLoop(fabric, model, optimizer, plugin), model, fabric.global_rank, out)
    if plugin is not None:
        out["mixed_precision"] = str(model._forward_module.mixed_precision)


def run_core(level: str, out: dict[str, Any]) -> None:
    amp = Amp(level, **SETTINGS)
    model = build()
    if amp.properties.casts_model:  # O3: FSDP shards the half model (as the plugin's convert_module leaves it)
        convert_module(model, amp.half_dtype, keep_batchnorm_fp32=True)
    wrapped = FullyShardedDataParallel(model, mixed_precision=fsdp1_mixed_precision(amp),
                                       auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                                       use_orig_params=True)  # fmt: skip
    amp.prepare_model(wrapped)
    optimizer = amp.prepare_optimizer(torch.optim.SGD(wrapped.parameters(), lr=0.05, momentum=0.9))
    train(CoreLoop(amp, wrapped, optimizer), wrapped, dist.get_rank(), out)


def run_refused(level: str, out: dict[str, Any]) -> None:
    """The plugin at a level it refuses under the strategy: what it says, and at which call (``refused_at``)."""
    plugin = FabricMixedPrecisionPlugin(level, **SETTINGS)
    fabric = make_fabric(plugin)
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


def run_resume(state_dict_type: str, out: dict[str, Any]) -> None:
    """The O1 loop saved after ``RESUME_AT`` steps, and a fresh run loaded from it for the remaining steps."""
    path = os.environ["MPX_OUT"] + f"/ckpt_{state_dict_type}"
    results = {}
    for phase in ("straight", "resumed"):
        part: dict[str, Any] = {"losses": [], "norms": [], "ref_norms": [], "skipped": [], "scales": []}
        plugin = FabricMixedPrecisionPlugin("O1", **SETTINGS)
        fabric = make_fabric(plugin, state_dict_type=state_dict_type)
        model = fabric.setup_module(build())
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        loop = FabricLoop(fabric, model, optimizer, plugin)
        steps = range(STEPS)
        if phase == "straight":
            loop.save_at, loop.path = RESUME_AT, path
        else:
            state = {"model": model, "optimizer": optimizer, "mpx": plugin}
            fabric.load(path, state)
            # A sharded checkpoint puts the plugin's saved state dict in its place (Fabric's FSDPStrategy does not call
            # load_state_dict on it, as for ModelParallelStrategy): docs/fabric.md's lines restore it.
            part["fabric_restored_the_plugin"] = state["mpx"] is plugin
            if state["mpx"] is not plugin:
                plugin.load_state_dict(state["mpx"])
            part["scale_at_load"] = float(plugin.metrics()["mpx/loss_scale"])
            steps = range(RESUME_AT, STEPS)
        train(loop, model, fabric.global_rank, part, steps)
        results[phase] = part
    out.update(results)


def main() -> None:
    results: dict[str, Any] = {}
    for case in os.environ["MPX_CASES"].split(","):
        if case.startswith(USER_SETUPS):
            # The user's set-ups (tests/hostile_fabric_fsdp1_script.py), in this launch rather than one of their own.
            from tests.hostile_fabric_fsdp1_script import RUNS

            kind, _, precision = case[len(USER_SETUPS):].partition(":")
            with case_error({"losses": [], "norms": []}) as out:
                RUNS[kind](precision, out)
            results[case] = out
            continue
        kind, _, level = case.partition(":")
        with case_error({"losses": [], "norms": [], "ref_norms": [], "skipped": [], "scales": []}) as out:
            if kind == "plugin":
                run_fabric(level, "", out)
            elif kind == "fabric":
                run_fabric("", level, out)
            elif kind == "core":
                run_core(level, out)
            elif kind == "resume":
                run_resume(level, out)
            else:
                run_refused(level, out)
        results[case] = out
    # Fabric's launch in the first case started the process group, and no case ends it.
    write_rank_results(results)
    end_ranks()


if __name__ == "__main__":
    main()
