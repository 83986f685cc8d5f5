"""Apex's entry points: ``initialize`` (and the older ``init()``, which returns Apex's handle) make the
:class:`~lightning_mpx.Amp` of the call, install it in ``_amp_state``, prepare the models and optimizers, and at O1
enter the cast scope on the calling thread."""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Callable, Sequence

import torch
from torch import nn

from lightning_mpx.apex._state import ScalerView, _amp_state
from lightning_mpx.apex.fp16_utils import _HalfParameters
from lightning_mpx.apex.handle import AmpHandle, NoOpHandle
from lightning_mpx.apex.loss_scaling import AmpOptimizer
from lightning_mpx.apex.model_hooks import _add_model_hooks
from lightning_mpx.common.dtypes import HALF_DTYPE_NAMES, parse_half_dtype
from lightning_mpx.common.keywords import checks_keywords
from lightning_mpx.engine.amp import Amp
from lightning_mpx.engine.optimizers import refuse_unregistrable
from lightning_mpx.masters.weights import refuse_unpreparable
from lightning_mpx.opt_levels import resolve_properties
from lightning_mpx.settings import MixedPrecisionSettings

#: Rows of Apex's O1 lists that the core's default table does not have, added to the table of the ``Amp`` that
#: ``initialize`` makes (not to the default): Apex's ``tensor_overrides.FP32_FUNCS`` lists ``Tensor.cpu``, so a
#: half tensor comes back to the host as FP32.
_APEX_ROWS: tuple[tuple[Callable[..., Any], str], ...] = ((torch.Tensor.cpu, "float"),)


@checks_keywords("amp.initialize()")  # a misspelt keyword names Apex's keywords (Python's TypeError named none)
def initialize(
    models: nn.Module | Sequence[nn.Module],
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: torch.dtype | None = None,
    patch_torch_functions: bool | None = None,
    keep_batchnorm_fp32: bool | str | None = None,
    master_weights: bool | None = None,
    loss_scale: float | str | None = None,
    cast_model_outputs: torch.dtype | None = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
) -> Any:
    """Apex's ``amp.initialize``: prepare ``models`` and ``optimizers`` for ``opt_level``.

    ``cast_model_type=torch.bfloat16`` (O2/O3) makes bfloat16 the half dtype (loss scale: a static 1.0 unless
    ``loss_scale="dynamic"``). Returns ``models`` (when ``optimizers`` is ``None``) or ``(models, optimizers)``, each
    in the shape given (one object, or a list). The optimizers come back wrapped (:class:`AmpOptimizer`): use the
    returned ones.
    Calling it again leaves the earlier calls' models and optimizers working with their own engine, as in Apex (a
    checkpoint restored into new ones trains beside the run it came from); their loss scalers start afresh, as
    Apex's global ones did. The new call takes over the O1 cast scope, ``loss_scalers`` and ``state_dict()``; models
    and optimizers given to it again lose what earlier calls did to them first.
    """
    if _amp_state.loaded is not None and _amp_state.loaded is _amp_state.amp:
        _amp_state.loaded = None  # said once: a script that catches this and goes on is not refused again
        raise RuntimeError(
            "amp.initialize() was called after amp.load_state_dict(): the loss scales loaded went to the previous "
            "initialize() call's engine, and this call starts afresh without them. Call amp.initialize() first, then "
            "amp.load_state_dict(checkpoint['amp']), in Apex's documented order."
        )
    models_list, models_single = _as_list(models, nn.Module, "models")
    if optimizers is None:
        optimizers_list, optimizers_single = [], True
    else:
        optimizers_list, optimizers_single = _as_list(optimizers, torch.optim.Optimizer, "optimizers")
    # Every argument is checked before _amp_state is touched: a call that raises leaves the earlier calls' scope,
    # engines, scalers and wrappers exactly as they were, and a correct call after it is as if it had not happened.
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled={enabled!r} must be True or False.")
    if isinstance(verbosity, bool) or not isinstance(verbosity, int):
        raise TypeError(f"verbosity={verbosity!r} must be an integer (0 silences amp's messages).")
    carried: list[tuple[Any, dict[str, Any]]] = []
    if enabled:
        if any(isinstance(opt, AmpOptimizer) for opt in optimizers_list):
            raise ValueError("optimizers: an optimizer returned by a previous amp.initialize() was passed; pass the "
                             "original optimizer (its .optimizer attribute).")
        settings, keep_model, half_params = _call_settings(
            models_list, opt_level, cast_model_type, patch_torch_functions, keep_batchnorm_fp32, master_weights,
            loss_scale, cast_model_outputs, num_losses, min_loss_scale, max_loss_scale,
        )  # fmt: skip
        if not keep_model and not _amp_state.allow_incoming_model_not_fp32:
            _check_params_fp32(models_list)
        for optimizer in optimizers_list:  # what the engine's prepare_optimizer refuses (LBFGS...), refused here
            refuse_unregistrable(optimizer, with_masters=settings.properties.master_weights)
        if settings.properties.master_weights and not keep_model:
            _refuse_stray_half(models_list, optimizers_list)  # the engine's refusal, before a model is cast
        if not keep_model:  # the engine's refusals of a model (lazy, meta, nothing to cast), before any is prepared
            for model in models_list:
                refuse_unpreparable(model, settings.properties, "amp.initialize")
        carried = _carry_over(models_list, optimizers_list)
    # A refusal while preparing (the engine's, other than those checked above) leaves _amp_state as it was (_Undo): a
    # correct call after it is as if it had not happened. The earlier hooks and wrapper of a model or optimizer given
    # again stay dropped (begin_call's): the refusals above come first, so that the earlier pair trains on.
    undo = _Undo(models_list, optimizers_list)
    try:
        return _initialize(models_list, models_single, optimizers, optimizers_list, optimizers_single, enabled,
                           verbosity, settings if enabled else None, num_losses, keep_model if enabled else False,
                           half_params if enabled else [], cast_model_outputs, carried)  # fmt: skip
    except BaseException:
        undo.restore()
        raise


def _initialize(
    models_list: list[nn.Module],
    models_single: bool,
    optimizers: Any,
    optimizers_list: list[Any],
    optimizers_single: bool,
    enabled: bool,
    verbosity: int,
    settings: Any,
    num_losses: int,
    keep_model: bool,
    half_params: Any,
    cast_model_outputs: Any,
    carried: list[tuple[Any, dict[str, Any]]],
) -> Any:
    """:func:`initialize` past its checks: ``_amp_state`` changed, the models and optimizers prepared."""
    _amp_state.begin_call(models_list, [o for o in optimizers_list if not isinstance(o, AmpOptimizer)])
    _amp_state.verbosity = verbosity
    _amp_state.enabled = enabled
    if not enabled:
        _amp_state.amp = None
        return _shaped(models_list, models_single, optimizers, optimizers_list, optimizers_single)
    amp = _install_engine(settings, num_losses)
    if keep_model and amp.properties.master_weights:
        # The core makes masters per prepared model and casts it; a holder of the half parameters alone is already
        # half, so preparing it only makes their masters.
        _amp_state.holder = amp.prepare_model(_HalfParameters(half_params))
        _amp_state.models[_amp_state.holder] = amp
    for model in models_list:
        if not keep_model:
            # At O2 in one process the masters start from the exact FP32 values the model held (a checkpoint loaded
            # before initialize resumes bit-exactly, as one loaded after it does); under torch.distributed from the
            # half rounding, which DDP's broadcast of rank 0's half weights keeps equal on every rank.
            amp.prepare_model(model)
        _amp_state.models[model] = amp
        _add_model_hooks(amp, model, cast_model_outputs, cast_model=not keep_model)
    wrapped = []
    for optimizer in optimizers_list:
        if amp.properties.casts_model and not amp.properties.master_weights and not keep_model and optimizer.state:
            # O3: state made before (a checkpoint loaded first) takes the parameters' half dtype, as Apex's
            # load_state_dict(state_dict()) trick did; at O2 the core moves it to the FP32 masters. A fresh optimizer
            # has none to move (ZeroRedundancyOptimizer's state_dict() raises before consolidate_state_dict()).
            optimizer.load_state_dict(optimizer.state_dict())
        wrapper = AmpOptimizer(optimizer, _amp_state, amp)
        wrapper.guard_original()  # before the engine's hooks: its refusal speaks Apex
        amp.prepare_optimizer(optimizer)
        _amp_state.optimizers[id(optimizer)] = wrapper
        _amp_state.current.append(wrapper)
        _amp_state.idle.add(id(optimizer))
        wrapped.append(wrapper)
    for target, saved in carried:
        target.load_state_dict(saved)  # through the new engine's hooks: its masters and their optimizer state
    if amp.properties.patch_torch_functions:
        _amp_state.handle = _enter_casts(amp, verbose=verbosity == 2)
    return _shaped(models_list, models_single, optimizers, wrapped, optimizers_single)


class _Undo:
    """What :func:`initialize` changes in ``_amp_state`` (and in the earlier calls' engines: their loss scalers start
    afresh), saved before it does, and put back by :meth:`restore` when it fails while preparing: its own hooks,
    wrappers and O1 scope are removed, the earlier calls' state and scales are as they were (the earlier hooks and
    wrapper of a model or optimizer given to it again stay dropped, as any call given them drops them)."""

    def __init__(self, models: list[nn.Module], optimizers: list[Any]) -> None:
        self.models = models
        self.optimizers = [o for o in optimizers if not isinstance(o, AmpOptimizer)]
        self.saved = {f.name: _copied(getattr(_amp_state, f.name)) for f in dataclasses.fields(_amp_state)}
        engines = {id(w._engine): w._engine for w in _amp_state.optimizers.values()}
        self.scales = [(scaler, scaler.state_dict()) for e in engines.values() for scaler in e.scalers]
        self.scope = _amp_state.cast_scope

    def restore(self) -> None:
        state = _amp_state
        if state.cast_scope is not None and state.cast_scope is not self.scope:
            state.leave_cast_scope()  # this call's
        for model in self.models:
            for handle in state.hooks.pop(model, []):  # this call's (begin_call removed the earlier ones)
                handle.remove()
        for optimizer in self.optimizers:
            wrapper = state.optimizers.get(id(optimizer))
            if (
                wrapper is not None
                and wrapper.optimizer is optimizer
                and wrapper is not self.saved["optimizers"].get(id(optimizer))
            ):  # this call's wrapper
                wrapper._engine.release_optimizer(optimizer)
                wrapper.unguard_original()
        for scaler, scale in self.scales:
            scaler.load_state_dict(scale)
        for name, value in self.saved.items():
            setattr(state, name, value)
        given = {id(o) for o in self.optimizers}
        for model in self.models:
            state.hooks.pop(model, None)  # dropped by begin_call (its handles removed): not hooked any more
        for key in [k for k, w in state.optimizers.items() if k in given and w.optimizer is _by_id(self.optimizers, k)]:
            del state.optimizers[key]  # released by begin_call
        state.current = [w for w in state.current if id(w.optimizer) not in given]
        if self.scope is not None and state.cast_scope is None:
            self.scope.__enter__()  # the earlier call's O1 scope, which begin_call left, entered again
            state.cast_scope, state.cast_thread = self.scope, threading.get_ident()


def _by_id(objects: list[Any], key: int) -> Any:
    return next((o for o in objects if id(o) == key), None)


def _copied(value: Any) -> Any:
    """A copy of an ``_amp_state`` field's container (one level deeper for the hooks' lists); other values as they
    are."""
    if isinstance(value, weakref.WeakKeyDictionary):
        return weakref.WeakKeyDictionary({k: list(v) if isinstance(v, list) else v for k, v in value.items()})
    if isinstance(value, weakref.WeakValueDictionary):
        return weakref.WeakValueDictionary(dict(value.items()))
    if isinstance(value, (list, set, dict)):
        return type(value)(value)
    return value


def _refuse_stray_half(models: list[nn.Module], optimizers: list[Any]) -> None:
    """At O2, an optimizer over half parameters of no model given to this call (they would have no FP32 master),
    refused before anything is cast (the engine refuses it at ``prepare_optimizer``, after the models were cast)."""
    owned = {id(p) for model in models for p in model.parameters()}
    for optimizer in optimizers:
        stray = [
            p for group in optimizer.param_groups for p in group["params"]
            if isinstance(p, torch.Tensor) and p.dtype in (torch.float16, torch.bfloat16) and id(p) not in owned
        ]  # fmt: skip
        if stray:
            raise ValueError(
                f"optimizers: {type(optimizer).__name__} holds {len(stray)} half parameter(s) (first: shape "
                f"{tuple(stray[0].shape)}, {stray[0].dtype}) of no model given to this amp.initialize() call: they "
                "would have no FP32 master weights. Pass the model that owns them in models (FP32, as built)."
            )


def _check_params_fp32(models: list[nn.Module]) -> None:
    """Apex's ``check_params_fp32``: a model made half before ``initialize`` is refused (at O1 its half weights
    would train without FP32 masters; O2 would make masters of the rounded values). Models an earlier
    ``initialize`` prepared (half by then) are its own doing."""
    for model in models:
        if model in _amp_state.models:
            continue
        for name, param in model.named_parameters():
            if param.dtype in (torch.float16, torch.bfloat16):
                raise RuntimeError(
                    f"models: found parameter {name!r} with dtype {param.dtype}, expected torch.float32. When using "
                    "amp.initialize, you do not need to call .half() on your model before passing it, no matter "
                    "what optimization level you choose (as in Apex). To keep half parameters on purpose pass "
                    "cast_model_type=False, or set amp._amp_state.allow_incoming_model_not_fp32 = True."
                )


def _carry_over(models: list[nn.Module], optimizers: list[Any]) -> list[tuple[Any, dict[str, Any]]]:
    """The state of the models and optimizers an earlier ``initialize`` prepared, taken through its hooks before
    this call drops them: the exact FP32 masters (``model.state_dict()``) and the optimizer state keyed by them
    (``optimizer.state_dict()``). Loaded after this call's preparation, so that a second ``initialize`` of the same
    objects (Apex refused it) trains on where it was, instead of rounding the masters to half and leaving the
    momentum (Adam's moments and step count) keyed by masters that are gone."""
    out: list[tuple[Any, dict[str, Any]]] = []
    for model in models:
        if model in _amp_state.hooks:
            out.append((model, model.state_dict()))
    for optimizer in optimizers:
        wrapper = _amp_state.optimizers.get(id(optimizer))
        if not isinstance(optimizer, AmpOptimizer) and wrapper is not None and wrapper.optimizer is optimizer:
            out.append((optimizer, optimizer.state_dict()))
    return out


def _call_settings(
    models: list[nn.Module],
    opt_level: str,
    cast_model_type: Any,
    patch_torch_functions: Any,
    keep_batchnorm_fp32: Any,
    master_weights: Any,
    loss_scale: Any,
    cast_model_outputs: Any,
    num_losses: int,
    min_loss_scale: float | None,
    max_loss_scale: float,
) -> tuple[MixedPrecisionSettings, bool, list[nn.Parameter]]:
    """``initialize``'s arguments checked and resolved, touching nothing: the settings of its engine, whether the
    models stay as given (``cast_model_type=False``) and, then, their half parameters."""
    if cast_model_outputs is not None and cast_model_outputs not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"cast_model_outputs={cast_model_outputs!r} is not valid; valid choices: None, torch.float32, "
            "torch.float16, torch.bfloat16."
        )
    # cast_model_type=False: the models stay as given; at O2 the parameters the user made half get FP32 masters.
    keep_model = cast_model_type is False
    if keep_model:
        cast_model_type = None
    if isinstance(cast_model_type, str) and cast_model_type.lower() in HALF_DTYPE_NAMES:
        # a half dtype by name ("bfloat16", "fp16"...) is that dtype, as Apex's torch.bfloat16 (a ValueError before
        # for "bfloat16", which named the float16 choices only)
        cast_model_type = parse_half_dtype(cast_model_type, argument="cast_model_type")
    overrides: dict[str, Any] = {}
    if cast_model_type is torch.bfloat16:
        # Apex cast the model to whatever dtype it was given: bfloat16 becomes the half dtype of the whole call
        # (its loss scale then defaults to a static 1.0, bfloat16 having FP32's range).
        overrides["half_dtype"] = torch.bfloat16
    for name, value in (
        ("cast_model_type", cast_model_type),
        ("patch_torch_functions", patch_torch_functions),
        ("keep_batchnorm_fp32", _parse_keep_batchnorm(keep_batchnorm_fp32)),
        ("master_weights", master_weights),
        ("loss_scale", _parse_loss_scale(loss_scale)),
    ):
        if value is not None:
            overrides[name] = value
    half_params = [
        p for m in models for p in m.parameters() if p.dtype in (torch.float16, torch.bfloat16)
    ] if keep_model else []
    if keep_model:
        wants_masters = resolve_properties(opt_level, **overrides).master_weights
        if not (wants_masters and half_params):
            # Nothing to cast and no masters to keep: the preset's policy and loss scaling only.
            overrides.update(cast_model_type=None, master_weights=False, keep_batchnorm_fp32=None)
    settings = _settings(opt_level, num_losses, min_loss_scale, max_loss_scale, **overrides)
    return settings, keep_model, half_params


def _settings(
    opt_level: str,
    num_losses: int,
    min_loss_scale: float | None,
    max_loss_scale: float,
    allow_banned: bool = False,
    **overrides: Any,
) -> MixedPrecisionSettings:
    """The settings of a call's :class:`Amp` (Apex's defaults), checked: a bad value raises here, before
    ``_amp_state`` is touched."""
    overrides.setdefault("half_dtype", torch.float16)  # Apex's, on every device (the core's picks bfloat16 on a CPU)
    floor = float(torch.finfo(torch.float32).tiny) if min_loss_scale is None else min_loss_scale
    # cast_model_type=None, keep_batchnorm_fp32=None (a model kept as given): resolve_properties' None, which the
    # front doors' keywords read as "not given" (the level's value): added to the settings' overrides as they are.
    kept = {name: overrides.pop(name) for name in list(overrides) if overrides[name] is None}
    scaler: dict[str, Any] = {}
    if resolve_properties(opt_level, **overrides).dynamic_loss_scale:
        # Apex's dynamic scale started at min(max_loss_scale, 2**16) (a floor above it: the floor).
        scaler.update(min_loss_scale=floor, max_loss_scale=max_loss_scale,
                      init_scale=_apex_init_scale(floor, max_loss_scale))
    else:  # a static scale reads none of them: only the bounds given are passed (the engine warns they are ignored)
        scaler.update({} if max_loss_scale == 2.0**24 else {"max_loss_scale": max_loss_scale})
        scaler.update({} if min_loss_scale is None else {"min_loss_scale": min_loss_scale})
    settings = MixedPrecisionSettings.from_kwargs(
        opt_level,
        num_losses=num_losses,
        **scaler,
        # Apex kept skipping at its floor (max(min_loss_scale, scale / 2)) and went on training: never an error.
        on_floor="warn",
        allow_banned=allow_banned,
        # Apex says "Gradient overflow. Skipping step" at the step and its users read the scale right after: the
        # overflow flag is read on the host there, whatever the optimizer.
        skip_on_device=False,
        **overrides,
    )
    return dataclasses.replace(settings, overrides={**settings.overrides, **kept})


def _install_engine(settings: MixedPrecisionSettings, num_losses: int, *, fresh_earlier: bool = True) -> Amp:
    """A new :class:`Amp` of ``settings`` (Apex's O1 rows), installed in ``_amp_state``.

    Apex's loss scalers were global: each ``initialize`` replaced them, for the earlier calls' optimizers too. Here
    each call's engine owns its scalers, and those of the earlier calls' engines start afresh as Apex's new ones did
    (a restored run and the run it came from then scale alike).
    """
    earlier = [w._engine for w in _amp_state.optimizers.values()] if fresh_earlier else []
    for engine in {id(e): e for e in earlier}.values():
        for scaler in engine.scalers:
            overflows = scaler.state_dict()["overflows"]
            scaler.load_state_dict({"scale": scaler.init_scale, "growth_tracker": 0,
                                    "hysteresis_tracker": scaler.hysteresis, "overflows": overflows})
    amp = Amp.from_settings(settings)
    amp.log_overflows = False  # Apex's own message is logged instead (rank zero only)
    if not amp.properties.patch_torch_functions:
        # O2/O3: Apex patched nothing for losses (the model's outputs are cast to FP32, the loss computed outside it)
        # and this layer never enters the core's forward_context(): the loss regions' hooks would only cost a Python
        # call per submodule per forward.
        amp._loss_regions = None
    if amp.policy is not None and amp.properties.patch_torch_functions:
        for function, category in (*_APEX_ROWS, *_amp_state.registrations):
            amp.policy.table.register(function, category)  # into this Amp's own copy of the table
        amp.policy.refuse_inplace_float = True  # Apex refused x.half().exp_() with NotImplementedError
        # Apex's O1 is one scope for the whole run with Apex's cache (per grad mode, cleared per scale_loss block):
        # the Python policy's engine, not torch.autocast's per-scope cache.
        amp.policy.engine = "mode"
    _amp_state.amp = amp
    _amp_state.enabled = True
    _amp_state.loss_scalers = [ScalerView(amp, i) for i in range(num_losses)]
    return amp


def _enter_casts(amp: Amp, *, verbose: bool) -> AmpHandle:
    """Enter ``amp``'s O1 cast scope on this thread (until the next ``initialize``/``init`` or the handle's
    ``_deactivate()``) and return the handle of it."""
    scope = amp.forward_context()
    scope.__enter__()
    _amp_state.cast_scope = scope
    _amp_state.cast_thread = threading.get_ident()
    return AmpHandle(amp, scope, verbose=verbose)


def _as_list(value: Any, kind: type, name: str) -> tuple[list[Any], bool]:
    if isinstance(value, kind):
        return [value], True
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, kind) for v in value):
        return list(value), False
    raise TypeError(f"{name}={value!r} must be a {kind.__name__} or a non-empty list of them.")


def _apex_init_scale(floor: Any, ceiling: Any) -> Any:
    """Apex's first dynamic scale, ``min(max_loss_scale, 2**16)``, kept within the floor (the core's check of
    both bounds is left to name a bad one)."""
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (floor, ceiling)) or floor > ceiling:
        return 2.0**16
    return max(floor, min(ceiling, 2.0**16))


def _shaped(models: list[Any], models_single: bool, optimizers: Any, opts: list[Any], opts_single: bool) -> Any:
    out_models = models[0] if models_single else models
    if optimizers is None:
        return out_models
    return out_models, (opts[0] if opts_single else opts)


def _parse_keep_batchnorm(value: Any) -> bool | None:
    # Apex's command lines pass strings ("True"/"False").
    if isinstance(value, str):
        if value in ("True", "False"):
            return value == "True"
        raise ValueError(
            f"keep_batchnorm_fp32={value!r} is not valid; valid choices: None, True, False, 'True', 'False'."
        )
    return value


def _parse_loss_scale(value: Any) -> Any:
    if isinstance(value, str) and value != "dynamic":
        try:
            return float(value)
        except ValueError:
            raise ValueError(
                f"loss_scale={value!r} is not valid; valid choices: 'dynamic' or a positive number."
            ) from None
    return value


# -- Apex's older entry point ---------------------------------------------------------------------------------------
@checks_keywords("amp.init()")
def init(
    enabled: bool = True,
    loss_scale: float | str = "dynamic",
    enable_caching: bool = True,
    verbose: bool = False,
    allow_banned: bool = False,
) -> AmpHandle | NoOpHandle:
    """Apex's older entry point: turn O1's casts on, on this thread, and return the handle of them.

    Scripts written before ``amp.initialize`` (and Apex's own tests) call it; ``initialize`` at O1 does the same and
    keeps the handle in ``_amp_state.handle``. Like ``initialize`` it leaves the previous call's scope and builds a
    new :class:`~lightning_mpx.Amp` (O1, ``loss_scale``), the one the handle's ``wrap_optimizer``/``scale_loss`` and
    the module's ``scale_loss`` use from then on.

    Args:
        enabled: ``False`` returns a :class:`NoOpHandle` and changes nothing.
        loss_scale: ``"dynamic"`` or a positive static scale.
        enable_caching: Cache the half casts of parameters until the end of each ``scale_loss`` block.
        verbose: Accepted for compatibility (Apex printed every cast; the policy here does not trace calls).
        allow_banned: Run banned functions (``binary_cross_entropy``) in FP32 instead of raising.
    """
    for name, value in (("enabled", enabled), ("enable_caching", enable_caching), ("verbose", verbose),
                        ("allow_banned", allow_banned)):
        if not isinstance(value, bool):
            raise TypeError(f"{name}={value!r} must be True or False.")
    if not enabled:
        return NoOpHandle()
    settings = _settings("O1", 1, None, 2.0**24, allow_banned=allow_banned, loss_scale=_parse_loss_scale(loss_scale))
    _amp_state.begin_call([], [])
    # Apex's init() patched the functions and left the loss scalers of initialize() alone.
    amp = _install_engine(settings, 1, fresh_earlier=False)
    assert amp.policy is not None
    amp.policy.cache_casts = enable_caching
    _amp_state.handle = _enter_casts(amp, verbose=verbose)
    return _amp_state.handle

