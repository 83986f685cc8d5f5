"""At O2, where optimizers share parameters (a head in the whole model's optimizer and in its own, its FP32 master
shared): what one optimizer's step leaves in the shared half gradients when another optimizer's clip is in the values
it stepped with, and the write the user made to shown half gradients that an optimizer's clip took since.

A step that does not show the true values on the model leaves the half gradients with the scale, the clips since its
unscale applied later to what is kept (:func:`~lightning_mpx.engine.rescale.rescale_stepped`). A shared master's FP32
gradient may come from another optimizer's unscale and carry its clip (the whole model's engine clip, then the head's
step alone): the head's half gradients then lacked that clip, which no step of the head applies, so a loop that does
not zero them added the next backward to the unclipped values (the whole model's next clip 1.88 against FP32's 1.13,
silently). :func:`keep_clipped` writes the FP32 values the step used back into those half gradients, at the scale
they carry, and notes them (``stepped_final``) so that no clip is applied to them again; the other optimizers' notes
of them move along.

:func:`took_written` is the other half: after an optimizer's clip took the user's write to shown half gradients
into the shared masters and clipped them, another optimizer's unscale took the half gradients again (the write
without the clip: 3.5x FP32's travel off). The note of the FP32 gradient each half gradient stands for is moved to the
clipped one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lightning_mpx.engine.optimizer_state import _OptimizerState, _Stage
from lightning_mpx.engine.true_grads import carried_scale

if TYPE_CHECKING:
    from lightning_mpx.engine.shared_grads import SharedGrads


def keep_clipped(shared: SharedGrads, stepped: _OptimizerState) -> None:
    """After a step of ``stepped``'s optimizer (STEPPED, its half gradients left with the scale): the shared half
    gradients whose FP32 gradient, the one its step used (``shared.masters``), carries another optimizer's clip (that
    optimizer unscaled and not stepped, with clips) get its values times the scale they carry and are noted as final;
    those another optimizer's step made final already stay so. Python per shared parameter (shared heads only)."""
    others = [state for state in shared.optimizers.values() if state is not stepped]
    clipping = any(state.stage is _Stage.UNSCALED and state.clips for state in others)
    inherited = frozenset().union(*(state.stepped_final for state in others if state.stage is _Stage.STEPPED))
    if not clipping and not inherited:
        return
    final, sources, targets = set(), [], []
    for index in stepped.mastered:
        param = stepped.pair_params[index]
        half = param.grad
        if half is None or id(param) not in shared.ids:
            continue
        if (id(half), half._version) in inherited:
            final.add((id(half), half._version))
            continue
        noted = shared.masters.get(id(half))
        if not clipping or shared.holds(half) or noted is None or noted[0] is not half or noted[1] != half._version:
            continue  # true values another unscale showed there: stepped_shown's (SharedGrads.settled)
        if noted[2] is not half:
            sources.append(noted[2])
            targets.append(half)
    if targets:
        before = [(id(half), half._version) for half in targets]
        scale = carried_scale(stepped, shared.scalers).to(targets[0].device)
        torch._foreach_copy_(targets, torch._foreach_mul(sources, scale))  # rounded to the half dtype, as a show
        now = {key: (id(half), half._version) for key, half in zip(before, targets)}
        for half, true in zip(targets, sources):
            shared.masters[id(half)] = (half, half._version, true)
        final.update(now.values())
        _move_marks(shared, stepped, now)
    if final:
        stepped.stepped_final = frozenset(final)


def _move_marks(shared: SharedGrads, stepped: _OptimizerState, now: dict[tuple[int, int], tuple[int, int]]) -> None:
    """The engine's write of :func:`keep_clipped` (``now``: each half gradient's mark before it, and after), not the
    user's: moved along in the marks of the step that made it and of the other optimizers that noted them."""
    if stepped.stepped_marks is not None:
        stepped.stepped_marks = frozenset(now.get(mark, mark) for mark in stepped.stepped_marks)
    for state in list(shared.optimizers.values()):
        if state is stepped:
            continue
        if state.stage is _Stage.UNSCALED and state.unscaled_marks:
            state.unscaled_marks = tuple(now.get(m, m) if m is not None else None for m in state.unscaled_marks)
        elif state.stage is _Stage.STEPPED and state.stepped_marks is not None:
            state.stepped_marks = frozenset(now.get(mark, mark) for mark in state.stepped_marks)
            state.stepped_final |= {mark for mark in now.values() if mark in state.stepped_marks}


def took_written(shared: SharedGrads, state: _OptimizerState) -> None:
    """After ``state``'s clip took the user's writes to its half gradients since its unscale into the masters'
    FP32 gradients (:func:`~lightning_mpx.engine.rescale.follow_cleared_grads`), before it clips them: a shared half
    gradient noted with the FP32 gradient an earlier unscale made or showed (``shared.masters``), written since, is
    noted with the master's FP32 gradient now, so that another optimizer's unscale takes that one (with this clip)
    rather than the written half gradient again."""
    for index in state.mastered:
        param, master = state.pair_params[index], state.pair_masters[index]
        half, true = param.grad, master.grad
        if half is None or true is None or id(param) not in shared.ids:
            continue
        noted = shared.masters.get(id(half))
        if noted is not None and noted[0] is half and noted[1] != half._version:
            shared.masters[id(half)] = (half, half._version, true)
