"""Cast policies and ``torch.compile``'d code: the hand-off of compiled forward code, and the backward of compiled
graphs.

Dynamo traces an active mode's ``__torch_function__`` into the graph, so the compiled code already holds the casts;
but a mode left on the stack while the compiled code runs is still handed every torch call of its runtime (AOT
autograd's wrappers, inductor's extern kernels), which it lets through one by one. A hand-off
(:meth:`~lightning_mpx.casting.policy.CastPolicy.hand_off_compiled`) takes the policy's mode off the stack around the
compiled call, and the compiled code enters the policy's scope itself (traced, so no mode is on the stack at run
time): the same casts, no call into the hook. The backward pass of a compiled graph is left alone the same way
(:func:`_leave_compiled_backward`).
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Mapping

import torch

from lightning_mpx.casting.mode import _CastMode, _Policy

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


def _leave_compiled_backward(policy: _Policy, roots: list[torch.Tensor]) -> None:
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


def _pop_recompute_modes(policy: _Policy, grad_outputs: Any) -> None:
    stack_len, stack_at = torch._C._len_torch_function_stack, torch._C._get_function_stack_at
    while stack_len():
        top = stack_at(stack_len() - 1)
        if not (type(top) is _CastMode and top.policy is policy and top.recompute_only):
            return
        torch._C._pop_torch_function_stack()


class _ScopeInside:
    """``fn`` inside the policy's scope when a :class:`_HandOff` took the policy's mode off the stack to call the
    compiled code that runs this (read while tracing: dynamo guards on the flag)."""

    def __init__(self, policy: _Policy, fn: Callable[..., Any]) -> None:
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

    def __init__(self, policy: _Policy, compiled: Callable[..., Any]) -> None:
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
        # The scope's marker (an O1 table run by Python: casting.scopes.policy_scope) off while the compiled code runs:
        # its own scope, traced, takes none (its graph is the one compiled without it).
        marker = popped[0].marker
        if marker is not None and torch.is_autocast_enabled(marker):
            torch.set_autocast_enabled(marker, False)
        else:
            marker = None
        try:
            return self.compiled(*args, **kwargs)
        finally:
            if marker is not None:
                torch.set_autocast_enabled(marker, True)
            policy._handed_off = previous
            for mode in reversed(popped):
                torch._C._push_on_torch_function_stack(mode)


class HandOffHandle:
    """Undoes a hand-off installed by :meth:`~lightning_mpx.casting.policy.CastPolicy.hand_off_compiled`:
    ``handle.remove()``."""

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


def _hand_off_module(policy: _Policy, module: torch.nn.Module) -> HandOffHandle | None:
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


def _hand_off_method(policy: _Policy, owner: Any, name: str, original: Callable[..., Any],
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


def hand_off_compiled(policy: _Policy, root: Any, *, methods: Mapping[str, Callable[..., Any]] | None = None,
                      compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]] | None = None
                      ) -> list[HandOffHandle]:
    """What :meth:`~lightning_mpx.casting.policy.CastPolicy.hand_off_compiled` does for ``policy`` (see there)."""
    handles = []
    if isinstance(root, torch.nn.Module):
        from torch._dynamo.eval_frame import OptimizedModule

        for module in root.modules():
            if isinstance(module, OptimizedModule):
                handle = _hand_off_module(policy, module)
                if handle is not None:
                    handles.append(handle)
    if methods:
        if compile_fn is None:
            raise TypeError("compile_fn=None: methods need the function that compiled them")
        for name, original in methods.items():
            handle = _hand_off_method(policy, root, name, original, compile_fn)
            if handle is not None:
                handles.append(handle)
    return handles
