"""The calling thread's cast scope carried into ``torch.nn.DataParallel``'s replicas.

Over two or more GPUs, ``nn.DataParallel`` replicates the model (``torch.nn.parallel.replicate``, which calls each
module's ``_replicate_for_data_parallel()`` on the calling thread) and runs each replica's forward in a worker thread
of its own (``torch.nn.parallel.parallel_apply``), which carries grad mode and ``torch.autocast``'s on/off into the
thread, but neither autocast's dtype nor the torch-function modes: O1's cast policy (a ``TorchFunctionMode`` of the
calling thread, from ``Amp.forward_context()`` or the Apex layer's O1 scope) would not be in effect in the replicas,
which would run uncast, silently.

:func:`carry_scope_into_replicas` gives a prepared model an instance attribute ``_replicate_for_data_parallel``
(:class:`ReplicaScope`): called only by ``replicate``, it makes torch's replica and, when a cast scope or
``torch.autocast`` is on on the calling thread, gives the replica a call (``_call_impl``, its hooks included) that
enters the same scope in the worker thread (fresh modes of the same policies, the same autocast dtypes) when that
thread has not got it; an instance ``forward`` bound to the model (the Accelerate adapter's, Accelerate's own
autocast wrapper) is bound to the replica, which would run the model's own parameters else. Nothing runs on an
ordinary forward: a model that is not replicated never calls it.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from typing import Any, Callable

import torch
from torch import nn

from lightning_mpx.casting.mode import _CastMode
from lightning_mpx.common.weak import WeakHook

_ATTRIBUTE = "_replicate_for_data_parallel"
_AUTOCAST_DEVICES = ("cpu", "cuda")


class _Scope:
    """What the calling thread had on when the replica was made: its cast modes and its enabled autocasts."""

    def __init__(self, modes: list[_CastMode], autocasts: list[tuple[str, torch.dtype, bool]]) -> None:
        self.modes = modes
        self.autocasts = autocasts

    def missing(self) -> bool:
        """Whether this thread lacks one of the modes (a worker thread; with one replica, parallel_apply runs it on
        the calling thread, where the modes are on already)."""
        stack = torch.overrides._get_current_function_mode_stack()
        return any(all(mode is not on for on in stack) for mode in self.modes) or any(
            not torch.is_autocast_enabled(device) or torch.get_autocast_dtype(device) != dtype
            for device, dtype, _ in self.autocasts
        )

    def enter(self, stack: contextlib.ExitStack) -> None:
        """Enter the scope on this thread: the autocasts (with their dtypes), then fresh modes of the same policies in
        the same state (their counters are per thread: a mode is one scope's)."""
        for device, dtype, cache in self.autocasts:
            stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=cache))
        for mode in self.modes:
            fresh = _CastMode(mode.policy, recompute_only=mode.recompute_only, autocast_device=mode.autocast_device,
                              marker=mode.marker)
            fresh.fp32, fresh.disabled = mode.fp32, mode.disabled
            stack.enter_context(fresh)


class _ScopedCall:
    """A replica's ``_call_impl``: its call (hooks and forward) inside the calling thread's scope."""

    def __init__(self, call: Callable[..., Any], scope: _Scope) -> None:
        self.call = call
        self.scope = scope

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.scope.missing():
            return self.call(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            self.scope.enter(stack)
            return self.call(*args, **kwargs)


def bound_weakly(function: Callable[..., Any], obj: Any) -> WeakHook:
    """``function`` bound to ``obj`` through a weak reference: put on ``obj`` itself, no reference cycle (a replica
    is freed with its parameters' copies as soon as DataParallel's forward lets it go)."""
    return WeakHook(types.MethodType(function, obj))


class ReplicaScope:
    """A prepared model's ``_replicate_for_data_parallel`` (an instance attribute, taken off each replica): torch's,
    and the replica's call made to enter the calling thread's cast scope in a worker thread (see the module's
    docstring). It holds the model weakly (no reference cycle: a model the user drops is freed at once); copied with
    the model (``copy.deepcopy``, pickling), it acts for the copy."""

    def __init__(self, module: nn.Module) -> None:
        self._module = weakref.ref(module)

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return (ReplicaScope, (self._module(),))

    def __call__(self) -> nn.Module:
        module = self._module()
        if module is None:  # (only the model calls it: it is alive)
            raise RuntimeError("the model this replicate call belongs to is gone")
        replica = type(module)._replicate_for_data_parallel(module)
        replica.__dict__.pop(_ATTRIBUTE, None)  # (the copied __dict__'s: it would replicate the original)
        for key in ("forward", "generate"):  # an instance's own, bound to the model (the adapters', Accelerate's):
            value = replica.__dict__.get(key)  # bound to the replica, which would run the model's parameters else
            if value is None:
                continue
            rebind = getattr(value, "for_replica", None)  # lightning_mpx's AmpForward
            if rebind is not None:
                replica.__dict__[key] = rebind(module, replica)
            elif isinstance(value, types.MethodType) and value.__self__ is module:
                replica.__dict__[key] = bound_weakly(value.__func__, replica)
        modes = [m for m in torch.overrides._get_current_function_mode_stack() if isinstance(m, _CastMode)]
        autocasts = [(device, torch.get_autocast_dtype(device), torch.is_autocast_cache_enabled())
                     for device in _AUTOCAST_DEVICES if torch.is_autocast_enabled(device)]  # fmt: skip
        if modes or autocasts:
            scope = _Scope(modes, autocasts)
            compiled = replica._compiled_call_impl  # module.compile(): the call torch makes instead
            if compiled is not None:
                replica._compiled_call_impl = _ScopedCall(compiled, scope)
            else:
                replica._call_impl = _ScopedCall(bound_weakly(type(replica)._call_impl, replica), scope)
        return replica


def carry_scope_into_replicas(module: nn.Module) -> None:
    """Have ``nn.DataParallel``'s replicas of ``module`` (of the model it wraps, for a ``DataParallel`` prepared
    itself) run in the cast scope of the thread that replicates them (see the module's docstring)."""
    for target in (module, module.module) if isinstance(module, nn.DataParallel) else (module,):
        if not isinstance(target.__dict__.get(_ATTRIBUTE), ReplicaScope):
            target.__dict__[_ATTRIBUTE] = ReplicaScope(target)
