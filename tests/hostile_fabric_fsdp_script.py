"""Cases of tests/test_fabric_fsdp.py, run by ``tests/fabric_fsdp_script.py`` in its launch (``hostile/<case>`` in
its ``$MPX_CASES``; :func:`run_case`): ``FabricMixedPrecisionPlugin`` under Fabric's ``ModelParallelStrategy`` (FSDP2),
used as a Fabric user would, two CPU processes (gloo), bfloat16 with a dynamic scale. The cases:

* ``plugin:<level>``: the user's loop (below) with the plugin; ``core:<level>``: the same loop with the core ``Amp``
  and ``shard_model``; ``fabric:<precision>``: Fabric's own precision (``bf16-mixed``, ``32-true``) with
  ``fully_shard`` on the same units, the overflowing optimizer's step left out by hand (its clip would raise).
* ``resume``: the plugin's O1 loop with ``fabric.save`` (a distributed checkpoint) before the first step and after
  ``RESUME_AT`` steps, then for each checkpoint a fresh Fabric, plugin, model and optimizers that ``fabric.load`` it
  and run the remaining steps.
* ``refused:O2``: what the first call after ``fabric.setup`` says at O2.
* ``mix:<order>``: a model ``parallelize_fn`` shards and one it leaves whole, set up ``together``, the whole one
  ``whole_first`` (and used) or the sharded one first (``sharded_first``); ``late:sharded``: a second sharded model
  set up after the first one trained (a GAN set up model by model).

The loop: a body (``SGD`` with momentum) and a head (``AdamW``) optimizer, built by ``fabric.setup_optimizers``
after ``fabric.setup_module``; clipping by norm and by value (``fabric.clip_gradients``); an inf in rank 1's shard
only (the head's at ``HEAD_INF``, the body's at ``BODY_INF``); two micro-batches under ``no_backward_sync`` from
``ACCUMULATE_FROM``; an evaluation forward (``model.eval()``, ``no_grad``) before ``EVAL_AT`` steps; the plugin's
reads (``step_was_skipped``, ``metrics``, ``fabric.log_dict``) on rank 0 only.
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard

from lightning_mpx import Amp, FabricMixedPrecisionPlugin
from lightning_mpx.engine.sharding import local_tensor
from lightning_mpx.integrations.fsdp import shard_model

BATCH = 16  # global
STEPS = 8
CLIP_NORM = 0.05  # below every step's norm: every clip by norm scales
CLIP_VALUE = 0.01
HEAD_INF, BODY_INF = 3, 5  # an inf in rank 1's shard only
ACCUMULATE_FROM = 4
EVAL_AT = (0, 2, 6)  # 0: before the plugin's first step
RESUME_AT = 4  # after the head's overflow: the checkpoint holds a backed-off scale and a skip
# Per step: "norm" (clip_gradients(max_norm=)), "value" (clip_val=) or None.
CLIPS = (None, "norm", "value", "norm", "norm", "value", None, "norm")
SETTINGS: dict[str, Any] = {"half_dtype": "bfloat16", "loss_scale": "dynamic", "init_scale": 2.0**12,
                            "growth_interval": 1000, "on_floor": "continue"}  # fmt: skip
TIMEOUT = timedelta(seconds=60)  # a collective one rank alone makes fails here rather than hanging the test


def build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )


def units(model: nn.Sequential) -> list[nn.Module]:
    return [model[0], model[3], model[5]]


def split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The body's parameters and the head's (the last ``Linear``)."""
    head = list(getattr(model, "module", model)[5].parameters())  # through Fabric's wrapper
    return [p for p in model.parameters() if all(p is not h for h in head)], head


def optimizers(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    body, head = split(model)
    return torch.optim.SGD(body, lr=0.05, momentum=0.9), torch.optim.AdamW(head, lr=1e-2, fused=True)


def batches() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)) for _ in range(2)]
            for _ in range(STEPS)]  # fmt: skip


def poison(model: nn.Module, step: int, rank: int) -> int | None:
    """Put an inf into rank 1's shard of a gradient at the overflow steps; which optimizer holds it (0 body, 1 head)."""
    which = 1 if step == HEAD_INF else 0 if step == BODY_INF else None
    if which is not None and rank == 1:
        grad = split(model)[which][0].grad
        local_tensor(grad).view(-1)[0] = float("inf")
    return which


def full_weights(model: nn.Module) -> list[list[float]]:
    return [p.full_tensor().double().flatten().tolist() for p in model.parameters()]


def train(loop: Any, rank: int, out: dict[str, Any], start: int = 0, stop: int = STEPS) -> None:
    per = BATCH // 2
    evals = out.setdefault("evals", [])
    for step, micro in list(enumerate(batches()))[start:stop]:
        if step in EVAL_AT:
            loop.model.eval()
            with torch.no_grad():
                x, y = (t[rank * per:(rank + 1) * per] for t in micro[1])
                evals.append(float(F.mse_loss(loop.forward(x).float(), y)))
            loop.model.train()
        n = 2 if step >= ACCUMULATE_FROM else 1
        if step == 0:
            loop.telemetry()
        total = 0.0
        for i in range(n):
            x, y = (t[rank * per:(rank + 1) * per] for t in micro[i])
            with loop.no_sync(i < n - 1):
                loss = F.mse_loss(loop.forward(x).float(), y) / n
                loop.backward(loss)
            total += float(loss.detach())
        out["norms"].append(loop.clip_and_step(step, poison(loop.model, step, rank) if loop.amp else None))
        reduced = torch.tensor([total])
        dist.all_reduce(reduced)
        out["losses"].append(float(reduced) / 2)
        loop.read(step, out)
    out["weights"] = full_weights(loop.model)


class FabricLoop:
    """The loop's parts with Fabric (the plugin, or Fabric's own precision: ``plugin=None``)."""

    def __init__(self, fabric: Fabric, model: Any, opts: Any, plugin: FabricMixedPrecisionPlugin | None) -> None:
        self.fabric, self.model, self.opts, self.plugin = fabric, model, opts, plugin
        self.amp = plugin.amp if plugin is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def telemetry(self) -> None:
        if self.plugin is not None:
            self.plugin.request_telemetry()

    def backward(self, loss: torch.Tensor) -> None:
        self.fabric.backward(loss)

    def no_sync(self, enabled: bool) -> Any:
        return self.fabric.no_backward_sync(self.model, enabled=enabled)

    def clip_and_step(self, step: int, inf: int | None) -> list[float | None]:
        norms: list[float | None] = []
        for index, opt in enumerate(self.opts):
            if self.plugin is None and index == (1 if step == HEAD_INF else 0 if step == BODY_INF else None):
                opt.zero_grad()  # Fabric's own precision: the overflowing optimizer's step left out by hand
                norms.append(None)
                continue
            norm = None
            if CLIPS[step] == "norm":
                value = self.fabric.clip_gradients(self.model, opt, max_norm=CLIP_NORM)
                norm = float(value.full_tensor() if hasattr(value, "full_tensor") else value)
            elif CLIPS[step] == "value":
                self.fabric.clip_gradients(self.model, opt, clip_val=CLIP_VALUE)
            norms.append(norm)
            opt.step()
        for opt in self.opts:
            opt.zero_grad()
        return norms

    def read(self, step: int, out: dict[str, Any]) -> None:
        """Rank 0 only: what a user logs (no collective: rank 1 is already in its next step)."""
        if self.plugin is None or not self.fabric.is_global_zero:
            return
        out["skipped"].append([self.plugin.step_was_skipped(opt) for opt in self.opts])
        metrics = self.plugin.metrics()
        self.fabric.log_dict(metrics, step=step)
        out["scales"].append(metrics["mpx/loss_scale"])
        out["skipped_steps"] = metrics["mpx/skipped_steps"]
        if step == 0:
            out["telemetry"] = sorted(k for k in metrics if k.startswith(("mpx/underflow", "mpx/headroom")))


class CoreLoop:
    """The loop's parts with the core ``Amp`` and ``shard_model``."""

    def __init__(self, amp: Amp, model: nn.Module, opts: Any) -> None:
        self.amp, self.model, self.opts = amp, model, opts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.amp.forward_context():
            return self.amp.cast_outputs(self.model(self.amp.cast_inputs(x)))

    def telemetry(self) -> None:
        self.amp.request_telemetry()

    def backward(self, loss: torch.Tensor) -> None:
        self.amp.backward(loss)

    def no_sync(self, enabled: bool) -> Any:
        self.model.set_requires_gradient_sync(not enabled)
        return torch.enable_grad()

    def clip_and_step(self, step: int, inf: int | None) -> list[float | None]:
        norms: list[float | None] = []
        for opt in self.opts:
            norm = None
            if CLIPS[step] == "norm":
                norm = float(self.amp.clip_grad_norm_(opt, CLIP_NORM))
                norm = 0.0 if norm != norm or norm == float("inf") else norm
            elif CLIPS[step] == "value":
                self.amp.clip_grad_value_(opt, CLIP_VALUE)
            norms.append(norm)
            self.amp.step(opt)
        self.amp.update()
        for opt in self.opts:
            opt.zero_grad()
        return norms

    def read(self, step: int, out: dict[str, Any]) -> None:
        if dist.get_rank() != 0:
            return
        out["skipped"].append([self.amp.iteration.skipped(opt) for opt in self.opts])
        metrics = self.amp.metrics()
        out["scales"].append(float(metrics["mpx/loss_scale"]))
        out["skipped_steps"] = float(metrics["mpx/skipped_steps"])


def fabric_of(plugin: FabricMixedPrecisionPlugin | None, precision: str | None = None, *, whole: Any = None) -> Fabric:
    """A Fabric with ``ModelParallelStrategy``; ``parallelize_fn`` shards every model but ``whole``."""

    def parallelize(model: nn.Module, mesh: Any) -> nn.Module:
        if whole is not None and model is whole:
            return model
        if plugin is not None:
            return shard_model(model, plugin, mesh=mesh["data_parallel"], blocks=units(model))
        for unit in units(model):
            fully_shard(unit, mesh=mesh["data_parallel"])
        return fully_shard(model, mesh=mesh["data_parallel"])

    strategy = ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1, timeout=TIMEOUT)
    kwargs: dict[str, Any] = {"plugins": [plugin]} if plugin is not None else {"precision": precision}
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, loggers=CSVLogger(os.environ["MPX_OUT"]),
                    **kwargs)  # fmt: skip
    fabric.launch()  # the first run starts the second process; later ones find the process group running
    return fabric


def set_up(plugin: FabricMixedPrecisionPlugin | None, precision: str | None = None) -> FabricLoop:
    fabric = fabric_of(plugin, precision)
    model = fabric.setup_module(build())
    opts = fabric.setup_optimizers(*optimizers(model))
    return FabricLoop(fabric, model, opts, plugin)


def run_plugin(level: str, out: dict[str, Any]) -> None:
    plugin = FabricMixedPrecisionPlugin(level, **SETTINGS)
    loop = set_up(plugin)
    train(loop, loop.fabric.global_rank, out)
    out["sharded"] = plugin.amp.sharded
    if loop.fabric.is_global_zero:
        out["logged"] = [sorted(row) for row in loop.fabric.logger.experiment.metrics]  # what log_dict got


def run_fabric(precision: str, out: dict[str, Any]) -> None:
    loop = set_up(None, precision)
    train(loop, loop.fabric.global_rank, out)


def run_core(level: str, out: dict[str, Any]) -> None:
    amp = Amp(level, **SETTINGS)
    model = build()
    shard_model(model, amp, blocks=units(model))
    amp.prepare_model(model)
    opts = [amp.prepare_optimizer(opt) for opt in optimizers(model)]
    train(CoreLoop(amp, model, opts), dist.get_rank(), out)


def run_resume(out: dict[str, Any]) -> None:
    """``straight``: the plugin's loop with a ``fabric.save`` before the first step and one after ``RESUME_AT``
    steps; ``resumed<k>``: a fresh Fabric, plugin, model and optimizers that ``fabric.load`` the checkpoint of step
    ``k`` and run the remaining steps."""
    straight: dict[str, Any] = {"losses": [], "norms": [], "skipped": [], "scales": []}
    plugin = FabricMixedPrecisionPlugin("O1", **SETTINGS)
    loop = set_up(plugin)
    for start, stop in ((0, 0), (0, RESUME_AT), (RESUME_AT, STEPS)):
        train(loop, loop.fabric.global_rank, straight, start=start, stop=stop)
        if stop < STEPS:
            state = {"model": loop.model, "body": loop.opts[0], "head": loop.opts[1], "mpx": plugin, "step": stop}
            loop.fabric.save(os.path.join(os.environ["MPX_OUT"], f"step{stop}"), state)
    out["straight"] = straight
    for k in (0, RESUME_AT):
        resumed: dict[str, Any] = {"losses": [], "norms": [], "skipped": [], "scales": []}
        plugin = FabricMixedPrecisionPlugin("O1", **SETTINGS)
        loop = set_up(plugin)
        state = {"model": loop.model, "body": loop.opts[0], "head": loop.opts[1], "mpx": plugin, "step": -1}
        loop.fabric.load(os.path.join(os.environ["MPX_OUT"], f"step{k}"), state)
        # ModelParallelStrategy's distributed checkpoint puts the plugin's saved state dict in its place (it does not
        # call load_state_dict on it, as Fabric's other strategies do): docs/fabric.md's lines restore it.
        resumed["fabric_restored_the_plugin"] = state["mpx"] is plugin
        if state["mpx"] is not plugin:
            plugin.load_state_dict(state["mpx"])
            state["mpx"] = plugin
        resumed["step"] = state["step"]
        train(loop, loop.fabric.global_rank, resumed, start=k)
        out[f"resumed{k}"] = resumed


def run_refused(level: str, out: dict[str, Any]) -> None:
    plugin = FabricMixedPrecisionPlugin(level, **SETTINGS)
    fabric = fabric_of(plugin)
    model = fabric.setup_module(build())
    opts = fabric.setup_optimizers(*optimizers(model))
    try:
        fabric.backward(model(torch.randn(4, 16)).float().sum())
        opts[0].step()
    except Exception as error:  # noqa: BLE001 - the message is the result
        out["refusal"] = f"{type(error).__name__}: {error}"


def _use(fabric: Fabric, model: Any) -> None:
    fabric.backward(model(torch.randn(4, 16)).float().sum())


def run_mix(order: str, out: dict[str, Any]) -> None:
    """A sharded and a whole model in one plugin: where (and what) the user is told."""
    plugin = FabricMixedPrecisionPlugin("O1", **SETTINGS)
    whole = build()
    fabric = fabric_of(plugin, whole=whole)
    out["where"] = "setup"
    try:
        if order == "whole_first":
            w = fabric.setup_module(whole)
            _use(fabric, w)
            s = fabric.setup_module(build())
        elif order == "sharded_first":
            s = fabric.setup_module(build())
            _use(fabric, s)
            w = fabric.setup_module(whole)
        else:
            s, w = fabric.setup_module(build()), fabric.setup_module(whole)
        out["where"] = "use"
        _use(fabric, s)
        _use(fabric, w)
        out["where"] = None
    except Exception as error:  # noqa: BLE001 - the message is the result
        out["refusal"] = f"{type(error).__name__}: {error}"


def run_late(out: dict[str, Any]) -> None:
    """Two sharded models, the second set up after the first trained a step (a GAN set up model by model)."""
    plugin = FabricMixedPrecisionPlugin("O1", **SETTINGS)
    fabric = fabric_of(plugin)
    first = fabric.setup_module(build())
    opt = fabric.setup_optimizers(torch.optim.SGD(first.parameters(), lr=0.05))
    _use(fabric, first)
    opt.step()
    second = fabric.setup_module(build())
    opt2 = fabric.setup_optimizers(torch.optim.SGD(second.parameters(), lr=0.05))
    before = full_weights(second)
    _use(fabric, second)
    opt2.step()
    out["second_changed"] = full_weights(second) != before
    out["second_weights"] = full_weights(second)
    out["sharded"] = plugin.amp.sharded


def run_case(case: str) -> dict[str, Any]:
    """One case of ``$MPX_CASES`` (``kind:arg``, above) on this rank: its results, or ``error`` when it raised."""
    kind, _, arg = case.partition(":")
    out: dict[str, Any] = {"losses": [], "norms": [], "skipped": [], "scales": []}
    try:
        if kind == "plugin":
            run_plugin(arg, out)
        elif kind == "fabric":
            run_fabric(arg, out)
        elif kind == "core":
            run_core(arg, out)
        elif kind == "resume":
            run_resume(out)
        elif kind == "refused":
            run_refused(arg, out)
        elif kind == "mix":
            run_mix(arg, out)
        else:
            run_late(out)
    except Exception:  # noqa: BLE001 - reported by the test, which names the case
        out["error"] = traceback.format_exc()[-3000:]
    return out
