"""At O2, writes to the FP32 masters' gradients (``amp.master_params(optimizer)``) after ``unscale_()`` showed the true
values on the model's half gradients, told apart per master.

After a show the model's half gradients are a copy of the masters' FP32 ones. A write to both of one parameter before
the step (``m.grad.mul_(0.5)`` over ``amp.master_params(opt)``, then ``p.grad.mul_(0.5)`` on the model; or torch's
``clip_grad_norm_(amp.master_params(opt), ...)`` then a write to the model's) cannot both be kept: the model's write
was made on the copy, which lacks the masters' write, and the step takes the model's (a write to them is the user's,
as after ``torch.amp.GradScaler.unscale_``), losing the masters' silently (2x FP32's update, or the clip undone).

The signal is the version counter of each master's FP32 gradient. Those a step's unscale makes are views of one buffer
(:class:`~lightning_mpx.masters.pairs.GradLayout`), which share the buffer's counter: a write to one master's moved
every master's, so a version check alone refused correct code (the masters of some parameters written, the model's of
others; a shared master's clip by another optimizer). :func:`hand_out`, called where the user gets the masters after a
show (``amp.master_params``), gives each such gradient a tensor of its own over the same memory (its ``.data``: no copy,
no kernel, a counter of its own; C-level maps, no Python per parameter) and notes its version; the engine's own writes
since (its clips, the copy of a model write into the master) move the note along (:func:`advance`); the step's check of
a model write (:func:`~lightning_mpx.engine.rescale.leftovers`) asks :func:`refuse_both` for that parameter. Nothing of
this runs unless ``amp.master_params`` was called between a show and the step; a shared parameter's master (another
optimizer's unscale may take its gradient: :mod:`~lightning_mpx.engine.shared_grads`) and a sharded one (a ``DTensor``
gradient) are left out. The notes go with the step, or with the backward after an ``unscale_`` not stepped.
"""

from __future__ import annotations

import itertools
import operator
from typing import Iterable

import torch

from lightning_mpx.engine.grad_checks import charge
from lightning_mpx.engine.masters_left import note_left
from lightning_mpx.engine.optimizer_state import _OptimizerState

_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
_GRAD, _DATA, _VERSION = operator.attrgetter("grad"), operator.attrgetter("data"), operator.attrgetter("_version")


def hand_out(
    state: _OptimizerState, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], shared: frozenset[int]
) -> None:
    """``amp.master_params`` of ``state``'s optimizer after a show (``pairs``: its (parameter, master) pairs;
    ``shared``: the ids of the parameters another optimizer holds, left out): each master's FP32 gradient gets a
    version counter of its own (its ``.data``: a tensor over the same memory, made without a kernel) and is noted as
    handed out. One noted already keeps its note (a write since stays seen). C-level maps: no Python per parameter
    (the Apex habit ``clip_grad_norm_(amp.master_params(opt), ...)`` pays it every step)."""
    handed = state.handed if state.handed is not None else {}
    pairs = list(pairs)
    params, masters = list(map(_FIRST, pairs)), list(map(_SECOND, pairs))
    with torch._C.DisableTorchFunction():  # a torch-function mode would run per tensor
        grads = list(map(_GRAD, masters))
        # not a parameter of its own master, with a plain gradient (a sharded one, a DTensor's, is not watched),
        # held by this optimizer alone, not noted yet
        taken = list(map(all, zip(map(operator.is_not, masters, params), map(operator.is_, map(type, grads),
                                                                            itertools.repeat(torch.Tensor)),
                                  map(operator.not_, map(shared.__contains__, map(id, params))),
                                  map(operator.not_, map(handed.__contains__, map(id, masters))))))  # fmt: skip
        masters = list(itertools.compress(masters, taken))
        own = list(map(_DATA, itertools.compress(grads, taken)))  # views of the step's one buffer share its counter
        list(map(setattr, masters, itertools.repeat("grad"), own))
        handed.update(zip(map(id, masters), zip(masters, own, map(_VERSION, own))))
    state.handed = handed


def clean(state: _OptimizerState) -> set[int] | None:
    """Before an engine write to the masters' gradients (a clip): the ids of the masters handed out and not written
    since (``None``: none handed out)."""
    handed = state.handed
    if not handed:
        return None
    return {key for key, (master, grad, version) in handed.items() if master.grad is grad and grad._version == version}


def advance(state: _OptimizerState, unwritten: set[int] | None) -> None:
    """After an engine write to the masters' gradients: those ``unwritten`` by the user before it (:func:`clean`) are
    noted as the engine left them; a user's write before it stays seen."""
    handed = state.handed
    if not handed or unwritten is None:
        return
    for key in unwritten:
        master, _, _ = handed[key]
        grad = master.grad
        if grad is not None:
            handed[key] = (master, grad, grad._version)


def renote(state: _OptimizerState) -> None:
    """After a show (the model's gradients copy the masters' again, writes and all): every note starts again."""
    handed = state.handed
    if handed:
        state.handed = {
            key: (master, grad, grad._version)
            for key, (master, _, _) in handed.items()
            if (grad := master.grad) is not None
        }


def any_written(state: _OptimizerState) -> bool:
    """Whether any master's FP32 gradient handed out was written (in place, or replaced) since it was handed out or
    since the engine's last write to it: the step then shows them on the model, so that what it leaves there is what it
    stepped with (torch's clip of ``amp.master_params(opt)`` after ``unscale_()``, a loop that does not zero the
    gradients: the next clip 1.35 where FP32's is 0.89). C-level maps over the notes, no Python per master."""
    handed = state.handed
    if not handed:
        return False
    masters, grads, versions = zip(*handed.values())
    return any(map(operator.is_not, map(_GRAD, masters), grads)) or tuple(map(_VERSION, grads)) != versions


def charge_written(state: _OptimizerState) -> None:
    """At the step, after a write to the masters' gradients handed out (:func:`any_written`) where the engine holds
    several optimizers: their non-finite values are charged to the step's loss, which then skips. A clip over several
    optimizers' masters (torch's ``clip_grad_norm_(amp.master_params(o1) + amp.master_params(o2), ...)``), one of them
    overflowing, has a NaN norm that makes the others' finite gradients NaN after ``unscale_()`` checked them; their
    steps applied them: NaN weights, silently (``torch.amp.GradScaler`` does the same). Now every optimizer the NaN
    reached skips, as the Accelerate adapter's joint clip makes them (one max-norm pass; one optimizer's clip of its own
    finite gradients cannot make them non-finite, so the usual loop of one optimizer pays nothing)."""
    grads = [grad for master, _, _ in state.handed.values() if (grad := master.grad) is not None]  # type: ignore[union-attr]
    if grads:
        largest = torch.nn.utils.get_total_norm(grads, float("inf"))  # NaN or inf where one holds it
        charge(state, state.loss_id or 0, torch.isfinite(largest).logical_not().float())


def cleared(state: _OptimizerState) -> None:
    """A front door's ``zero_grad`` (the Apex layer's optimizer) cleared the masters' gradients with the model's
    between an unscale and the step: the writes to the masters' before it (``amp.master_params(opt)``'s, torch's clip
    of them) are gone with them, so a write to the model's after it is the only one, taken as FP32 steps with it.
    Without this note the step refused it as 'both written' (the zeroing moved the masters' counters as a write)."""
    renote(state)
    if state.masters_left is not None:
        state.masters_left = note_left(state)


def written(state: _OptimizerState, master: torch.Tensor) -> bool:
    """Whether ``master``'s FP32 gradient was written (in place, or replaced: ``m.grad = m.grad * 0.5``) since it was
    handed out or since the engine's last write to it."""
    noted = state.handed.get(id(master)) if state.handed else None
    if noted is None:
        return False
    grad = master.grad
    return grad is not noted[1] or grad._version != noted[2]


def noted_again(state: _OptimizerState, master: torch.Tensor) -> None:
    """The engine just wrote ``master``'s FP32 gradient (a model write copied into it): noted as it left it."""
    noted = state.handed.get(id(master)) if state.handed else None
    grad = master.grad
    if noted is not None and grad is not None:
        state.handed[id(master)] = (master, grad, grad._version)  # type: ignore[index]


def refuse_both(state: _OptimizerState) -> None:
    """At O2 after ``unscale_()``: both a master's FP32 gradient (``amp.master_params(optimizer)``) and the model's
    gradient of the same parameter were written since."""
    raise RuntimeError(
        "both the FP32 master weights' gradients (amp.master_params(optimizer): p.grad of each, written or clipped "
        "with torch.nn.utils.clip_grad_norm_) and the model's gradients of the same parameters were written between "
        "unscale_() (or an Apex scale_loss block) and step() at O2: the model's gradients hold a copy of the values "
        "unscale_() showed, which the "
        "write to the masters' did not change, so the step cannot keep both writes "
        f"({state.loss_id or 0!r} is the loss). Write one of them (the model's, as after torch.amp.GradScaler."
        "unscale_, or the masters'), or call amp.show_unscaled_on_model(optimizer) after writing the masters' "
        "gradients and before writing the model's."
    )
