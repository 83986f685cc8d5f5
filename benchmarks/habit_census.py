"""Host syncs, kernels and Python calls per training step of real training habits, against each front door's reference.

A census, not a timing: every row trains a tiny model on CPU with ``AdamW(fused=True)`` and counts, over a few steady
steps (after ``--warmup`` optimizer steps), per optimizer step:

* ``syncs``: ``aten._local_scalar_dense`` calls (``.item()``, ``bool(t)``, ``float(t)`` of a tensor): on a GPU each
  one stalls the host until the device catches up;
* ``reads``: ``Tensor.tolist`` calls (a ``TorchFunctionMode``; no aten op on CPU): one host transfer each, a sync on a
  GPU unless the tensor is a copy made behind earlier work (the engine reads a step skipped on the device at the next
  backward from a pinned copy queued behind that step: one read per step that waits for that copy, not the queue);
* ``ops``: dispatched aten ops that are not views (each one a kernel launch on a GPU), under a ``TorchDispatchMode``;
* ``calls``: Python function calls (``sys.setprofile``'s ``call`` events), in a second, identical run without the
  modes (whose own Python would be counted).

The counts do not depend on the machine's load: a row's difference from its reference is the cost of lightning_mpx
for that habit. Every row runs at two depths of its model (``--depths``: GPT blocks, ResNet stages); the growth of
ops and calls per extra parameter tensor, less the reference's, says whether a row does per-parameter work that its
reference does not (an O2 row falling off its one-buffer fast path, say).

Front doors, each with its reference (the framework's own bfloat16 mixed precision, the same optimizer and habit):

* ``trainer``: ``Trainer(plugins=[MixedPrecisionPlugin("O1"|"O2", half_dtype=torch.bfloat16)])`` against
  ``Trainer(precision="bf16-mixed")`` (which refuses ``gradient_clip_val`` with a fused optimizer: its clip rows
  clip with torch's ``clip_grad_norm_``/``clip_grad_value_`` in ``on_before_optimizer_step``, as a user then does);
  habits: ``plain``, ``clip-norm`` (``gradient_clip_val=1.0``), ``clip-value`` (``gradient_clip_algorithm="value"``),
  ``accumulate`` (``accumulate_grad_batches=2``), ``scheduler`` (a per-step ``LambdaLR``), ``log``
  (``self.log("loss", ..., on_step=True, prog_bar=True)``), ``lr-monitor`` (``LearningRateMonitor``),
  ``checkpoint`` (``ModelCheckpoint(every_n_train_steps=2)``), ``param-groups`` (weight decay on the matrices only,
  Hugging Face's split), ``frozen`` (the first half of the parameters frozen, all of them in the optimizer: a
  LoRA-like base), ``tied`` (GPT only: the head shares the token embedding; the other GPT rows untie it),
  ``grad-norm`` (Lightning's ``grad_norm`` logged in ``on_before_optimizer_step``); the rows that log write to a
  CSV logger every step (``log_every_n_steps=1``: every step is a logging step);
* ``fabric``: ``FabricMixedPrecisionPlugin("O1"|"O2")`` against ``Fabric(precision="bf16-mixed")``; habits ``plain``,
  ``clip`` (``fabric.clip_gradients(max_norm=1.0)``), ``no-backward-sync`` (accumulation over 2 batches);
* ``accelerate``: ``lightning_mpx.accelerate.Accelerator(mixed_precision="O1"|"O2")`` against Accelerate's own
  ``Accelerator(mixed_precision="bf16")``; habits ``plain``, ``accumulate`` (``accelerator.accumulate``, 2 batches),
  ``clip`` (``accelerator.clip_grad_norm_``); Accelerate's process-wide state is reset around every row;
* ``loop``: the core ``Amp`` loop (``core-O1``, ``core-O2``, bfloat16) against a ``torch.autocast`` bfloat16 loop;
  habits ``plain``, ``clip`` (``amp.unscale_(opt)``, then torch's ``clip_grad_norm_(amp.master_params(opt), 1.0)``;
  the reference clips its parameters);
* ``apex``: the Apex layer (``apex-O1``, ``apex-O2``: ``amp.initialize`` + ``amp.scale_loss``, float16 with dynamic
  loss scaling as Apex has it) against a ``torch.autocast`` float16 loop with ``GradScaler``; habits ``plain``,
  ``clip`` (Apex's habit: torch's ``clip_grad_norm_(amp.master_params(opt), 1.0)`` after the ``scale_loss`` block;
  the reference clips after ``GradScaler.unscale_``).

The ``-gpu`` variants (``O1-gpu`` of ``trainer``, ``fabric`` and ``accelerate``, ``core-O1-gpu`` of ``loop``) run O1
the way it runs on a GPU. There, O1 with no table given takes ``CastTable.for_device("cuda")``: the default table
settled ``torch.autocast``'s way, whose policy enters ``torch.autocast`` and pushes no torch-function mode. On CPU
the default table differs from CPU autocast's narrow lists, and the plain ``O1`` rows run the Python mode. The
``-gpu`` rows give ``cast_table=CastTable.autocast_aligned("cpu")`` (:func:`gpu_table`), so the CPU run takes the
path a CUDA run takes: ``torch.autocast`` alone, no mode.

    python benchmarks/habit_census.py [--fronts trainer fabric accelerate loop apex] [--models gpt resnet]
        [--habits plain clip-norm ...] [--warmup 3] [--steps 4] [--depths 1 3] [--out PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the package comes from PYTHONPATH (before/after runs)

import _harness  # noqa: E402
from _step_variants import ModelSpec, _loss, build_model, make_batches  # noqa: E402
from plugin_overhead import _quiet  # noqa: E402  (Lightning's info lines and warnings are not the output)

TRAINER_HABITS = ("plain", "clip-norm", "clip-value", "accumulate", "scheduler", "log", "lr-monitor", "checkpoint",
                  "param-groups", "frozen", "tied", "grad-norm")  # fmt: skip
FRONTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {  # front -> (variants, reference first; habits)
    "trainer": (("bf16-mixed", "O1", "O1-gpu", "O2"), TRAINER_HABITS),
    "fabric": (("bf16-mixed", "O1", "O1-gpu", "O2"), ("plain", "clip", "no-backward-sync")),
    "accelerate": (("bf16", "O1", "O1-gpu", "O2"), ("plain", "accumulate", "clip")),
    "loop": (("autocast", "core-O1", "core-O1-gpu", "core-O2"), ("plain", "clip")),
    "apex": (("autocast-fp16", "apex-O1", "apex-O2"), ("plain", "clip")),
}
HABITS = tuple(dict.fromkeys(h for _, habits in FRONTS.values() for h in habits))
MODELS = ("gpt", "resnet")
ACCUMULATING = ("accumulate", "no-backward-sync")
LOGGING = ("log", "lr-monitor", "grad-norm")
LR = 1e-3


def spec_of(model: str, depth: int) -> ModelSpec:
    """The tiny model at ``depth`` (GPT blocks, or ResNet stages of one block each)."""
    if model == "gpt":
        return ModelSpec(batch=2, vocab=32, seq=8, dim=16, layers=depth, heads=2)
    return ModelSpec(batch=2, image=8, width=2, blocks=(1,) * depth)


def applies(model: str, habit: str) -> bool:
    """Whether a habit has a row for a model (weights are tied in the GPT alone)."""
    return habit != "tied" or model == "gpt"


def network(model: str, depth: int, habit: str) -> nn.Module:
    """The seeded network; the GPT's head untied from its token embedding unless the habit is ``tied``."""
    torch.manual_seed(0)
    net = build_model(model, spec_of(model, depth))
    if model == "gpt" and habit != "tied":
        net.head.weight = nn.Parameter(net.tok.weight.detach().clone())
    if habit == "frozen":  # a LoRA-like frozen base: the first half of the parameters, all of them in the optimizer
        params = list(net.parameters())
        for p in params[: len(params) // 2]:
            p.requires_grad_(False)
    return net


def optimizer_of(net: nn.Module, habit: str) -> torch.optim.Optimizer:
    """``AdamW(fused=True)`` over every parameter; two groups (decay on the matrices only) for ``param-groups``."""
    if habit == "param-groups":
        decay = [p for p in net.parameters() if p.ndim >= 2]
        rest = [p for p in net.parameters() if p.ndim < 2]
        groups: Any = [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=LR, fused=True)
    return torch.optim.AdamW(net.parameters(), lr=LR, fused=True)


def gpu_table() -> Any:
    """The table that makes a CPU run of O1 take a CUDA run's path: ``torch.autocast`` alone, no torch-function
    mode (on CUDA, ``CastTable.for_device("cuda")`` is autocast-aligned the same way)."""
    from lightning_mpx import CastTable

    return CastTable.autocast_aligned("cpu")


def settings_of(variant: str) -> tuple[str, dict[str, Any]]:
    """The opt level and the settings of a lightning_mpx variant (bfloat16; a ``-gpu`` variant with
    :func:`gpu_table`)."""
    settings: dict[str, Any] = {"half_dtype": torch.bfloat16}
    if variant.endswith("-gpu"):
        settings["cast_table"] = gpu_table()
    return variant.removeprefix("core-").removesuffix("-gpu"), settings


# -- counting ---------------------------------------------------------------------------------------------------------
class _Ops(TorchDispatchMode):
    """Counts host syncs and non-view aten ops while ``active``."""

    def __init__(self) -> None:
        super().__init__()
        self.active, self.syncs, self.ops, self.reads = False, 0, 0, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.active:
            if func is torch.ops.aten._local_scalar_dense.default:
                self.syncs += 1
            if not func.is_view:
                self.ops += 1
        return func(*args, **(kwargs or {}))


class _Reads(TorchFunctionMode):
    """Counts ``Tensor.tolist`` calls while ``ops.active``: one host transfer each, without an aten op on CPU."""

    def __init__(self, ops: _Ops) -> None:
        super().__init__()
        self.counted = ops

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.counted.active and func is torch.Tensor.tolist:
            self.counted.reads += 1
        return func(*args, **(kwargs or {}))


class Window:
    """The counted steps: :meth:`mark` at every batch's start opens the count at batch ``start`` and closes it at
    batch ``end``; ``what`` is ``"ops"`` (syncs and ops, a dispatch mode over the whole run) or ``"calls"``."""

    def __init__(self, what: str, start: int, end: int) -> None:
        self.what, self.start, self.end, self.batches = what, start, end, 0
        self.mode = _Ops() if what == "ops" else None
        self.calls = 0

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            self.calls += 1

    def mark(self) -> None:
        # The collector stays off inside the window: a collection there runs finalizers and weakref callbacks of
        # whatever earlier steps left, which moved the per-parameter columns by about 0.2 from run to run.
        if self.batches == self.start:
            gc.collect()
            gc.disable()
            if self.mode is not None:
                self.mode.active = True
            else:
                sys.setprofile(self._profile)
        elif self.batches == self.end:
            if self.mode is not None:
                self.mode.active = False
            else:
                sys.setprofile(None)
            gc.enable()
        self.batches += 1

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        try:
            with self.mode if self.mode is not None else contextlib.nullcontext(), \
                    _Reads(self.mode) if self.mode is not None else contextlib.nullcontext():
                yield
        finally:
            sys.setprofile(None)
            gc.enable()
        if self.batches <= self.end:
            raise RuntimeError(f"the run stopped at batch {self.batches}, before the window's end at {self.end}")


# -- the front doors --------------------------------------------------------------------------------------------------
def _trainer(variant: str, habit: str, net: nn.Module, batches: list[Any], steps: int, window: Window,
             tmp: Path) -> None:
    import lightning.pytorch as pl
    from _step_variants import ListDataset
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.utilities import grad_norm

    from lightning_mpx import MixedPrecisionPlugin

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = _loss(self.net(batch[0]), batch[1])
            if habit == "log":
                self.log("loss", loss, on_step=True, prog_bar=True)
            return loss

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            if habit == "grad-norm":
                self.log_dict(grad_norm(self, norm_type=2))
            if variant == "bf16-mixed" and habit == "clip-norm":  # Lightning refuses its own clip with a fused AdamW
                torch.nn.utils.clip_grad_norm_(self.parameters(), 1.0)
            if variant == "bf16-mixed" and habit == "clip-value":
                torch.nn.utils.clip_grad_value_(self.parameters(), 1.0)

        def configure_optimizers(self) -> Any:
            opt = optimizer_of(self, habit)
            if habit != "scheduler":
                return opt
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.01 * s))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    class Mark(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            window.mark()

        def on_train_end(self, *args: Any) -> None:
            window.mark()

    callbacks: list[Any] = [Mark()]
    if habit == "lr-monitor":
        callbacks.append(LearningRateMonitor(logging_interval="step"))
    if habit == "checkpoint":
        callbacks.append(ModelCheckpoint(dirpath=tmp / "ckpt", every_n_train_steps=2, save_top_k=-1))
    if variant == "bf16-mixed":
        kwargs: dict[str, Any] = {"precision": "bf16-mixed"}
    else:
        level, settings = settings_of(variant)
        kwargs = {"plugins": [MixedPrecisionPlugin(level, **settings)]}
    if habit == "clip-norm" and variant != "bf16-mixed":
        kwargs["gradient_clip_val"] = 1.0
    if habit == "clip-value" and variant != "bf16-mixed":
        kwargs.update(gradient_clip_val=1.0, gradient_clip_algorithm="value")
    if habit == "accumulate":
        kwargs["accumulate_grad_batches"] = 2
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps,
        logger=CSVLogger(str(tmp), name="census") if habit in LOGGING else False, log_every_n_steps=1,
        enable_checkpointing=habit == "checkpoint", enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=callbacks, **kwargs,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(ListDataset(batches), batch_size=None, shuffle=False)
    trainer.fit(Module(), loader)


def _fabric(variant: str, habit: str, net: nn.Module, batches: list[Any], steps: int, window: Window) -> None:
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    if variant == "bf16-mixed":
        fabric = Fabric(accelerator="cpu", devices=1, precision="bf16-mixed")
    else:
        level, settings = settings_of(variant)
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[FabricMixedPrecisionPlugin(level, **settings)])
    model, optimizer = fabric.setup(net, optimizer_of(net, habit))
    every = 2 if habit == "no-backward-sync" else 1
    for i in range(steps * every):
        window.mark()
        x, y = batches[i % len(batches)]
        stepping = (i + 1) % every == 0
        with fabric.no_backward_sync(model, enabled=not stepping) if every > 1 else contextlib.nullcontext():
            fabric.backward(_loss(model(x), y) / every)
        if stepping:
            if habit == "clip":
                fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    window.mark()


def _accelerate(variant: str, habit: str, net: nn.Module, batches: list[Any], steps: int, window: Window) -> None:
    import accelerate

    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    every = 2 if habit == "accumulate" else 1
    if variant == "bf16":
        accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=every)
    else:
        level, settings = settings_of(variant)
        accelerator = Accelerator(cpu=True, mixed_precision=level, gradient_accumulation_steps=every,
                                  kwargs_handlers=[MixedPrecisionKwargs(**{**settings, "half_dtype": "bfloat16"})])
    model, optimizer = accelerator.prepare(net, optimizer_of(net, habit))
    for i in range(steps * every):
        window.mark()
        x, y = batches[i % len(batches)]
        with accelerator.accumulate(model) if every > 1 else contextlib.nullcontext():
            accelerator.backward(_loss(model(x), y))
            if habit == "clip" and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    window.mark()


def _loop(variant: str, habit: str, net: nn.Module, batches: list[Any], steps: int, window: Window) -> None:
    from lightning_mpx import Amp

    optimizer = optimizer_of(net, habit)
    one: Callable[[Any, Any], None]
    if variant.startswith("autocast"):
        fp16 = variant == "autocast-fp16"  # Apex's reference: float16 autocast and GradScaler (skips on the device)
        scaler = torch.amp.GradScaler("cpu", enabled=fp16)

        def one(x: Any, y: Any) -> None:
            with torch.autocast("cpu", dtype=torch.float16 if fp16 else torch.bfloat16):
                loss = _loss(net(x), y)
            scaler.scale(loss).backward()
            if habit == "clip":
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    elif variant.startswith("core-"):
        level, settings = settings_of(variant)
        amp = Amp(level, **settings)
        model = amp.prepare_model(net)
        opt = amp.prepare_optimizer(optimizer)

        def one(x: Any, y: Any) -> None:
            with amp.forward_context():
                loss = _loss(amp.cast_outputs(model(amp.cast_inputs(x))), y)
            amp.backward(loss)
            if habit == "clip":
                amp.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1.0)
            amp.step(opt)
            amp.update()
            opt.zero_grad(set_to_none=True)
    else:
        from lightning_mpx.apex import amp as apex_amp

        model, opt = apex_amp.initialize(net, optimizer, opt_level=variant.removeprefix("apex-"), verbosity=0)

        def one(x: Any, y: Any) -> None:
            loss = _loss(model(x), y)
            with apex_amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            if habit == "clip":
                torch.nn.utils.clip_grad_norm_(apex_amp.master_params(opt), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    try:
        for i in range(steps):
            window.mark()
            one(*batches[i % len(batches)])
        window.mark()
    finally:
        if variant.startswith("apex-"):  # the O1 scope and hooks go before the census's own modes are left
            from lightning_mpx.apex._state import _amp_state

            _amp_state.reset()


@contextlib.contextmanager
def _accelerate_state(front: str) -> Iterator[None]:
    """Accelerate's process-wide singleton state, emptied before and after an ``accelerate`` row."""
    if front != "accelerate":
        yield
        return
    from accelerate.state import AcceleratorState, GradientState

    def reset() -> None:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()

    reset()
    try:
        yield
    finally:
        reset()


def count(front: str, variant: str, habit: str, model: str, depth: int, what: str, warmup: int = 3,
          steps: int = 4) -> dict[str, int]:
    """One run of a row, counting ``what`` (``"ops"``: syncs and non-view ops; ``"calls"``) over optimizer steps
    ``warmup`` to ``warmup + steps``; totals over the window (not per step)."""
    every = 2 if habit in ACCUMULATING else 1
    window = Window(what, warmup * every, (warmup + steps) * every)
    net = network(model, depth, habit)
    batches = make_batches(model, spec_of(model, depth), 4, torch.device("cpu"))
    total = warmup + steps + 1  # optimizer steps: the window's end is the start of the last one
    with _quiet(), tempfile.TemporaryDirectory(prefix="habit-census-") as tmp, _accelerate_state(front), \
            window.running():
        if front == "trainer":
            _trainer(variant, habit, net, batches, total, window, Path(tmp))
        elif front == "fabric":
            _fabric(variant, habit, net, batches, total, window)
        elif front == "accelerate":
            _accelerate(variant, habit, net, batches, total, window)
        else:  # loop, apex
            _loop(variant, habit, net, batches, total, window)
    if what == "ops":
        assert window.mode is not None
        return {"syncs": window.mode.syncs, "reads": window.mode.reads, "ops": window.mode.ops}
    return {"calls": window.calls}


def row(front: str, variant: str, habit: str, model: str, depths: tuple[int, int] = (1, 3), warmup: int = 3,
        steps: int = 4, calls: bool = True) -> dict[str, Any]:
    """A row's counts per optimizer step at the first depth, and their growth per extra parameter tensor between the
    two depths (``ops_per_param``, ``calls_per_param``); ``calls=False`` skips the Python-call runs."""
    if front not in FRONTS or variant not in FRONTS[front][0] or habit not in FRONTS[front][1]:
        raise ValueError(f"front={front!r}, variant={variant!r}, habit={habit!r} is not a row; valid choices: "
                         + "; ".join(f"{f}: {v} x {h}" for f, (v, h) in FRONTS.items()))
    if model not in MODELS or not applies(model, habit):
        raise ValueError(f"model={model!r} has no {habit!r} row; valid choices: {MODELS} ('tied': gpt only)")
    per: list[dict[str, float]] = []
    params = []
    for depth in depths:
        found: dict[str, float] = dict(count(front, variant, habit, model, depth, "ops", warmup, steps))
        if calls:
            found.update(count(front, variant, habit, model, depth, "calls", warmup, steps))
        per.append({k: v / steps for k, v in found.items()})
        params.append(sum(1 for _ in network(model, depth, habit).parameters()))
    result: dict[str, Any] = {"front": front, "variant": variant, "habit": habit, "model": model,
                              "param_tensors": params, **per[0]}
    for key in ("ops", "calls"):
        if key in per[0]:
            result[f"{key}_per_param"] = (per[1][key] - per[0][key]) / (params[1] - params[0])
    return result


def compare(rows: list[dict[str, Any]]) -> None:
    """Add each row's differences from its reference (the front's first variant, same habit and model)."""
    refs = {(r["front"], r["habit"], r["model"]): r for r in rows if r["variant"] == FRONTS[r["front"]][0][0]}
    for r in rows:
        ref = refs.get((r["front"], r["habit"], r["model"]))
        for key in ("syncs", "reads", "ops", "calls", "ops_per_param", "calls_per_param"):
            if ref is not None and key in r:
                r[f"extra_{key}"] = r[key] - ref[key]
    plain = {(r["front"], r["variant"], r["model"]): r for r in rows if r["habit"] == "plain"}
    for r in rows:  # the habit's own growth: beyond the plain row's, once per micro-batch of the step
        base = plain.get((r["front"], r["variant"], r["model"]))
        every = 2 if r["habit"] in ACCUMULATING else 1
        if base is not None and "extra_ops_per_param" in r and "extra_ops_per_param" in base:
            r["habit_ops_per_param"] = r["extra_ops_per_param"] - every * base["extra_ops_per_param"]


def findings(rows: list[dict[str, Any]]) -> list[str]:
    """The cliffs: an extra host sync per step over the reference, or ops growing per parameter beyond it (and, for
    a habit, beyond what the plain row grows beyond it per micro-batch)."""
    out = []
    for r in rows:
        name = f"{r['front']} {r['variant']} {r['habit']} ({r['model']})"
        if r.get("extra_syncs", 0) > 0:
            out.append(f"{name}: {r['extra_syncs']:g} extra host sync(s) per step")
        grows = r.get("habit_ops_per_param", r.get("extra_ops_per_param", 0))
        if grows > 0.5:
            out.append(f"{name}: {grows:.1f} extra ops per step per parameter tensor")
    return out


def table(rows: list[dict[str, Any]]) -> str:
    def num(r: dict[str, Any], key: str, spec: str = "g") -> str:
        value, extra = r.get(key), r.get(f"extra_{key}")
        if value is None:
            return "-"
        return f"{value:{spec}}" + ("" if not extra else f" ({extra:+{spec}})")

    return _harness.markdown_table(
        ["front", "model", "habit", "variant", "syncs", "reads", "ops", "ops/param", "calls", "calls/param"],
        [[r["front"], r["model"], r["habit"], r["variant"], num(r, "syncs"), num(r, "reads"), num(r, "ops"),
          num(r, "ops_per_param", ".1f"), num(r, "calls", ".0f"), num(r, "calls_per_param", ".1f")]
         for r in rows], align="llllrrrrrr")  # fmt: skip


NOTE = ("Per optimizer step, over the steady steps; in brackets the difference from the reference row (the front's "
        "first variant, same habit and model). ops/param, calls/param: growth per extra parameter tensor between "
        "the two depths.")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fronts", nargs="+", choices=tuple(FRONTS), default=list(FRONTS))
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--habits", nargs="+", choices=HABITS, default=None, help="default: every habit of a front")
    parser.add_argument("--warmup", type=int, default=3, help="optimizer steps before the counted ones")
    parser.add_argument("--steps", type=int, default=4, help="counted optimizer steps")
    parser.add_argument("--depths", nargs=2, type=int, default=[1, 3], help="the two model depths compared")
    parser.add_argument("--no-calls", action="store_true", help="skip the Python-call runs")
    parser.add_argument("--out", type=Path, default=_harness.default_out("habit_census"))
    args = parser.parse_args(argv)
    if args.warmup < 1 or args.steps < 1 or min(args.depths) < 1 or args.depths[0] >= args.depths[1]:
        parser.error(f"--warmup={args.warmup} and --steps={args.steps} must be at least 1, --depths={args.depths} "
                     "two increasing depths of at least 1")
    torch.set_num_threads(1)
    rows = []
    for front in args.fronts:
        variants, habits = FRONTS[front]
        for model in args.models:
            for habit in habits:
                if (args.habits and habit not in args.habits) or not applies(model, habit):
                    continue
                for variant in variants:
                    rows.append(row(front, variant, habit, model, tuple(args.depths), args.warmup, args.steps,
                                    not args.no_calls))  # fmt: skip
                    print(f"  {front:<10} {model:<6} {habit:<16} {variant:<10} syncs {rows[-1]['syncs']:g} "
                          f"ops {rows[-1]['ops']:g}", flush=True)
    compare(rows)
    found = findings(rows)
    text = table(rows)
    print(text + "\n\n" + NOTE)
    print("\n".join(["", "findings:", *found]) if found else "\nno findings")
    result = {"benchmark": "habit_census", "command": _harness.command(argv), **_harness.machine("cpu"),
              "warmup": args.warmup, "steps": args.steps, "depths": args.depths, "rows": rows, "findings": found}
    _harness.save(args.out, result, {"": text + "\n\n" + NOTE, "findings": "\n".join(f"- {f}" for f in found)
                                     or "none"})  # fmt: skip
    return result


if __name__ == "__main__":
    main()
