"""The cast policy: apply a :class:`~lightning_mpx.casting.table.CastTable` during a scope.

Nothing in torch is patched. Two engines (``CastPolicy(engine=...)``):

* ``"autocast"`` (O1's, picked by ``"auto"`` for the default table and tables near it): ``policy.scope()`` enters
  ``torch.autocast(device_type, half_dtype)`` (thread-local), whose C++ dispatch casts every op on which the table
  and autocast agree; only the functions where they differ on that device (``table.autocast_differences(...)``) are
  left to the Python policy below, run with autocast off. Without any, no torch-function mode is pushed at all:
  a mode is handed every torch call of the scope (3-5 us of Python each) once it is pushed.
* ``"mode"`` (the O2 table's, the Apex layer's): the Python policy handles every call.

The Python policy is a :class:`torch.overrides.TorchFunctionMode`: it sees every call to a torch function,
``torch.nn.functional`` function or ``Tensor`` method made on this thread, looks the function up in the table and
casts the floating-point tensor arguments:

* ``half``: FP32 inputs become the half dtype (FP64 is left alone, as ``torch.autocast`` does);
* ``float``: half inputs become FP32;
* ``promote`` and ``sequence``: when the floating inputs disagree, all become the widest of them;
* ``banned``: :class:`BannedOpError`, or FP32 when the policy allows banned ops;
* anything else runs with its inputs as given, and so does a call with an ``out=`` tensor: casting ``out`` would
  write the result into a copy (as ``torch.autocast``, such calls are not cast).

Torch dispatches a torch function written in Python (``F.softmax``, ``F.multi_head_attention_forward``...) to the
mode as one call, and the ops it calls internally run with the mode set aside: such a function is cast as a whole,
by its own table entry, or runs as given when the table does not list it.

Casts of leaf tensors that require grad (the parameters) are cached. Casts made with gradients enabled serve every
forward pass up to the next backward pass started through the policy (:meth:`CastPolicy.backward`, what
``Amp.backward`` runs, a backward call inside a scope, or :meth:`CastPolicy.recompute_scope`), as Apex's cache served
the forward passes of one ``scale_loss`` block, and at the latest until :meth:`CastPolicy.clear_cache`, which the
training loop calls at each iteration boundary. The backward pass keeps what it needs through autograd; the cache
does not hold the half copies for it (held, they cost 6-14% of a mid-size training step on CPU by keeping memory that the
backward pass would otherwise reuse). A parameter changed in place since (an optimizer step between two forward
passes) or given new storage (``p.data = ...``) is cast again. Casts made
without gradients (evaluation) live for one scope: a write through ``p.data`` changes the values without any trace on
the parameter, and evaluation-only runs never reach an iteration boundary. Casts are differentiable, so gradients
reach the FP32 parameters in FP32; the gradients of a cached cast's several uses (a weight used at every time step)
are summed in half first, as with ``torch.autocast``'s cache (``cache_casts=False``: per-use casts, summed in FP32).

Activation checkpointing (``torch.utils.checkpoint``, Hugging Face ``gradient_checkpointing_enable()``) re-runs part
of the forward pass during the backward pass, where the forward's scope has ended. Torch restores ``torch.autocast``'s
state for that recomputation, but not torch-function modes, so :meth:`CastPolicy.recompute_scope` is entered around
the backward pass (``Amp.backward`` does it): inside it the policy casts only code that runs with gradients enabled,
which during a backward pass is the recomputation (the engine runs backward functions with gradients disabled), and
the recomputed forward gets the forward's dtypes. A bare ``loss.backward()`` outside both scopes has no policy to
recompute with, unless the checkpoint call itself records it: :func:`checkpoint_contexts` is a ``context_fn`` for
``checkpoint(..., use_reentrant=False)`` that does (the reentrant variant takes no ``context_fn``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

from lightning_mpx.common.dtypes import parse_half_dtype
from lightning_mpx.casting.lists import AUTOCAST_ACTIONS
from lightning_mpx.casting.table import CastTable

# Actions, resolved once per function and memoised by each policy.
# _PASS is 0 (falsy) and the casting actions come before _BANNED: the hook tests for them so.
_PASS, _HALF, _FLOAT, _PROMOTE, _SEQUENCE, _PROMOTE_NATIVE, _BANNED, _BACKWARD, _INPLACE_FLOAT, _PLAIN = range(10)
# _PLAIN: run as given with torch.autocast off (a function that autocast casts and the table leaves alone).
_CATEGORY_ACTION = MappingProxyType(
    {"half": _HALF, "float": _FLOAT, "promote": _PROMOTE, "sequence": _SEQUENCE, "banned": _BANNED}
)  # read only when a policy resolves its table, never while a forward pass runs
_LOW = (torch.float16, torch.bfloat16)
_FP32 = (torch.float32,)
_CONTAINERS = (torch.Tensor, list, tuple)  # what _cast_changed may change; anything else is passed as given
_UNSET: Any = object()  # a parameter-cast cache not looked up yet (CastPolicy._cache_now)


_ENGINES = ("auto", "autocast", "mode")


def autocast_differences(table: CastTable, device_type: str, *, allow_banned: bool = False,
                         half_dtype: torch.dtype | str | None = None
                         ) -> dict[Callable[..., Any], tuple[str | None, str | None]]:
    """``table.autocast_differences(device_type, allow_banned=allow_banned, half_dtype=half_dtype)``: see
    :meth:`CastTable.autocast_differences`."""
    return table.autocast_differences(device_type, allow_banned=allow_banned, half_dtype=half_dtype)


class BannedOpError(NotImplementedError):
    """A banned op (such as ``binary_cross_entropy``) was called inside a cast-policy scope.

    A ``NotImplementedError``, as Apex raised for banned ops (and so also a ``RuntimeError``)."""


class CastPolicy:
    """Applies a cast table to torch calls made inside :meth:`scope`.

    Args:
        table: The table to apply; a fresh :meth:`CastTable.default` when ``None``. The policy reads the table live,
            so registering into it later takes effect at the next scope.
        half_dtype: ``torch.float16`` or ``torch.bfloat16`` (or their names).
        allow_banned: Run banned ops in FP32 instead of raising :class:`BannedOpError`.
        cache_casts: Cache the half copies of parameters until :meth:`clear_cache` (under the ``"autocast"``
            engine: ``torch.autocast``'s ``cache_enabled``, a cache that lives for one scope).
        device_type: The device whose ``torch.autocast`` the ``"autocast"`` engine enters (``"cuda"``, ``"cpu"``);
            ``None``: ``"cuda"`` when CUDA is available, else ``"cpu"``. Tensors on another device are cast only by
            the Python policy (the functions listed by :func:`autocast_differences`).
        engine: ``"autocast"``: the scope enters ``torch.autocast(device_type, half_dtype)`` and a torch-function
            mode only for the functions where the table differs from autocast on that device
            (:func:`autocast_differences`), none at all when there are none; ``"mode"``: the Python policy casts
            every call; ``"auto"``: ``"autocast"`` when no function differs on that device (a table from
            :meth:`CastTable.autocast_aligned`: no torch-function mode at all), else ``"mode"`` (the default table,
            whose differences would push the mode anyway, and the O2 table).

    Example:
        >>> policy = CastPolicy(half_dtype="bfloat16")
        >>> with policy.scope():  # doctest: +SKIP
        ...     loss = model(x).sum()
        >>> loss.backward(); optimizer.step(); policy.clear_cache()  # doctest: +SKIP
    """

    def __init__(
        self,
        table: CastTable | None = None,
        half_dtype: str | torch.dtype = torch.float16,
        *,
        allow_banned: bool = False,
        cache_casts: bool = True,
        device_type: str | None = None,
        engine: str = "auto",
    ) -> None:
        self.table = table if table is not None else CastTable.default()
        self.half_dtype = parse_half_dtype(half_dtype)
        self.allow_banned = allow_banned
        self.cache_casts = cache_casts
        if device_type is not None and device_type not in AUTOCAST_ACTIONS:
            raise ValueError(f"device_type={device_type!r} is not supported; valid choices: None, "
                             f"{', '.join(map(repr, AUTOCAST_ACTIONS))}.")
        if engine not in _ENGINES:
            raise ValueError(f"engine={engine!r} is not an engine; valid choices: {', '.join(map(repr, _ENGINES))}.")
        self.device_type = device_type
        self.engine = engine
        #: The device whose torch.autocast the scope enters, or None (the Python policy alone); set by the last
        #: resolution of the table (see _refresh_actions).
        self._autocast_device: str | None = None
        #: Refuse in-place twins of ``float``-category ``Tensor`` methods on half tensors (``x.half().exp_()``) with
        #: ``NotImplementedError``, as Apex did: the result cannot be FP32 in a half tensor. Off by default (the
        #: op then runs in half as written); :mod:`lightning_mpx.apex` turns it on.
        self.refuse_inplace_float = False
        self._actions: dict[Callable[..., Any], int] = {}
        self._actions_stamp = 0  # bumped whenever _actions is rebuilt: compiled code guards on it
        self._action_lookup = _action_lookup(self._actions)
        # The table and table version that _actions was memoised from. The table itself, not its id(): an id can be
        # reused by a new table once the old one is freed.
        self._actions_of: tuple[Any, ...] = (None, -1, None)
        # Parameter casts made with gradients enabled, until clear_cache(), and without, until the next scope entry:
        # (id(tensor), dtype) -> _CacheEntry
        self._grad_cache: dict[tuple[int, torch.dtype], _CacheEntry] = {}
        self._no_grad_cache: dict[tuple[int, torch.dtype], _CacheEntry] = {}
        # True while a _HandOff runs compiled code with this policy's mode taken off the stack: the compiled code
        # (a _ScopeInside) then enters the scope itself, inside the compiled region. Read while tracing (guarded).
        self._handed_off = False
        # Resolved now rather than at the first scope: a scope entered inside a compiled region would otherwise
        # resolve while tracing and recompile at the second call.
        self._refresh_actions()

    @contextlib.contextmanager
    def scope(self) -> Iterator[CastPolicy]:
        """Apply the policy to torch calls on this thread until the block ends (also when it raises): under the
        ``"autocast"`` engine, ``torch.autocast`` and, only where the table differs from it, the Python mode."""
        self._refresh_actions()
        # Evaluation casts are redone in every scope: a write through ``p.data`` leaves no trace on ``p``.
        self._no_grad_cache.clear()
        device = self._autocast_device
        if device is None:
            # An autocast around this scope (another policy's autocast engine, or the user's own torch.autocast)
            # would cast the half arguments this policy made to its own dtype: the innermost policy decides.
            with _outer_autocast_off(), _CastMode(self):
                yield self
            return
        with torch.autocast(device, dtype=self.half_dtype, cache_enabled=self.cache_casts):
            if self._actions:
                with _CastMode(self, autocast_device=device):
                    yield self
            else:  # nothing for Python to do: torch.autocast's C++ dispatch alone
                yield self

    @contextlib.contextmanager
    def recompute_scope(self) -> Iterator[CastPolicy]:
        """Apply the policy to forward code that autograd re-runs during a backward pass entered in this block.

        Enter it around ``loss.backward()`` (``Amp.backward`` does): activation checkpointing
        (``torch.utils.checkpoint`` with ``use_reentrant=True`` or ``False``) then recomputes with the forward's
        casts, as it does for ``torch.autocast``. Only calls made with gradients enabled are cast: during a backward pass that is the
        recomputation, while the engine's own backward functions (and Python ``autograd.Function.backward``) run
        with gradients disabled and are left alone, unless the backward builds a graph (``create_graph=True``).
        """
        self._refresh_actions()
        self._grad_cache.clear()  # a backward pass starts: the forward passes' casts are not needed any more
        if self._autocast_device is not None and not self._actions:
            # torch.utils.checkpoint restores torch.autocast's state for the recomputation itself.
            yield self
            return
        with _CastMode(self, recompute_only=True, autocast_device=self._autocast_device):
            yield self

    def backward(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``tensor.backward(*args, **kwargs)`` inside :meth:`recompute_scope`, without a call into the policy's hook.

        The same as ``with policy.recompute_scope(): tensor.backward(...)``, which hands ``Tensor.backward`` to the
        policy's mode first: this goes to the autograd engine directly (``Amp.backward`` uses it).
        """
        self._refresh_actions()
        if self._autocast_device is not None and not self._actions:
            # torch.utils.checkpoint restores torch.autocast's state for the recomputation itself.
            tensor.backward(*args, **kwargs)
            return
        _run_backward(self, torch.Tensor.backward, (tensor, *args), kwargs)

    def hand_off_compiled(self, root: Any, *, methods: Mapping[str, Callable[..., Any]] | None = None,
                          compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None
                          ) -> list[HandOffHandle]:
        """Let compiled code called inside this policy's scope run with the policy inside the compiled region.

        A policy entered outside ``torch.compile``'d code is traced into its graph (the casts are in the graph), but
        its mode stays on the stack while the compiled code runs and is handed every torch call of torch's own
        runtime there. After this, each ``torch.compile``'d module found in ``root`` (``root`` itself or a submodule)
        takes the policy's mode off the stack while it runs and enters the scope itself, inside its compiled
        region: the same casts (the graph is the same), and no call into the policy's hook. Outside a scope, or with
        casts disabled, it runs as before. A backward pass started with :meth:`backward` (or inside
        :meth:`recompute_scope`) leaves compiled graphs' backward alone too.

        Args:
            root: A module, or any object for ``methods`` only.
            methods: ``{name: original}`` for compiled methods set as instance attributes of ``root``, with their
                uncompiled function, compiled again by ``compile_fn`` with the scope inside.
            compile_fn: What compiled those methods (for example the ``dynamo_ctx`` of a ``torch.compile``'d module).

        Returns:
            Handles whose ``remove()`` restores the modules and methods.
        """
        handles = []
        if isinstance(root, torch.nn.Module):
            from torch._dynamo.eval_frame import OptimizedModule

            for module in root.modules():
                if isinstance(module, OptimizedModule):
                    handle = _hand_off_module(self, module)
                    if handle is not None:
                        handles.append(handle)
        if methods:
            if compile_fn is None:
                raise TypeError("compile_fn=None: methods need the function that compiled them")
            for name, original in methods.items():
                handle = _hand_off_method(self, root, name, original, compile_fn)
                if handle is not None:
                    handles.append(handle)
        return handles

    def clear_cache(self) -> None:
        """Drop the cached casts of parameters: call it at each iteration boundary, after the optimizer step (a
        backward pass started through the policy drops the training casts already)."""
        self._grad_cache.clear()
        self._no_grad_cache.clear()
        device = self._autocast_device
        if device is not None and torch.is_autocast_enabled(device):
            torch.clear_autocast_cache()  # called inside a scope: torch.autocast's casts are dropped too

    @property
    def engine_in_use(self) -> str:
        """The engine the next scope runs: ``"autocast"`` (with the device, e.g. ``"autocast:cuda"``) or ``"mode"``."""
        self._refresh_actions()
        return "mode" if self._autocast_device is None else f"autocast:{self._autocast_device}"

    @property
    def python_functions(self) -> tuple[Callable[..., Any], ...]:
        """The functions the Python policy handles in a scope (under the ``"autocast"`` engine: where the table
        differs from autocast). Empty: the scope pushes no torch-function mode, and no torch call pays Python
        dispatch; otherwise every torch call in the scope does (the mode is handed them all)."""
        self._refresh_actions()
        return tuple(f for f in self._actions if f not in _BACKWARD_ENTRIES)

    @property
    def cache_size(self) -> int:
        """The number of parameter casts the Python policy holds (``torch.autocast``'s own are not counted)."""
        return len(self._grad_cache) + len(self._no_grad_cache)

    # -- internals ----------------------------------------------------------------------------------------------
    def _refresh_actions(self) -> None:
        """Resolve the table into ``{function: action}`` when the table (or its version) changed since last time.

        The map is built whole and then only read: ``torch.compile`` traces the mode's ``__torch_function__`` and
        guards on this dict, so a lazily filled (mutated) map would recompile, and a ``MappingProxyType`` read after
        a mutation is a graph break. A function missing from the map runs as given.
        """
        table, version = self._actions_of[:2]
        refuse = self.refuse_inplace_float
        key = (refuse, self.engine, self.device_type, self.allow_banned, self.half_dtype)
        if table is not self.table or version != self.table._version or self._actions_of[2:] != key:
            actions = {entry.function: _CATEGORY_ACTION[entry.category] for entry in self.table}
            autocast_device = None
            if self.engine != "mode":
                device = self.device_type or ("cuda" if torch.cuda.is_available() else "cpu")
                differences = autocast_differences(self.table, device, allow_banned=self.allow_banned,
                                                   half_dtype=self.half_dtype)
                # "auto" takes autocast's dispatch only where it is the whole policy (no Python set): a mode pushed
                # for a few functions sees every torch call anyway (the cost this engine exists to avoid), and the
                # mode engine keeps the table's exact semantics (0-dim operands, the cast cache across scopes).
                if self.engine == "autocast" or not differences:
                    autocast_device = device
                    # Only what differs is left to Python; a function that autocast casts and the table does not
                    # list runs as given, with autocast off.
                    actions = {f: actions.get(f, _PLAIN) for f in differences}
            for function in _NATIVE_PROMOTION:
                if actions.get(function) == _PROMOTE:
                    actions[function] = _PROMOTE_NATIVE
            actions.update(dict.fromkeys(_BACKWARD_ENTRIES, _BACKWARD))
            if refuse:
                for entry in self.table.entries("float"):
                    inplace = getattr(torch.Tensor, entry.name + "_", None) if entry.namespace == "torch.Tensor" else None
                    if inplace is not None and inplace not in actions:
                        actions[inplace] = _INPLACE_FLOAT
            if autocast_device is not None and actions.keys() <= _BACKWARD_ENTRIES:
                actions = {}  # no mode at all: torch's checkpoint restores autocast for recomputation itself
            self._actions = actions
            self._action_lookup = _action_lookup(actions)
            self._autocast_device = autocast_device
            self._actions_of = (self.table, self.table._version, *key)
            self._actions_stamp += 1

    def _cast_changed(self, value: Any, dtype: torch.dtype, castable: tuple[torch.dtype, ...],
                      cache: Any = _UNSET) -> Any:
        """``value`` with its floating tensors of a ``castable`` dtype cast to ``dtype`` (in lists and tuples too),
        or ``None`` when nothing changes.

        ``cache``: the parameter-cast cache to use (``None``: no caching; ``_UNSET``: :meth:`_cache_now`'s, looked
        up only when a parameter is cast). Callers test the result against ``None``, not against ``value``: dynamo
        cannot trace ``is`` between two lists or tuples (torch 2.11: neither; 2.13: tuples), and the casts run inside
        compiled code.
        """
        if isinstance(value, torch.Tensor):
            current = value.dtype
            if current is dtype or current not in castable:
                return None
            return self._cast_tensor(value, dtype, cache)
        if type(value) is list or (isinstance(value, tuple) and not isinstance(value, torch.Size)):
            return self._cast_sequence(value, dtype, castable, cache)
        return None

    def _cast_tensor(self, value: torch.Tensor, dtype: torch.dtype, cache: Any = _UNSET) -> torch.Tensor:
        # ``to(dtype=...)``: the keyword form skips the argument parser's failed try of ``to(device, ...)``, about
        # 2 us of a ~4 us cast of a small tensor.
        if value.requires_grad and value.is_leaf:
            if cache is _UNSET:
                cache = self._cache_now()
            if cache is not None:
                return _cached_cast(cache, value, dtype)
        return value.to(dtype=dtype)

    def _cast_sequence(self, value: Any, dtype: torch.dtype, castable: tuple[torch.dtype, ...],
                       cache: Any = _UNSET) -> Any:
        """The list or tuple ``value`` with its items cast (:meth:`_cast_changed`), or ``None`` when no item changes."""
        items = None  # a copy, made at the first item that changes
        for index, item in enumerate(value):
            if isinstance(item, _CONTAINERS):
                cast = self._cast_changed(item, dtype, castable, cache)
                if cast is not None:
                    if items is None:
                        items = list(value)
                    items[index] = cast
        if items is None:
            return None  # nothing to cast: the caller keeps its container, whatever its type
        if isinstance(value, list):
            return items
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)  # namedtuple

    def _cache_now(self) -> dict[Any, Any] | None:
        """The parameter-cast cache for a call made now: ``None`` when caching is off or while compiling (under
        ``torch.compile`` the cast is a node of the graph, done once per use in the compiled code; a cache read while
        tracing would guard on the cache's size and keys and recompile as it fills)."""
        if not self.cache_casts or torch.compiler.is_compiling():
            return None
        return self._grad_cache if torch.is_grad_enabled() else self._no_grad_cache

    def _cast_all(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None, dtype: torch.dtype,
                  castable: tuple[torch.dtype, ...]) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
        """The call's arguments with :meth:`_cast_changed` applied; the same objects where nothing changes.

        The hook's hot path: the tensor arguments are handled inline (no call per tensor), and the parameter-cast
        cache is looked up once, at the first parameter to cast.
        """
        cache = _UNSET
        new_args = None  # a copy, made at the first argument that changes
        index = 0
        for item in args:
            if isinstance(item, torch.Tensor):
                current = item.dtype
                if current is not dtype and current in castable:
                    if new_args is None:
                        new_args = list(args)
                    if item.requires_grad and item.is_leaf:  # a parameter: cached
                        if cache is _UNSET:
                            cache = self._cache_now()
                        new_args[index] = item.to(dtype=dtype) if cache is None else _cached_cast(cache, item, dtype)
                    else:
                        new_args[index] = item.to(dtype=dtype)
            elif type(item) is tuple or type(item) is list:  # not torch.Size or a namedtuple: _cast_changed sees to those
                cast = self._cast_sequence(item, dtype, castable, cache)
                if cast is not None:
                    if new_args is None:
                        new_args = list(args)
                    new_args[index] = cast
            elif isinstance(item, (list, tuple)):
                cast = self._cast_changed(item, dtype, castable, cache)
                if cast is not None:
                    if new_args is None:
                        new_args = list(args)
                    new_args[index] = cast
            index += 1
        if new_args is not None:
            args = tuple(new_args)
        if kwargs:
            new_kwargs = None
            for name, item in kwargs.items():
                if isinstance(item, torch.Tensor):
                    current = item.dtype
                    if current is dtype or current not in castable:
                        continue
                    cast = self._cast_tensor(item, dtype, cache)
                elif isinstance(item, (list, tuple)):
                    cast = self._cast_changed(item, dtype, castable, cache)
                    if cast is None:
                        continue
                else:
                    continue
                if new_kwargs is None:
                    new_kwargs = dict(kwargs)
                new_kwargs[name] = cast
            if new_kwargs is not None:
                kwargs = new_kwargs
        return args, kwargs


def _cached_cast(cache: dict[Any, Any], value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``value.to(dtype=dtype)`` through ``cache``, for a leaf tensor that requires grad (a parameter).

    Keyed by id() (Tensor.__hash__ is a Python call); the entry keeps the tensor alive, so the id cannot be reused
    while the entry exists. A tensor changed in place since (its version) or given new storage (its address) is cast
    again.
    """
    key = (id(value), dtype)
    hit = cache.get(key)
    version, address = value._version, value.data_ptr()
    if hit is not None and hit[0] == version and hit[1] == address:
        return hit[2]
    cast = value.to(dtype=dtype)
    cache[key] = (version, address, cast, value, value.untyped_storage())  # see _CacheEntry
    return cast


class _CacheEntry(NamedTuple):
    """A cached cast and what it was made from (the cache stores it as a plain tuple in this order)."""

    version: int  # the tensor's version counter: in-place updates through the tensor itself bump it
    address: int  # its data_ptr(): ``p.data = other`` changes it
    cast: torch.Tensor
    tensor: torch.Tensor  # keeps the tensor alive, so that its id() is not reused while the entry exists
    storage: Any  # the storage cast from, kept alive so that a new storage cannot take its address


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
# The calls that start a backward pass, with the names of their (roots, inputs) arguments.
_BACKWARD_ARGUMENTS: Mapping[Callable[..., Any], tuple[str, str]] = MappingProxyType(
    {
        torch.Tensor.backward: ("self", "inputs"),
        torch.autograd.backward: ("tensors", "inputs"),
        torch.autograd.grad: ("outputs", "inputs"),
    }
)
_BACKWARD_ENTRIES = frozenset(_BACKWARD_ARGUMENTS)
_TENSOR_BACKWARD_KEYWORDS = frozenset({"gradient", "retain_graph", "create_graph", "inputs"})
_BACKWARD_SIGNATURES: Mapping[Callable[..., Any], inspect.Signature] = MappingProxyType(
    {func: inspect.signature(func) for func in _BACKWARD_ARGUMENTS}
)


def _run_backward(policy: CastPolicy, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run a backward pass (``func`` is ``Tensor.backward``, ``torch.autograd.backward`` or ``torch.autograd.grad``)
    with a recompute mode of ``policy`` on the mode stack, so that activation checkpointing recomputes with the
    forward's casts.

    Torch sets a mode aside while the mode handles a call, and any call of these functions with a mode active is
    handed to the mode: the mode stack that the autograd engine captures for the backward pass would never hold a
    cast mode. Torch decides whether to hand a call to the modes by looking at the call's tensor arguments only, so
    the same call made with the tensors' gradient edges (``torch.autograd.graph.get_gradient_edge``, public API that
    computes the same gradients) reaches the engine directly, with the recompute mode in place.
    """
    roots_name, inputs_name = _BACKWARD_ARGUMENTS[func]
    if func is not torch.autograd.grad:  # not a gradient penalty's grad() inside a forward pass
        policy._grad_cache.clear()  # the forward passes' casts: autograd keeps what the backward pass needs
    if func is torch.Tensor.backward and len(args) == 1 and _TENSOR_BACKWARD_KEYWORDS.issuperset(kwargs):
        bound, arguments = None, {"self": args[0], **kwargs}  # the common call, without inspect's binding
    else:
        bound = _BACKWARD_SIGNATURES[func].bind(*args, **kwargs)
        arguments = bound.arguments
    roots, inputs = arguments.get(roots_name), arguments.get(inputs_name)
    root_tensors, input_tensors = list(_tensors(roots)), list(_tensors(inputs))
    if (
        not root_tensors
        or any(t.grad_fn is None for t in root_tensors)  # a leaf (or no graph): no recomputation behind it
        or any(not t.requires_grad for t in input_tensors)
    ):
        return func(*args, **kwargs)  # torch's own result or error
    if _compiled_graphs_made():
        _leave_compiled_backward(policy, root_tensors)
    if func is torch.Tensor.backward and _make_grads is not None and _engine_run_backward is not None:
        given = arguments.get("inputs")
        engine_inputs = tuple(given.values()) if isinstance(given, dict) else given
        # As torch.autograd.backward reads it: one tensor, or a sequence of them (a list of parameters, often).
        engine_inputs = (
            () if engine_inputs is None
            else (engine_inputs,) if isinstance(engine_inputs, torch.Tensor)
            else tuple(engine_inputs)
        )
        if engine_inputs or given is None:
            # torch.autograd.backward's own steps, with the gradient made and checked before the mode is entered
            # (inside it, those tensor calls would go through the hook). The engine's entry point does not consult
            # torch-function modes, so it is given the tensors themselves (no gradient edges needed here).
            create_graph = bool(arguments.get("create_graph", False))
            retain_graph = arguments.get("retain_graph")
            root = arguments["self"]
            gradient = arguments.get("gradient")
            if gradient is None and not root.is_nested and root.is_floating_point() and root.numel() == 1:
                grads: tuple[Any, ...] = (torch.ones_like(root, memory_format=torch.preserve_format),)  # a loss
            else:
                grads = _make_grads((root,), (gradient,), is_grads_batched=False)
            with _CastMode(policy, recompute_only=True, autocast_device=policy._autocast_device):
                _engine_run_backward((root,), grads, create_graph if retain_graph is None else retain_graph,
                                     create_graph, engine_inputs, allow_unreachable=True, accumulate_grad=True)
            return None
    arguments[roots_name] = _as_edges(roots)
    if inputs is not None:
        arguments[inputs_name] = _as_edges(inputs)
    if func is torch.Tensor.backward:
        create_graph = bool(arguments.get("create_graph", False))
        retain_graph = arguments.get("retain_graph")
        edges = (arguments["self"],)
        gradient = arguments.get("gradient")
        if gradient is None and root_tensors[0].numel() == 1:
            # What the engine would make for a scalar, made here: inside the mode it would be a call into the hook.
            gradient = torch.ones_like(root_tensors[0], memory_format=torch.preserve_format)
        with _CastMode(policy, recompute_only=True, autocast_device=policy._autocast_device):
            return torch.autograd.backward(
                edges[0], None if gradient is None else (gradient,), retain_graph, create_graph,
                inputs=arguments.get("inputs"),
            )
    assert bound is not None
    with _CastMode(policy, recompute_only=True, autocast_device=policy._autocast_device):
        return func(*bound.args, **bound.kwargs)


# torch.autograd.backward's two steps (private; the public call is used where a torch release lacks them).
_make_grads = getattr(torch.autograd, "_make_grads", None)
_engine_run_backward = getattr(torch.autograd.graph, "_engine_run_backward", None)

# How far from the roots of a backward pass to look for compiled graphs' backward nodes (a loss computed eagerly from
# a compiled model's output is a few nodes away; an eager model is not searched further than this).
_SEARCH_DEPTH, _SEARCH_NODES = 6, 12
_COMPILED_BACKWARD = "CompiledFunctionBackward"  # the node of an AOT-autograd (torch.compile) graph's backward


def _compiled_graphs_made() -> bool:
    """Whether ``torch.compile`` has made an autograd graph in this process (dynamo's own count of AOT-autograd
    compilations), without which no backward pass holds a compiled graph's node and :func:`_leave_compiled_backward`
    has nothing to find: an eager model's backward then skips that search (a dozen nodes' Python wrappers per step).
    A graph made by functorch's ``aot_function`` alone, outside dynamo, is not counted: its backward runs with the
    recompute mode on, which its runtime's calls, made without gradients, pass through unchanged."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return False  # dynamo never loaded: nothing was compiled
    counters = getattr(utils, "counters", None)
    if counters is None:
        return True  # a torch without the count: search, as before
    aot = counters.get("aot_autograd")
    return bool(aot) and aot.get("total", 0) > 0


def _leave_compiled_backward(policy: CastPolicy, roots: list[torch.Tensor]) -> None:
    """Take ``policy``'s recompute modes off the mode stack while the backward of a compiled graph runs.

    A compiled graph's backward is one node whose recomputation, if any, is inside the graph, with the forward's
    casts traced into it; the mode would only be handed the node's own runtime calls. The autograd engine restores
    the mode stack it captured for every node it runs, so a pre-hook that pops the modes affects that node alone
    (also when it raises). Only nodes near the roots are looked at (at most ``_SEARCH_NODES``).
    """
    hook = None
    frontier = [t.grad_fn for t in roots]
    budget = _SEARCH_NODES
    for _ in range(_SEARCH_DEPTH):
        following = []
        for node in frontier:
            if node is None:
                continue
            name = type(node).__name__
            if name == "AccumulateGrad":  # a leaf: nothing behind it
                continue
            if name == _COMPILED_BACKWARD:
                if hook is None:
                    hook = functools.partial(_pop_recompute_modes, policy)
                node.register_prehook(hook)
                continue  # behind it: the compiled graph's inputs (parameters, mostly), not searched
            budget -= 1
            if budget <= 0:
                return
            following.extend([edge[0] for edge in node.next_functions])
        if not following:
            return
        frontier = following


def _pop_recompute_modes(policy: CastPolicy, grad_outputs: Any) -> None:
    stack_len, stack_at = torch._C._len_torch_function_stack, torch._C._get_function_stack_at
    while stack_len():
        top = stack_at(stack_len() - 1)
        if not (type(top) is _CastMode and top.policy is policy and top.recompute_only):
            return
        torch._C._pop_torch_function_stack()


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        yield from (v for v in value.values() if isinstance(v, torch.Tensor))
    elif isinstance(value, (list, tuple)):
        yield from (v for v in value if isinstance(v, torch.Tensor))


def _as_edges(value: Any) -> Any:
    edge = torch.autograd.graph.get_gradient_edge
    if isinstance(value, torch.Tensor):
        return edge(value)
    if isinstance(value, dict):
        return {k: edge(v) if isinstance(v, torch.Tensor) else v for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return tuple(edge(v) if isinstance(v, torch.Tensor) else v for v in value)
    return value


def _action_lookup(actions: dict[Callable[..., Any], int]) -> Callable[[Callable[..., Any], int], int]:
    """The lookup of a function's action in one resolved table: ``lookup(func, stamp)`` (``stamp`` is the policy's
    ``_actions_stamp``, which changes whenever the table is resolved again).

    Under ``torch.compile`` dynamo runs it while tracing and keeps the result as a constant
    (``assume_constant_result``), guarding on ``stamp`` (an int) instead of on every key of the table: read as a dict
    in the traced code, the table's ~330 function keys would each become a guard, checked at every call of the
    compiled code. Its arguments are a torch function and an int, constants for dynamo on torch 2.11 as on 2.13 (the
    policy itself as an argument is one only on 2.13: torch 2.11's dynamo raised on it).
    """

    def lookup(func: Callable[..., Any], stamp: int) -> int:
        return actions.get(func, _PASS)

    # What torch.compiler.assume_constant_result(lookup) sets, without importing dynamo (seconds) at import time.
    lookup._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return lookup


@contextlib.contextmanager
def _outer_autocast_off() -> Iterator[None]:
    """``torch.autocast(device, enabled=False)`` for each device whose autocast is on (none: nothing entered)."""
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


class _CastMode(TorchFunctionMode):
    """The torch-function mode behind :meth:`CastPolicy.scope`; one per scope entry."""

    def __init__(self, policy: CastPolicy, *, recompute_only: bool = False, autocast_device: str | None = None) -> None:
        super().__init__()
        self.policy = policy
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
        device = self.autocast_device
        if device is None or action == _BACKWARD or not torch.is_autocast_enabled(device):
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

    def _apply(self, func: Callable[..., Any], action: int, args: tuple[Any, ...], kwargs: dict[str, Any] | None
               ) -> Any:
        policy = self.policy
        if action == _PLAIN:
            return func(*args, **kwargs) if kwargs else func(*args)
        if action == _HALF and self.fp32:
            action = _FLOAT  # inside an FP32 module: the table's half ops run in FP32
        if action < _BANNED:  # _HALF, _FLOAT, _PROMOTE, _SEQUENCE, _PROMOTE_NATIVE
            if self.recompute_only and not torch.is_grad_enabled():
                return func(*args, **kwargs) if kwargs else func(*args)
            if kwargs and kwargs.get("out") is not None:
                # Casting the out= tensor would write the result into a copy that the caller never sees.
                return func(*args, **kwargs)
            if action == _HALF:
                args, kwargs = policy._cast_all(args, kwargs, policy.half_dtype, _FP32)
            elif action == _FLOAT:
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
                        widest = torch.promote_types(a_dtype, b_dtype)
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
                    args, kwargs = policy._cast_all(args, kwargs, widest, _ALL_FLOATS)
            return func(*args, **kwargs) if kwargs else func(*args)
        if action == _BACKWARD:
            return _run_backward(policy, func, args, kwargs or {})
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
        if self.recompute_only and not torch.is_grad_enabled():
            return func(*args, **kwargs) if kwargs else func(*args)
        if not policy.allow_banned:
            raise BannedOpError(policy.table.banned_advice(func))
        args, kwargs = policy._cast_all(args, kwargs, torch.float32, _LOW)
        return func(*args, **kwargs) if kwargs else func(*args)


def checkpoint_contexts() -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=...)``: the
    recomputation runs with the cast policies that were active when the checkpointed forward ran.

    Torch calls it when the forward reaches the checkpoint; it records the cast modes on this thread's mode stack
    then (their policy and state: casts disabled, an FP32 module around the call) and returns a do-nothing forward
    context and a recompute context that enters the same modes again, wherever the backward pass runs, as torch does
    for ``torch.autocast``'s state. A plain ``loss.backward()`` then recomputes with the forward's casts, as
    ``Amp.backward`` does for any checkpoint; with no policy active at the forward (an FP32 forward), both contexts
    do nothing. Under ``Amp.backward`` the recorded state takes the place of its recompute scope for the
    recomputation (a block run inside :func:`disable_casts` recomputes without casts).

    Example:
        >>> from torch.utils.checkpoint import checkpoint
        >>> y = checkpoint(block, x, use_reentrant=False, context_fn=checkpoint_contexts)  # doctest: +SKIP
        >>> model.gradient_checkpointing_enable(  # Hugging Face  # doctest: +SKIP
        ...     gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": checkpoint_contexts})

    Torch refuses a ``context_fn`` for ``use_reentrant=True`` (``ValueError``), and under ``torch.compile`` accepts
    only torch-dispatch modes (the compiled graph recomputes with the forward's casts anyway): eager mode,
    non-reentrant checkpoints.
    """
    states = [
        (mode.policy, mode.recompute_only, mode.disabled, mode.fp32, mode.autocast_device)
        for mode in torch.overrides._get_current_function_mode_stack()
        if isinstance(mode, _CastMode)
    ]
    if not states:
        return contextlib.nullcontext(), contextlib.nullcontext()
    return contextlib.nullcontext(), _Reentry(states)


class _Reentry:
    """Enters fresh cast modes with recorded states (bottom of the stack first) in place of the backward pass's
    recompute modes (``CastPolicy.recompute_scope``, ``Amp.backward``), which would cast the recomputation whatever
    the forward did: the recorded state decides. Re-enterable: a backward pass with ``retain_graph=True`` followed by
    another recomputes a checkpoint once per pass."""

    def __init__(self, states: list[tuple[CastPolicy, bool, int, int, str | None]]) -> None:
        self.states = states
        self._open: list[tuple[contextlib.ExitStack, list[Any]]] = []

    def __enter__(self) -> None:
        popped = []
        stack_len, stack_at = torch._C._len_torch_function_stack, torch._C._get_function_stack_at
        while stack_len():
            top = stack_at(stack_len() - 1)
            if not (type(top) is _CastMode and top.recompute_only):
                break
            popped.append(torch._C._pop_torch_function_stack())
        stack = contextlib.ExitStack()
        try:
            for policy, recompute_only, disabled, fp32, autocast_device in self.states:
                policy._refresh_actions()
                mode = _CastMode(policy, recompute_only=recompute_only, autocast_device=autocast_device)
                mode.disabled, mode.fp32 = disabled, fp32
                stack.enter_context(mode)
        except BaseException:
            stack.close()
            _push_back(popped)
            raise
        self._open.append((stack, popped))

    def __exit__(self, *exc: Any) -> None:
        stack, popped = self._open.pop()
        try:
            stack.__exit__(*exc)
        finally:
            _push_back(popped)


def _push_back(popped: list[Any]) -> None:
    for mode in reversed(popped):
        torch._C._push_on_torch_function_stack(mode)


_AUTOCAST_DEVICES = ("cpu", "cuda")


class Fp32State(NamedTuple):
    """What :func:`enter_fp32` changed, for :func:`exit_fp32`."""

    modes: list[Any]  # the cast modes whose half ops now run in FP32
    autocast_off: tuple[str, ...]  # the devices whose torch.autocast was turned off


def _autocast_turn_off() -> tuple[str, ...]:
    """Turn torch.autocast off on every device where it is on (this thread); returns those devices."""
    devices = tuple(d for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d))
    if devices:
        (_set_autocast_between_graphs() if torch.compiler.is_compiling() else _set_autocast)(devices, False)
    return devices


def _set_autocast(devices: tuple[str, ...], enabled: bool) -> None:
    for device in devices:
        torch.set_autocast_enabled(device, enabled)


def _set_autocast_between_graphs() -> Callable[[tuple[str, ...], bool], None]:
    """``_set_autocast`` for compiled code: dynamo refuses the global setter inside a graph, so in compiled code (an
    FP32 module's hooks) the call runs eagerly between graphs (each graph is guarded on the autocast state it was
    traced with). Wrapped where it is used, under compilation: wrapping at import would import dynamo and triton."""
    return torch.compiler.disable(_set_autocast)


def _autocast_off_contexts() -> tuple[contextlib.AbstractContextManager[Any], ...]:
    """``torch.autocast(enabled=False)`` for CPU and, where torch has it, CUDA (a do-nothing context otherwise)."""
    cuda = torch.autocast("cuda", enabled=False) if torch.cuda.is_available() else contextlib.nullcontext()
    return torch.autocast("cpu", enabled=False), cuda


def _autocast_turn_on(devices: tuple[str, ...]) -> None:
    if devices:
        (_set_autocast_between_graphs() if torch.compiler.is_compiling() else _set_autocast)(devices, True)


def enter_fp32() -> Fp32State:
    """Make the table's half ops run in FP32 in every cast policy active on this thread, until :func:`exit_fp32` is
    given what this returned (nests). What a module pinned to FP32 at O1 runs under (see
    :mod:`lightning_mpx.health.promotion`, which calls the two from forward hooks and casts the module's inputs to FP32):
    ``torch.autocast`` is turned off inside (the ``"autocast"`` engine's casts are autocast's)."""
    modes = [mode for mode in torch.overrides._get_current_function_mode_stack() if isinstance(mode, _CastMode)]
    for mode in modes:
        mode.fp32 += 1
    return Fp32State(modes, _autocast_turn_off())


def exit_fp32(state: Fp32State | list[Any] | None = None) -> None:
    """Undo one :func:`enter_fp32`, given what it returned (``None`` or a list of modes: the cast modes active on
    this thread now, or those, and autocast is left as it is)."""
    modes, devices = (state.modes, state.autocast_off) if isinstance(state, Fp32State) else (state, ())
    if modes is None:
        modes = [mode for mode in torch.overrides._get_current_function_mode_stack() if isinstance(mode, _CastMode)]
    for mode in modes:
        mode.fp32 = max(0, mode.fp32 - 1)
    _autocast_turn_on(devices)


def casts_off_if_on() -> contextlib.AbstractContextManager[Any]:
    """:func:`disable_casts` when a torch-function mode (a cast policy's among them) or ``torch.autocast`` (the
    autocast engine's) is on on this thread, else a context that does nothing. The adapters' backward and optimizer
    step use it: usually called outside every policy's scope, where ``disable_casts`` would have nothing to do, but a
    manual backward or step inside a training step's scope must not run an optimizer's matmuls in half."""
    if torch._C._len_torch_function_stack() or any(map(torch.is_autocast_enabled, _AUTOCAST_DEVICES)):
        return disable_casts()
    return contextlib.nullcontext()


@contextlib.contextmanager
def fp32_scope() -> Iterator[None]:
    """Run the table's half ops of every active cast policy on this thread in FP32 inside the block (state restored
    when it ends or raises; scopes nest)."""
    modes = enter_fp32()
    try:
        yield
    finally:
        exit_fp32(modes)


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Run the enclosed code with every active cast policy on this thread turned off.

    Useful inside a model's forward for a block that must see its inputs exactly as given. The policies are found on
    torch's own torch-function mode stack, and ``torch.autocast`` (which the ``"autocast"`` engine enters) is turned
    off on every device; their state is restored when the block ends, also when it raises.
    """
    modes = [mode for mode in torch.overrides._get_current_function_mode_stack() if isinstance(mode, _CastMode)]
    for mode in modes:
        mode.disabled += 1
    try:
        # The "autocast" engine's casts (and a torch.autocast of the user's around it) are off too.
        if torch.compiler.is_compiling():  # dynamo traces autocast's context managers, not its global setter
            cpu_off, cuda_off = _autocast_off_contexts()
            with cpu_off, cuda_off:
                yield
        else:
            devices = _autocast_turn_off()
            try:
                yield
            finally:
                _autocast_turn_on(devices)
    finally:
        for mode in modes:
            mode.disabled -= 1


# -- compiled code called from inside a scope ---------------------------------------------------------------------
#
# Dynamo traces an active mode's __torch_function__ into the graph, so the compiled code already holds the casts; but a
# mode left on the stack while the compiled code runs is still handed every torch call of its runtime (AOT autograd's
# wrappers, inductor's extern kernels), which it lets through one by one. A hand-off takes the policy's mode off the
# stack around the compiled call, and the compiled code enters the policy's scope itself (traced, so no mode is on the
# stack at run time): the same casts, no call into the hook.


class _ScopeInside:
    """``fn`` inside the policy's scope when a :class:`_HandOff` took the policy's mode off the stack to call the
    compiled code that runs this (read while tracing: dynamo guards on the flag)."""

    def __init__(self, policy: CastPolicy, fn: Callable[..., Any]) -> None:
        self.policy = policy
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.policy._handed_off:
            with self.policy.scope():
                return self.fn(*args, **kwargs)
        return self.fn(*args, **kwargs)


class _HandOff:
    """Calls compiled code (which runs a :class:`_ScopeInside`) with the policy's active forward modes taken off the
    mode stack, and puts them back afterwards, also when it raises."""

    def __init__(self, policy: CastPolicy, compiled: Callable[..., Any]) -> None:
        self.policy = policy
        self.compiled = compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        policy = self.policy
        if torch.compiler.is_compiling():  # called from other compiled code: traced as it is
            return self.compiled(*args, **kwargs)
        popped = []
        stack_len, stack_at = torch._C._len_torch_function_stack, torch._C._get_function_stack_at
        while stack_len():
            top = stack_at(stack_len() - 1)
            if not (type(top) is _CastMode and top.policy is policy and not top.recompute_only and not top.disabled):
                break
            popped.append(torch._C._pop_torch_function_stack())
        if not popped:
            return self.compiled(*args, **kwargs)
        previous, policy._handed_off = policy._handed_off, True
        try:
            return self.compiled(*args, **kwargs)
        finally:
            policy._handed_off = previous
            for mode in reversed(popped):
                torch._C._push_on_torch_function_stack(mode)


class HandOffHandle:
    """Undoes a hand-off installed by :meth:`CastPolicy.hand_off_compiled`: ``handle.remove()``."""

    def __init__(self, restore: list[tuple[Any, str, Any]]) -> None:
        self._restore = restore  # (object, attribute, previous instance value or _MISSING)

    def remove(self) -> None:
        """Restore the attributes that the hand-off replaced (idempotent)."""
        for owner, name, previous in reversed(self._restore):
            if previous is _MISSING:
                owner.__dict__.pop(name, None)
            else:
                owner.__dict__[name] = previous
        self._restore = []


_MISSING = object()


def _hand_off_module(policy: CastPolicy, module: torch.nn.Module) -> HandOffHandle | None:
    """Hand-off for a ``torch.compile``'d module (an ``OptimizedModule``): its original module's ``forward`` enters the
    scope (inside the compiled region), and its compiled ``forward`` is called through a :class:`_HandOff`."""
    inner = module._orig_mod
    outer = module.__dict__.get("forward")
    if outer is None or isinstance(outer, _HandOff):
        return None
    restore = [(module, "forward", outer)]
    current = inner.__dict__.get("forward", _MISSING)
    if not (isinstance(current, _ScopeInside) and current.policy is policy):  # not twice for one module
        restore.append((inner, "forward", current))
        inner.__dict__["forward"] = _ScopeInside(policy, inner.forward)
    module.__dict__["forward"] = _HandOff(policy, outer)
    return HandOffHandle(restore)


def _hand_off_method(policy: CastPolicy, owner: Any, name: str, original: Callable[..., Any],
                     compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]]) -> HandOffHandle | None:
    """Hand-off for a compiled method ``owner.name`` (an instance attribute) whose uncompiled version is ``original``
    and that ``compile_fn`` compiled (Lightning's ``trainer.fit(torch.compile(model))`` compiles the steps so)."""
    current = owner.__dict__.get(name)
    if current is None or isinstance(current, _HandOff):
        return None
    handoff = _HandOff(policy, compile_fn(_ScopeInside(policy, original)))
    functools.update_wrapper(handoff, original)  # __wrapped__: what was compiled (Lightning's is_overridden reads it)
    owner.__dict__[name] = handoff
    return HandOffHandle([(owner, name, current)])
