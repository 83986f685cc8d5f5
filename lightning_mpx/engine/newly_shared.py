"""At O2, the FP32 gradient of a master that becomes shared after another optimizer's unscale.

:class:`~lightning_mpx.engine.shared_grads.SharedGrads` notes the FP32 gradient each unscale makes while parameters
are shared (``SharedGrads.masters``), so that a later optimizer holding the same master takes it as the first one
made it (clipped) rather than dividing the half gradient again. Where no parameter was shared at that unscale (the
usual loop, which pays nothing for this), nothing was noted: a parameter that becomes shared later in the iteration
(``add_param_group`` of a parameter the clipped optimizer holds, to another optimizer, between the clip and the other
one's step) found no note, and the other's step applied the unclipped gradient where FP32's applies the clipped one.

When the overlap is found again (:meth:`SharedGrads.refresh`, at the registration, the release, or the unscale that
finds a parameter count changed: before that unscale makes the masters' new gradients), :func:`made_before` takes
the gradients of the newly shared masters as the optimizer that unscaled them has them now: the master's FP32
gradient while it is unscaled and not stepped (clipped, as its step uses it), or, after its step freed that gradient,
the half gradient it left (not written since) divided by the scale it carries with that optimizer's clips applied
(:func:`~lightning_mpx.engine.true_grads.true_grad`): the same values, made the same way.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lightning_mpx.engine.optimizer_state import _OptimizerState, _Stage
from lightning_mpx.engine.true_grads import true_grad
from lightning_mpx.scaling.scaler import LossScaler

Noted = dict[int, tuple[torch.Tensor, int, torch.Tensor]]  # as SharedGrads.masters: by the half gradient's id


def made_before(
    held: Sequence[tuple[_OptimizerState, Sequence[torch.Tensor]]], new: set[int], scalers: Sequence[LossScaler]
) -> Noted:
    """For the parameters whose ``id`` is in ``new`` (shared from now on) with a master of their own: (the half
    gradient, its version, the true FP32 gradient) by the half gradient's ``id``, where an optimizer of ``held``
    (``(state, parameters)`` pairs) unscaled it in this iteration and it is as that unscale (or the step after it)
    left it. Nothing is changed."""
    noted: Noted = {}
    for state, _ in held:
        stage = state.stage
        if stage is _Stage.STEPPED:
            marks = state.stepped_marks or frozenset()
        elif stage is _Stage.UNSCALED or stage is _Stage.SKIPPED:
            marks = frozenset(mark for mark in state.unscaled_marks if mark is not None)
        else:
            continue
        for param, master in state.pairs:
            half = param.grad
            if master is param or half is None or id(param) not in new or id(half) in noted:
                continue
            if (id(half), half._version) not in marks:  # written since (zero_grad), or not this unscale's
                continue
            if stage is _Stage.STEPPED:  # the step freed the master's gradient: made again as the step had it
                true = true_grad(state, scalers, param, master)
            else:
                true = master.grad
            if true is not None:
                noted[id(half)] = (half, half._version, true)
    return noted
