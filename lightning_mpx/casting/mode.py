"""The torch-function mode that applies a cast policy's resolved table to each torch call of a scope.

:class:`~lightning_mpx.casting.policy.CastPolicy` resolves its table into ``{function: action}`` (the actions below);
:class:`_CastMode`, pushed on torch's mode stack by the policy's scopes, looks every call up there and casts the
call's floating-point tensor arguments through the policy (whose parameter-cast cache serves the casts). The mode
reads the policy through :class:`_Policy`, so that this module never imports the policy back.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from itertools import chain
from operator import attrgetter
from types import MappingProxyType
from typing import Any, Callable, Protocol

import torch
from torch.overrides import TorchFunctionMode

from lightning_mpx.casting.table import CastTable
from lightning_mpx.casting.targets import Notes, exact_source, exact_sources

# Actions, resolved once per function and memoised by each policy.
# _PASS is 0 (falsy) and the casting actions come before _BANNED: the hook tests for them so.
(_PASS, _HALF, _FLOAT, _PROMOTE, _SEQUENCE, _PROMOTE_NATIVE, _BANNED, _BACKWARD, _INPLACE_FLOAT, _PLAIN,
 _BODY) = range(11)
# _PLAIN: run as given with torch.autocast off (a function that autocast casts and the table leaves alone).
# _BODY: a call that runs the user's code inside it, run with the mode on (_BODY_CALLS).
_CATEGORY_ACTION = MappingProxyType(
    {"half": _HALF, "float": _FLOAT, "promote": _PROMOTE, "sequence": _SEQUENCE, "banned": _BANNED}
)  # read only when a policy resolves its table, never while a forward pass runs
_LOW = (torch.float16, torch.bfloat16)
# What a policy's resolved actions were resolved from, as CastPolicy._refresh_actions records it in _actions_of
# (tests/test_cast_hot_path.py keeps the two in step): compared in eager code, a C-level read of the policy instead
# of a call into _refresh_actions (dynamo cannot call an attrgetter: traced code calls _refresh_actions).
_actions_key = attrgetter("table", "table._version", "refuse_inplace_float", "engine", "device_type", "allow_banned",
                          "half_dtype")
_CONTAINERS = (torch.Tensor, list, tuple)  # what a cast may change in an argument; anything else is passed as given
_UNSET: Any = object()  # a parameter-cast cache not looked up yet (CastPolicy._cache_now)


class BannedOpError(NotImplementedError):
    """A banned op (such as ``binary_cross_entropy``) was called inside a cast-policy scope.

    A ``NotImplementedError``, as Apex raised for banned ops (and so also a ``RuntimeError``)."""


class _Policy(Protocol):
    """What the cast modes (and the backward passes, checkpoints and compiled hand-offs that enter them) read from
    the :class:`~lightning_mpx.casting.policy.CastPolicy` they apply."""

    table: CastTable
    half_dtype: torch.dtype
    allow_banned: bool
    _actions_stamp: int
    _autocast_device: str | None
    _actions: dict[Callable[..., Any], int]
    _actions_of: tuple[Any, ...]
    _to_half: tuple[torch.dtype, ...]
    cache_casts: bool
    _grad_cache: dict[Any, Any]
    _no_grad_cache: dict[Any, Any]
    _handed_off: bool
    _recomputes: bool
    _recomputes_seen: bool
    _action_lookup: Callable[[Callable[..., Any], int], int]
    _noted: Notes
    _marker_device: str | None

    def scope(self) -> AbstractContextManager[Any]: ...

    def _refresh_actions(self) -> None: ...

    def _cast_tensor(self, value: torch.Tensor, dtype: torch.dtype, cache: Any = ...) -> torch.Tensor: ...

    def _cast_changed(self, value: Any, dtype: torch.dtype, castable: tuple[torch.dtype, ...], cache: Any = ...
                      ) -> Any: ...

    def _cast_all(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None, dtype: torch.dtype,
                  castable: tuple[torch.dtype, ...]) -> tuple[tuple[Any, ...], dict[str, Any] | None]: ...

    def _run_backward(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


def _widest(values: Any, found: set[torch.dtype]) -> None:
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point():
                found.add(value.dtype)
        elif isinstance(value, (list, tuple)):
            _widest(value, found)


def _promote_dtype(found: set[torch.dtype]) -> torch.dtype | None:
    if len(found) < 2:
        return None
    widest = found.pop()
    for dtype in found:
        widest = torch.promote_types(widest, dtype)
    return widest


_ALL_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Promote-category ops whose kernels already compute in the widest floating dtype of two tensor operands that are both
# dimensioned (or both 0-dim: torch lets a 0-dim tensor adopt a dimensioned one's dtype, the table does not), each
# operand converted exactly: the result, its dtype and every gradient (each backward formula's operations promote
# the same way) are bit for bit those of casting the narrower operand first. The policy calls them as given then.
# Ops whose backward multiplies two inputs together (div, atan2) are left out: a product of two half operands would
# round in half there.
_NATIVE_PROMOTION = frozenset(
    getattr(owner, name)
    for owner in (torch, torch.Tensor)
    for name in ("add", "sub", "mul", "eq", "ne", "ge", "gt", "le", "lt")
) | {torch.Tensor.__eq__, torch.Tensor.__rsub__}


# Under torch.compile dynamo hands an activation checkpoint (``torch.utils.checkpoint.checkpoint``, traced as the
# ``tag_activation_checkpoint`` higher-order op) to the modes and traces the checkpointed function inside that call,
# where a mode is set aside while it handles it: the body would be traced without casts (FP32 where eager mode has
# half). Eager mode never hands these to a mode (checkpoint is plain Python there).
_BODY_CALLS = frozenset(
    f for f in (torch.utils.checkpoint.checkpoint, getattr(torch.ops.higher_order, "tag_activation_checkpoint", None))
    if f is not None
)

_top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_autocast_enabled = torch._C.is_autocast_enabled  # C functions: no Python call per op
_set_autocast_enabled = torch._C.set_autocast_enabled
_tracing_context = torch._guards.TracingContext.try_get  # dynamo's, set while it traces a frame


def _may_be_recomputed() -> bool:
    """Whether forward code running now runs again during a backward pass: inside an activation checkpoint
    (``torch.utils.checkpoint``). A non-reentrant checkpoint runs its forward with saved-tensor hooks on the stack, a
    reentrant one under ``no_grad``; both are counted, and so are other saved-tensor hooks (``save_on_cpu``) and a
    ``no_grad`` block inside a forward pass (a frozen teacher's forward): a backward pass then enters a recompute mode
    that it did not need, which costs time, never a cast. Inference mode is not counted (nothing is recomputed).

    Dynamo cannot trace the saved-tensor hooks' getter: under ``torch.compile`` it runs this while tracing and keeps
    the result as a constant. While it traces, nothing counts: a compiled graph's checkpoints recompute inside the
    graph, with its casts, and a flag set from traced code would be guarded on (a compiled ``validation_step`` under
    ``no_grad`` recompiled once per fit, guarding ``policy._recomputes_seen``).
    """
    if torch.compiler._is_compiling_flag:  # (the flag is_compiling() returns, read here without its call)
        return False
    if torch.is_grad_enabled():
        return _top_saved_tensors_hooks(False) is not None
    # torch 2.11's dynamo sets no _is_compiling_flag while it traces (2.13's does), only its tracing context: asked
    # here, off the training path (gradients off, not inference mode: a validation under no_grad)
    return not torch.is_inference_mode_enabled() and _tracing_context() is None


_may_be_recomputed._dynamo_marked_constant = True  # type: ignore[attr-defined]


class _InMode:
    """``fn`` called with ``mode`` on the mode stack (a checkpointed function under ``torch.compile``: _BODY_CALLS)."""

    def __init__(self, mode: TorchFunctionMode, fn: Callable[..., Any]) -> None:
        self.mode = mode
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.mode:
            return self.fn(*args, **kwargs)


def _in_reentrant_recompute() -> bool:
    """Whether the autograd engine runs a reentrant checkpoint's backward node now: its recomputation. A reentrant
    checkpoint nested in it runs its forward under ``no_grad`` there, recomputed code all the same, which a recompute
    mode casts (anywhere else gradients off means a backward function, left alone)."""
    node = torch._C._current_autograd_node()
    return node is not None and type(node).__name__ == "CheckpointFunctionBackward"


def _in_autocast_block() -> bool:
    """Whether code runs inside a ``torch.autocast`` context (its nesting counter, read and left as it was): a
    recomputation by ``torch.utils.checkpoint``, which restores the forward's autocast state in one, or a user's
    block; a backward pass outside every scope runs in none."""
    torch.autocast_increment_nesting()
    return torch.autocast_decrement_nesting() > 0


class _CastMode(TorchFunctionMode):
    """The torch-function mode behind :meth:`~lightning_mpx.casting.policy.CastPolicy.scope`; one per scope entry."""

    def __init__(self, policy: _Policy, *, recompute_only: bool = False, autocast_device: str | None = None,
                 marker: str | None = None) -> None:
        # TorchFunctionMode.__init__ does nothing (a call saved per scope).
        self.policy = policy
        # The device whose torch.autocast the scope turned on as a marker (an O1 table run by this mode: see
        # scopes.policy_scope): while it is on, the user's code runs in the scope, and the calls autocast would cast
        # run with it off; while it is off, the user's code turned it off (torch.autocast(device, enabled=False), as
        # transformers' rotary embeddings do), and calls run as given. None: no marker.
        self.marker = marker
        # The device whose torch.autocast runs beside this mode: the functions the mode handles run with it off.
        self.autocast_device = autocast_device
        self.disabled = 0
        # Above 0 inside a module pinned or promoted to FP32 (lightning_mpx.health.promotion): half ops run in FP32.
        self.fp32 = 0
        # A backward pass's mode (CastPolicy.recompute_scope): casts only what runs with gradients enabled.
        self.recompute_only = recompute_only

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        policy = self.policy
        # Read live: a table changed inside a scope applies.
        action = policy._action_lookup(func, policy._actions_stamp)
        if not action or self.disabled:  # _PASS
            return func(*args, **kwargs) if kwargs else func(*args)
        marker = self.marker
        if marker is not None:  # an O1 scope's torch.autocast, on while the user's code runs (scopes.policy_scope)
            if not _autocast_enabled(marker):
                if not self.fp32 and action != _BACKWARD and (not self.recompute_only or _in_autocast_block()):
                    # Inside the user's torch.autocast(marker, enabled=False) (or a block that turned it off): no
                    # casts, as torch.autocast gives none there. (Inside an FP32 module the table's FP32 casts run;
                    # a backward pass outside every autocast block, building a graph, is cast as before.)
                    return func(*args, **kwargs) if kwargs else func(*args)
                marker = None
            else:  # the table's call, without autocast's casts on top (inside a Python function of the table too);
                # dynamo traces the C setter (compiled code in an eager scope)
                _set_autocast_enabled(marker, False)
        try:
            if action <= _PROMOTE_NATIVE and self.autocast_device is None:
                # The hot path, inline (a call saved here is saved per op); what it leaves goes to _apply, which decides
                # the same way.
                if action < _PROMOTE and not self.recompute_only:  # _HALF, _FLOAT
                    if kwargs and kwargs.get("out") is not None:
                        # Casting the out= tensor would write the result into a copy that the caller never sees.
                        return func(*args, **kwargs)
                    if action == _HALF and not self.fp32:
                        dtype, castable, exact = policy.half_dtype, policy._to_half, False
                    else:  # _FLOAT, or a half op inside an FP32 module
                        dtype, castable = torch.float32, _LOW
                        # O2's loss on a target that the model boundary cast to half takes its FP32 source's values
                        exact = action == _FLOAT and policy.table.exact_sources
                    # policy._cast_all, inline with its cache lookup and _cached_cast: positions are ints, keywords str.
                    cache = compiling = _UNSET
                    new_args = new_kwargs = None  # copies, made at the first argument that changes
                    for where, item in chain(enumerate(args), kwargs.items()) if kwargs else enumerate(args):
                        if isinstance(item, torch.Tensor):
                            current = item.dtype
                            if current is dtype or current not in castable:
                                continue
                            if item.requires_grad and item.is_leaf:  # a parameter: cached
                                if cache is _UNSET:  # policy._cache_now(), inline
                                    compiling = torch.compiler.is_compiling()
                                    cache = None if compiling or not policy.cache_casts else (
                                        policy._grad_cache if torch.is_grad_enabled() else policy._no_grad_cache
                                    )
                                if cache is None:
                                    item = item.to(dtype=dtype)
                                else:
                                    key = (id(item), dtype)
                                    hit = cache.get(key)
                                    try:
                                        version, address = item._version, item.data_ptr()
                                    except RuntimeError:  # no version or storage: see policy._cached_cast
                                        version = None
                                    if version is None:
                                        item = item.to(dtype=dtype)
                                    elif hit is not None and hit[0] == version and hit[1] == address:
                                        item = hit[2]
                                    else:
                                        cast = item.to(dtype=dtype)
                                        cache[key] = (version, address, cast, item, item.untyped_storage())
                                        item = cast
                            else:
                                source = exact_source(item, dtype, policy._noted) if exact else None
                                item = item.to(dtype=dtype) if source is None else source
                        elif isinstance(item, (list, tuple)):
                            for inner in item:
                                if isinstance(inner, _CONTAINERS):
                                    break
                            else:
                                continue  # no tensor and no sequence inside (a stride, a shape): nothing to cast
                            item = policy._cast_changed(item, dtype, castable, cache)
                            if item is None:
                                continue
                        else:
                            continue
                        if type(where) is int:
                            if new_args is None:
                                new_args = list(args)
                            new_args[where] = item
                        else:
                            if new_kwargs is None:
                                new_kwargs = dict(kwargs)
                            new_kwargs[where] = item
                    if new_args is not None:
                        args = tuple(new_args)
                    if new_kwargs is not None:
                        kwargs = new_kwargs
                    if (
                        # _may_be_recomputed() inline where this call is known to run eagerly (a parameter was cast):
                        # dynamo cannot trace the saved-tensor hooks' getter, and keeps the function's result instead.
                        (_top_saved_tensors_hooks(False) is not None if torch.is_grad_enabled()
                         else not torch.is_inference_mode_enabled())
                        if compiling is False else _may_be_recomputed()
                    ) and not policy._recomputes_seen:  # the flag read last: a graph traced otherwise guards on it, and
                        # recompiled at the second step after an evaluation under no_grad had set it
                        policy._recomputes = policy._recomputes_seen = True  # a checkpoint's: recomputed in a backward
                    return func(*args, **kwargs) if kwargs else func(*args)
                if action != _SEQUENCE and action >= _PROMOTE and not kwargs and len(args) == 2:  # _PROMOTE(_NATIVE)
                    # The binary call that casts nothing (x + y of one dtype, x * 2.0, a native promotion), as _apply
                    # finds it.
                    a, b = args
                    if isinstance(a, torch.Tensor):
                        if isinstance(b, torch.Tensor):
                            a_dtype, b_dtype = a.dtype, b.dtype
                            if (a_dtype is b_dtype or not (a_dtype.is_floating_point and b_dtype.is_floating_point)
                                    or (action == _PROMOTE_NATIVE and (a.ndim == 0) is (b.ndim == 0))):
                                return func(a, b)
                        elif not isinstance(b, (list, tuple)):
                            return func(a, b)
                    elif isinstance(b, torch.Tensor) and not isinstance(a, (list, tuple)):
                        return func(a, b)
                return self._apply(func, action, args, kwargs)
            if action == _BODY and args and callable(args[0]):
                # The checkpointed function runs under this mode, as in eager mode; the call itself runs as given (with
                # the mode on it would be handed to the mode again). Dynamo refuses a change of the mode stack inside
                # the body unless the traced code changed it before (a scope entered inside the compiled region does),
                # so the mode is entered and left once here, outside the body.
                mode = self
                if self.marker is not None:  # turned off around this call: the body runs without a marker, as
                    # before the marker (dynamo refuses autocast's C setter in a checkpoint's body)
                    mode = _CastMode(policy, recompute_only=self.recompute_only, autocast_device=self.autocast_device)
                    mode.fp32, mode.disabled = self.fp32, self.disabled
                with mode:
                    pass
                return func(_InMode(mode, args[0]), *args[1:], **(kwargs or {}))
            device = self.autocast_device
            if device is None or action == _BACKWARD:
                return self._apply(func, action, args, kwargs)
            if not _autocast_enabled(device):
                if not self.fp32 and (not self.recompute_only or _in_autocast_block()):
                    # the user's torch.autocast(device, enabled=False) block: no casts, as torch.autocast gives none
                    return func(*args, **kwargs) if kwargs else func(*args)
                return self._apply(func, action, args, kwargs)
            # The table's own action, as the Python policy applies it, without autocast's casts on top.
            if torch.compiler.is_compiling():  # dynamo traces autocast's context manager, not its global setter
                with torch.autocast(device, enabled=False):
                    return self._apply(func, action, args, kwargs)
            torch.set_autocast_enabled(device, False)
            try:
                return self._apply(func, action, args, kwargs)
            finally:
                torch.set_autocast_enabled(device, True)
        finally:
            if marker is not None:
                _set_autocast_enabled(marker, True)

    def _apply(self, func: Callable[..., Any], action: int, args: tuple[Any, ...], kwargs: dict[str, Any] | None
               ) -> Any:
        policy = self.policy
        if action == _PLAIN:
            self._note_recompute()
            return func(*args, **kwargs) if kwargs else func(*args)
        exact = action == _FLOAT and policy.table.exact_sources  # (a half op in an FP32 module is not a loss)
        if action == _HALF and self.fp32:
            action = _FLOAT  # inside an FP32 module: the table's half ops run in FP32
        if action < _BANNED:  # _HALF, _FLOAT, _PROMOTE, _SEQUENCE, _PROMOTE_NATIVE
            if self.recompute_only and not torch.is_grad_enabled() and not _in_reentrant_recompute():
                return func(*args, **kwargs) if kwargs else func(*args)
            if kwargs and kwargs.get("out") is not None:
                # Casting the out= tensor would write the result into a copy that the caller never sees.
                return func(*args, **kwargs)
            if action == _HALF or action == _FLOAT:
                if not self.recompute_only and _may_be_recomputed() and not policy._recomputes_seen:  # (see above)
                    policy._recomputes = policy._recomputes_seen = True  # a checkpoint's: recomputed in a backward
                if action == _HALF:
                    args, kwargs = policy._cast_all(args, kwargs, policy.half_dtype, policy._to_half)
                else:
                    if exact:  # a loss recomputed in the backward pass (a checkpoint's) takes what its forward took
                        args, kwargs = exact_sources(args, kwargs, torch.float32, policy._noted)
                    args, kwargs = policy._cast_all(args, kwargs, torch.float32, _LOW)
            else:
                if not kwargs and len(args) == 2:
                    # The common binary call (x + y, x * 2.0): no promotion when both tensors have one dtype or only
                    # one argument holds tensors (what _widest would find).
                    a, b = args
                    a_tensor, b_tensor = isinstance(a, torch.Tensor), isinstance(b, torch.Tensor)
                    if a_tensor and b_tensor:
                        a_dtype, b_dtype = a.dtype, b.dtype
                        if a_dtype is b_dtype or not (a_dtype.is_floating_point and b_dtype.is_floating_point):
                            return func(a, b)
                        if action == _PROMOTE_NATIVE and (a.ndim == 0) is (b.ndim == 0):
                            # The op's own type promotion gives what the casts would (see _NATIVE_PROMOTION),
                            # without a cast kernel, its copy and its backward node.
                            return func(a, b)
                        # Two floating dtypes (x + x.half()): what _widest and _cast_all find, without them.
                        self._note_recompute()
                        widest = torch.promote_types(a_dtype, b_dtype)
                        if policy.table.exact_sources:  # O3's loss on a boundary-cast target: its source's values
                            (a, b), _ = exact_sources((a, b), None, widest, policy._noted)
                            a_dtype, b_dtype = a.dtype, b.dtype
                        if a_dtype is not widest and a_dtype in _ALL_FLOATS:
                            a = policy._cast_tensor(a, widest)
                        if b_dtype is not widest and b_dtype in _ALL_FLOATS:
                            b = policy._cast_tensor(b, widest)
                        return func(a, b)
                    elif (a_tensor and not isinstance(b, (list, tuple))) or (
                        b_tensor and not isinstance(a, (list, tuple))
                    ):
                        return func(a, b)
                found: set[torch.dtype] = set()
                _widest(args, found)
                if kwargs:
                    _widest(tuple(kwargs.values()), found)
                widest = _promote_dtype(found)
                if widest is not None:
                    self._note_recompute()
                    if policy.table.exact_sources:  # O3's loss on a boundary-cast target: its source's values
                        args, kwargs = exact_sources(args, kwargs, widest, policy._noted)
                    args, kwargs = policy._cast_all(args, kwargs, widest, _ALL_FLOATS)
            return func(*args, **kwargs) if kwargs else func(*args)
        if action == _BACKWARD:
            return policy._run_backward(func, args, kwargs or {})
        if action == _INPLACE_FLOAT:
            target = args[0] if args else None
            if isinstance(target, torch.Tensor) and target.dtype in _LOW:
                name = getattr(func, "__name__", repr(func))
                raise NotImplementedError(
                    f"Tensor.{name} on a {target.dtype} tensor: {name[:-1]} belongs to the FP32 list, and an in-place "
                    f"op cannot write an FP32 result into a half tensor; use the out-of-place {name[:-1]}(), or make "
                    "the tensor FP32 first (as Apex refused it)."
                )
            return func(*args, **kwargs) if kwargs else func(*args)
        # _BANNED
        if self.recompute_only and not torch.is_grad_enabled() and not _in_reentrant_recompute():
            return func(*args, **kwargs) if kwargs else func(*args)
        if not policy.allow_banned:
            raise BannedOpError(policy.table.banned_advice(func))
        self._note_recompute()
        args, kwargs = policy._cast_all(args, kwargs, torch.float32, _LOW)
        return func(*args, **kwargs) if kwargs else func(*args)

    def _note_recompute(self) -> None:
        """Note on the policy that a backward pass recomputes the cast about to be made (an activation
        checkpoint's forward: :func:`_may_be_recomputed`), so that it enters a recompute mode. Only casts are noted:
        a call that casts nothing in the forward casts nothing when recomputed either."""
        if not self.recompute_only and _may_be_recomputed() and not self.policy._recomputes_seen:  # (in that order:
            # the flag read under compile only where it is set, not guarded on in a graph that does not set it)
            self.policy._recomputes = self.policy._recomputes_seen = True
