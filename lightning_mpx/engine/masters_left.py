"""At O2, the FP32 masters' gradients as the engine last left them before the step, and the user's writes since.

Between an unscale the user's code may follow (``unscale_()``, the engine's clip) and the step, the masters' FP32
gradients are what the step uses, and the user may write them (``amp.master_params(opt)``'s ``.grad``, or a list of
the masters kept from before the unscale, clipped with torch's ``clip_grad_norm_``). FP32 has one gradient per
parameter, so what such a write leaves is what its step leaves too, and a later write to the model's gradients is made
on top of it. At O2 the model's half gradients are another tensor: after the engine's clip they still carry the scale
(and the clips to apply later), after ``unscale_()`` they hold the copy it showed. So a write to the masters' gradients
was lost from what the step leaves (a loop that does not zero them added the next backward to the unwritten values),
and a write to the model's gradients after one made with a list kept from before the unscale (which
:mod:`~lightning_mpx.engine.master_writes` does not watch: nothing was handed out) undid it at the step, silently.

:func:`note_left` notes the masters' gradients as the engine leaves them (at the end of a show and of a clip); the
unscale makes them views of one buffer (:class:`~lightning_mpx.masters.pairs.GradLayout`), which share one version
counter, so one view and its version tell a write to any of them, with no call per parameter (the show and the clip
note through :func:`note_after`, one call; the step's check is written out, attribute reads). The step then shows the
masters' gradients on the model before it steps (:func:`moved`: one multi-tensor copy, only after such a write), so
that they hold what it stepped with; the step's check of a write to the model's gradients refuses both writes
(:func:`~lightning_mpx.engine.master_writes.refuse_both`). Only where no parameter is shared between optimizers (a
shared master's gradient is another optimizer's unscale's: :mod:`~lightning_mpx.engine.shared_grads`) and not
sharded. Not told: a write through ``.data`` (a counter of its own), a master's gradient replaced by another tensor
(``m.grad = m.grad * 0.5``). A write to the gradients ``amp.master_params()`` handed out after ``unscale_()`` (tensors
of their own) is told by engine.master_writes (:func:`~lightning_mpx.engine.master_writes.any_written`) and shown alike.
"""

from __future__ import annotations

import operator
from typing import Any

from lightning_mpx.engine.optimizer_state import _OptimizerState

_GRAD = operator.attrgetter("grad")


def note_left(state: _OptimizerState) -> tuple[Any, ...] | None:
    """The note of ``state``'s masters' gradients as they are now, as the engine leaves them (for
    ``state.masters_left``): one view of their buffer and its version, or (no one buffer: fewer than two masters,
    several devices or dtypes) each gradient and its version; ``None`` without gradients."""
    masters, mastered = state.pair_masters, state.mastered
    probe = masters[mastered[0]].grad if mastered else None
    if probe is None:
        return None
    if probe._base is not None:  # a view of the one buffer the step's unscale made
        return (probe, probe._version, None, None)
    grads = tuple(map(_GRAD, map(masters.__getitem__, mastered)))
    return (probe, probe._version, grads, tuple(-1 if g is None else g._version for g in grads))


def note_after(state: _OptimizerState) -> None:
    """At the end of a show or an engine clip (not sharded): ``state.masters_left`` noted, one view of the masters'
    buffer and its version in the usual case, written out so that it costs one call; none where the gradients were
    handed out (:mod:`~lightning_mpx.engine.master_writes` watches those)."""
    probe = state.pair_masters[state.mastered[0]].grad if state.mastered else None
    if probe is not None and probe._base is not None:
        state.masters_left = (probe, probe._version, None, None)
    else:
        state.masters_left = None if state.handed else note_left(state)


def moved(state: _OptimizerState) -> bool:
    """Whether the masters' gradients were written in place since :func:`note_left` (any of them: with one buffer its
    counter, else each one's)."""
    left = state.masters_left
    if left is None:
        return False
    probe, version, grads, versions = left
    if probe._version != version:
        return True
    return grads is not None and any(g is not None and g._version != v for g, v in zip(grads, versions))
