"""An overflow counted once per loss in the Apex layer: the optimizers a block that overflowed did not name, whose
gradients its backward reached (``AmpState.charged``), and the gradients' marks that tell whether they are still as
that block left them."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from lightning_mpx.apex._state import AmpState
from lightning_mpx.engine.amp import Amp
from lightning_mpx.engine.optimizer_state import _Stage

if TYPE_CHECKING:
    from lightning_mpx.apex.loss_scaling import AmpOptimizer


def _params(wrapper: AmpOptimizer) -> list[torch.Tensor]:
    return [p for group in wrapper.optimizer.param_groups for p in group["params"]]


def _grad_marks(params: list[torch.Tensor]) -> tuple[tuple[int, int] | None, ...]:
    """Identity and version of each parameter's gradient (``None`` where it has none)."""
    with torch._C.DisableTorchFunction():  # O1's cast mode would run per parameter
        return tuple(None if (g := p.grad) is None else (id(g), g._version) for p in params)


def _charge_unnamed(state: AmpState, amp: Amp, own: list[AmpOptimizer], named: list[int], loss_id: int) -> None:
    """After a block's overflow: note the optimizers of ``own`` not in ``named`` whose gradients its backward reached
    (pending at ``loss_id``, as the block left them). Their step finds the same non-finite values and is skipped; the
    block's overflow counted once for its loss (one back-off per iteration, as ``GradScaler`` stepping both), their
    step's flags count for none (``loss_scaling._optimizer_step``), while the gradients are still as the block left
    them (:func:`_charged_still`)."""
    for wrapper in own:
        key, core = id(wrapper.optimizer), amp._optimizers.get(id(wrapper.optimizer))
        if key in named or core is None or core.stage is not _Stage.READY or core.loss_id != loss_id:
            continue
        params = _params(wrapper)
        if any(p.grad is not None for p in params):
            state.charged[key] = (loss_id, _held(params))


def _recharge(state: AmpState, wrapper: AmpOptimizer, loss_id: int) -> bool:
    """A block of ``loss_id`` names an optimizer noted by :func:`_charge_unnamed`: its gradients as that block left
    them (not cleared: a GAN's discriminator reached by the generator's block, not zeroed before its own) hold the
    overflow counted already, which this block's check finds again; its step is skipped, and counts for none, as one
    ``GradScaler`` update of the iteration. Otherwise (cleared, written) forgotten. Returns whether the charge is
    another loss's (``num_losses=2``: loss 0's inf reached the gradients loss 1's block names): this block's check
    then finds that loss's overflow, not its own, and counts it for none (the caller takes it as found before the
    block, as Apex's check of the block's own new gradients would). An overflow of this block's own in those
    gradients is not told apart from it (they are non-finite already; the step is skipped either way)."""
    key = id(wrapper.optimizer)
    charged, marks = state.charged[key]
    if not _same(marks, _params(wrapper), versions=True):
        del state.charged[key]
        return False
    return charged != loss_id


def _renote(state: AmpState, wrapped: list[AmpOptimizer]) -> None:
    """At the end of a block naming optimizers still charged (:func:`_recharge` kept them): their gradients as this
    block left them are the charged ones, which :func:`_charged_still` compares at the step."""
    for wrapper in wrapped:
        entry = state.charged.get(id(wrapper.optimizer))
        if entry is not None:
            state.charged[id(wrapper.optimizer)] = (entry[0], _held(_params(wrapper)))


_Held = tuple[tuple[weakref.ref[torch.Tensor], int] | None, ...]  # what _held notes


def _charged_still(wrapper: AmpOptimizer, marks: _Held | None) -> bool:
    """Whether ``wrapper``'s gradients are the tensors :func:`_charge_unnamed` noted (``marks``), added to or not (by
    a later block of another loss too, which brought them to its scale: the charged inf stays).
    An optimizer charged in an iteration it did not step in (stepped every other iteration, or only later) whose
    gradients ``model.zero_grad()`` set to ``None`` since holds new gradients at its step: their overflow counts (it
    was hidden). A clear in place (``set_to_none=False`` on the model, not the optimizer) is not told apart."""
    return marks is not None and _same(marks, _params(wrapper), versions=False)


def _held(params: list[torch.Tensor]) -> _Held:
    """A weak reference to each parameter's gradient and its version (``None`` where it has none): a gradient freed
    and another made in its place is told apart, where an ``id`` could be reused."""
    with torch._C.DisableTorchFunction():  # O1's cast mode would run per parameter
        return tuple(None if (g := p.grad) is None else (weakref.ref(g), g._version) for p in params)


def _same(marks: _Held, params: list[torch.Tensor], versions: bool) -> bool:
    """Whether ``params``' gradients are the tensors of ``marks`` (and, with ``versions``, unwritten since)."""
    if len(marks) != len(params):
        return False
    with torch._C.DisableTorchFunction():
        for mark, param in zip(marks, params):
            grad = param.grad
            if mark is None or grad is None:
                if mark is not grad:
                    return False
            elif mark[0]() is not grad or (versions and mark[1] != grad._version):
                return False
    return True


def _left_over(state: AmpState, wrapper: AmpOptimizer) -> bool:
    """Whether ``wrapper``'s gradients are still the ones its skipped step left (``AmpState.after_step``): the same
    tensors, unwritten since. Otherwise (cleared, by either ``zero_grad``, or added to by a backward) forgotten."""
    key = id(wrapper.optimizer)
    if _same(state.after_step[key], _params(wrapper), versions=True):
        return True
    del state.after_step[key]
    return False
