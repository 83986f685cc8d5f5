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
does not hold the half copies for it (held, they cost 6-14% of a mid-size training step on CPU by keeping memory that
the backward pass would otherwise reuse). A parameter changed in place since (an optimizer step between two forward
passes) or given new storage (``p.data = ...``) is cast again. Casts made
without gradients (evaluation) live for one scope: a write through ``p.data`` changes the values without any trace on
the parameter, and evaluation-only runs never reach an iteration boundary. Casts are differentiable, so gradients
reach the FP32 parameters in FP32; the gradients of a cached cast's several uses (a weight used at every time step)
are summed in half first, as with ``torch.autocast``'s cache (``cache_casts=False``: per-use casts, summed in FP32).

Activation checkpointing recomputes part of the forward pass during the backward pass, outside the forward's scope: a
backward pass started through the policy recomputes with the forward's casts (see
:mod:`lightning_mpx.casting.checkpointing`, which also has :func:`checkpoint_contexts` for a bare
``loss.backward()``). The torch-function mode itself is in :mod:`lightning_mpx.casting.mode`, FP32 scopes and
:func:`disable_casts` in :mod:`lightning_mpx.casting.scopes`, the hand-off to compiled code in
:mod:`lightning_mpx.casting.compiled`, the casts of a call's arguments (the policy's base) in
:mod:`lightning_mpx.casting.arg_casts`; this module re-exports their public names.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping

import torch

from lightning_mpx.casting.arg_casts import ArgumentCasts, _cached_cast, _CacheEntry  # noqa: F401  (kept import path)
from lightning_mpx.casting.checkpointing import (
    _BACKWARD_ENTRIES,
    _TENSOR_BACKWARD,
    _run_backward,
    builds_graph,
    checkpoint_contexts,
)
from lightning_mpx.casting.compiled import HandOffHandle, hand_off_compiled
from lightning_mpx.casting.lists import AUTOCAST_ACTIONS
from lightning_mpx.casting.mode import (
    _BACKWARD,
    _BODY,
    _BODY_CALLS,
    _CATEGORY_ACTION,
    _INPLACE_FLOAT,
    _NATIVE_PROMOTION,
    _PASS,
    _PLAIN,
    _PROMOTE,
    _PROMOTE_NATIVE,
    BannedOpError,
    _actions_key,
    _CastMode,
)
from lightning_mpx.casting.scopes import (
    Fp32State,
    casts_off_if_on,
    disable_casts,
    enter_fp32,
    exit_fp32,
    fp32_scope,
    policy_forward_scope,
    policy_scope,
)
from lightning_mpx.casting.table import CastTable
from lightning_mpx.casting.targets import Notes
from lightning_mpx.common.dtypes import parse_half_dtype

__all__ = [
    "BannedOpError",
    "CastPolicy",
    "Fp32State",
    "HandOffHandle",
    "autocast_differences",
    "casts_off_if_on",
    "checkpoint_contexts",
    "disable_casts",
    "enter_fp32",
    "exit_fp32",
    "fp32_scope",
]


_ENGINES = ("auto", "autocast", "mode")


def autocast_differences(table: CastTable, device_type: str, *, allow_banned: bool = False,
                         half_dtype: torch.dtype | str | None = None
                         ) -> dict[Callable[..., Any], tuple[str | None, str | None]]:
    """``table.autocast_differences(device_type, allow_banned=allow_banned, half_dtype=half_dtype)``: see
    :meth:`CastTable.autocast_differences`."""
    return table.autocast_differences(device_type, allow_banned=allow_banned, half_dtype=half_dtype)


class CastPolicy(ArgumentCasts):
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
        if table is not None and not isinstance(table, CastTable):
            raise TypeError(f"table={type(table).__name__} must be a lightning_mpx.CastTable or None (the default).")
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
        #: The dtypes a half op casts to ``half_dtype``: FP32, and the other half dtype after cast_other_half().
        self._to_half: tuple[torch.dtype, ...] = (torch.float32,)
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
        # The _actions_stamp whose torch.autocast was found enabled (its arguments checked): forward_scope then
        # switches autocast on without constructing one (see casting.scopes._AutocastSwitch).
        self._autocast_checked = -1
        # An O1 table run by the Python policy: the device whose torch.autocast a scope turns on as a marker of the
        # user's code (off inside the user's torch.autocast(enabled=False) blocks: see casting.scopes.policy_scope);
        # None otherwise. Set by _refresh_actions.
        self._marker_device: str | None = None
        # Whether a forward pass in a scope ran a cast that a backward pass recomputes (an activation checkpoint's):
        # only then does a backward pass enter a recompute mode, which is handed every torch call it makes (FSDP's
        # gathers and reductions among them). Set by the forward's mode (with _recomputes_seen, this iteration's
        # note); clear_cache() keeps it for one more iteration, for a graph that outlives an update (a GAN's
        # generator, differentiated after the discriminator's step), and drops it the iteration after.
        self._recomputes = False
        self._recomputes_seen = False
        # Amp.cast_inputs' casts (weakly, per thread) until the thread's scope ends (casting.targets).
        self._noted = Notes()
        # Resolved now rather than at the first scope: a scope entered inside a compiled region would otherwise
        # resolve while tracing and recompile at the second call.
        self._refresh_actions()

    # The generator function itself, as a method: dynamo traces it inside compiled code (an object wrapping it broke
    # Fabric's compiled graph), and in eager code it pushes its mode on torch's stack itself.
    scope = policy_scope

    # A function of the policy, as scope is (see casting.scopes.policy_forward_scope).
    forward_scope = policy_forward_scope

    @contextlib.contextmanager
    def recompute_scope(self, *, create_graph: bool = False) -> Iterator[CastPolicy]:
        """Apply the policy to forward code that autograd re-runs during a backward pass entered in this block.

        Enter it around ``loss.backward()`` (``Amp.backward`` does): activation checkpointing
        (``torch.utils.checkpoint`` with ``use_reentrant=True`` or ``False``) then recomputes with the forward's
        casts, as it does for ``torch.autocast``. Only calls made with gradients enabled are cast: during a backward
        pass that is the recomputation, while the engine's own backward functions (and Python
        ``autograd.Function.backward``) run with gradients disabled and are left alone, unless the backward builds a
        graph (``create_graph=True``: say so, and Python backward functions are cast too).

        The block enters a mode only when there is something to recompute: a cast that a scope's forward ran inside
        an activation checkpoint since the last :meth:`clear_cache`. Otherwise the backward pass runs as it would
        outside, and FSDP's gathers and reductions in it make no call into the policy's hook.
        """
        self._refresh_actions()
        self._grad_cache.clear()  # a backward pass starts: the forward passes' casts are not needed any more
        if (not self._recomputes and not create_graph) or (self._autocast_device is not None and not self._actions):
            # No cast of a scope's forward is recomputed (no activation checkpoint ran one since clear_cache()), or
            # torch.utils.checkpoint restores torch.autocast's state for the recomputation itself.
            yield self
            return
        with _CastMode(self, recompute_only=True, autocast_device=self._autocast_device,
                       marker=self._marker_device):
            yield self

    def backward(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """``tensor.backward(*args, **kwargs)`` inside :meth:`recompute_scope`, without a call into the policy's hook.

        The same as ``with policy.recompute_scope(): tensor.backward(...)``, which hands ``Tensor.backward`` to the
        policy's mode first: this goes to the autograd engine directly (``Amp.backward`` uses it).
        """
        if _actions_key(self) != self._actions_of:  # _refresh_actions() when something changed (a call saved)
            self._refresh_actions()
        if not self._recomputes and not ((args or kwargs) and builds_graph(args, kwargs)):
            # No cast of a scope's forward is recomputed, and no graph is built: nothing for a mode to do.
            self._grad_cache.clear()
            tensor.backward(*args, **kwargs)
            return
        if self._autocast_device is not None and not self._actions:
            # torch.utils.checkpoint restores torch.autocast's state for the recomputation itself.
            tensor.backward(*args, **kwargs)
            return
        if torch.Tensor.backward is not _TENSOR_BACKWARD:
            # Replaced since import (a profiler's wrapper, a test's mock): called as it is, once. Torch hands a mode
            # the replacement, not a backward call it knows, so an activation checkpoint then recomputes without
            # the forward's casts (as after a bare loss.backward()).
            tensor.backward(*args, **kwargs)
            return
        _run_backward(self, _TENSOR_BACKWARD, (tensor, *args), kwargs)

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
        return hand_off_compiled(self, root, methods=methods, compile_fn=compile_fn)

    def cast_other_half(self) -> None:
        """Have the half ops cast tensors of the other half dtype to ``half_dtype`` too, as ``torch.autocast`` does
        (O1 of a model loaded in float16 under a bfloat16 run: its float16 weights met bfloat16 inputs, "mat1 and mat2
        must have the same dtype"). Off by default: a scope nested in another policy's of the other half dtype then
        leaves the inner policy's casts as they are."""
        self._to_half = (torch.float32, torch.float16, torch.bfloat16)

    def clear_cache(self) -> None:
        """Drop the cached casts of parameters: call it at each iteration boundary, after the optimizer step (a
        backward pass started through the policy drops the training casts already). That a forward pass ran casts
        inside an activation checkpoint is kept until the call after next: a graph may outlive one boundary (a GAN's
        generator, differentiated after the discriminator's step)."""
        self._recomputes, self._recomputes_seen = self._recomputes_seen, False
        # _clear_casts(), inline (a call saved per step)
        self._grad_cache.clear()
        self._no_grad_cache.clear()
        device = self._autocast_device
        if device is not None and torch.is_autocast_enabled(device):
            torch.clear_autocast_cache()

    def _clear_casts(self) -> None:
        """Drop the cached casts of parameters (and ``torch.autocast``'s, inside a scope)."""
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
        return tuple(f for f in self._actions if f not in _BACKWARD_ENTRIES and f not in _BODY_CALLS)

    @property
    def cache_size(self) -> int:
        """The number of parameter casts the Python policy holds (``torch.autocast``'s own are not counted)."""
        return len(self._grad_cache) + len(self._no_grad_cache)

    # -- internals ----------------------------------------------------------------------------------------------
    def _run_backward(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A backward call (``Tensor.backward``, ``torch.autograd.backward``/``grad``) that this policy's mode was
        handed inside a scope, run with a recompute mode in place (see
        :func:`~lightning_mpx.casting.checkpointing._run_backward`)."""
        return _run_backward(self, func, args, kwargs)

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
            actions.update(dict.fromkeys(_BODY_CALLS, _BODY))
            if refuse:
                for entry in self.table.entries("float"):
                    inplace = (
                        getattr(torch.Tensor, entry.name + "_", None) if entry.namespace == "torch.Tensor" else None
                    )
                    if inplace is not None and inplace not in actions:
                        actions[inplace] = _INPLACE_FLOAT
            marker = None
            device = self.device_type or ("cuda" if torch.cuda.is_available() else "cpu")
            if autocast_device is None and device in ("cpu", "cuda") and self.table.entries("half"):
                # An O1 table run by Python: its scope turns torch.autocast on as a marker (code in a user's
                # torch.autocast(enabled=False) then runs as given). The mode runs the table's calls with it off, and
                # the functions that autocast casts and the table does not list too (as given).
                marker = device
                for function, (_, theirs) in autocast_differences(
                        self.table, device, allow_banned=self.allow_banned, half_dtype=self.half_dtype).items():
                    if theirs is not None:
                        actions.setdefault(function, _PLAIN)
            self._marker_device = marker
            if autocast_device is not None and actions.keys() <= _BACKWARD_ENTRIES | _BODY_CALLS:
                actions = {}  # no mode at all: torch's checkpoint restores autocast for recomputation itself
            self._actions = actions
            self._action_lookup = _action_lookup(actions)
            self._autocast_device = autocast_device
            self._actions_of = (self.table, self.table._version, *key)
            self._actions_stamp += 1


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
