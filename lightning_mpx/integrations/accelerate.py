"""Hugging Face Accelerate with Apex-style opt levels: ``Accelerator(mixed_precision="O2")``.

Swap the import and pick an opt level; the rest of an Accelerate script stays as it is::

    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    accelerator = Accelerator(mixed_precision="O2", kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")])
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for x, y in loader:
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
  cast policy is active during the forward; O2: loss functions called inside it run in FP32; O2/O3: float inputs
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
  ``MixedPrecisionKwargs(log_metrics=False)`` turns this off and :meth:`Accelerator.mpx_metrics` returns them.
* ``save_state``/``load_state`` write and read the loss scalers, the FP32 masters and the skip counters in
  ``lightning_mpx_amp.bin`` next to Accelerate's own files.

**FSDP** (``fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)``, or 1): Accelerate shards the model and
the opt level is carried out partly by FSDP. The plugin's ``mixed_precision_policy`` is set to the level's
(:func:`lightning_mpx.integrations.fsdp.mixed_precision_policy`, FSDP1: :func:`~lightning_mpx.integrations.fsdp.fsdp1_mixed_precision`:
gathered in half, gradients reduced in FP32); before Accelerate shards, the model gets the level's casts (O3: half;
O1/O2: trainable half parameters FP32, as Accelerate's own FSDP upcast) and, with FSDP2, its FP32 islands (batch norm
where the level keeps it FP32, ``fp32_modules``) become FSDP units of their own. Then the
:class:`~lightning_mpx.engine.amp.Amp` prepares the *sharded* model (no conversion, no second copy: FSDP's sharded FP32
parameters are the O2 masters) and the optimizer once Accelerate has swapped its parameters for the shards. The
scaler works on each rank's shards with one all-reduce per step (overflow flags and the global squared norm), so
``clip_grad_norm_(model.parameters(), ...)`` clips by the global norm and every rank skips an overflow step with
the same scale; ``save_state`` uses FSDP's own checkpoints and writes the engine's state (identical on every rank)
once. With FSDP1, make the optimizer from the prepared model (as Accelerate asks). Refused: ``on_floor="promote"``
at O2/O3, a ``mixed_precision_policy`` of your own; DeepSpeed refuses every opt level (configure its own ``fp16``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import os
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from lightning_mpx.casting.boundary import INPUT_DTYPES, DtypeProbe
from lightning_mpx.common.dtypes import parse_half_dtype
from lightning_mpx.common.imports import require
from lightning_mpx.integrations import accelerate_fsdp as _accelerate_fsdp
from lightning_mpx.common.containers import _cast_collection
from lightning_mpx.engine.amp import Amp
from lightning_mpx.casting.table import _NAMESPACES as _TABLE_NAMESPACES
from lightning_mpx.casting.table import CastTable
from lightning_mpx.opt_levels import OPT_LEVELS, _check_loss_scale
from lightning_mpx.health.promotion import check_patterns
from lightning_mpx.settings import (
    DEFAULTS,
    MODEL_WRITES,
    SCALER_FIELDS,
    MixedPrecisionSettings,
    OnFloor,
    ScalerSettings,
    check_choice,
    check_flag,
    check_positive_int,
)
from lightning_mpx.scaling.unscale import BACKENDS

# Import through require() so that a missing accelerate names the extra that installs it.
require("accelerate", feature="lightning_mpx.integrations.accelerate")
from accelerate import Accelerator as _BaseAccelerator  # type: ignore[import-untyped]  # noqa: E402
from accelerate.optimizer import AcceleratedOptimizer  # type: ignore[import-untyped]  # noqa: E402
from accelerate.utils import (  # type: ignore[import-untyped]  # noqa: E402
    AutocastKwargs,
    DistributedType,
    GradScalerKwargs,
    KwargsHandler,
    is_compiled_module,
)

__all__ = ["AMP_STATE_NAME", "NATIVE_MIXED_PRECISION", "Accelerator", "MixedPrecisionKwargs"]

#: Accelerate's own ``mixed_precision`` values, passed through unchanged.
NATIVE_MIXED_PRECISION: tuple[str, ...] = ("no", "fp16", "bf16", "fp8")
#: The file that ``save_state`` writes the :class:`~lightning_mpx.engine.amp.Amp` state to.
AMP_STATE_NAME = "lightning_mpx_amp.bin"

_D, _S = DEFAULTS, DEFAULTS.scaler  # the defaults of the fields, from the one place that defines them
_ADAPTER_FIELDS = ("log_metrics", "telemetry_every_n_steps", "fsdp_gather")
#: ``MixedPrecisionKwargs(fsdp_gather=...)``: the dtype FSDP all-gathers O1's FP32 parameters in (see lightning_mpx.integrations.fsdp).
FSDP_GATHER_CHOICES: tuple[str, ...] = ("half", "fp32")
_SUPPORTED_DISTRIBUTED = (
    DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.FSDP
)
_DEEPSPEED_HINT = (
    "DeepSpeed brings its own mixed-precision engine (FP16 master weights in its ZeRO optimizer, its own dynamic "
    "loss scaler), which an opt level would fight: configure it in DeepSpeed's config instead, e.g. "
    '"fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1} '
    '(or "bf16": {"enabled": true}), or pass Accelerate\'s mixed_precision="fp16"/"bf16" with the DeepSpeed plugin.'
)


@dataclasses.dataclass
class MixedPrecisionKwargs(KwargsHandler):  # type: ignore[misc]
    """Settings of the opt level, in Accelerate's kwargs-handler style.

    Pass it as ``Accelerator(mixed_precision="O2", kwargs_handlers=[MixedPrecisionKwargs(...)])``. The defaults are
    :class:`~lightning_mpx.engine.amp.Amp`'s; only the fields you change are passed on. Values are checked here as far as
    they can be without the opt level, and again, against the opt level, when the :class:`Accelerator` is built.

    Args:
        half_dtype, num_losses, cast_table, allow_banned, unscale_backend, overflow_log_interval, model_writes,
            diagnose_overflows, fp32_modules, skip_on_device: The engine's settings, documented and checked in
            :class:`~lightning_mpx.settings.MixedPrecisionSettings` (pass ``loss_id`` to
            :meth:`Accelerator.backward` with ``num_losses`` above 1; the overflow record of ``diagnose_overflows``
            is ``accelerator.amp.last_overflow``).
        cast_model_type, patch_torch_functions, keep_batchnorm_fp32, master_weights, loss_scale: Opt-level property
            overrides (see :func:`~lightning_mpx.opt_levels.resolve_properties`); ``None`` keeps the preset's value.
        init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, consecutive_hysteresis,
            min_loss_scale, max_loss_scale, on_floor: Loss-scaler settings (see
            :class:`~lightning_mpx.settings.ScalerSettings`).
        log_metrics: Add the ``mpx/...`` metrics to every :meth:`Accelerator.log` call.
        telemetry_every_n_steps: Measure underflow, zeros and headroom (``mpx/underflow/<module>``,
            ``mpx/zeros/<module>``, ``mpx/headroom/<module>``, see :mod:`lightning_mpx.health.telemetry`) in the unscale of
            every n-th iteration
            (the first, then every n-th: log when ``step % n == 0``); ``None`` (default) measures only after
            :meth:`Accelerator.request_mpx_telemetry`.
        fsdp_gather: Under Accelerate's FSDP at O1, the dtype FSDP all-gathers the FP32 parameters in: ``"half"``
            (default; the cast table on top) or ``"fp32"`` (Apex's exact O1, which keeps half copies of the weights
            alive until the backward: about 45% of the model's FP32 bytes on every rank, measured). Only ``"half"``
            at O2/O3; ignored without FSDP.

    Raises:
        ValueError: for a value that is invalid whatever the opt level (a dtype, a scaler setting, ...).
        TypeError: for a flag that is not a bool.
    """

    half_dtype: str | torch.dtype = _D.half_dtype
    num_losses: int = _D.num_losses
    cast_model_type: str | torch.dtype | None = None
    patch_torch_functions: bool | None = None
    keep_batchnorm_fp32: bool | None = None
    master_weights: bool | None = None
    loss_scale: float | str | None = None
    init_scale: float = _S.init_scale
    growth_factor: float = _S.growth_factor
    backoff_factor: float = _S.backoff_factor
    growth_interval: int = _S.growth_interval
    hysteresis: int = _S.hysteresis
    consecutive_hysteresis: bool = _S.consecutive_hysteresis
    min_loss_scale: float = _S.min_loss_scale
    max_loss_scale: float = _S.max_loss_scale
    on_floor: OnFloor = _S.on_floor
    cast_table: CastTable | None = _D.cast_table
    allow_banned: bool = _D.allow_banned
    unscale_backend: str = _D.unscale_backend
    overflow_log_interval: float = _D.overflow_log_interval
    model_writes: str = _D.model_writes
    fp32_modules: Sequence[str] = _D.fp32_modules
    skip_on_device: bool = _D.skip_on_device
    log_metrics: bool = True
    diagnose_overflows: bool = _D.diagnose_overflows
    telemetry_every_n_steps: int | None = None
    fsdp_gather: str = "half"

    def __post_init__(self) -> None:
        # The checks that need no opt level, with the messages of lightning_mpx.settings; settings() checks the rest.
        parse_half_dtype(self.half_dtype)
        self.fp32_modules = check_patterns(self.fp32_modules)
        check_positive_int("num_losses", self.num_losses)
        for name in ("patch_torch_functions", "keep_batchnorm_fp32", "master_weights"):
            if getattr(self, name) not in (None, True, False):
                raise TypeError(f"{name}={getattr(self, name)!r} must be True, False or None (the preset's value).")
        for name in ("allow_banned", "log_metrics", "diagnose_overflows", "skip_on_device"):
            check_flag(name, getattr(self, name))
        every = self.telemetry_every_n_steps
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"telemetry_every_n_steps={every!r} must be a positive integer or None.")
        check_choice("unscale_backend", self.unscale_backend, BACKENDS)
        check_choice("fsdp_gather", self.fsdp_gather, FSDP_GATHER_CHOICES, quote=True)
        check_choice("model_writes", self.model_writes, MODEL_WRITES, quote=True)
        if self.cast_table is not None and not isinstance(self.cast_table, CastTable):
            raise TypeError(f"cast_table={type(self.cast_table).__name__} must be a lightning_mpx.CastTable or None.")
        loss_scale = "dynamic" if self.loss_scale is None else self.loss_scale
        _check_loss_scale(loss_scale)
        ScalerSettings(**{name: getattr(self, name) for name in SCALER_FIELDS}).check_init_scale(loss_scale)

    def settings(self, opt_level: str) -> MixedPrecisionSettings:
        """The :class:`~lightning_mpx.settings.MixedPrecisionSettings` of ``opt_level`` with these fields."""
        return MixedPrecisionSettings.from_kwargs(opt_level, **self.amp_kwargs())

    def amp_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for :class:`~lightning_mpx.engine.amp.Amp`: the fields changed from their defaults."""
        return {k: v for k, v in self.to_kwargs().items() if k not in _ADAPTER_FIELDS}


class Accelerator(_BaseAccelerator):  # type: ignore[misc]
    """``accelerate.Accelerator`` that also accepts the opt levels ``"O0"`` to ``"O3"`` as ``mixed_precision``.

    Args:
        *args: Passed to ``accelerate.Accelerator``.
        mixed_precision: An opt level (``"O0"``, ``"O1"``, ``"O2"``, ``"O3"``) or one of Accelerate's values
            (``"no"``, ``"fp16"``, ``"bf16"``, ``"fp8"``), which behave exactly as in Accelerate. ``None`` reads
            ``ACCELERATE_MIXED_PRECISION``, which may also hold an opt level.
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
        self.amp: Amp | None = None
        self.mpx_kwargs: MixedPrecisionKwargs | None = None
        handlers = list(kwargs_handlers or [])
        ours = [h for h in handlers if isinstance(h, MixedPrecisionKwargs)]
        theirs = [h for h in handlers if not isinstance(h, MixedPrecisionKwargs)]
        if len(ours) > 1:
            raise ValueError(f"kwargs_handlers holds {len(ours)} MixedPrecisionKwargs; pass at most one.")
        opt_level = _opt_level_of(mixed_precision)
        if opt_level is None:
            if ours:
                raise ValueError(
                    f"MixedPrecisionKwargs configures an opt level, but mixed_precision={mixed_precision!r}; use "
                    f"one of {', '.join(map(repr, OPT_LEVELS))}, or drop MixedPrecisionKwargs."
                )
            super().__init__(*args, mixed_precision=mixed_precision, kwargs_handlers=theirs or None, **kwargs)
            return

        native = [type(h).__name__ for h in theirs if isinstance(h, (GradScalerKwargs, AutocastKwargs))]
        if native:
            raise ValueError(
                f"{', '.join(native)} configure torch's GradScaler/autocast, which mixed_precision={opt_level!r} "
                "does not use; pass the loss-scaler settings in MixedPrecisionKwargs instead."
            )
        settings = ours[0] if ours else MixedPrecisionKwargs()
        # Built before Accelerate sets up processes and devices, so that a bad combination fails fast.
        amp = Amp.from_settings(settings.settings(opt_level))
        deepspeed = kwargs.get("deepspeed_plugin") or kwargs.get("deepspeed_plugins")
        if deepspeed is not None or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
            raise ValueError(f"mixed_precision={opt_level!r} cannot run under DeepSpeed. {_DEEPSPEED_HINT}")
        self._native_view = False  # True while Accelerate's own code prepares a model: see mixed_precision
        super().__init__(*args, mixed_precision="no", kwargs_handlers=theirs or None, **kwargs)
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
                amp.found_inf_reducer = _all_reduce_max  # every rank takes the same skip decision
            amp.log_overflows = self.is_main_process
        # Optimizers that stepped (or skipped) since the last Amp.update(): see the module docstring.
        self._stepped: set[int] = set()
        self._iterations = 0  # Amp.update() calls so far: telemetry_every_n_steps counts them
        self._converted: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        # FSDP2: optimizers prepared before Accelerate sharded their model, registered with the engine after.
        self._deferred: list[_AmpOptimizer] | None = None
        self.register_save_state_pre_hook(self._save_amp_state)
        self.register_load_state_pre_hook(self._load_amp_state)

    # -- pickling ---------------------------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """Accelerate's state (its prepared objects, dataloaders, hooks) and the opt level's settings; not the engine's
        run, which pickling cannot carry (its masters are tied to the model's half parameters by reference, its hooks
        to the models and optimizers): the unpickled Accelerator starts a fresh engine with the same settings, as
        after :meth:`free_memory`. Its unpickled optimizers refuse to step (see ``_AmpOptimizer.step``); prepare new
        ones, or carry a run with ``save_state``/``load_state``."""
        state = dict(self.__dict__)
        amp = state.get("amp")
        if amp is not None:
            state["amp"] = None
            state["_mpx_engine"] = (amp.opt_level, amp.found_inf_reducer, amp.log_overflows)
            state["_converted"] = None  # weak references (to the models the old engine converted)
            state["_stepped"] = set()
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
        if self.is_fsdp2:
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
        if self.amp is None or getattr(model, "_is_accelerate_prepared", False) or model in self._converted:
            if self.amp is not None and model in self._converted and not evaluation_mode:
                self.amp.prepare_model(model, train=True)  # prepared for evaluation before: masters now (once)
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        place = self.device_placement if device_placement is None else device_placement
        if place and not self.verify_device_map(model):
            # On the device before conversion: O2's masters are created next to the parameters they copy.
            model.to(self.device)
        self.amp.prepare_model(model, train=not evaluation_mode)  # no FP32 masters for a model only evaluated
        self._converted.add(model)
        self._install_forward(model)
        prepared = super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if self.amp.master_weights and prepared is not model:
            # Wrapped (DDP broadcasts rank zero's weights to every process): the masters take the weights that
            # will be trained, where they differ from them.
            self.amp.refresh_masters(model.parameters(), force=True)
        return prepared

    def _install_forward(self, model: nn.Module) -> None:
        assert self.amp is not None
        if self.amp.properties.patch_torch_functions or self.amp.properties.casts_model:
            # An instance attribute, as Accelerate's own autocast wrapper: the class and other instances are untouched,
            # and unwrap_model(model, keep_fp32_wrapper=False) removes it through _original_forward.
            # A torch.compile'd model gets it on its original module, inside the compiled region: the policy is
            # traced into the graph and no mode is left on the stack while the compiled code runs.
            target = model._orig_mod if is_compiled_module(model) else model
            target._original_forward = target.forward  # type: ignore[assignment]
            target.forward = _AmpForward(target.forward, self.amp)

    # -- FSDP ---------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _as_native(self) -> Iterator[None]:
        """Accelerate's own preparation code reads ``mixed_precision`` as ``"no"`` inside (its FSDP paths upcast
        half parameters otherwise; the opt level has decided the dtypes already)."""
        self._native_view = True
        try:
            yield
        finally:
            self._native_view = False

    @property
    def _fsdp_gather(self) -> str:
        return self.mpx_kwargs.fsdp_gather if self.mpx_kwargs is not None else "half"

    def _fsdp2_shard_kwargs(self) -> dict[str, Any]:
        """``fully_shard``'s mesh, offload and reshard settings, as Accelerate's ``fsdp2_prepare_model`` takes them."""
        plugin = self.state.fsdp_plugin
        mesh = getattr(self, "torch_device_mesh", None)
        return {
            "mesh": mesh[tuple(self.parallelism_config.fsdp_dim_names)] if mesh is not None else None,
            "reshard_after_forward": plugin.reshard_after_forward,
            "offload_policy": plugin.cpu_offload,
        }

    def _prepare_fsdp2_models(self, args: tuple[Any, ...], device_placement: list[bool] | None) -> Any:
        """FSDP2: the level's casts and FP32 islands first, then Accelerate (which prepares the optimizers, shards the
        model, and swaps the optimizers' parameters for the shards), then the engine on the sharded model and the
        optimizers as they are now."""
        assert self.amp is not None
        optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
        for model in args:
            if isinstance(model, nn.Module) and not getattr(model, "_is_accelerate_prepared", False):
                mapping = _accelerate_fsdp.before_sharding(
                    model, self.amp.settings, 2, self._fsdp2_shard_kwargs(), gather=self._fsdp_gather
                )
                _accelerate_fsdp.swap_parameters(optimizers, mapping)
        self._deferred = []
        try:
            with self._as_native():
                prepared = super().prepare(*args, device_placement=device_placement)
            deferred = self._deferred
        finally:
            self._deferred = None
        for obj in prepared if isinstance(prepared, (tuple, list)) else (prepared,):  # a list from FSDP2
            if isinstance(obj, nn.Module) and obj not in self._converted:
                self.amp.prepare_model(obj)  # sharded: no conversion, no masters; the policies are checked
                self._converted.add(obj)
                self._install_forward(obj)
        for wrapped in deferred:
            self.amp.prepare_optimizer(wrapped.optimizer)  # after the swap: it holds the shards now
        return prepared

    def _prepare_fsdp1_model(self, model: nn.Module, device_placement: bool | None, evaluation_mode: bool) -> nn.Module:
        """FSDP1: the level's casts before Accelerate wraps the model, the engine on the wrapped model."""
        assert self.amp is not None
        if self.is_fsdp2 or getattr(model, "_is_accelerate_prepared", False) or model in self._converted:
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        _accelerate_fsdp.before_sharding(model, self.amp.settings, 1, {}, gather=self._fsdp_gather)
        self._install_forward(model)  # on the inner module: the wrapper's forward calls it
        with self._as_native():
            prepared = super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        self.amp.prepare_model(prepared, train=not evaluation_mode)
        self._converted.add(model)
        self._converted.add(prepared)
        return prepared

    def _check_sharded_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer that does not hold the prepared (sharded) model's parameters: FSDP1 replaces them
        with flat shards when it wraps the model, and an optimizer made before would train tensors nothing uses."""
        known = {id(p) for model in self._models for p in model.parameters()}
        params = list(_params(optimizer))
        stale = sum(id(p) not in known for p in params)
        if stale:
            raise ValueError(
                f"optimizer={type(optimizer).__name__} holds {stale} of {len(params)} parameter(s) that are not the "
                "parameters of a model this Accelerator sharded with FSDP (FSDP1 replaces them with flat shards when "
                "it wraps the model): prepare the model first, then make the optimizer from it: `model = "
                "accelerator.prepare(model); optimizer = accelerator.prepare(AdamW(model.parameters()))`."
            )

    def _check_masters_exist(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse, naming the calls, an optimizer at O2 before any model was prepared for training: it steps the FP32
        masters that preparing a model (for training) makes."""
        assert self.amp is not None
        if not self.amp.properties.master_weights or self.amp.sharded or self.amp.master_weights:
            return
        level = self.amp.opt_level
        name = type(optimizer).__name__
        if not len(self._converted):
            raise RuntimeError(
                f"optimizer={name} was prepared before its model, and no model has been prepared by this Accelerator: "
                f"at mixed_precision={level!r} the optimizer steps the FP32 master weights that preparing the model "
                "makes. Prepare the model first or in the same call: `model, optimizer = accelerator.prepare(model, "
                "optimizer)` (any order), or `model = accelerator.prepare(model)` before "
                "`optimizer = accelerator.prepare(optimizer)`."
            )
        raise RuntimeError(
            f"optimizer={name} was prepared, but every model this Accelerator prepared was prepared for evaluation "
            f"(`prepare_model(model, evaluation_mode=True)`), which makes no FP32 master weights; at "
            f"mixed_precision={level!r} the optimizer steps them. Prepare its model for training first: "
            "`model = accelerator.prepare(model)` (or `accelerator.prepare_model(model)`), then "
            "`optimizer = accelerator.prepare(optimizer)`."
        )

    def free_memory(self, *objects: Any) -> Any:
        """As ``accelerate.Accelerator.free_memory``; with an opt level, the engine's masters, optimizers and loss
        scales are released too: the next ``prepare`` starts a fresh engine with the same settings."""
        released = super().free_memory(*objects)
        if self.amp is not None:
            assert self.mpx_kwargs is not None
            old = self.amp
            old.diagnose_overflows = False  # its forward hooks leave the models
            self.amp = Amp.from_settings(self.mpx_kwargs.settings(old.opt_level))
            self.amp.found_inf_reducer, self.amp.log_overflows = old.found_inf_reducer, old.log_overflows
            self._stepped.clear()
            self._converted = weakref.WeakSet()
        return released

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        """As ``accelerate.Accelerator.prepare_optimizer``; with an opt level the optimizer steps through the
        :class:`~lightning_mpx.engine.amp.Amp` (at O2 on the FP32 masters). Prepare its model first."""
        if self.amp is None or getattr(optimizer, "_is_accelerate_prepared", False):
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        if self._deferred is None:
            if self.distributed_type == DistributedType.FSDP:
                self._check_sharded_optimizer(optimizer)
            self._check_masters_exist(optimizer)
            self.amp.prepare_optimizer(optimizer)
        wrapped = _AmpOptimizer(
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
        scope, at O2 the policy that runs loss functions in FP32 (nothing at O0 and O3)."""
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

    def backward(self, loss: torch.Tensor, loss_id: int = 0, **kwargs: Any) -> None:
        """Scaled backward of ``loss / gradient_accumulation_steps`` (Accelerate's division is kept).

        Args:
            loss: The loss.
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
        self._close_iteration()  # a pending update must reach the scale this backward uses
        every = self.mpx_kwargs.telemetry_every_n_steps if self.mpx_kwargs is not None else None
        if every is not None and self._iterations % every == 0:
            self.amp.request_telemetry()  # before this iteration's unscale; Amp.update() ends the request
        self.amp.backward(loss / self.gradient_accumulation_steps, loss_id=loss_id, **kwargs)

    # -- gradients --------------------------------------------------------------------------------------------------
    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Unscale the gradients of ``optimizer`` (one, a list, or ``None``: every prepared optimizer that holds
        gradients). At O2 the unscaled gradients are the FP32 masters' ``.grad``. Does nothing to an optimizer
        already unscaled since its last step. Call it right before the step: a later backward would add scaled
        gradients to unscaled ones."""
        if self.amp is None:
            super().unscale_gradients(optimizer)
            return
        self._check_sync("unscale_gradients")
        if optimizer is None:
            owners = [opt for opt in self._amp_optimizers() if self._has_grads(opt)]
        else:
            owners = [self._owner(opt) for opt in (optimizer if isinstance(optimizer, (list, tuple)) else [optimizer])]
        self._unscale(owners)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        """Clip the unscaled gradients of ``parameters`` to a global norm; returns the norm before clipping.

        With an opt level, ``parameters`` (the model's or the optimizer's) are mapped to the optimizers that train
        them, which are unscaled first; when they are exactly one optimizer's parameters and ``norm_type`` is 2,
        unscaling, the overflow check, the norm and the clip are one fused pass, and the norm is logged as
        ``mpx/grad_norm``. Under FSDP the norm is the global one (over every rank's shards); only that fused case
        is supported there.

        Raises:
            RuntimeError: inside ``accumulate()`` on a step that does not synchronise gradients.
            ValueError: when a parameter with a gradient belongs to no optimizer prepared by this accelerator, or
                under FSDP for a part of an optimizer's parameters or a norm_type other than 2.
        """
        if self.amp is None:
            return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)  # type: ignore[no-any-return]
        self._check_sync("clip_grad_norm_")
        owners, targets = self._targets(parameters)
        if float(norm_type) == 2.0 and len(owners) == 1:
            owner = owners[0]
            if {id(p) for p in targets} == {id(p) for p in self.amp.master_params(owner.optimizer)}:
                norm = self.amp.clip_grad_norm_(owner.optimizer, max_norm)
                owner.unscaled = True
                return norm
        if self.amp.sharded:
            raise ValueError(
                f"clip_grad_norm_ with norm_type={norm_type!r} on {len(targets)} parameter(s) of {len(owners)} "
                "optimizer(s): under FSDP the global norm (one collective across ranks) is computed for exactly "
                "one optimizer's parameters with norm_type=2. Pass model.parameters() (or that optimizer's "
                "parameters) and norm_type=2."
            )
        self._unscale(owners)
        return torch.nn.utils.clip_grad_norm_(targets, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Clamp the unscaled gradients of ``parameters`` to ``[-clip_value, clip_value]`` (see
        :meth:`clip_grad_norm_` for how parameters are mapped)."""
        if self.amp is None:
            super().clip_grad_value_(parameters, clip_value)
            return
        self._check_sync("clip_grad_value_")
        owners, targets = self._targets(parameters)
        self._unscale(owners)
        torch.nn.utils.clip_grad_value_(targets, clip_value)

    # -- metrics ----------------------------------------------------------------------------------------------------
    def request_mpx_telemetry(self) -> None:
        """Measure underflow and headroom in this iteration's unscale (call it before the optimizer step); the next
        :meth:`log` or :meth:`mpx_metrics` holds ``mpx/underflow/<module>``, ``mpx/zeros/<module>`` and
        ``mpx/headroom/<module>``."""
        if self.amp is None:
            raise ValueError(
                f"request_mpx_telemetry() needs an opt level, but mixed_precision={self.mixed_precision!r}; use "
                f"one of {', '.join(map(repr, OPT_LEVELS))}."
            )
        self.amp.request_telemetry()

    def mpx_metrics(self) -> dict[str, float]:
        """``mpx/loss_scale``, ``mpx/overflows`` (since the previous call), ``mpx/skipped_steps`` and
        ``mpx/grad_norm`` (when ``clip_grad_norm_`` computed it since the previous call) as Python floats, with a
        ``/loss{id}`` suffix when there are several losses, and ``mpx/underflow/<module>``, ``mpx/zeros/<module>``
        and ``mpx/headroom/<module>`` after telemetry was measured. Reads the device (one sync); empty with a native
        value."""
        if self.amp is None:
            return {}
        return {name: float(value) for name, value in self.amp.metrics().items()}

    def log(self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, Any] | None = None) -> None:
        """As ``accelerate.Accelerator.log``; with an opt level the :meth:`mpx_metrics` are added to ``values``
        (your own values win on a name clash) unless ``MixedPrecisionKwargs(log_metrics=False)``. The device is read
        only here, and only on the main process, which is the only one that logs."""
        if self.amp is not None and self.mpx_kwargs is not None and self.mpx_kwargs.log_metrics and self.is_main_process:
            values = {**self.mpx_metrics(), **values}
        super().log(values, step=step, log_kwargs=log_kwargs)

    # -- internals ----------------------------------------------------------------------------------------------------
    def _amp_optimizers(self) -> list[_AmpOptimizer]:
        return [opt for opt in self._optimizers if isinstance(opt, _AmpOptimizer)]

    def _optimizer_stepped(self, optimizer: _AmpOptimizer) -> None:
        self._stepped.add(id(optimizer))
        if all(id(opt) in self._stepped for opt in self._amp_optimizers()):
            self._close_iteration()

    def _close_iteration(self) -> None:
        if self.amp is not None and self._stepped:
            self.amp.update()
            self._stepped.clear()
            self._iterations += 1

    def _check_sync(self, what: str) -> None:
        if not self.sync_gradients:
            raise RuntimeError(
                f"{what}() was called while accelerator.sync_gradients is False (inside accumulate(), before the "
                "last micro-batch): the gradients are still accumulating, scaled. Call it under "
                "`if accelerator.sync_gradients:`."
            )

    def _owner(self, optimizer: Any) -> _AmpOptimizer:
        for opt in self._amp_optimizers():
            if optimizer is opt or optimizer is opt.optimizer:
                return opt
        raise ValueError(f"optimizer={type(optimizer).__name__} was not prepared by this Accelerator.")

    def _has_grads(self, owner: _AmpOptimizer) -> bool:
        return any(p.grad is not None for p in _params(owner.optimizer))

    def _targets(self, parameters: Any) -> tuple[list[_AmpOptimizer], list[torch.Tensor]]:
        """The optimizers that train ``parameters``, and the tensors whose ``.grad`` hold their unscaled gradients
        (the FP32 masters at O2, the parameters themselves otherwise)."""
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        index: dict[int, tuple[_AmpOptimizer, torch.Tensor]] = {}
        assert self.amp is not None
        for opt in self._amp_optimizers():
            for param in _params(opt.optimizer):
                master = self.amp.master_of(param)  # where the unscaled gradient lives
                index[id(param)] = index[id(master)] = (opt, master)
        owners: dict[int, _AmpOptimizer] = {}
        targets: dict[int, torch.Tensor] = {}
        strays = 0
        for param in params:
            hit = index.get(id(param))
            if hit is None:
                strays += param.grad is not None
                continue
            owners.setdefault(id(hit[0]), hit[0])
            targets.setdefault(id(hit[1]), hit[1])
        if strays:
            raise ValueError(
                f"parameters holds {strays} tensor(s) with gradients that no optimizer prepared by this Accelerator "
                "trains: their gradients are scaled and cannot be unscaled. Prepare the optimizer that trains them."
            )
        return list(owners.values()), list(targets.values())

    def _unscale(self, owners: Iterable[_AmpOptimizer]) -> None:
        assert self.amp is not None
        for owner in owners:
            if not self.amp.is_unscaled(owner.optimizer):  # the engine's stage: a skipped batch's clip is forgotten
                self.amp.unscale_(owner.optimizer)
                owner.unscaled = True

    def _save_amp_state(self, models: list[nn.Module], weights: list[dict[str, Any]], output_dir: str) -> None:
        assert self.amp is not None
        self._close_iteration()  # the checkpoint holds the scale the next backward would use
        state = self.amp.state_dict()  # every rank reads its device state (all ranks agree: the flags are reduced)
        if self.is_main_process or (self.project_configuration.save_on_each_node and self.is_local_main_process):
            torch.save(state, os.path.join(output_dir, AMP_STATE_NAME))

    def _load_amp_state(self, models: list[nn.Module], input_dir: str) -> None:
        assert self.amp is not None
        path = os.path.join(input_dir, AMP_STATE_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"{path} does not exist: the checkpoint in {input_dir} was not saved by lightning_mpx's Accelerator "
                f"with an opt level, so the loss scale and FP32 masters of mixed_precision={self.amp.opt_level!r} "
                "cannot be restored. To start this run from the weights of a checkpoint of plain Accelerate, load "
                "them into the model before accelerator.prepare(...) (model.load_state_dict(...), or accelerate's "
                "load_checkpoint_in_model), or after it (FP32 values go to the O2 masters exactly); the optimizer "
                "and the loss scale then start afresh."
            )
        self._close_iteration()
        for opt in self._amp_optimizers():
            opt.unscaled = False
        self.amp.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


_UNPICKLED_STEP = (
    "this prepared optimizer was unpickled (or deep-copied): the loss scale and FP32 master weights it stepped with "
    "belong to the Accelerator that prepared it, and are not pickled with it. Prepare an optimizer again and load this "
    "one's state: `optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters()))` (after "
    "`accelerator.prepare(model)`), then `optimizer.load_state_dict(unpickled.state_dict())`; to carry a whole run "
    "(loss scales, masters), use accelerator.save_state(dir) and accelerator.load_state(dir)."
)


class _AmpOptimizer(AcceleratedOptimizer):  # type: ignore[misc]
    """Accelerate's optimizer wrapper whose real step goes through :meth:`Amp.step`.

    ``step_was_skipped`` is true after an overflow, which keeps a prepared scheduler from advancing; inside
    ``accumulate()`` a step that does not synchronise gradients does nothing, as in Accelerate.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        amp: Amp,
        on_step: Callable[[_AmpOptimizer], None],
        device_placement: bool = True,
    ) -> None:
        super().__init__(optimizer, device_placement=device_placement, scaler=None)
        self.amp = amp
        self.on_step = on_step
        self.unscaled = False  # unscaled since the last step (by clip_grad_norm_/unscale_gradients)

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if not self.gradient_state.sync_gradients:
            return  # accumulating: Accelerate steps only on the synchronising micro-batch
        if self.amp is None:
            raise RuntimeError(_UNPICKLED_STEP)
        if closure is not None:
            raise ValueError(
                "closure: loss scaling cannot re-run a closure inside the optimizer step; call the closure, then "
                "optimizer.step() without it."
            )
        self._is_overflow = True  # stays true if Amp.step raises (LossScaleFloorError skips the step first)
        # A bool, or with skip_on_device a StepOutcome, read when step_was_skipped asks (a prepared scheduler does)
        self._stepped = self.amp.step(self.optimizer)  # (Amp turns the casts off inside accelerator.autocast())
        self.unscaled = False
        self.on_step(self)

    @property
    def _is_overflow(self) -> bool:  # what Accelerate's step_was_skipped returns
        return not self.__dict__.get("_stepped", True)

    @_is_overflow.setter
    def _is_overflow(self, value: bool) -> None:
        self.__dict__["_stepped"] = not value

    def __getstate__(self) -> dict[str, Any]:
        """The optimizer (its parameter groups and state) and the last step's outcome, not the engine's run.

        The engine (loss scales, O2's masters and their link to the model's half parameters, hooks on the optimizer)
        belongs to the Accelerator that prepared the optimizer; a copy of it would step a model it does not train.
        The unpickled optimizer's ``state_dict()`` loads into an optimizer prepared again (see ``step``)."""
        state = super().__getstate__()
        state.pop("on_step", None)  # a bound method of the Accelerator: not part of the optimizer
        amp = state.pop("amp", None)
        if amp is not None and amp.properties.master_weights:
            state["optimizer"] = _with_masters_in_groups(self.optimizer, amp)
        if "_stepped" in state:
            state["_stepped"] = bool(state["_stepped"])  # a StepOutcome read now: the engine is not pickled
        return state  # type: ignore[no-any-return]

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.amp = None  # type: ignore[assignment]  # no engine: step() says what to do
        self.on_step = None  # type: ignore[assignment]


def _with_masters_in_groups(optimizer: torch.optim.Optimizer, amp: Amp) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` holding what it steps at O2: the FP32 masters in its groups, its state (keyed by the
    masters) shared. Between steps the engine keeps the model's half parameters in the groups and swaps the masters in
    only for a step or a state-dict call, with hooks that a pickle does not carry."""
    groups = [{**group, "params": [amp.master_of(p) for p in group["params"]]} for group in optimizer.param_groups]
    twin = optimizer.__class__.__new__(optimizer.__class__)
    twin.__setstate__({"defaults": optimizer.defaults, "state": optimizer.state, "param_groups": groups})
    return twin


class _AmpForward:
    """A prepared model's ``forward`` under the opt level: ``Amp.forward_context`` around it (O1's cast policy; at O2,
    loss functions in FP32), O2/O3's float inputs cast to half; half outputs cast to FP32 (as Accelerate's own
    wrapper) so that the loss is computed in FP32.

    A deep copy or pickle of the model (``AveragedModel``, an EMA model) gets a forward with an engine of its own
    whose O2/O3 casts follow the copy's own dtype (:class:`~lightning_mpx.casting.boundary.DtypeProbe`): a copy converted
    with ``.float()`` runs as a plain FP32 model."""

    def __init__(self, forward: Callable[..., Any], amp: Amp) -> None:
        # __wrapped__ is the plain function, so that Accelerate's unwrap_model(keep_fp32_wrapper=False) can restore it.
        module = getattr(forward, "__self__", None)
        probe = DtypeProbe(amp.half_dtype, module) if isinstance(module, nn.Module) else None
        self._init(forward, amp, probe)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        amp = self._amp
        if amp.properties.casts_model:
            dtype = amp.half_dtype if self._probe is None else self._probe.dtype(self._forward.__self__)
            if dtype is None:  # a copy converted to FP32: nothing to cast
                return self._forward(*args, **kwargs)
            args, kwargs = _cast_collection(args, dtype, INPUT_DTYPES), _cast_collection(kwargs, dtype, INPUT_DTYPES)
        with amp.forward_context():
            output = self._forward(*args, **kwargs)
        # Accelerate's convert_to_fp32 loses defaultdicts and skips dataclasses; this keeps every container's type.
        return _cast_collection(output, torch.float32, (torch.float16, torch.bfloat16))

    def __getstate__(self) -> dict[str, Any]:
        # What the forward needs, not the engine (its masters, optimizers and scales stay with the original): a
        # pickled model gets an engine of its own with the same casts. The table travels as names, resolved
        # again on load (torch's functions pickle by name only where torch allows it).
        policy = self._amp.policy
        data: dict[str, dict[str, list[str]]] = {}
        extra: list[tuple[Any, str]] = []
        for entry in policy.table if policy is not None else ():
            if entry.namespace in _TABLE_NAMESPACES:
                data.setdefault(entry.namespace, {}).setdefault(entry.category, []).append(entry.name)
            else:
                extra.append((entry.function, entry.category))  # a user's @dispatchable: pickled by reference
        return {
            "forward": self._forward,
            "properties": self._amp.properties,
            "table": (data, extra) if policy is not None else None,
            "allow_banned": policy.allow_banned if policy is not None else False,
            "probe": self._probe,  # pickled as the copy's: it follows the copy's own dtype
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        table = None
        if state["table"] is not None:
            data, extra = state["table"]
            table = CastTable.from_data({ns: {c: tuple(names) for c, names in by.items()} for ns, by in data.items()})
            for function, category in extra:
                table.register(function, category)
        engine = _engine_for_forward(state["properties"], table, state["allow_banned"])
        self._init(state["forward"], engine, state.get("probe"))

    def __deepcopy__(self, memo: dict[int, Any]) -> _AmpForward:
        # A deepcopy (AveragedModel, EMA callbacks) forwards through the copied model, with an engine of its own.
        policy = self._amp.policy
        engine = _engine_for_forward(
            self._amp.properties,
            policy.table.copy() if policy is not None else None,
            policy.allow_banned if policy is not None else False,
        )
        twin = _AmpForward.__new__(_AmpForward)
        twin._init(copy.deepcopy(self._forward, memo), engine, copy.deepcopy(self._probe, memo))
        return twin

    def _init(self, forward: Callable[..., Any], amp: Amp, probe: DtypeProbe | None) -> None:
        self._forward = forward
        self._amp = amp
        self._probe = probe
        functools.update_wrapper(self, getattr(forward, "__func__", forward))


def _engine_for_forward(properties: Any, table: CastTable | None, allow_banned: bool) -> Amp:
    """An :class:`Amp` with ``properties`` and ``table``, for a copied model's forward (no models, no optimizers)."""
    return Amp(
        properties.opt_level,
        half_dtype=properties.half_dtype,
        cast_table=table if properties.patch_torch_functions else None,  # O2's loss-only table is made by Amp
        allow_banned=allow_banned,
        cast_model_type=properties.cast_model_type,
        patch_torch_functions=properties.patch_torch_functions,
        keep_batchnorm_fp32=properties.keep_batchnorm_fp32,
        master_weights=properties.master_weights,
        loss_scale=properties.loss_scale,
    )


def _params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


def _all_reduce_max(flag: torch.Tensor) -> None:
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)


def _opt_level_of(mixed_precision: object) -> str | None:
    """The opt level that ``mixed_precision`` (or ``ACCELERATE_MIXED_PRECISION`` when it is ``None``) names, or
    ``None`` for Accelerate's own values."""
    value = mixed_precision
    if value is None:
        env = os.environ.get("ACCELERATE_MIXED_PRECISION")
        return env if env in OPT_LEVELS else None
    text = str(value)  # PrecisionType members are str enums
    if text in OPT_LEVELS:
        return text
    if text in NATIVE_MIXED_PRECISION:
        return None
    hint = ""
    if len(text) == 2 and text[1] in "0123" and text[0] in "0o":
        hint = (
            f" The opt level starts with the capital letter O, not "
            f"{'the digit zero' if text[0] == '0' else 'a lower-case o'}: did you mean 'O{text[1]}'?"
        )
    raise ValueError(
        f"mixed_precision={value!r} is not valid; valid choices: Accelerate's "
        f"{', '.join(map(repr, NATIVE_MIXED_PRECISION))} or lightning_mpx's opt levels "
        f"{', '.join(map(repr, OPT_LEVELS))}.{hint}"
    )
