"""Clipping the unscaled gradients of one of a :class:`~lightning_mpx.engine.optimizers.StepMachine`'s optimizers, and
showing them on the half model at O2: the state each call reads and writes is the machine's (the optimizer's
:class:`~lightning_mpx.engine.optimizer_state._OptimizerState`, its ``grad_norms``); these functions hold only the code.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch

from lightning_mpx.common.keywords import Required
from lightning_mpx.engine import data_writes
from lightning_mpx.engine.grad_checks import local_squares, reduce_checks
from lightning_mpx.engine.master_writes import advance, clean, renote
from lightning_mpx.engine.masters_left import moved, note_after, note_left
from lightning_mpx.engine.optimizer_state import _Stage
from lightning_mpx.engine.rescale import follow_cleared_grads, grad_marks, unscale_late
from lightning_mpx.engine.sharding import local_tensor
from lightning_mpx.engine.shared_clips import took_written
from lightning_mpx.masters.pairs import param_pairs

_PARAMS = operator.itemgetter("params")

if TYPE_CHECKING:
    from lightning_mpx.engine.optimizers import StepMachine


def clip_norm(
    machine: StepMachine, optimizer: torch.optim.Optimizer, max_norm: float, *, with_masters: bool
) -> torch.Tensor:
    """:meth:`Amp.clip_grad_norm_ <lightning_mpx.engine.amp.Amp.clip_grad_norm_>` for ``machine``'s ``optimizer``."""
    state = machine.state(optimizer)
    max_norm = clip_limit("max_norm", max_norm)
    unwritten = clean(state) if state.handed else None  # masters handed out: the clip's write is the engine's
    kept = moved(state)  # the masters' gradients written since the engine left them
    if state.stage is not _Stage.UNSCALED:
        machine._unscale(state, max_norm=float(max_norm))
    else:
        if machine.masters.weights:
            # The model's gradients, written since the unscale, are clipped.
            follow_cleared_grads(state, machine.masters.weights)
            if machine.shared.masters:  # and taken by another optimizer's unscale clipped (engine.shared_clips)
                took_written(machine.shared, state)
        if state.unscaled_groups is not None:  # and those of a group added since, unscaled now
            unscale_late(state, machine.scalers, machine.masters.weights, optimizer, machine.backend, machine.shared)
        params = machine._unscaled_params(optimizer, with_masters)
        if machine.sharding is not None:  # the global norm: this rank's squares, summed with the flags
            device = state.found_inf.device if state.found_inf is not None else torch.device("cpu")
            squares = local_squares(machine.sharding, params, device)
            grads = [p.grad for p in params if p.grad is not None]
            state.grad_norm = reduce_checks(state, machine.sharding, squares, grads, float(max_norm))
        else:
            state.grad_norm = _clip_unscaled(params, float(max_norm), state.found_inf)
    assert state.grad_norm is not None
    if machine.masters.weights:  # the half gradients lack it (see rescale.after_step)
        state.clips += (("norm", state.grad_norm, max_norm),)
        state.clips_found = state.found_inf  # its coefficient where the clip is applied to the half gradients
        if unwritten is not None:
            advance(state, unwritten)
        if not kept:  # the masters' gradients as the clip left them
            if machine.sharding is None and not machine.shared.ids:  # engine.masters_left: not shared, not sharded
                note_after(state)
    machine.grad_norms[state.loss_id or 0] = state.grad_norm
    return state.grad_norm


def clip_value_(
    machine: StepMachine, optimizer: torch.optim.Optimizer, clip_value: float, *, with_masters: bool
) -> None:
    """:meth:`Amp.clip_grad_value_ <lightning_mpx.engine.amp.Amp.clip_grad_value_>` for ``machine``'s ``optimizer``."""
    state = machine.state(optimizer)
    clip_value = clip_limit("clip_value", clip_value)
    unwritten = clean(state) if state.handed else None  # as in clip_norm
    kept = moved(state)  # the masters' gradients written since the engine left them
    if state.stage is not _Stage.UNSCALED:
        machine._unscale(state)
    else:
        if machine.masters.weights:
            follow_cleared_grads(state, machine.masters.weights)  # as in clip_grad_norm_
            if machine.shared.masters:
                took_written(machine.shared, state)
        if state.unscaled_groups is not None:
            unscale_late(state, machine.scalers, machine.masters.weights, optimizer, machine.backend, machine.shared)
    params = machine._unscaled_params(optimizer, with_masters)
    if machine.sharding is not None:  # elementwise: each rank clamps its own shards
        for param in params:
            local_tensor(param.grad).clamp_(-clip_value, clip_value)  # type: ignore[arg-type]
    elif params:  # torch's clip refuses an empty list
        torch.nn.utils.clip_grad_value_(params, clip_value)
    if machine.masters.weights:
        state.clips += (("value", None, clip_value),)
        if unwritten is not None:
            advance(state, unwritten)
        if not kept:  # the masters' gradients as the clip left them
            if machine.sharding is None and not machine.shared.ids:  # engine.masters_left: not shared, not sharded
                note_after(state)


def follow_model_writes(machine: StepMachine, optimizer: torch.optim.Optimizer) -> None:
    """At O2, between ``optimizer``'s unscale and its step: the writes made to the model's half gradients since the
    unscale showed the true values there (``p.grad.zero_()``, ``p.grad.mul_(3)``) taken into the masters' FP32
    gradients now, as :func:`clip_norm` and :func:`clip_value_` take them first, for a clip of the masters'
    gradients made outside the engine (the Accelerate adapter's clip over several optimizers or by another norm,
    torch's clip on the masters): without it that clip measured and clipped the unwritten values, and the show after
    it put them over the write. Nothing before an unscale or without masters."""
    state = machine.state(optimizer)
    if not machine.masters.weights or state.stage is not _Stage.UNSCALED:
        return
    follow_cleared_grads(state, machine.masters.weights)
    if state.unscaled_groups is not None:  # a group added since the unscale, unscaled now (as in clip_norm)
        unscale_late(state, machine.scalers, machine.masters.weights, optimizer, machine.backend, machine.shared)


def show_unscaled(machine: StepMachine, optimizer: torch.optim.Optimizer, *, fresh: bool = False) -> None:
    """:meth:`Amp.show_unscaled_on_model <lightning_mpx.engine.amp.Amp.show_unscaled_on_model>` for ``machine``'s
    ``optimizer``; ``fresh``: called by the unscale itself, right after it noted the half gradients it read (no user
    code between: nothing to follow)."""
    state = machine.state(optimizer)
    master_weights = machine.masters.weights
    if not master_weights or state.stage is not _Stage.UNSCALED:
        return
    pairs = param_pairs(state, master_weights, optimizer=optimizer)  # current for the marks below (paired=True)
    if not fresh:
        follow_cleared_grads(state, master_weights, optimizer, paired=True)
        noted = state.unscaled_groups  # a group added since the unscale (rescale.unscale_late); the check written
        lists = () if noted is None else tuple(map(_PARAMS, optimizer.param_groups))  # out (C-level: no call)
        if noted is not None and (
            len(lists) != len(noted[0]) or not all(map(operator.is_, lists, noted[0]))
            or tuple(map(len, lists)) != noted[1]
        ):  # fmt: skip
            unscale_late(state, machine.scalers, master_weights, optimizer, machine.backend, machine.shared)
            pairs = param_pairs(state, master_weights, optimizer=optimizer)
    targets, sources = [], []
    shared = machine.shared if machine.shared.ids else None  # parameters another optimizer holds (shared_grads)
    for param, master in pairs:
        if master is not param and master.grad is not None:
            if param.grad is None:
                param.grad = master.grad.to(param.dtype)
            elif shared is None or not shared.showing(param.grad, master.grad):  # shown by another's unscale
                targets.append(param.grad)
                sources.append(master.grad)
    before = None if shared is None else [(id(grad), grad._version) for grad in targets]
    if targets:
        # One multi-tensor copy (rounding to the half dtype as copy_ does), not a kernel per parameter: the Trainer
        # calls this at every step it clips or has an on_before_optimizer_step hook.
        torch._foreach_copy_(targets, sources)
    if shared is not None and before is not None:  # they hold true values now, for the other optimizers' unscales
        shared.shown([(param.grad, master.grad) for param, master in pairs if master is not param
                      and id(param) in shared.ids and param.grad is not None and master.grad is not None],
                     before, state)  # fmt: skip
        shared.note_params(param for param, master in pairs if master is not param and id(param) in shared.ids
                           and param.grad is not None and master.grad is not None)  # fmt: skip
    state.shown, state.clips = True, ()  # the half gradients hold the true values now, clipped so far
    if state.handed:  # the masters' writes shown too (engine.master_writes)
        renote(state)
    # and the masters' gradients as the model shows them: masters_left.note_after written out (the show's call budget,
    # tests/test_core_step_calls_show_unscaled.py), not shared, not sharded
    if machine.sharding is None and not machine.shared.ids:
        probe = state.pair_masters[state.mastered[0]].grad if state.mastered else None
        if probe is not None and probe._base is not None:
            state.masters_left = (probe, probe._version, None, None)
        else:
            state.masters_left = None if state.handed else note_left(state)
    # the copies are ours, not the user's writes
    state.unscaled_marks = grad_marks(state, master_weights, optimizer, paired=True)
    if state.data_habit is not False:  # looked at for writes through .data (engine.data_writes)
        data_writes.note(state)


def _clip_unscaled(params: list[torch.Tensor], max_norm: float, found_inf: torch.Tensor | None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(params, max_norm)`` with its two halves (torch >= 2.6), the coefficient
    left at 1 on an overflow (``found_inf`` set; without it, for a non-finite norm: see :meth:`Amp.clip_grad_norm_
    <lightning_mpx.engine.amp.Amp.clip_grad_norm_>`); an infinite norm of finite gradients gets torch's coefficient, 0
    (:func:`~lightning_mpx.scaling.unscale.clip_coefficient`); older torch: its clip as it is."""
    get_norm = getattr(torch.nn.utils, "get_total_norm", None)
    clip_with = getattr(torch.nn.utils, "clip_grads_with_norm_", None)
    if get_norm is None or clip_with is None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    total = get_norm([p.grad for p in params if p.grad is not None])
    # A norm of 0 makes torch's coefficient max_norm / 1e-6, clamped to 1: the gradients are multiplied by one.
    if found_inf is None:
        clip_with(params, max_norm, torch.where(torch.isfinite(total), total, 0.0))
    else:
        clip_with(params, max_norm, torch.where(found_inf.reshape(()).to(total.device) == 0, total, 0.0))
    return total


def clip_limit(name: str, value: object) -> float:
    """``value`` as a float, refused unless a positive number (``math.inf``: no clipping): a NaN limit makes every
    gradient NaN, a negative one flips or pins them, and the step that follows would apply them."""
    if isinstance(value, Required):  # left out (a misspelt keyword is named before): Python's missing-argument error
        value.refuse()
    try:
        limit = None if isinstance(value, (bool, str)) else float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError):
        limit = None
    if limit is None or not limit > 0:
        raise ValueError(
            f"{name}={value!r} must be a positive number (math.inf: measure without clipping); a zero, negative or "
            "NaN limit would zero, flip or poison the gradients the step applies."
        )
    return limit
