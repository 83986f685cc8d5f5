"""Backward passes under a cast policy, so that activation checkpointing recomputes with the forward's casts.

Activation checkpointing (``torch.utils.checkpoint``, Hugging Face ``gradient_checkpointing_enable()``) re-runs part
of the forward pass during the backward pass, where the forward's scope has ended. Torch restores ``torch.autocast``'s
state for that recomputation, but not torch-function modes, so a backward pass started through a policy
(:meth:`~lightning_mpx.casting.policy.CastPolicy.backward`, a backward call inside a scope,
:meth:`~lightning_mpx.casting.policy.CastPolicy.recompute_scope`) runs with a recompute mode on the stack
(:func:`_run_backward`): it casts only code that runs with gradients enabled, which during a backward pass is the
recomputation (the engine runs backward functions with gradients disabled), and the recomputed forward gets the
forward's dtypes. A bare ``loss.backward()`` outside both scopes has no policy to recompute with, unless the
checkpoint call itself records it: :func:`checkpoint_contexts` is a ``context_fn`` for
``checkpoint(..., use_reentrant=False)`` that does (the reentrant variant takes no ``context_fn``).
"""

from __future__ import annotations

import contextlib
import inspect
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping

import torch

from lightning_mpx.casting.compiled import _compiled_graphs_made, _leave_compiled_backward
from lightning_mpx.casting.mode import _CastMode, _Policy

# torch's own Tensor.backward, as imported: a later replacement (a profiler's wrapper, a test's mock) is not it.
_TENSOR_BACKWARD = torch.Tensor.backward
# The calls that start a backward pass, with the names of their (roots, inputs) arguments.
_BACKWARD_ARGUMENTS: Mapping[Callable[..., Any], tuple[str, str]] = MappingProxyType(
    {
        _TENSOR_BACKWARD: ("self", "inputs"),
        torch.autograd.backward: ("tensors", "inputs"),
        torch.autograd.grad: ("outputs", "inputs"),
    }
)
_BACKWARD_ENTRIES = frozenset(_BACKWARD_ARGUMENTS)
_TENSOR_BACKWARD_KEYWORDS = frozenset({"gradient", "retain_graph", "create_graph", "inputs"})
_BACKWARD_SIGNATURES: Mapping[Callable[..., Any], inspect.Signature] = MappingProxyType(
    {func: inspect.signature(func) for func in _BACKWARD_ARGUMENTS}
)


def _run_backward(policy: _Policy, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
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
    if func is _TENSOR_BACKWARD and len(args) == 1 and _TENSOR_BACKWARD_KEYWORDS.issuperset(kwargs):
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
    if not policy._recomputes and not arguments.get("create_graph"):
        # No cast of a scope's forward is recomputed and no graph is built: the mode, set aside while it handles
        # this call, is not needed (it would be handed every torch call of the backward pass).
        return func(*args, **kwargs)
    if _compiled_graphs_made():
        _leave_compiled_backward(policy, root_tensors)
    if func is _TENSOR_BACKWARD and _make_grads is not None and _engine_run_backward is not None:
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
            with _CastMode(policy, recompute_only=True, autocast_device=policy._autocast_device,
                           marker=policy._marker_device):
                _engine_run_backward((root,), grads, create_graph if retain_graph is None else retain_graph,
                                     create_graph, engine_inputs, allow_unreachable=True, accumulate_grad=True)
            return None
    arguments[roots_name] = _as_edges(roots)
    if inputs is not None:
        arguments[inputs_name] = _as_edges(inputs)
    if func is _TENSOR_BACKWARD:
        create_graph = bool(arguments.get("create_graph", False))
        retain_graph = arguments.get("retain_graph")
        edges = (arguments["self"],)
        gradient = arguments.get("gradient")
        if gradient is None and root_tensors[0].numel() == 1:
            # What the engine would make for a scalar, made here: inside the mode it would be a call into the hook.
            gradient = torch.ones_like(root_tensors[0], memory_format=torch.preserve_format)
        with _CastMode(policy, recompute_only=True, autocast_device=policy._autocast_device,
                       marker=policy._marker_device):
            return torch.autograd.backward(
                edges[0], None if gradient is None else (gradient,), retain_graph, create_graph,
                inputs=arguments.get("inputs"),
            )
    assert bound is not None
    with _CastMode(policy, recompute_only=True, autocast_device=policy._autocast_device,
                   marker=policy._marker_device):
        return func(*bound.args, **bound.kwargs)


def builds_graph(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
    """Whether ``Tensor.backward(*args, **kwargs)`` (``gradient, retain_graph, create_graph, inputs``) builds a
    graph of the backward pass (``create_graph=True``): its Python backward functions then run with gradients
    enabled, where a recompute mode casts them."""
    return bool(kwargs.get("create_graph") or (len(args) > 2 and args[2]))


# torch.autograd.backward's two steps (private; the public call is used where a torch release lacks them).
_make_grads = getattr(torch.autograd, "_make_grads", None)
_engine_run_backward = getattr(torch.autograd.graph, "_engine_run_backward", None)


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



def checkpoint_contexts() -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=...)``: the
    recomputation runs with the cast policies that were active when the checkpointed forward ran.

    Torch calls it when the forward reaches the checkpoint; it records the cast modes on this thread's mode stack
    then (their policy and state: casts disabled, an FP32 module around the call) and returns a do-nothing forward
    context and a recompute context that enters the same modes again, wherever the backward pass runs, as torch does
    for ``torch.autocast``'s state. A plain ``loss.backward()`` then recomputes with the forward's casts, as
    ``Amp.backward`` does for any checkpoint; with no policy active at the forward (an FP32 forward), both contexts
    do nothing. Under ``Amp.backward`` the recorded state takes the place of its recompute scope for the
    recomputation (a block run inside :func:`~lightning_mpx.casting.scopes.disable_casts` recomputes without casts).

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
        (mode.policy, mode.recompute_only, mode.disabled, mode.fp32, mode.autocast_device, mode.marker)
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

    def __init__(self, states: list[tuple[_Policy, bool, int, int, str | None, str | None]]) -> None:
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
            for policy, recompute_only, disabled, fp32, autocast_device, marker in self.states:
                policy._refresh_actions()
                mode = _CastMode(policy, recompute_only=recompute_only, autocast_device=autocast_device, marker=marker)
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
