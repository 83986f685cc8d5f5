"""Writes between accumulated backwards at O2 that looked like a torch optimizer's step (engine.raw_steps'
``stepped_along``), judged at the step instead of at the backward that found them.

A write to the prepared optimizer's half parameters between two accumulated backwards, whose elements moved from their
FP32 masters' rounding against their gradients' signs nearly everywhere, is what a raw torch optimizer's step leaves:
the next engine step takes it into the masters at its half rounding only (what of the update is below the rounding is
lost, where FP32 and ``"bf16-mixed"`` keep it). Two correct habits write the same way:

* a descent probe undone before the step (extragradient's extrapolation, a first-order MAML inner step written in
  place): a backward is made at the probed weights, then the weights are restored. The step finds nothing of the
  probe in the half weights, so it loses nothing. So the backward that finds such a write only notes it
  (:class:`KeptWrite`: the masters' rounding and the write, copies made on this path alone), and the step judges it
  (:func:`judge_kept`, before anything is written): refused where the write still stands (the half weights' move
  from that rounding has more than half of the write's length along it), let through where it was undone.
* a weight decay written by hand (``p.mul_(1 - lr * wd)``) where an L2 penalty in the loss dominates the gradients:
  every element moves towards zero, against its gradient. A torch optimizer's step is no multiple of the weights
  (its update follows the gradients, which are the weights' only where such a penalty alone makes them, and then the
  step is that weight decay): a write that is one factor times the masters' rounding, within the half rounding
  (:func:`is_scaling`), is no raw step. What of the decay is below the rounding is lost as a decay written outside
  accumulation is (docs/master_weights.md).

Nothing here runs in the usual step: the state's ``kept_writes`` is empty unless such a write was found.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = ["KeptWrite", "forget_undone", "is_scaling", "judge_kept", "keep_write"]


@dataclass
class KeptWrite:
    """A write found at a backward (``message``: its refusal), judged at the next step of its optimizer: for each
    parameter found, its masters' rounding then (``base``, half) and the write from it (``delta``, FP32)."""

    message: str
    params: list[torch.Tensor]
    base: list[torch.Tensor]
    delta: list[torch.Tensor]

    def stands(self) -> bool:
        """Whether the half weights still hold the write: their move from ``base`` has more than half of the write's
        length along it (an undone probe has none: restored from a copy, or by subtraction up to rounding)."""
        along = total = 0.0
        with torch.no_grad():
            for param, base, delta in zip(self.params, self.base, self.delta):
                if param.shape != base.shape:  # resized since: a write of another kind, kept as it was
                    return True
                moved = param.detach().float() - base.float()
                along += float(torch.dot(moved.flatten(), delta.flatten()))
                total += float(torch.dot(delta.flatten(), delta.flatten()))
        return along * 2 > total


def keep_write(state: Any, message: str, found: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Note on ``state`` (an optimizer's) the write over ``found``'s parameters, each with its masters' rounding
    (half), for :func:`judge_kept` at its next step."""
    with torch.no_grad():
        base = [rounded.detach().clone() for _, rounded in found]
        delta = [param.detach().float() - rounded.float() for param, rounded in found]
    state.kept_writes.append(KeptWrite(message, [param for param, _ in found], base, delta))


def forget_undone(state: Any) -> None:
    """At a backward that found the weights written again (before :func:`keep_write` notes a new write), forget the
    writes noted on ``state`` that were undone since: a probe undone before the next backward at the restored weights
    (extragradient under accumulation) keeps no copy past it, where each such backward kept one until the step."""
    state.kept_writes = [write for write in state.kept_writes if write.stands()]


def judge_kept(state: Any, machine: Any) -> None:
    """At a step of ``state``'s optimizer, before it: a write noted by :func:`keep_write` that still stands is refused
    (``machine.refused``, which the step raises: on every rank, where they meet); those undone are forgotten."""
    kept, state.kept_writes = state.kept_writes, []
    standing = next((write for write in kept if write.stands()), None)
    if standing is not None and machine.refused is None:
        machine.refused = standing.message


def is_scaling(rounded: torch.Tensor, param: torch.Tensor, changed: int) -> bool:
    """Whether ``param`` (half) is one factor times ``rounded`` (its masters' rounding) rounded to half, for all but
    1/16 of the ``changed`` elements (a product rounded twice: ``p.sub_(c * p)``): a weight decay or a rescaling by
    hand. Each element bounds the factor by the halfway points to its neighbours in half (divided by its value); the
    factor is taken in the middle of the bounds left once the 1/16 outermost of each side are set aside, and the
    elements whose bounds hold it are counted. A raw step moves elements away from zero and towards it alike (or by
    amounts no one factor gives): their bounds hold no common factor."""
    with torch.no_grad():
        old, new = rounded.detach().flatten(), param.detach().flatten()
        up = torch.nextafter(new, torch.full_like(new, float("inf"))).double()
        down = torch.nextafter(new, torch.full_like(new, float("-inf"))).double()
        value, base = new.double(), old.double()
        live = base != 0
        if not bool(live.any()):
            return False
        low, high = (value + down) / 2 / base, (value + up) / 2 / base
        low, high = torch.minimum(low, high)[live], torch.maximum(low, high)[live]  # a negative value swaps them
        spare = int(live.sum()) // 16
        floor = low.kthvalue(low.numel() - spare).values  # the bounds left once the 1/16 outermost are set aside
        ceiling = high.kthvalue(spare + 1).values
        factor = (floor + ceiling) / 2
        slack = factor.abs() * 2.0**-20  # the product's own FP32 rounding before its rounding to half
        misfit = int(((low > factor + slack) | (high < factor - slack)).sum()) + int((~live & (value != 0)).sum())
    return misfit * 16 <= changed
