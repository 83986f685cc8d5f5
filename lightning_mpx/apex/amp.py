"""Apex's ``amp`` front end over :class:`lightning_mpx.Amp`: old Apex scripts run with one changed import.

::

    from lightning_mpx.apex import amp          # was: from apex import amp

    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()

Each ``initialize`` (or the older ``init()``, which returns Apex's handle) maps onto one :class:`~lightning_mpx.Amp`
(its loss scalers, its cast policy, its FP32 masters). What differs from Apex, and why:

* Nothing is patched process-wide. ``initialize`` returns each optimizer wrapped in a thin object whose ``step()``
  goes through ``Amp.step()`` (at O2 the masters stand in for the half parameters only there) and which delegates
  everything else; models get removable forward hooks (input/output casts at O2/O3) and, at O2/O3, state-dict hooks.
* A later ``initialize`` leaves the earlier calls' models and optimizers working with their own engine, as Apex's
  per-object patches did, and their loss scalers start afresh as Apex's global ones did. One ``scale_loss`` block
  cannot name optimizers of two calls (their scalers differ).
* O1's cast policy is a scoped ``TorchFunctionMode`` that ``initialize`` enters **on the calling thread** and keeps
  entered until the next ``initialize``. Code on other threads runs uncast: ``torch.nn.DataParallel`` runs its
  replicas on worker threads, so under it nothing is cast (use ``DistributedDataParallel``, one process per device,
  or enter ``_amp_state.amp.forward_context()`` inside the module's forward).
* ``register_*_function`` registers into the cast table instead of patching the module: the function must take part
  in torch's ``__torch_function__`` protocol (torch functions, ``Tensor`` methods; for your own function use the
  ``half_function``/``float_function``/``promote_function`` decorators, which make it do so).
* The scale backs off when the skipped step happens (``Amp.update()`` after the last named optimizer's step), not
  at the end of the block; the overflow message, logged at the end of the block, names the scale it will back off to.
* ``min_loss_scale=None`` (Apex: no floor) means the smallest normal FP32 number, with a warning when reached.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch
from torch import nn

from lightning_mpx.engine.amp import Amp, _cast_collection
from lightning_mpx.engine.preparation import _EngineHook
from lightning_mpx.apex._state import AmpState, ScalerView, _amp_state, is_rank_zero
from lightning_mpx.apex.fp16_utils import _HalfParameters
from lightning_mpx.casting.policy import disable_casts as _disable_casts
from lightning_mpx.casting.table import _takes_part_in_dispatch, dispatchable
from lightning_mpx.opt_levels import resolve_properties

__all__ = [
    "disable_casts",
    "float_function",
    "half_function",
    "init",
    "initialize",
    "load_state_dict",
    "master_params",
    "promote_function",
    "register_float_function",
    "register_half_function",
    "register_promote_function",
    "scale_loss",
    "state_dict",
]

log = logging.getLogger("lightning_mpx.apex")

#: Rows of Apex's O1 lists that the core's default table does not have, added to the table of the ``Amp`` that
#: ``initialize`` makes (not to the default): Apex's ``tensor_overrides.FP32_FUNCS`` lists ``Tensor.cpu``, so a
#: half tensor comes back to the host as FP32.
_APEX_ROWS: tuple[tuple[Callable[..., Any], str], ...] = ((torch.Tensor.cpu, "float"),)
F = TypeVar("F", bound=Callable[..., Any])


class AmpOptimizer(torch.optim.Optimizer):
    """The optimizer ``initialize`` returns: ``step()`` runs through :meth:`Amp.step`; everything else is the wrapped
    optimizer's. A subclass of ``Optimizer`` (without its ``__init__``) so that learning-rate schedulers accept it.

    Attributes:
        optimizer: The wrapped optimizer.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, state: AmpState, amp: Amp) -> None:  # noqa: D107
        # No super().__init__: every piece of optimizer state lives in the wrapped optimizer.
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "_amp_state", state)
        # The engine of the initialize() call that wrapped it: a later call leaves it working (as Apex did).
        object.__setattr__(self, "_engine", amp)

    # Attributes the base class would otherwise read from self.
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "optimizer"), name)

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        """Step through ``Amp.step()`` unless a ``scale_loss`` block that named this optimizer overflowed."""
        if closure is not None:
            raise NotImplementedError(
                "closure: Currently, Amp does not support closure use with optimizers (loss scaling cannot re-run "
                "the closure inside the step); run the closure first, then call step() without it."
            )
        _optimizer_step(self._amp_state, self)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; at O2 its half parameters get FP32 masters at the next step."""
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"AmpOptimizer({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("AmpOptimizer cannot be pickled; save optimizer.state_dict() instead.")


# -- initialize ---------------------------------------------------------------------------------------------------
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

    Returns ``models`` (when ``optimizers`` is ``None``) or ``(models, optimizers)``, each in the shape given (one
    object, or a list). The optimizers come back wrapped (:class:`AmpOptimizer`): use the returned ones.
    Calling it again leaves the earlier calls' models and optimizers working with their own engine, as in Apex (a
    checkpoint restored into new ones trains beside the run it came from); their loss scalers start afresh, as
    Apex's global ones did. The new call takes over the O1 cast scope, ``loss_scalers`` and ``state_dict()``; models
    and optimizers given to it again lose what earlier calls did to them first.
    """
    models_list, models_single = _as_list(models, nn.Module, "models")
    if optimizers is None:
        optimizers_list, optimizers_single = [], True
    else:
        optimizers_list, optimizers_single = _as_list(optimizers, torch.optim.Optimizer, "optimizers")
    _amp_state.begin_call(models_list, [o for o in optimizers_list if not isinstance(o, AmpOptimizer)])
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled={enabled!r} must be True or False.")
    if isinstance(verbosity, bool) or not isinstance(verbosity, int):
        raise TypeError(f"verbosity={verbosity!r} must be an integer (0 silences amp's messages).")
    _amp_state.verbosity = verbosity
    _amp_state.enabled = enabled
    if not enabled:
        _amp_state.amp = None
        return _shaped(models_list, models_single, optimizers, optimizers_list, optimizers_single)
    if any(isinstance(opt, AmpOptimizer) for opt in optimizers_list):
        raise ValueError("optimizers: an optimizer returned by a previous amp.initialize() was passed; pass the "
                         "original optimizer (its .optimizer attribute).")
    if cast_model_outputs is not None and cast_model_outputs not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(
            f"cast_model_outputs={cast_model_outputs!r} is not valid; valid choices: None, torch.float32, "
            "torch.float16, torch.bfloat16."
        )
    # cast_model_type=False: the models stay as given; at O2 the parameters the user made half get FP32 masters.
    keep_model = cast_model_type is False
    if keep_model:
        cast_model_type = None
    overrides: dict[str, Any] = {}
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
        p for m in models_list for p in m.parameters() if p.dtype in (torch.float16, torch.bfloat16)
    ] if keep_model else []
    if keep_model:
        wants_masters = resolve_properties(opt_level, **overrides).master_weights
        if not (wants_masters and half_params):
            # Nothing to cast and no masters to keep: the preset's policy and loss scaling only.
            overrides.update(cast_model_type=None, master_weights=False, keep_batchnorm_fp32=None)
    amp = _engine(opt_level, num_losses, min_loss_scale, max_loss_scale, **overrides)
    if keep_model and amp.properties.master_weights:
        # The core makes masters per prepared model and casts it; a holder of the half parameters alone is already
        # half, so preparing it only makes their masters.
        _amp_state.holder = amp.prepare_model(_HalfParameters(half_params))
    for model in models_list:
        if not keep_model:
            # At O2 in one process the masters start from the exact FP32 values the model held (a checkpoint loaded
            # before initialize resumes bit-exactly, as one loaded after it does); under torch.distributed from the
            # half rounding, which DDP's broadcast of rank 0's half weights keeps equal on every rank.
            amp.prepare_model(model)
        _add_model_hooks(amp, model, cast_model_outputs, cast_model=not keep_model)
    wrapped = []
    for optimizer in optimizers_list:
        if amp.properties.casts_model and not amp.properties.master_weights and not keep_model:
            # O3: state made before (a checkpoint loaded first) takes the parameters' half dtype, as Apex's
            # load_state_dict(state_dict()) trick did; at O2 the core moves it to the FP32 masters.
            optimizer.load_state_dict(optimizer.state_dict())
        amp.prepare_optimizer(optimizer)
        wrapper = AmpOptimizer(optimizer, _amp_state, amp)
        _amp_state.optimizers[id(optimizer)] = wrapper
        _amp_state.current.append(wrapper)
        wrapped.append(wrapper)
    if amp.properties.patch_torch_functions:
        _amp_state.handle = _enter_casts(amp, verbose=verbosity == 2)
    return _shaped(models_list, models_single, optimizers, wrapped, optimizers_single)


def _engine(
    opt_level: str,
    num_losses: int,
    min_loss_scale: float | None,
    max_loss_scale: float,
    allow_banned: bool = False,
    fresh_earlier: bool = True,
    **overrides: Any,
) -> Amp:
    """A new :class:`Amp` (Apex's settings and O1 rows), installed in ``_amp_state``.

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
    amp = Amp(
        opt_level,
        num_losses=num_losses,
        min_loss_scale=float(torch.finfo(torch.float32).tiny) if min_loss_scale is None else min_loss_scale,
        max_loss_scale=max_loss_scale,
        on_floor="warn" if min_loss_scale is None else "raise",
        allow_banned=allow_banned,
        **overrides,
    )
    amp.log_overflows = False  # Apex's own message is logged instead (rank zero only)
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


def _add_model_hooks(
    amp: Amp, model: nn.Module, cast_model_outputs: torch.dtype | None, *, cast_model: bool = True
) -> None:
    """Apex patched ``model.forward``; here: removable hooks on this model instance only. Each hook acts on the
    module it is called for, so a copy of the model (``copy.deepcopy`` for EMA, ``torch.save(model)``) carries hooks
    that act on the copy: its ``state_dict()`` gives its own values (loading into it leaves this model's masters
    alone: the core's load hook acts on the module it is called for too). Apex's patched forward could not be
    pickled; these hooks can."""
    props = amp.properties
    casts = props.casts_model and cast_model
    hooks = _amp_state.hooks.setdefault(model, [])
    if casts:
        hooks.append(model.register_forward_pre_hook(_CastInputs(props.half_dtype), with_kwargs=True))
    out_dtype = cast_model_outputs if cast_model_outputs is not None else (torch.float32 if casts else None)
    if out_dtype is not None:
        hooks.append(model.register_forward_hook(_CastOutputs(out_dtype)))
    if props.master_weights or casts:  # O2 and O3: Apex's state dicts were FP32 whenever it cast the model
        hooks.append(model.register_state_dict_post_hook(_Fp32StateDict(amp)))


class _CastInputs:
    """Forward pre-hook: the model's floating-point inputs (FP32, FP64) cast to its half dtype."""

    def __init__(self, half: torch.dtype) -> None:
        self.half = half

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        castable = (torch.float32, torch.float64)
        return _cast_collection(args, self.half, castable), _cast_collection(kwargs, self.half, castable)


class _CastOutputs:
    """Forward hook: the model's floating-point outputs cast to ``dtype`` (FP32 by default, as in Apex)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.castable = tuple(d for d in (torch.float16, torch.bfloat16, torch.float32) if d != dtype)

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        return _cast_collection(output, self.dtype, self.castable)


class _Fp32StateDict(_EngineHook):
    """O2/O3: ``model.state_dict()`` holds FP32 tensors as in Apex; a parameter with a master gives the master's
    exact value (Apex gave the half value cast up), so a checkpoint resumes bit-exactly."""

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        amp = self.engine()
        if amp is not None:
            amp.refresh_masters()  # writes made to the half model since the last step
        params = {prefix + name: p for name, p in module.named_parameters()}
        for key, value in list(state_dict.items()):
            if not torch.is_tensor(value) or value.dtype not in (torch.float16, torch.bfloat16):
                continue
            param = params.get(key)
            master = amp.master_of(param) if amp is not None and param is not None else None
            state_dict[key] = master.detach().clone() if master is not None and master is not param else value.float()


# -- the loss -------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def scale_loss(
    loss: torch.Tensor,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    loss_id: int = 0,
    model: nn.Module | None = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> Iterator[torch.Tensor]:
    """Yield ``loss`` times the scale of ``loss_id``; at the end of the block, unscale the gradients of
    ``optimizers`` (into the FP32 masters at O2) unless ``delay_unscale``.

    Several blocks before one ``step()`` accumulate: a later block's backward adds to the unscaled gradients of the
    earlier ones (they are scaled back up first). An overflow in the block skips the next ``step()`` of every
    optimizer it names and backs off this loss's scale.

    ``model`` and ``delay_overflow_check`` are accepted for compatibility and unused (as in Apex's last releases).
    """
    state = _amp_state
    items = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
    if state.amp is None and all(_wrapper_of(item) is None for item in items):  # enabled=False, as Apex
        yield loss  # (an earlier call's optimizers keep scaling: their step unscales)
        return
    wrapped = _resolve(optimizers)
    amp = wrapped[0]._engine
    ids = [id(w.optimizer) for w in wrapped]
    if any(i in state.stepped for i in ids):
        # A new iteration began for an optimizer that already stepped: close the last one.
        _update(state)
    state.touched.update(ids)
    # The core scales every unscaled gradient of this engine's optimizers back up for this block's backward, named
    # or not.
    own = [w for w in state.optimizers.values() if w._engine is amp]
    unscaled = [w.optimizer for w in own if amp.is_unscaled(w.optimizer)]
    # What earlier blocks left non-finite stays so: only an overflow this block makes skips what it names (Apex
    # checked only the block's own new gradients).
    overflowed_before = [_overflowed(amp, w.optimizer) for w in wrapped]
    if amp.properties.master_weights:
        _stash(state, amp, own)
    yield amp.scale_loss(loss, loss_id)
    if amp.policy is not None and amp.properties.patch_torch_functions:
        amp.policy.clear_cache()  # Apex cleared its cast cache at the end of every block
    if delay_unscale:
        return
    overflow = False
    for wrapper, before in zip(wrapped, overflowed_before):
        amp.unscale_(wrapper.optimizer)
        overflow = overflow or (not before and _overflowed(amp, wrapper.optimizer))
    for key in list(state.stash):
        _restore_stash(state, state.optimizers[key])
    for optimizer in unscaled:
        if not amp.is_unscaled(optimizer):
            # Not named here: Apex left its gradients unscaled, so unscale them again (exactly where the scales are
            # powers of two, as Apex's are; an overflow there counts at its own step).
            amp.unscale_(optimizer)
    if overflow:
        state.skip_next.update(ids)
        _log_overflow(amp, loss_id)


def _overflowed(amp: Amp, optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s gradients held non-finite values at their last check since its step (a host read)."""
    found = amp.found_inf(optimizer)
    return found is not None and bool(found.item() > 0)


def _stash(state: AmpState, amp: Amp, wrappers: list[AmpOptimizer]) -> None:
    """O2: take the unscaled FP32 master gradients of earlier blocks out of the way of this block's backward.

    The core would scale them back up into the half gradients, where a true gradient above 65504 / scale overflows;
    Apex kept them in FP32 and added them after unscaling the next block, and so does this (it is the core's
    ``scale_loss`` that finds nothing left to rescale: both gradients are cleared here).
    """
    for wrapper in wrappers:
        inner = wrapper.optimizer
        if not amp.is_unscaled(inner):
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        kept = state.stash.setdefault(id(inner), [])
        for param, master in zip(params, amp.master_params(inner)):
            if master is not param and master.grad is not None:
                kept.append((master, master.grad))
                master.grad = None
                param.grad = None


def _restore_stash(state: AmpState, wrapper: AmpOptimizer) -> None:
    """Add the stashed FP32 gradients of ``wrapper``'s optimizer to its unscaled master gradients (unscaling
    first)."""
    amp, optimizer = wrapper._engine, wrapper.optimizer
    kept = state.stash.pop(id(optimizer), None)
    if kept is None:
        return
    if not amp.is_unscaled(optimizer):
        amp.unscale_(optimizer)
    for master, grad in kept:
        master.grad = grad if master.grad is None else master.grad.add_(grad)
    # The model's gradients show the sums too (a half copy, as after any unscale; the step uses the masters'), made
    # where the stash cleared them: the core then sees a later zero_grad() or `p.grad = None` as the user clearing
    # them and drops the masters' copies. Without a half gradient, a master's would outlive the user's clearing (after
    # a skipped step: its inf, added to the next iteration's gradients).
    amp.show_unscaled_on_model(optimizer)


def _wrapper_of(item: Any) -> AmpOptimizer | None:
    """The live wrapper of an optimizer, or of the optimizer a wrapper wraps; ``None`` when there is none (or the
    wrapper was replaced by a later ``initialize`` of the same optimizer)."""
    inner = item.optimizer if isinstance(item, AmpOptimizer) else item
    wrapper = _amp_state.optimizers.get(id(inner))
    if wrapper is None or wrapper.optimizer is not inner or (isinstance(item, AmpOptimizer) and wrapper is not item):
        return None
    return wrapper


def _resolve(optimizers: Any) -> list[AmpOptimizer]:
    items = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
    out: list[AmpOptimizer] = []
    for item in items:
        wrapper = _wrapper_of(item)
        if wrapper is None:
            raise ValueError(
                f"optimizers={item!r} was not passed to amp.initialize() (or a later amp.initialize() was given its "
                "optimizer again: use the optimizer that call returned)."
            )
        if all(wrapper is not seen for seen in out):
            out.append(wrapper)
    if any(w._engine is not out[0]._engine for w in out):
        raise ValueError(
            "optimizers: the optimizers named in one scale_loss() block come from different amp.initialize() calls, "
            "whose loss scalers differ; give each call's optimizers their own block."
        )
    return out


def _log_overflow(amp: Amp, loss_id: int) -> None:
    if _amp_state.verbosity <= 0 or not is_rank_zero():
        return
    scaler = amp.scalers[loss_id]
    scale = scaler.get_scale()
    if scaler.dynamic:
        new = max(scale * scaler.backoff_factor, scaler.min_loss_scale)
        log.info("Gradient overflow.  Skipping step, loss scaler %d reducing loss scale to %s", loss_id, new)
    else:
        log.info("Gradient overflow.  Skipping step, loss scaler %d keeps its static loss scale %s", loss_id, scale)


def _optimizer_step(state: AmpState, wrapper: AmpOptimizer) -> None:
    if _wrapper_of(wrapper) is None:
        raise RuntimeError(
            "step(): this optimizer was given to a later amp.initialize() (or _amp_state.reset() ran); step the "
            "optimizer that call returned."
        )
    key = id(wrapper.optimizer)
    if key in state.skip_next:
        # A block that named it overflowed (in its gradients or another optimizer's): skip, as Apex. The overflow is
        # already charged to that block's loss, whose scale backs off in the update below.
        state.skip_next.discard(key)
        state.stash.pop(key, None)
    else:
        _restore_stash(state, wrapper)
        wrapper._engine.step(wrapper.optimizer)
    state.stepped.add(key)
    if {key for key in state.touched if key in state.optimizers} <= state.stepped:  # a dropped wrapper will not step
        _update(state)


def _update(state: AmpState) -> None:
    """Close the iteration: the scales of the losses that overflowed back off, in each engine involved."""
    engines: list[Amp] = []
    for key in state.touched:
        wrapper = state.optimizers.get(key)
        if wrapper is not None and all(wrapper._engine is not e for e in engines):
            engines.append(wrapper._engine)
    for engine in engines:
        engine.update()
    state.touched.clear()
    state.stepped.clear()
    state.skip_next.clear()
    state.stash.clear()


# -- checkpoints and masters ----------------------------------------------------------------------------------------
def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The tensors ``optimizer`` updates: the FP32 masters at O2 (their ``.grad`` holds the unscaled gradients after
    a ``scale_loss`` block), the parameters otherwise. For ``clip_grad_norm_(amp.master_params(opt), ...)``."""
    inner = optimizer.optimizer if isinstance(optimizer, AmpOptimizer) else optimizer
    wrapper = _wrapper_of(optimizer)
    if wrapper is None:
        for group in inner.param_groups:
            yield from group["params"]
        return
    yield from wrapper._engine.master_params(inner)


def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """Apex's format, ``{'loss_scaler0': {'loss_scale': float, 'unskipped': int}, ...}``, plus the core's full state
    (scalers and exact FP32 masters) under ``'lightning_mpx'``, which Apex ignores with a warning."""
    amp = _amp_state.require()
    out = {} if destination is None else destination
    full = amp.state_dict()
    for i, scaler_state in enumerate(full["scalers"]):
        out[f"loss_scaler{i}"] = {
            "loss_scale": float(scaler_state["scale"]),
            "unskipped": int(scaler_state["growth_tracker"]),
        }
    out["lightning_mpx"] = full
    return out


def load_state_dict(state: dict[str, Any]) -> None:
    """Load :func:`state_dict` output, an Apex checkpoint's ``"amp"`` entry, or a core ``Amp.state_dict()``."""
    amp = _amp_state.require()
    if "scalers" in state:  # the core's own format
        amp.load_state_dict(state)
        return
    if "lightning_mpx" in state:
        amp.load_state_dict(state["lightning_mpx"])
        return
    keys = sorted(k for k in state if k.startswith("loss_scaler"))
    unexpected = sorted(set(state) - set(keys))
    if unexpected:
        raise ValueError(f"state has unexpected keys {unexpected}; valid keys: loss_scaler0 to loss_scaler"
                         f"{amp.num_losses - 1}.")
    if len(keys) != amp.num_losses:
        raise ValueError(
            f"state has {len(keys)} loss scaler(s) but amp.initialize() was called with num_losses={amp.num_losses}."
        )
    for i, scaler in enumerate(amp.scalers):
        entry = state[f"loss_scaler{i}"]
        current = scaler.state_dict()
        scaler.load_state_dict({
            "scale": float(entry["loss_scale"]),
            "growth_tracker": int(entry["unskipped"]),
            "hysteresis_tracker": scaler.hysteresis,
            "overflows": current["overflows"],
        })


# -- Apex's older entry point: init() and its handle ----------------------------------------------------------------
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
    _amp_state.begin_call([], [])
    # Apex's init() patched the functions and left the loss scalers of initialize() alone.
    amp = _engine("O1", 1, None, 2.0**24, allow_banned=allow_banned, fresh_earlier=False,
                  loss_scale=_parse_loss_scale(loss_scale))
    assert amp.policy is not None
    amp.policy.cache_casts = enable_caching
    _amp_state.handle = _enter_casts(amp, verbose=verbose)
    return _amp_state.handle


class AmpHandle:
    """Apex's ``AmpHandle``: the O1 cast scope that :func:`init` (or ``initialize`` at O1) entered, over the engine
    in ``_amp_state``. ``_deactivate()`` leaves the scope (Apex restored the functions it had patched)."""

    def __init__(self, amp: Amp, scope: Any, *, verbose: bool = False) -> None:  # noqa: D107
        self._amp = amp
        self._scope = scope
        self._verbose = verbose

    def is_active(self) -> bool:
        """Whether this handle's cast scope is still entered."""
        return _amp_state.cast_scope is not None and _amp_state.cast_scope is self._scope

    def _deactivate(self) -> None:
        """Leave the cast scope, if it is still this handle's (a later ``init``/``initialize`` left it already).
        The engine, its scalers and the wrapped optimizers stay usable, without O1's casts."""
        if self.is_active():
            _amp_state.leave_cast_scope()

    def _disable_casts(self) -> contextlib.AbstractContextManager[None]:
        return _disable_casts()

    def _clear_cache(self) -> None:
        if self._amp.policy is not None:
            self._amp.policy.clear_cache()

    @property
    def has_cache(self) -> bool:
        return self._amp.policy is not None and self._amp.policy.cache_casts

    @property
    def verbose(self) -> bool:
        return self._verbose

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, num_loss: int = 1) -> LegacyOptimizer:
        """Apex's first optimizer wrapper: register ``optimizer`` with the engine and return it wrapped, with
        ``scale_loss(loss)`` (see :class:`LegacyOptimizer`)."""
        amp = self._current()
        if isinstance(num_loss, bool) or not isinstance(num_loss, int) or num_loss < 1:
            raise ValueError(f"num_loss={num_loss!r} must be a positive integer.")
        inner = optimizer.optimizer if isinstance(optimizer, AmpOptimizer) else optimizer
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"optimizer={type(optimizer).__name__} is not a torch.optim.Optimizer.")
        amp.prepare_optimizer(inner)
        wrapper = LegacyOptimizer(inner, _amp_state, amp)
        _amp_state.optimizers[id(inner)] = wrapper
        _amp_state.current.append(wrapper)
        return wrapper

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
        """The module's :func:`scale_loss` for an optimizer that :meth:`wrap_optimizer` or ``initialize`` returned.

        Raises:
            TypeError: for an optimizer that was not wrapped: Apex patched its ``step`` to skip an overflowed step;
                nothing is patched here, so the wrapper's ``step`` is what skips.
        """
        self._current()
        if not isinstance(optimizer, AmpOptimizer):
            raise TypeError(
                f"optimizer={type(optimizer).__name__}: handle.scale_loss() needs the optimizer returned by "
                "handle.wrap_optimizer(optimizer) (or amp.initialize()), whose step() skips a step that overflowed; "
                "lightning_mpx does not patch the optimizer's own step()."
            )
        with scale_loss(loss, optimizer) as scaled:
            yield scaled

    def _current(self) -> Amp:
        if _amp_state.amp is not self._amp:
            raise RuntimeError(
                "this handle belongs to an earlier amp.init()/amp.initialize(), which a later call replaced; use the "
                "handle the latest call returned (or _amp_state.handle)."
            )
        return self._amp

    def __repr__(self) -> str:
        return f"AmpHandle(active={self.is_active()}, {self._amp.properties.opt_level})"


class LegacyOptimizer(AmpOptimizer):
    """What :meth:`AmpHandle.wrap_optimizer` returns: an :class:`AmpOptimizer` with Apex's first API,
    ``with optimizer.scale_loss(loss) as scaled: scaled.backward()``. Its losses share loss 0's scaler (Apex's
    first wrapper kept one scaler per loss; ``initialize(num_losses=...)`` is the way to separate them)."""

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor) -> Iterator[torch.Tensor]:
        """:func:`scale_loss` for this optimizer."""
        with scale_loss(loss, self) as scaled:
            yield scaled


class NoOpHandle:
    """What ``init(enabled=False)`` returns: no casts, no scaling; the optimizers are stepped as they are."""

    def is_active(self) -> bool:
        return False

    def _deactivate(self) -> None:
        pass

    def _disable_casts(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def _clear_cache(self) -> None:
        pass

    @property
    def has_cache(self) -> bool:
        return False

    @property
    def verbose(self) -> bool:
        return False

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, num_loss: int = 1) -> _PlainOptimizer:
        return _PlainOptimizer(optimizer)

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor, optimizer: Any) -> Iterator[torch.Tensor]:
        yield loss


class _PlainOptimizer:
    """``NoOpHandle.wrap_optimizer``: the optimizer itself, plus a ``scale_loss`` that yields the loss unscaled."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)

    @contextlib.contextmanager
    def scale_loss(self, loss: torch.Tensor) -> Iterator[torch.Tensor]:
        yield loss


# -- the cast table -------------------------------------------------------------------------------------------------
def _register(function: Callable[..., Any], category: str) -> None:
    _amp_state.registrations.append((function, category))
    amp = _amp_state.amp
    if amp is not None and amp.policy is not None and amp.properties.patch_torch_functions:
        amp.policy.table.register(function, category)
        # The policy re-reads its table when a scope is entered; initialize's scope stays entered, so re-read now.
        amp.policy._refresh_actions()


def _register_named(module: Any, name: str, category: str) -> None:
    if not hasattr(module, name):
        raise ValueError(f"name={name!r}: {getattr(module, '__name__', module)!r} has no attribute {name!r}.")
    function = getattr(module, name)
    if not _takes_part_in_dispatch(function):
        raise TypeError(
            f"name={name!r}: {getattr(module, '__name__', module)}.{name} does not take part in torch's "
            "__torch_function__ protocol, so the scoped cast policy cannot see it (Apex patched the module instead). "
            f"Decorate its definition with @amp.{category}_function."
        )
    _register(function, category)


def register_half_function(module: Any, name: str) -> None:
    """Run ``module.name`` with half inputs under O1 (from the next ``initialize`` on, or now if initialized)."""
    _register_named(module, name, "half")


def register_float_function(module: Any, name: str) -> None:
    """Run ``module.name`` with FP32 inputs under O1."""
    _register_named(module, name, "float")


def register_promote_function(module: Any, name: str) -> None:
    """Run ``module.name`` in the widest floating type of its inputs under O1."""
    _register_named(module, name, "promote")


def _decorator(category: str) -> Callable[[F], F]:
    def decorate(function: F) -> F:
        wrapper = dispatchable(function)
        _register(wrapper, category)
        return wrapper  # type: ignore[return-value]

    return decorate


half_function = _decorator("half")
half_function.__doc__ = "Decorator: the function runs with half inputs under O1."
float_function = _decorator("float")
float_function.__doc__ = "Decorator: the function runs with FP32 inputs under O1."
promote_function = _decorator("promote")
promote_function.__doc__ = "Decorator: the function runs in the widest floating type of its inputs under O1."


def disable_casts() -> contextlib.AbstractContextManager[None]:
    """Run the enclosed code without O1's casts (Apex's ``amp.disable_casts()``)."""
    return _disable_casts()
