"""At O2, a write to half parameters told apart by their FP32 masters' rounding: a torch optimizer's step between
accumulated backwards (:func:`stepped_along`), a half weight written back to its master's rounding (:func:`at_rounding`,
a rollback by ``copy_`` to the last step's snapshot: no raw step), and that rounding itself (:func:`rounding`, the
value a refused write is compared with at the step: engine.kept_writes).

Used by :func:`~lightning_mpx.engine.raw_steps.refuse_raw_step` (engine.raw_steps, which re-exports
:func:`stepped_along`), only where the versions of a registered optimizer's parameters changed since the last engine
backward: never in the usual step.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lightning_mpx.engine.kept_writes import is_scaling
from lightning_mpx.masters.weights import MasterWeights

__all__ = ["at_rounding", "rounding", "stepped_along"]

_HALF = (torch.float16, torch.bfloat16)
_MOVED = 16  # elements moved below which a write is not told from a hand write (stepped_along)


def stepped_along(
    params: Sequence[torch.Tensor],
    noted: Sequence[int],
    master_weights: Sequence[MasterWeights],
    renormed: frozenset[int] = frozenset(),
) -> list[torch.Tensor]:
    """Of ``params`` (a registered optimizer's, with their versions ``noted`` at the last engine backward), at O2 the
    half ones written since that hold a gradient (kept: no ``zero_grad``) and whose values moved away from their FP32
    masters' rounding along minus that gradient: what a torch optimizer's step writes (SGD, Adam: each element moves
    against the sign of its gradient), which the next engine step would take into the masters at its half rounding
    only (most of a small step rounds away). A clamp, a renormalisation by hand, an EMA swapped in and back, a
    SAM-style or adversarial perturbation (along the gradient, not against it), a write over zeroed gradients and one
    that is one factor times the weights (a weight decay by hand: engine.kept_writes.is_scaling) are no such step.
    Called only where versions changed between accumulated backwards (never in the usual step); without masters (O1)
    there is no value to compare with: nothing is found."""
    found: list[torch.Tensor] = []
    if not master_weights:
        return found
    agree = moved = 0
    with torch.no_grad():
        for param, version in zip(params, noted):
            grad = param.grad
            if grad is None or param._version == version or id(param) in renormed or param.dtype not in _HALF:
                continue
            master = next((m.master_of(param) for m in master_weights if m.covers(param)), param)
            if master is param or master.shape != param.shape or grad.shape != param.shape:
                continue
            rounded = master.detach().to(param.dtype)
            delta = param.detach().float() - rounded.float()
            changed = delta != 0
            count = int(changed.sum())
            if not count or is_scaling(rounded, param, count):  # a weight decay by hand (engine.kept_writes)
                continue
            along = int((changed & (torch.sign(delta) == -torch.sign(grad.float()))).sum())
            agree, moved = agree + along, moved + count
            if along * 2 > count:
                found.append(param)
    if moved < _MOVED or (moved - agree) * 16 > moved:
        # Too few elements moved to tell (a small step mostly rounds away), or not against the gradients nearly
        # everywhere: a torch optimizer's first step moves each element against its gradient's sign, and its
        # rounding to half keeps that sign; a write of another kind agrees by chance, about half the time.
        return []
    return found


def at_rounding(param: torch.Tensor, master_weights: Sequence[MasterWeights]) -> bool:
    """Whether ``param`` is a half weight with an FP32 master whose rounding it holds exactly."""
    if param.dtype not in _HALF:
        return False
    master = next((m.master_of(param) for m in master_weights if m.covers(param)), param)
    if master is param or master.shape != param.shape:
        return False
    with torch.no_grad():
        return bool(torch.equal(master.detach().to(param.dtype), param.detach()))


def rounding(param: torch.Tensor, master_weights: Sequence[MasterWeights]) -> torch.Tensor:
    """``param``'s FP32 master rounded to its dtype (:func:`stepped_along` found it: it has one)."""
    master = next(m.master_of(param) for m in master_weights if m.covers(param))
    return master.detach().to(param.dtype)
