"""Scopes inside a cast policy's scope: code run in FP32 (:func:`fp32_scope`, the modules pinned to FP32 at O1) or
without casts (:func:`disable_casts`), and the switches of ``torch.autocast`` they use.

Each finds the active policies on torch's own torch-function mode stack (this thread), changes their modes' state and
restores it when the block ends, also when it raises; ``torch.autocast`` (the ``"autocast"`` engine's casts) is turned
off inside and back on after.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, NamedTuple

import torch

from lightning_mpx.casting.mode import _actions_key, _CastMode, _Policy
from lightning_mpx.casting.targets import forget_scope

_AUTOCAST_DEVICES = ("cpu", "cuda")
_NOTHING = contextlib.nullcontext()  # stateless and reentrant: one for every call (no __init__ call per step)
_new_object = object.__new__
# torch.autocast's C switches, called directly where a scope turns its marker on and off (no Python call)
_set_autocast_enabled, _set_autocast_dtype = torch._C.set_autocast_enabled, torch._C.set_autocast_dtype
_autocast_dtype, _autocast_cache_enabled = torch._C.get_autocast_dtype, torch._C.is_autocast_cache_enabled
_autocast_enabled = torch._C.is_autocast_enabled
_set_autocast_cache_enabled = torch._C.set_autocast_cache_enabled


class Fp32State(NamedTuple):
    """What :func:`enter_fp32` changed, for :func:`exit_fp32`."""

    modes: list[Any]  # the cast modes whose half ops now run in FP32
    autocast_off: tuple[str, ...]  # the devices whose torch.autocast was turned off


def _autocast_turn_off() -> tuple[str, ...]:
    """Turn torch.autocast off on every device where it is on (this thread); returns those devices."""
    # (written out, without a generator or a helper: an O1 scope's marker is on in every FP32 module's hooks)
    cpu, cuda = torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda")
    if not (cpu or cuda):
        return ()
    devices = ("cpu", "cuda") if cpu and cuda else ("cpu",) if cpu else ("cuda",)
    if torch.compiler.is_compiling():
        _set_autocast_between_graphs()(devices, False)
    else:
        for device in devices:
            _set_autocast_enabled(device, False)
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


@contextlib.contextmanager
def _outer_autocast_off() -> Iterator[None]:
    """``torch.autocast(device, enabled=False)`` for each device whose autocast is on (none: nothing entered)."""
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def enter_fp32() -> Fp32State:
    """Make the table's half ops run in FP32 in every cast policy active on this thread, until :func:`exit_fp32` is
    given what this returned (nests). What a module pinned to FP32 at O1 runs under (see
    :mod:`lightning_mpx.health.promotion`, which calls the two from forward hooks and casts the module's inputs to
    FP32): ``torch.autocast`` is turned off inside (the ``"autocast"`` engine's casts are autocast's)."""
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
    if devices:  # _autocast_turn_on(devices), written out
        if torch.compiler.is_compiling():
            _set_autocast_between_graphs()(devices, True)
        else:
            for device in devices:
                _set_autocast_enabled(device, True)


def casts_off_if_on() -> contextlib.AbstractContextManager[Any]:
    """:func:`disable_casts` when a torch-function mode (a cast policy's among them) or ``torch.autocast`` (the
    autocast engine's) is on on this thread, else a context that does nothing. The adapters' backward and optimizer
    step use it: usually called outside every policy's scope, where ``disable_casts`` would have nothing to do, but a
    manual backward or step inside a training step's scope must not run an optimizer's matmuls in half."""
    if torch._C._len_torch_function_stack() or any(map(torch.is_autocast_enabled, _AUTOCAST_DEVICES)):
        return disable_casts()
    return _NOTHING


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
        else:  # (torch's C switches, written out: an O1 scope's marker is on here)
            cpu, cuda = _autocast_enabled("cpu"), _autocast_enabled("cuda")
            if cpu:
                _set_autocast_enabled("cpu", False)
            if cuda:
                _set_autocast_enabled("cuda", False)
            try:
                yield
            finally:
                if cpu:
                    _set_autocast_enabled("cpu", True)
                if cuda:
                    _set_autocast_enabled("cuda", True)
    finally:
        for mode in modes:
            mode.disabled -= 1


class _AutocastSwitch:
    """``torch.autocast``'s own switch (its ``__enter__`` and ``__exit__``, less their checks for TorchScript and
    ``torch.export``'s mode) for a policy that runs on ``torch.autocast`` alone, in eager code with no torch-function
    mode on, once a ``torch.autocast`` of the same arguments was found enabled
    (``CastPolicy.forward_scope``): constructing one checks them again in Python at every scope (on CUDA: CUDA's
    availability and, at bfloat16, the device's support). Entering it gives the policy, and it decorates a function, as
    :func:`policy_scope`'s context does.
    """

    __slots__ = ("device", "dtype", "cache", "policy", "saved")

    def __enter__(self) -> Any:
        device = self.device
        self.saved = torch.is_autocast_cache_enabled(), torch.is_autocast_enabled(device), torch.get_autocast_dtype(
            device)
        torch.set_autocast_enabled(device, True)
        torch.set_autocast_dtype(device, self.dtype)
        torch.autocast_increment_nesting()
        torch.set_autocast_cache_enabled(self.cache)
        return self.policy

    def __exit__(self, *exc: Any) -> bool:
        if torch.autocast_decrement_nesting() == 0:  # left the outermost autocast: its casts go
            torch.clear_autocast_cache()
        cache, enabled, dtype = self.saved
        torch.set_autocast_enabled(self.device, enabled)
        torch.set_autocast_dtype(self.device, dtype)
        torch.set_autocast_cache_enabled(cache)
        return False

    def __call__(self, func: Callable[..., Any]) -> Callable[..., Any]:
        """``func`` run in a forward scope of the policy at each call (a fresh one: the calls may nest or recurse)."""
        policy = self.policy

        @functools.wraps(func)
        def scoped(*args: Any, **kwargs: Any) -> Any:
            with policy_forward_scope(policy):
                return func(*args, **kwargs)

        return scoped


def policy_forward_scope(policy: Any) -> contextlib.AbstractContextManager[Any]:
    """:meth:`CastPolicy.forward_scope <lightning_mpx.casting.policy.CastPolicy.forward_scope>`: :func:`policy_scope`
    for a forward pass (``Amp.forward_context``). Where ``torch.autocast`` is the whole policy (the GPU's O1) and the
    table is resolved as it is now: in eager code with no torch-function mode on, :class:`_AutocastSwitch` once a
    ``torch.autocast`` of these arguments was found enabled (one call a scope, where the generator takes seven);
    traced by dynamo, ``torch.autocast`` itself (``torch.compiler.is_compiling()`` makes dynamo keep a frame that
    returns a context, and it cannot return the generator's). Else :func:`policy_scope`.
    """
    of = policy._actions_of  # _actions_key, read attribute by attribute: dynamo traces this
    if (policy._autocast_device is not None and not policy._actions and policy.table is of[0]
            and (policy.table._version, policy.refuse_inplace_float, policy.engine, policy.device_type,
                 policy.allow_banned, policy.half_dtype) == of[1:]):
        if policy._no_grad_cache:  # as every scope does (empty: no mode fills it)
            policy._no_grad_cache.clear()
        if torch.compiler.is_dynamo_compiling():  # first: traced code reads no eager-only state (a guard on it would
            # recompile the graph once an eager scope changes it)
            return torch.autocast(policy._autocast_device, dtype=policy.half_dtype, cache_enabled=policy.cache_casts)
        if policy._autocast_checked != policy._actions_stamp:
            if not torch.autocast(policy._autocast_device, dtype=policy.half_dtype,
                                  cache_enabled=policy.cache_casts)._enabled:
                return policy_scope(policy)  # (the generator gives the policy; torch.autocast gives itself)
            policy._autocast_checked = policy._actions_stamp  # these arguments hold: checked once
        if not torch._C._len_torch_function_stack():  # (torch.autocast tells torch.export's mode)
            switch = _new_object(_AutocastSwitch)  # no __init__ call
            switch.device, switch.dtype, switch.cache, switch.policy = (
                policy._autocast_device, policy.half_dtype, policy.cache_casts, policy)
            return switch
    return policy_scope(policy)


@contextlib.contextmanager
def policy_scope(policy: _Policy) -> Iterator[Any]:
    """:meth:`CastPolicy.scope <lightning_mpx.casting.policy.CastPolicy.scope>`: the policy applied to torch calls
    on this thread until the block ends (also when it raises): under the ``"autocast"`` engine, ``torch.autocast``
    and, only where the table differs from it, the Python mode."""
    try:
        traced = torch.compiler.is_dynamo_compiling()
        if traced or _actions_key(policy) != policy._actions_of:  # the key read inline in eager code (a call saved)
            policy._refresh_actions()
        # Evaluation casts are redone in every scope: a write through ``p.data`` leaves no trace on ``p``.
        policy._no_grad_cache.clear()
        device = policy._autocast_device
        if device is None:
            # An O1 table (half ops) in eager code: torch.autocast is turned on on the policy's device as a marker
            # while the user's code runs (the mode runs the calls autocast would cast differently with it off), so
            # that a torch.autocast(device, enabled=False) block of the user's (transformers' rotary embeddings,
            # entered only where autocast is on) turns it off and its calls run as given, as under torch.autocast.
            # Traced code takes no marker: a compiled graph keeps the casts it had.
            marker = None if traced else policy._marker_device
            # autocast on a device other than the marker's (the marker's own, a scope's around this one or the user's,
            # is switched below as it is)
            if (torch.is_autocast_enabled("cpu") and marker != "cpu") or (
                    torch.is_autocast_enabled("cuda") and marker != "cuda"):
                # An autocast around this scope (another policy's autocast engine, or the user's own torch.autocast)
                # would cast the half arguments this policy made to its own dtype: the innermost policy decides.
                try:
                    with _outer_autocast_off(), _CastMode(policy, marker=marker):
                        if marker is None:
                            yield policy
                        else:
                            with torch.autocast(marker, dtype=policy.half_dtype, cache_enabled=False):
                                yield policy
                finally:
                    if policy._noted:
                        forget_scope(policy)
                return
            if traced:  # dynamo traces the mode's own __enter__ and __exit__
                with _CastMode(policy):
                    yield policy
                return
            # Eager code pushes and pops the mode itself, as TorchFunctionMode.__enter__/__exit__ do (4 calls a scope),
            # and switches the marker with torch's C setters (torch.autocast's own, less its checks: no Python call).
            if marker is not None:
                saved = _autocast_dtype(marker), _autocast_cache_enabled(), _autocast_enabled(marker)
                _set_autocast_enabled(marker, True)
                _set_autocast_dtype(marker, policy.half_dtype)
                _set_autocast_cache_enabled(False)
            torch._C._push_on_torch_function_stack(_CastMode(policy, marker=marker))
            try:
                yield policy
            finally:
                torch._C._pop_torch_function_stack()
                if marker is not None:
                    _set_autocast_enabled(marker, saved[2])
                    _set_autocast_dtype(marker, saved[0])
                    _set_autocast_cache_enabled(saved[1])
                if policy._noted:  # Amp.cast_inputs' sources (casting.targets) go with the forward
                    forget_scope(policy)
            return
        with torch.autocast(device, dtype=policy.half_dtype, cache_enabled=policy.cache_casts):
            if policy._actions:
                with _CastMode(policy, autocast_device=device):
                    yield policy
            else:  # nothing for Python to do: torch.autocast's C++ dispatch alone
                yield policy
    except (RuntimeError, AssertionError) as error:  # the error's path only: a module set on a prepared model since,
        # or (FSDP's first forward) half parameters unfrozen beside FP32 ones in an FSDP unit, named
        named = getattr(policy, "forward_error", None)
        if named is not None:
            named(error)
        raise
