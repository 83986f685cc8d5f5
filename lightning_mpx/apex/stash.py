"""Apex's stash in the Apex layer: the unscaled gradients of earlier ``scale_loss`` blocks kept aside from a block's
backward and added back after its unscale (:func:`_stash`, :func:`_restore_stash`), and how a ``delay_unscale`` chain's
gradients cleared since its last block are told apart (:func:`_chain_cleared`, :func:`_tag_zeros`), their loss's
pending gradients then counting for nothing (:func:`_forget_pending`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from lightning_mpx.apex._state import AmpState
from lightning_mpx.apex.charges import _grad_marks
from lightning_mpx.engine.amp import Amp
from lightning_mpx.engine.optimizer_state import _Stage

if TYPE_CHECKING:
    from lightning_mpx.apex.loss_scaling import AmpOptimizer


def _stash(
    state: AmpState,
    amp: Amp,
    wrappers: list[AmpOptimizer],
    unscaled: list[torch.optim.Optimizer],
    delay_unscale: bool = False,
) -> None:
    """Take the unscaled gradients of earlier blocks out of the way of this block's backward (Apex's stash): at O2
    the FP32 master gradients, at O1 (and for FP32 parameters at O2) the parameters' own.

    The core would scale them back up for the backward (at O2 into the half gradients, where a true gradient above
    65504 / scale overflows) and check them again at the block's end, charging a non-finite value another loss's block
    left to this block's loss. Apex kept them aside, checked only the block's new gradients and added them after
    unscaling; so does this (it is the core's ``scale_loss`` that finds nothing left to rescale: the gradients are
    cleared here).
    """
    masters = amp.properties.master_weights
    for wrapper in wrappers:
        inner = wrapper.optimizer
        if id(inner) not in state.delayed and all(inner is not u for u in unscaled):
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        marks = state.delayed.pop(id(inner), None)
        if marks is not None and _chain_cleared(marks, params, id(inner) in state.stash):
            # The script cleared the gradients of the delay_unscale blocks since the last one ended (a batch dropped
            # mid-accumulation, zero_grad either way): what was stashed before goes with them, and their loss's
            # pending gradients count for nothing (Apex updated a scaler only at the end of a block it unscaled).
            state.stash.pop(id(inner), None)
            _forget_pending(amp, inner)
        if all(inner is not u for u in unscaled):
            continue
        if masters:
            # The masters' gradients follow a zero_grad() of the model's since the unscale (the core tells one from
            # the half gradients' version counters): what the user cleared is not kept aside and added back.
            amp.show_unscaled_on_model(inner)
        kept = state.stash.setdefault(id(inner), [])
        if state.cleared and id(inner) in state.cleared:
            # The wrapper's zero_grad() since a block left them unscaled (that block given up): nothing of it is kept
            # aside (its zeros, with set_to_none=False), so a delay_unscale chain that follows stays scaled, as Apex's.
            state.cleared.discard(id(inner))
            continue
        if delay_unscale and not masters and _all_zero(params):
            # O1, a delay_unscale block: gradients all zero are a clear since the block that left them unscaled
            # (model.zero_grad(set_to_none=False), which runs no code of ours; or a block whose loss was zero): kept in
            # place, nothing is set aside, so the chain stays scaled as Apex's (whose stash then held zeros). One host
            # read, on this path only (a delay_unscale block after an unscaled block with no step between).
            continue
        for param, master in zip(params, amp.master_params(inner) if masters else params):
            if master.grad is not None:
                kept.append((master, master.grad))
                master.grad = None
                param.grad = None


def _all_zero(params: list[torch.Tensor]) -> bool:
    """Whether every gradient of ``params`` is zero (``True`` without gradients): the first elements read first (one
    host read, every dtype promoted), so gradients with values end there."""
    with torch._C.DisableTorchFunction():
        grads = [g.detach() for p in params if (g := p.grad) is not None and g.numel()]
        if not grads:
            return True
        if any(g.is_sparse for g in grads):
            return False  # kept aside, as before
        if torch.cat([g.reshape(-1)[:1] for g in grads]).ne(0).any().item():
            return False
        return not torch.stack([g.ne(0).any() for g in grads]).any().item()


def _chain_cleared(marks: tuple[tuple[int, int] | None, ...], params: list[torch.Tensor], tagged: bool) -> bool:
    """Whether every gradient the last ``delay_unscale`` block left (``marks``, noted at its end) was cleared since:
    gone (``set_to_none``), or written and now zero (``zero_grad(set_to_none=False)``). Version counters tell a
    write apart without reading the gradients; only a chain whose every gradient was written is read (one host
    read), so that another in-place change (a scaling of the gradients) keeps what was stashed. A negative zero left
    proves that no clear wrote it (``zero_()`` writes +0.0): a chain with earlier blocks kept aside has its zeros
    written as -0.0 at its end (:func:`_tag_zeros`), so the in-place multiply of ``clip_grad_norm_`` on the all-zero
    gradients of a block whose loss was zeroed (``loss * 0``), which leaves every zero negative, is told from a
    ``zero_grad(set_to_none=False)``; a clear by ``grad.mul_(0)`` leaves the positive gradients' zeros positive.
    ``tagged`` (earlier blocks kept aside: the zeros were tagged): a gradient whose version did not move is read too,
    since a clear through ``.data`` (``p.grad.data.zero_()``) moves no version counter of ``p.grad``; its zeros are
    positive, where the chain's own are negative."""
    if all(mark is None for mark in marks):
        return False  # nothing was left to clear (a block that did not reach these parameters)
    written, unmoved = [], False
    for mark, now in zip(marks, _grad_marks(params)):
        if mark is None or now is None:
            continue
        if mark == now:
            if not tagged:
                return False  # one gradient as the block left it: the chain goes on
            unmoved = True  # as the block left it, or cleared through .data: the values tell
        else:
            written.append(now)
    if not written and not unmoved:
        return True
    with torch._C.DisableTorchFunction():
        grads = [g.detach() for p in params if (g := p.grad) is not None and g.numel()]
        if not grads:
            return True
        # A cleared gradient's first element is zero: one read of those first (one kernel, every dtype promoted), the
        # usual accumulation's gradients end there without a read of them whole.
        if torch.cat([g.reshape(-1)[:1] for g in grads]).ne(0).any().item():
            return False
        peak = torch.stack([g.abs().amax().float() for g in grads]).amax()
        # every zero negative: the tagged zeros as the chain left them, multiplied in place (no clear writes -0.0)
        tagged = torch.stack([torch.signbit(g).all() for g in grads]).all()
        nonzero, negative = torch.stack([peak != 0, tagged]).tolist()
        return not nonzero and not negative


def _tag_zeros(params: list[torch.Tensor]) -> None:
    """Write the zeros of ``params``' gradients as -0.0 (the same value to every use: ``x + -0.0 == x``), which a clear
    (``zero_()``, ``fill_(0)``) writes as +0.0 and an in-place multiply keeps: see :func:`_chain_cleared`."""
    with torch._C.DisableTorchFunction():
        for param in params:
            grad = param.grad
            if grad is not None and grad.is_floating_point() and not grad.is_sparse:
                grad.masked_fill_(grad == 0, -0.0)


def _forget_pending(amp: Amp, optimizer: torch.optim.Optimizer) -> None:
    """The pending (scaled, not yet unscaled) gradients of ``optimizer`` were cleared: the core forgets the loss and
    scale they carried and the checks made of them, so no later check counts an iteration for that loss."""
    state = amp._optimizers.get(id(optimizer))
    if state is not None and state.stage is _Stage.READY:
        state.clear_checks()
        state.loss_id = None
        state.grad_scale = None


def _restore_stash(state: AmpState, wrapper: AmpOptimizer) -> None:
    """Add the stashed FP32 gradients of ``wrapper``'s optimizer to its unscaled master gradients (unscaling
    first)."""
    amp, optimizer = wrapper._engine, wrapper.optimizer
    kept = state.stash.pop(id(optimizer), None)
    if kept is None:
        return
    if not amp.is_unscaled(optimizer):
        amp.unscale_(optimizer)
    for master, grad in kept:
        master.grad = grad if master.grad is None else master.grad.add_(grad)
    # The model's gradients show the sums too (a half copy, as after any unscale; the step uses the masters'), made
    # where the stash cleared them: the core then sees a later zero_grad() or `p.grad = None` as the user clearing
    # them and drops the masters' copies. Without a half gradient, a master's would outlive the user's clearing (after
    # a skipped step: its inf, added to the next iteration's gradients).
    amp.show_unscaled_on_model(optimizer)
