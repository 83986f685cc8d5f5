"""Hugging Face Accelerate with Apex-style opt levels: ``Accelerator(mixed_precision="O2")``.

Swap the import and pick an opt level; the rest of an Accelerate script stays as it is::

    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    accelerator = Accelerator(mixed_precision="O2", kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")])
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for step, (x, y) in enumerate(loader):
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)                     # scaled, divided by the accumulation steps
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)   # on the unscaled gradients
            optimizer.step()                               # skipped on overflow: optimizer.step_was_skipped
            scheduler.step()                               # does not advance on a skipped step
            optimizer.zero_grad()
        accelerator.log({"loss": loss.item()}, step=step)  # + mpx/loss_scale, mpx/overflows, ...

``mixed_precision`` also takes Accelerate's own values (``"no"``, ``"fp16"``, ``"bf16"``, ``"fp8"``), which keep
their native behaviour untouched. With an opt level, Accelerate itself runs with ``mixed_precision="no"`` and a
:class:`~lightning_mpx.engine.amp.Amp` does the work:

* ``prepare`` converts each model for the opt level (before device placement's DDP wrapper, after it is moved to the
  device, so that O2's FP32 masters live on the device), replaces its ``forward`` *on that instance only* (O1: the
  cast policy is active during the forward; O2: loss functions called inside it run in FP32; O3: those given
  arguments of two floating dtypes too; O2/O3: float inputs
  cast to half; every level: half outputs cast to
  FP32 so that the loss is computed in FP32), and wraps each optimizer so that ``step`` is ``Amp.step``.
* **When the scale is updated.** ``Amp.update()`` must run once per iteration, after the real optimizer steps. The
  adapter calls it (1) as soon as every optimizer prepared by this accelerator has stepped (or skipped) since the
  last update, which covers one optimizer, and one loss driving several optimizers; otherwise (2) at the next
  ``backward``, or (3) at ``save_state``, whichever comes first, which covers a GAN whose optimizers step one after
  the other on their own losses. So each loss's scale is updated once per iteration, never once per optimizer
  call, and always before the next scaled backward. Inside ``accumulate()`` only the real (synchronising) step
  counts.
* Under several processes (DDP) the overflow flag is all-reduced (MAX) before each step, so all ranks skip
  together, and only the main process logs overflow messages.
* ``log()`` adds ``mpx/loss_scale``, ``mpx/overflows`` (since the previous log), ``mpx/skipped_steps`` and
  ``mpx/grad_norm`` (when ``clip_grad_norm_`` computed it) to the values you log, read from the device only then;
  ``MixedPrecisionKwargs(log_metrics=False)`` turns this off. :meth:`Accelerator.mpx_metrics` returns them counted
  since its own previous call: it and the logs never take counts from each other.
* ``save_state``/``load_state`` write and read the loss scalers, the FP32 masters and the skip counters in
  ``lightning_mpx_amp.bin`` next to Accelerate's own files. At O2 ``get_state_dict`` (so ``save_model`` and the
  model files of ``save_state``) gives the FP32 masters, as Accelerate's own modes give an FP32 model.

**FSDP** (``fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)``, or 1): Accelerate shards the model and
the opt level is carried out partly by FSDP. The plugin's ``mixed_precision_policy`` is set to the level's
(:func:`lightning_mpx.integrations.fsdp.mixed_precision_policy`, FSDP1:
:func:`~lightning_mpx.integrations.fsdp.fsdp1_mixed_precision`: gathered in half, gradients reduced in FP32); before
Accelerate shards, the model gets the level's casts (O3: half; O1/O2: trainable half parameters FP32, as Accelerate's
own FSDP upcast) and, with FSDP2, its FP32 islands (batch norm where the level keeps it FP32, ``fp32_modules``) become
FSDP units of their own. Then the :class:`~lightning_mpx.engine.amp.Amp` prepares the *sharded* model (no conversion, no
second copy: FSDP's sharded FP32 parameters are the O2 masters) and the optimizer once Accelerate has swapped its
parameters for the shards. The scaler works on each rank's shards with one all-reduce per step (overflow flags and the
global squared norm), so ``clip_grad_norm_(model.parameters(), ...)`` clips by the global norm and every rank skips an
overflow step with the same scale; ``save_state`` uses FSDP's own checkpoints and writes the engine's state (identical
on every rank) once. With FSDP1, make the optimizer from the prepared model (as Accelerate asks). Refused:
``on_floor="promote"`` at O2/O3, a ``mixed_precision_policy`` of your own; DeepSpeed refuses every opt level (configure
its own ``fp16``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import warnings
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import nn

from lightning_mpx.common.imports import require
from lightning_mpx.common.keywords import Required, check_keywords, checks_method_keywords, required
from lightning_mpx.common.weak import WeakHook
from lightning_mpx.engine.amp import Amp
from lightning_mpx.engine.optimizer_state import BACKWARD_KEYWORDS
from lightning_mpx.masters.weights import refuse_lazy
from lightning_mpx.opt_levels import OPT_LEVELS
from lightning_mpx.settings import implicit_dtype_note

# Import through require() so that a missing accelerate names the extra that installs it.
require("accelerate", feature="lightning_mpx.accelerate")
from accelerate import Accelerator as _BaseAccelerator  # type: ignore[import-untyped]  # noqa: E402
from accelerate.utils import (  # type: ignore[import-untyped]  # noqa: E402
    AutocastKwargs,
    DistributedType,
    GradScalerKwargs,
    KwargsHandler,
)

from lightning_mpx.integrations import accelerate_fsdp as _accelerate_fsdp  # noqa: E402
from lightning_mpx.integrations.accelerate_arguments import (  # noqa: E402
    NATIVE_MIXED_PRECISION,
    _by_name,
    _check_keywords,
    _native_handler_refusal,
    _opt_level_of,
    _split_handlers,
)
from lightning_mpx.integrations.accelerate_checkpoint import (  # noqa: E402
    AMP_STATE_NAME,
    WholeModelExport,
    amp_state_path,
    masters_into,
    masters_left_to_weights,
    read_amp_state,
    warn_frozen_half,
    write_amp_state,
)
from lightning_mpx.integrations.accelerate_clipping import GradientClipping  # noqa: E402
from lightning_mpx.integrations.accelerate_forward import (  # noqa: E402
    AmpForward,
    engine_of,
    install_forward,
    release_optimizers,
    take_over,
)
from lightning_mpx.integrations.accelerate_fsdp import ShardedPreparation  # noqa: E402
from lightning_mpx.integrations.accelerate_kwargs import FSDP_GATHER_CHOICES, MixedPrecisionKwargs  # noqa: E402, F401
from lightning_mpx.integrations.accelerate_metrics import MpxLogging  # noqa: E402
from lightning_mpx.integrations.accelerate_optimizer import (  # noqa: E402
    AmpOptimizer,
    check_masters_exist,
    holding,
    keeping_grads,
    pair_again,
    released_by_engine,
)
from lightning_mpx.integrations.accelerate_precision import (  # noqa: E402
    held_opt_level,
    hold_opt_level,
    refuse_native_after_opt_level,
    refuse_set_precision,
)
from lightning_mpx.integrations.collectives import all_reduce_max  # noqa: E402
from lightning_mpx.integrations.fabric_checkpoint import shared_masters  # noqa: E402
from lightning_mpx.integrations.fp32_export import MastersInStateDict  # noqa: E402
from lightning_mpx.integrations.metric_counts import LOG_READER, upgrade_unlogged  # noqa: E402

_log = logging.getLogger("lightning_mpx")

__all__ = ["AMP_STATE_NAME", "NATIVE_MIXED_PRECISION", "Accelerator", "MixedPrecisionKwargs"]


_CHECKED_METHODS = (
    "prepare", "prepare_model", "prepare_optimizer", "get_state_dict", "free_memory", "autocast", "log", "mpx_metrics",
    "request_mpx_telemetry", "register_save_state_pre_hook", "save_model",
)  # fmt: skip
# backward()'s loss when left out, or misspelt (los=): refused naming it, with no check per call (keywords.Required)
_LOSS = required("accelerator.backward()", "loss")
_SUPPORTED_DISTRIBUTED = (
    DistributedType.NO,
    DistributedType.MULTI_CPU,
    DistributedType.MULTI_GPU,
    DistributedType.FSDP,
)
_DEEPSPEED_HINT = (
    "DeepSpeed brings its own mixed-precision engine (FP16 master weights in its ZeRO optimizer, its own dynamic "
    "loss scaler), which an opt level would fight: configure it in DeepSpeed's config instead, e.g. "
    '"fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1} '
    '(or "bf16": {"enabled": true}), or pass Accelerate\'s mixed_precision="fp16"/"bf16" with the DeepSpeed plugin.'
)


# Its own methods a user calls (not per step: a clip, backward and the optimizer's step check in their body) refuse a
# misspelt keyword naming the valid ones and the value given (Python's TypeError named no valid keyword).
@checks_method_keywords("accelerator", _CHECKED_METHODS)
class Accelerator(GradientClipping, MpxLogging, ShardedPreparation, WholeModelExport, _BaseAccelerator):  # type: ignore[misc]
    """``accelerate.Accelerator`` that also accepts the opt levels ``"O0"`` to ``"O3"`` as ``mixed_precision``.

    Args:
        *args: Passed to ``accelerate.Accelerator``.
        mixed_precision: An opt level (``"O0"``, ``"O1"``, ``"O2"``, ``"O3"``) or one of Accelerate's values
            (``"no"``, ``"fp16"``, ``"bf16"``, ``"fp8"``), which behave exactly as in Accelerate. ``None`` reads
            ``ACCELERATE_MIXED_PRECISION``, which may also hold an opt level; where an earlier Accelerator of this
            process runs an opt level, ``None`` takes it and that one's :class:`MixedPrecisionKwargs` (unless given),
            as Accelerate's own takes the process's precision (:mod:`.accelerate_precision`).
        kwargs_handlers: Accelerate's handlers, plus at most one :class:`MixedPrecisionKwargs` (opt levels only).
        **kwargs: Passed to ``accelerate.Accelerator``.

    Attributes:
        amp: The :class:`~lightning_mpx.engine.amp.Amp` that does the work, or ``None`` with a native value.
        mpx_kwargs: The :class:`MixedPrecisionKwargs` in use, or ``None`` with a native value.

    Raises:
        ValueError: for an unknown ``mixed_precision``, a :class:`MixedPrecisionKwargs` without an opt level, an
            invalid opt-level combination, torch's ``GradScalerKwargs``/``AutocastKwargs`` with an opt level, a
            DeepSpeed, Megatron-LM or XLA set-up with an opt level, or under FSDP ``on_floor="promote"`` at O2/O3
            or an ``fsdp_plugin.mixed_precision_policy`` of your own.
    """

    def __init__(
        self,
        *args: Any,
        mixed_precision: str | None = None,
        kwargs_handlers: list[KwargsHandler] | None = None,
        **kwargs: Any,
    ) -> None:
        _check_keywords(kwargs)
        if args:  # Accelerate's positional order (device_placement, split_batches, mixed_precision, ...): by name
            args, mixed_precision, kwargs_handlers, kwargs = _by_name(args, kwargs, mixed_precision, kwargs_handlers)
        self.amp: Amp | None = None
        self.mpx_kwargs: MixedPrecisionKwargs | None = None
        ours, theirs = _split_handlers(kwargs_handlers)
        if mixed_precision is None and (held := held_opt_level()) is not None:  # the process's, as Accelerate's own
            mixed_precision, ours = held[0], ours or [held[1]]
        opt_level = _opt_level_of(mixed_precision)
        if opt_level is None:
            if ours:
                raise ValueError(
                    f"MixedPrecisionKwargs configures an opt level, but mixed_precision={mixed_precision!r}; use "
                    f"one of {', '.join(map(repr, OPT_LEVELS))}, or drop MixedPrecisionKwargs."
                )
            refuse_native_after_opt_level(mixed_precision)
            super().__init__(*args, mixed_precision=mixed_precision, kwargs_handlers=theirs or None, **kwargs)
            return

        for handler in theirs:
            if isinstance(handler, (GradScalerKwargs, AutocastKwargs)):
                raise ValueError(_native_handler_refusal(handler, opt_level))
        settings = ours[0] if ours else MixedPrecisionKwargs()
        # Built before Accelerate sets up processes and devices, so that a bad combination fails fast.
        amp = Amp.from_settings(settings.settings(opt_level))
        deepspeed = kwargs.get("deepspeed_plugin") or kwargs.get("deepspeed_plugins")
        if deepspeed is not None or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
            raise ValueError(f"mixed_precision={opt_level!r} cannot run under DeepSpeed. {_DEEPSPEED_HINT}")
        self._native_view = False  # True while Accelerate's own code prepares a model: see mixed_precision
        refuse_set_precision(opt_level)
        super().__init__(*args, mixed_precision="no", kwargs_handlers=theirs or None, **kwargs)
        implicit = settings.implicit_dtype(self.device.type)
        if implicit is not None:  # no half_dtype given, on a CPU: bfloat16 (float16 matmuls are often emulated there)
            settings = dataclasses.replace(settings, half_dtype=implicit)
            amp = Amp.from_settings(settings.settings(opt_level))
            if self.is_main_process:
                implicit_dtype_note(_log, opt_level, implicit, 'MixedPrecisionKwargs(half_dtype="float16")')
        if self.distributed_type == DistributedType.DEEPSPEED:
            raise ValueError(f"mixed_precision={opt_level!r} cannot run under DeepSpeed. {_DEEPSPEED_HINT}")
        if self.distributed_type not in _SUPPORTED_DISTRIBUTED:
            raise ValueError(
                f"mixed_precision={opt_level!r} supports single-process, DDP and FSDP training, not "
                f"distributed_type={self.distributed_type}; use Accelerate's native mixed precision there."
            )
        if self.distributed_type == DistributedType.FSDP:
            plugin = self.state.fsdp_plugin
            _accelerate_fsdp.refuse_settings(amp.settings, plugin)
            # Accelerate's own mixed_precision is "no", so it leaves the plugin's policy to us.
            plugin.mixed_precision_policy = _accelerate_fsdp.fsdp_policy(
                amp.settings, plugin.fsdp_version, settings.fsdp_gather
            )
        elif kwargs.get("fsdp_plugin") is not None:
            warnings.warn(
                f"fsdp_plugin was given, but Accelerate chose distributed_type={self.distributed_type} (it selects "
                "FSDP only on GPU-like devices): the model is not sharded, and "
                f"mixed_precision={opt_level!r} runs as without FSDP.",
                UserWarning,
                stacklevel=2,
            )
        self.amp, self.mpx_kwargs = amp, settings
        if self.num_processes > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            if self.distributed_type != DistributedType.FSDP:
                # Under FSDP the engine's own collective (flags + global norm, one per step) makes the ranks agree.
                amp.found_inf_reducer = all_reduce_max  # every rank takes the same skip decision
            amp.log_overflows = self.is_main_process
        self._iterations = 0  # Amp.update() calls so far: telemetry_every_n_steps counts them
        self._converted: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        # FSDP2: optimizers prepared before Accelerate sharded their model, registered with the engine after.
        self._deferred: list[AmpOptimizer] | None = None
        # Weakly: a bound method in the Accelerator's own hook dicts would keep it (and its engine, models and masters)
        # alive after the user drops it, until the next cyclic collection (Accelerate's own is freed at once).
        self._amp_save_hook = self.register_save_state_pre_hook(WeakHook(self._save_amp_state))
        self.register_load_state_pre_hook(WeakHook(self._load_amp_state))
        hold_opt_level(opt_level, ours[0] if ours else MixedPrecisionKwargs())  # for a later Accelerator()

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> Any:
        """Accelerate's ``register_save_state_pre_hook``; the engine's own hook stays the last one, so that it sees
        the weights as the user's hooks leave them (a hook that casts them: the masters stay in the engine's file)."""
        handle = super().register_save_state_pre_hook(hook)
        ours = getattr(self, "_amp_save_hook", None)
        if ours is not None and ours.id in self._save_model_state_pre_hook:
            self._save_model_state_pre_hook.move_to_end(ours.id)
        return handle

    # -- pickling ---------------------------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """Accelerate's state (its prepared objects, dataloaders, hooks) and the opt level's settings; not the engine's
        run, which pickling cannot carry (its masters are tied to the model's half parameters by reference, its hooks
        to the models and optimizers): the unpickled Accelerator starts a fresh engine with the same settings, as
        after :meth:`free_memory`. Its unpickled optimizers refuse to step (see ``AmpOptimizer.step``); prepare new
        ones, or carry a run with ``save_state``/``load_state``."""
        state = dict(self.__dict__)
        amp = state.get("amp")
        if amp is not None:
            state["amp"] = None
            state["_mpx_engine"] = (amp.opt_level, amp.found_inf_reducer, amp.log_overflows)
            state["_converted"] = None  # weak references (to the models the old engine converted)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        engine = state.pop("_mpx_engine", None)
        self.__dict__.update(state)
        if engine is not None:
            opt_level, reducer, log_overflows = engine
            assert self.mpx_kwargs is not None
            self.amp = Amp.from_settings(self.mpx_kwargs.settings(opt_level))
            self.amp.found_inf_reducer, self.amp.log_overflows = reducer, log_overflows
            self._converted = weakref.WeakSet()

    # -- what the user sees ---------------------------------------------------------------------------------------
    @property
    def mixed_precision(self) -> str:
        """The opt level, or Accelerate's own mode (``"no"``, ``"fp16"``, ...)."""
        amp = getattr(self, "amp", None)
        if amp is None or getattr(self, "_native_view", False):
            # While Accelerate's FSDP code prepares a model it reads "no": it would otherwise upcast an O3 model to
            # FP32 (the opt level decides the parameters' dtypes).
            return str(self.state.mixed_precision)
        return amp.opt_level

    @property
    def opt_level(self) -> str | None:
        """The opt level, or ``None`` with a native ``mixed_precision`` value."""
        return self.amp.opt_level if self.amp is not None else None

    # -- prepare ----------------------------------------------------------------------------------------------------
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """As ``accelerate.Accelerator.prepare``; with an opt level, models are prepared first whatever the order
        of ``args``, because O2's optimizer needs the FP32 masters that preparing its model creates."""
        if self.amp is None:
            return super().prepare(*args, device_placement=device_placement)
        # distributed_type first: after AcceleratorState._reset_state() it raises Accelerate's own hint, which the
        # property is_fsdp2 would turn into a bare "no attribute 'is_fsdp2'".
        if self.distributed_type == DistributedType.FSDP and self.is_fsdp2:
            return self._prepare_fsdp2_models(args, device_placement)
        # Stable: models first, everything else in its order; the results go back to the caller's order.
        order = sorted(range(len(args)), key=lambda i: not isinstance(args[i], nn.Module))
        placements = device_placement  # of the wrong length: Accelerate raises its own error
        if device_placement is not None and len(device_placement) == len(args):
            placements = [device_placement[i] for i in order]
        prepared = super().prepare(*(args[i] for i in order), device_placement=placements)
        if len(args) <= 1:
            return prepared
        result: list[Any] = [None] * len(args)
        for position, index in enumerate(order):
            result[index] = prepared[position]
        return tuple(result)

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module:
        """As ``accelerate.Accelerator.prepare_model``, with the opt level's conversion and forward applied first
        (with FSDP1: the level's casts before Accelerate wraps the model, the engine on the wrapped model)."""
        if self.amp is not None and self.distributed_type == DistributedType.FSDP:
            return self._prepare_fsdp1_model(model, device_placement, evaluation_mode)
        agree = self.num_processes > 1  # every rank's masters from rank zero's FP32 values (one broadcast)
        train = not evaluation_mode
        adopted = None if self.amp is None else take_over(self.amp, model, train=train, rank_zero_fp32=agree)
        if adopted is not None:
            self._converted.add(adopted)  # prepared by an engine before free_memory() or a pickle: now by this one
        if self.amp is None or getattr(model, "_is_accelerate_prepared", False) or model in self._converted:
            if self.amp is not None and model in self._converted and not evaluation_mode:
                # prepared for evaluation before: masters now (once), from rank zero's FP32 weights as below
                self.amp.prepare_model(model, train=True, rank_zero_fp32=self.num_processes > 1)
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if self.amp.properties.master_weights and train:
            # A clear error, not the engine's on a parameter without a shape, naming the user's call (mpx_trainer's).
            refuse_lazy(model, getattr(self, "_mpx_prepared_by", "accelerator.prepare"))
        place = self.device_placement if device_placement is None else device_placement
        if place and not self.verify_device_map(model):
            # On the device before conversion: O2's masters are created next to the parameters they copy.
            model.to(self.device)
        holders = holding(self.amp, self._amp_optimizers(), model, train=not evaluation_mode)  # prepared before it
        with keeping_grads(model):  # accumulated before it was prepared (its optimizer was): not dropped
            # No FP32 masters for a model only evaluated. Every rank prepares together, before DDP wraps the model:
            # the masters start from rank zero's exact FP32 weights (one broadcast), not from their half rounding.
            self.amp.prepare_model(model, train=not evaluation_mode, rank_zero_fp32=self.num_processes > 1)
        pair_again(self.amp, holders)  # their masters for its parameters, now half
        self._converted.add(model)
        install_forward(self.amp, model)
        if self.amp.properties.master_weights:  # unwrap_model(model).state_dict(), save_pretrained: the FP32 masters
            MastersInStateDict.install(model, self.amp)  # in place of an earlier engine's (another door's)
        prepared = super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if self.amp.master_weights and prepared is not model:
            # Wrapped (DDP broadcasts rank zero's weights to every process): the masters take the weights that
            # will be trained, where they differ from them.
            self.amp.refresh_masters(model.parameters(), force=True)
        return prepared

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """As ``accelerate.Accelerator.get_state_dict``; at O2 the half weights are replaced by their FP32 masters (the
        weights training produced, FP32 as with Accelerate's own modes; the masters themselves, not copies), so that
        ``save_model`` and the model files of ``save_state`` hold them too. What has no master (a frozen half
        parameter, a model prepared for evaluation only; O3) stays as the model holds it; with ``unwrap=True`` (an
        export: ``save_model``, your own call) frozen half parameters are named in a warning with the workaround."""
        state: dict[str, Any] = super().get_state_dict(model, unwrap=unwrap)
        if self.amp is not None and self.distributed_type != DistributedType.FSDP:
            module = self.unwrap_model(model) if unwrap else model
            engine = engine_of(module, self.amp)  # after free_memory(): the engine that trained it
            masters_into(engine, module, state)
            if unwrap:  # an export (save_model, your own call); save_state's own call (unwrap=False) resumes exactly
                warn_frozen_half(engine, module, state, "get_state_dict")
        return state

    def free_memory(self, *objects: Any) -> Any:
        """As ``accelerate.Accelerator.free_memory``; with an opt level, the engine's masters and optimizers are
        released too: the next ``prepare`` starts a fresh engine with the same settings (a model prepared again is
        taken over by it, at O2 with its FP32 masters: see ``accelerate_forward.take_over``). The loss scale, the
        overflow counts and skipped steps go on (as Accelerate's own ``GradScaler`` is kept across it)."""
        released = super().free_memory(*objects)
        if self.amp is not None:
            assert self.mpx_kwargs is not None
            old = self.amp
            old.diagnose_overflows = False  # its forward hooks leave the models
            release_optimizers(old)  # an optimizer prepared again steps in the new engine, with its state
            self.amp = Amp.from_settings(self.mpx_kwargs.settings(old.opt_level))
            self.amp.found_inf_reducer, self.amp.log_overflows = old.found_inf_reducer, old.log_overflows
            self.amp.continue_from(old)  # the scale and the counts go on, as Accelerate's GradScaler does
            self._converted = weakref.WeakSet()
        return released

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        """As ``accelerate.Accelerator.prepare_optimizer``; with an opt level the optimizer steps through the
        :class:`~lightning_mpx.engine.amp.Amp` (at O2 on the FP32 masters). Prepare its model first."""
        if self.amp is not None and released_by_engine(optimizer, self.amp):
            # Prepared before free_memory() (a retried training function that kept it): its engine released it, and
            # this one steps it now (on the masters that took over its model's).
            check_masters_exist(self.amp, optimizer.optimizer, len(self._converted))
            self.amp.prepare_optimizer(optimizer.optimizer)
            optimizer.amp, optimizer.on_step = self.amp, self._optimizer_stepped
            self._optimizers.append(optimizer)
            return optimizer
        if self.amp is None or getattr(optimizer, "_is_accelerate_prepared", False):
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        if self._deferred is None:
            if self.distributed_type == DistributedType.FSDP:
                self._check_sharded_optimizer(optimizer)
            check_masters_exist(self.amp, optimizer, len(self._converted))
            self.amp.prepare_optimizer(optimizer)
        wrapped = AmpOptimizer(
            optimizer,
            self.amp,
            self._optimizer_stepped,
            device_placement=self.device_placement if device_placement is None else device_placement,
        )
        self._optimizers.append(wrapped)
        if self._deferred is not None:
            self._deferred.append(wrapped)  # FSDP2: registered once Accelerate has swapped in the shards
        return wrapped

    # -- forward and backward ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> Iterator[None]:
        """As ``accelerate.Accelerator.autocast``; with an opt level, ``Amp.forward_context``: the O1 cast policy's
        scope, at O2 the policy that runs loss functions in FP32, at O3 the one that runs a loss on arguments of two
        floating dtypes in FP32 (nothing at O0)."""
        if self.amp is None:
            with super().autocast(autocast_handler):
                yield
            return
        if autocast_handler is not None:
            raise ValueError(
                f"autocast_handler configures torch.autocast, which mixed_precision={self.amp.opt_level!r} does "
                "not use; use lightning_mpx.disable_casts() to run part of an O1 forward pass in FP32."
            )
        with self.amp.forward_context():
            yield

    def backward(self, loss: torch.Tensor = _LOSS, loss_id: int = 0, **kwargs: Any) -> None:
        """Scaled backward of ``loss / gradient_accumulation_steps`` (Accelerate's division is kept).

        Args:
            loss: The loss (left out, or misspelt: refused naming it).
            loss_id: Which loss scaler to use (``0`` to ``num_losses - 1``); opt levels only.
            **kwargs: Passed to ``Tensor.backward``.
        """
        if self.amp is None:
            if loss_id != 0:
                raise ValueError(
                    f"loss_id={loss_id!r} needs an opt level (mixed_precision='O1', ...) with "
                    "MixedPrecisionKwargs(num_losses=...); Accelerate's native modes have one scaler."
                )
            super().backward(loss, **kwargs)
            return
        if kwargs:  # refused in the adapter's name (the core's check names its own backward())
            check_keywords("accelerator.backward()", kwargs, ("loss", *BACKWARD_KEYWORDS))
        self._close_iteration()  # a pending update must reach the scale this backward uses
        every = self.mpx_kwargs.telemetry_every_n_steps if self.mpx_kwargs is not None else None
        if every is not None and self._iterations % every == 0:
            self.amp.request_telemetry()  # before this iteration's unscale; Amp.update() ends the request
        try:  # (no cost without an exception)
            divided = loss / self.gradient_accumulation_steps
        except TypeError:
            if isinstance(loss, Required) and kwargs:  # misspelt (los=): named, with the one meant
                check_keywords("accelerator.backward()", kwargs, ("loss", *BACKWARD_KEYWORDS))
            raise
        self.amp.backward(divided, loss_id=loss_id, **kwargs)

    # -- metrics ----------------------------------------------------------------------------------------------------
    # -- internals ----------------------------------------------------------------------------------------------------
    def _amp_optimizers(self) -> list[AmpOptimizer]:
        return [opt for opt in self._optimizers if isinstance(opt, AmpOptimizer)]

    def _optimizer_stepped(self, optimizer: AmpOptimizer) -> None:
        # The engine recorded the step: the iteration ends once every optimizer prepared here stepped (or skipped).
        if self.amp is not None and all(self.amp.iteration.stepped(opt.optimizer) for opt in self._amp_optimizers()):
            self._close_iteration()

    def _close_iteration(self) -> None:
        if self.amp is not None and self.amp.end_iteration():
            self._iterations += 1

    def _save_amp_state(
        self, models: list[nn.Module], weights: list[dict[str, Any]], output_dir: str, grad_scaler: bool = True
    ) -> None:
        # grad_scaler=False: no scaler.pt (transformers' Trainer loads one into accelerator.scaler, None unless fp16)
        assert self.amp is not None
        self._close_iteration()  # on every rank: the checkpoint holds the scale the next backward would use
        if not (self.is_main_process or (self.project_configuration.save_on_each_node and self.is_local_main_process)):
            return  # built where written only: no collective in it (the flags were reduced at the step)
        modules = [self.unwrap_model(m) for m in models]
        # the log's position with it; the masters the model files hold are not copied (the lean entry drops them, a
        # full one is written at once): a copy of each was a model's worth of memory at every save
        state = self.amp._state_dict(shared_masters(self.amp, modules))
        # At O2 the model files hold the FP32 masters: each is written once (load_state loads those files after this)
        state = masters_left_to_weights(self.amp, modules, weights, state)
        write_amp_state(state, output_dir, self.amp.scalers if grad_scaler else ())

    def _load_amp_state(self, models: list[nn.Module], input_dir: str) -> None:
        assert self.amp is not None
        path = amp_state_path(input_dir, self.amp.opt_level)
        self._close_iteration()
        for opt in self._amp_optimizers():
            opt.unscaled = False
        # The next log counts from the saving run's last one (a checkpoint of the release before: its counts not logged)
        self.amp.load_state_dict(upgrade_unlogged(read_amp_state(path), LOG_READER))
        self.amp._checkpoint.held.words = (_HELD_ENTRY, _HELD_ADVICE)  # its refusal names Accelerate's calls


# The O2/O3 resume check's words (engine.held_masters) for an entry load_state loaded without the models' files.
_HELD_ENTRY = "accelerator.load_state() loaded the engine's entry of a checkpoint that"
_HELD_ADVICE = (
    "accelerator.load_state(dir) loads the models' files and the engine's entry together: a load_state pre-hook "
    "(register_load_state_pre_hook) that took the models out of its list skipped the models' files. Load them before "
    "the next optimizer.step(): leave the models in load_state's list, or load the model file of that directory "
    "into accelerator.unwrap_model(model) yourself (load_state_dict)."
)


# The old names of the forward and optimizer wrappers, under which earlier pickles of prepared models refer to them.
_AmpForward, _AmpOptimizer = AmpForward, AmpOptimizer
