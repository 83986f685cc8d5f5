"""At O2, writes through ``.data`` to the half gradients between an unscale and the step.

After an unscale (or a clip) the user's code may write the model's half gradients before the step
(``p.grad.mul_(s)``): the engine tells such a write by the gradient's version counter
(:func:`~lightning_mpx.engine.rescale.follow_cleared_grads`) and takes it into the FP32 masters the step applies. A
write through ``p.grad.data`` (``p.grad.data.mul_(s)``, ``p.grad.data.clamp_(...)``) moves no counter: ``.data`` is a
tensor with a counter of its own. Telling it at every step would read every gradient at every step (a host read and
a kernel per gradient), a cost on everyone for a rare habit. So the engine looks once: the first time an optimizer's
half gradients are noted for user code that may follow (``unscale_()``, a clip), it keeps a bitwise copy of them and
compares at that iteration's step. A write found there is the habit: the engine warns once (naming the habit and the
free alternative, a write without ``.data``) and from then on compares at every step of that optimizer, moving the
counter of each gradient written so the write is taken (or refused) as any other write. A first look that finds no
write ends the looking: a habit that starts at a later step is not seen (the documented limit; write without
``.data``).

State: the optimizer's :class:`~lightning_mpx.engine.optimizer_state._OptimizerState` (``data_habit``, ``data_watch``);
these functions hold only the code. Callers test ``state.data_habit is not False`` inline before calling (no call on
the steps of an optimizer looked at and found clean).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lightning_mpx.engine.optimizer_state import _OptimizerState

# the integer dtype of each element size: a bitwise compare (a NaN equals itself, -0.0 differs from 0.0)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

HABIT = (
    "a write through p.grad.data to the half gradients between the unscale (or clip) and the step was found at O2 "
    "(p.grad.data.mul_/clamp_/zero_): .data moves no version counter, so lightning_mpx now compares this optimizer's "
    "half gradients with a copy at every step (one host read and a kernel per gradient) to take such writes. Write "
    "p.grad itself (p.grad.mul_(s), torch.nn.utils.clip_grad_*_) instead: that costs nothing, and a .data habit that "
    "starts after an optimizer's first unscale is never seen."
)


class DataWatch:
    """The half gradients as the engine left them: each gradient, its ``(id, version)`` then, and a copy."""

    __slots__ = ("copies", "grads", "marks")

    def __init__(self, grads: list[torch.Tensor]) -> None:
        self.grads = grads
        self.marks = [(id(g), g._version) for g in grads]
        self.copies = [g.detach().clone() for g in grads]


def note(state: _OptimizerState) -> None:
    """Where the engine notes ``state``'s half gradients for user code that may follow: a copy of them, at the first
    such point (the look) or at each once the habit was found; and where it takes writes made since and notes their
    counters again while looking (``rescale.follow_cleared_grads``: torch's clip of the model's gradients, then the
    engine's clip), or a ``.data`` write after that would be compared against stale marks and skipped."""
    grads = [state.pair_params[i].grad for i in state.mastered]
    state.data_watch = DataWatch([g for g in grads if g is not None and not g.is_sparse])


def told(state: _OptimizerState) -> None:
    """Before the engine tells the writes to ``state``'s half gradients by their counters: move the counter of each
    written through ``.data`` since :func:`note` (bitwise unlike its copy, same tensor at the same version)."""
    watch = state.data_watch
    if watch is None:
        return
    pairs = [
        (grad, copy)
        for grad, copy, mark in zip(watch.grads, watch.copies, watch.marks)
        if grad._version == mark[1] and grad.shape == copy.shape and grad.dtype == copy.dtype
    ]
    if not pairs:
        return
    device = pairs[0][0].device
    flags = torch.stack([_differs(grad, copy).to(device) for grad, copy in pairs]).tolist()
    written = [grad for (grad, _), flag in zip(pairs, flags) if flag]
    for grad in written:
        torch.autograd.graph.increment_version(grad)  # taken (or refused) by the counters as any write
    if written and state.data_habit is not True:
        state.data_habit = True
        warnings.warn(HABIT, UserWarning, stacklevel=2)
    # what the engine takes is noted again by the next note; the rest are compared against the same copies


def ended(state: _OptimizerState) -> None:
    """At the step: the copies let go; a first look that found no write ends the looking."""
    state.data_watch = None
    if state.data_habit is None:
        state.data_habit = False


def _differs(grad: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
    bits = _BITS.get(grad.element_size())
    if bits is None or grad.is_complex():
        return torch.ne(grad, copy).any()
    return torch.ne(grad.detach().view(bits), copy.view(bits)).any()
