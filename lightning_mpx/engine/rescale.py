"""Gradients carried across a point of the iteration: left unscaled by an unscale no step followed, cleared by the
user since, or pending for another loss or at a scale :meth:`~lightning_mpx.engine.amp.Amp.update` has changed since.

An unscale (or a clip) that no step followed leaves gradients with their true values (at O2 in the FP32 masters):
:func:`leftovers`. A later backward adds scaled values to them, so they are scaled back up first
(:func:`rescale_unscaled`). Gradients of another loss, or of this loss at a changed scale, are brought to the new
scale (:func:`rescale_pending`), so that one gradient buffer never mixes two scales. The user may clear half
gradients between an unscale and the step (``zero_grad`` either way): the masters' copies follow
(:func:`follow_cleared_grads`, by the marks :func:`grad_marks` notes).

A step leaves its gradients too (:func:`after_step`): with true values where it unscaled them in place, in the half
model at O2 at their scale. FP32 adds the next backward to them unless the loop zeroes them, and a second step
without a backward applies them again; so the next backward scales those the user did not clear up first
(:func:`rescale_stepped`), and an unscale or step before it takes them as they are (:func:`resume_stepped`). The
usual loop clears them (``zero_grad``): what it pays is a look at the gradients with C-level maps, no Python per
parameter. Plain functions over an optimizer's :class:`~lightning_mpx.engine.optimizer_state._OptimizerState`: no
engine is held.
"""

from __future__ import annotations

import functools
import itertools
import operator
import weakref
from typing import Any, Iterator, Sequence

import torch

from lightning_mpx.engine import data_writes
from lightning_mpx.engine.grad_checks import carry, charge
from lightning_mpx.engine.master_writes import noted_again, refuse_both, written
from lightning_mpx.engine.masters_left import moved as masters_moved
from lightning_mpx.engine.optimizer_state import _OptimizerState, _Stage, optimizer_params
from lightning_mpx.engine.scaled_write import clipped_nothing, refuse_scaled_write
from lightning_mpx.engine.sharding import local_tensors
from lightning_mpx.engine.shared_grads import SharedGrads
from lightning_mpx.engine.true_grads import carried_scale as _carried_scale
from lightning_mpx.masters.pairs import param_pairs
from lightning_mpx.masters.swap import drop_master_grads
from lightning_mpx.masters.weights import MasterWeights
from lightning_mpx.scaling.scaler import LossScaler
from lightning_mpx.scaling.unscale import clip_coefficient, unscale_grads_

Marks = tuple[tuple[int, int] | None, ...]

_GRAD = operator.attrgetter("grad")
_VERSION = operator.attrgetter("_version")
_PARAMS = operator.itemgetter("params")
_SOME = functools.partial(operator.is_not, None)
_DEREF = operator.methodcaller("__call__")
_PLAIN = frozenset({torch.Tensor})
_MARK = "_mpx_stepped"  # the attribute of a gradient a step left that holds its mark (after_step)


def grad_marks(
    state: _OptimizerState,
    master_weights: Sequence[MasterWeights],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    paired: bool = False,
) -> Marks:
    """Identity and version of each half parameter's gradient (``None`` where it has none), in pair order;
    ``optimizer``: the state's, when the caller holds it (a step does); ``paired``: the caller took
    :func:`param_pairs` since the parameter groups last changed (the pairs are current: a call saved)."""
    if not paired:
        param_pairs(state, master_weights, optimizer=optimizer)
    grads = list(map(_GRAD, map(state.pair_params.__getitem__, state.mastered)))
    if all(map(_SOME, grads)):  # the usual case, by C-level maps (no Python per parameter)
        return tuple(zip(map(id, grads), map(_VERSION, grads)))
    return tuple(None if g is None else (id(g), g._version) for g in grads)


def follow_cleared_grads(
    state: _OptimizerState,
    master_weights: Sequence[MasterWeights],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    paired: bool = False,
) -> None:
    """Between an unscale and the step, the user may clear the half gradients (``zero_grad`` either way, a skipped
    batch): the FP32 master gradients the step would use follow them (see :func:`leftovers`). A step that finds
    them as the unscale left them compares one tuple. ``optimizer`` and ``paired`` as for :func:`grad_marks`."""
    if state.data_watch is not None:  # writes through p.grad.data, looked for (engine.data_writes)
        data_writes.told(state)
    if grad_marks(state, master_weights, optimizer, paired=paired) != state.unscaled_marks:
        leftovers(state, master_weights, optimizer)
        # taken: a later check looks for later writes only
        state.unscaled_marks = grad_marks(state, master_weights, optimizer)
        if state.data_watch is not None or state.data_habit:  # the copies too: a .data write after this is told
            data_writes.note(state)


def note_groups(state: _OptimizerState, optimizer: torch.optim.Optimizer) -> None:
    """At an unscale the user's code may follow before the step (``unscale_()``, a clip): the parameter lists it read,
    for :func:`unscale_late`. C-level maps, per group."""
    lists = tuple(map(_PARAMS, optimizer.param_groups))
    state.unscaled_groups = (lists, tuple(map(len, lists)))


def unscale_late(
    state: _OptimizerState,
    scalers: Sequence[LossScaler],
    master_weights: Sequence[MasterWeights],
    optimizer: torch.optim.Optimizer,
    backend: str,
    shared: SharedGrads | None = None,
) -> None:
    """UNSCALED, before the step or a clip: the gradients of the parameters added to ``optimizer`` since the unscale
    (``add_param_group`` between a clip and the step: a backbone unfrozen in a hook there), which it never read: a
    backward's, at the scale of ``loss_id``. Unscaled now (at O2 into their new masters, and onto the half gradients
    too where the unscale showed the true values there) and checked, charged to ``loss_id``: the step applies this
    backward's gradient to them once, as FP32's does (``torch.amp.GradScaler``'s step applies them scaled). Not
    clipped: the clip before was of the parameters the optimizer held then, as FP32's. At O2 the user's clears since
    the unscale are taken first (:func:`follow_cleared_grads`). Groups as they were: the lists compared (C-level).
    ``shared`` as for :func:`rescale_unscaled`: a gradient another optimizer's unscale divided already is checked,
    not divided again."""
    noted = state.unscaled_groups
    if noted is None:
        return
    lists = tuple(map(_PARAMS, optimizer.param_groups))
    then, lengths = noted
    if len(lists) == len(then) and all(map(operator.is_, lists, then)) and tuple(map(len, lists)) == lengths:
        return
    if master_weights:  # the user's clears since the unscale, taken before the marks below are made again
        follow_cleared_grads(state, master_weights, optimizer)
    note_groups(state, optimizer)
    held = {id(param) for params, length in zip(then, lengths) for param in params[:length]}
    late = [param for param in itertools.chain.from_iterable(lists) if id(param) not in held and param.grad is not None]
    if not late:
        return
    master_of = {id(param): master for param, master in param_pairs(state, master_weights, optimizer=optimizer)}
    if shared is not None:
        shared.refresh()  # the group may hold parameters another optimizer holds
    inplace, halves, targets, made = [], [], [], []
    sharing = shared is not None and bool(shared.ids)
    for param in late:
        master = master_of.get(id(param), param)
        kept = shared.true_of(param.grad) if sharing and master is not param else None  # type: ignore[union-attr,arg-type]
        if master is param:
            inplace.append(param.grad)
        elif kept is not None:  # another optimizer's unscale made this master's gradient since the backward (a clip)
            master.grad = kept.to(master.dtype, copy=True)
            made.append(master.grad)
        else:
            halves.append(param.grad)
            master.grad = torch.empty_like(master)
            targets.append(master.grad)
    device = late[0].grad.device  # type: ignore[union-attr]
    factor = _carried_scale(state, scalers).to(device).double().reciprocal().float()  # in FP64, as the unscale
    found = torch.zeros((), dtype=torch.float32, device=device)
    if sharing:
        done = [grad for grad in inplace if shared.holds(grad)] + made  # true values already: checked, not divided
        inplace = [grad for grad in inplace if not shared.holds(grad)]
        if done:
            unscale_grads_(done, torch.ones_like(factor), found, backend=backend, workspace=state.workspace)
        shared.note(inplace)
    if inplace:
        unscale_grads_(inplace, factor, found, backend=backend, workspace=state.workspace)
    if halves:
        unscale_grads_(halves, factor, found, out=targets, backend=backend, workspace=state.workspace)
        if state.shown:
            torch._foreach_copy_(halves, targets)
        elif state.clips:  # the clips before are not theirs: left out where they are applied to the half gradients
            added = frozenset(map(id, halves))
            state.clips = tuple((*clip[:3], added | clip[3] if len(clip) > 3 else added) for clip in state.clips)
        if sharing:  # for a later optimizer holding these masters too
            shared.note_masters(halves, targets)  # type: ignore[union-attr]
    charge(state, state.loss_id or 0, found)
    if master_weights:  # the half gradients read, as an unscale notes them
        state.unscaled_marks = grad_marks(state, master_weights, optimizer)


def leftovers(
    state: _OptimizerState, master_weights: Sequence[MasterWeights], optimizer: torch.optim.Optimizer | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(gradient with true values, the model's gradient it belongs in) for the gradients an unscale left behind
    that the user has not cleared since.

    Without masters both are the parameter's own gradient (unscaled in place). At O2 the true values sit in the
    master's gradient; the half gradient the unscale read tells whether the user cleared it since (gone, or
    written: ``zero_grad`` either way), in which case the master's copy is dropped (``set_to_none=False``: its
    zeros are taken instead). ``optimizer`` as for :func:`grad_marks`.
    """
    if not master_weights:
        optimizer = state.optimizer if optimizer is None else optimizer
        return [(g, g) for p in optimizer_params(optimizer) if (g := p.grad) is not None]
    out = []
    marks = state.unscaled_marks
    index = 0
    both = masters_moved(state)  # the masters' gradients written since the engine left them (engine.masters_left)
    moved: dict[int, tuple[int, int]] | None = None  # the marks by gradient, made at the first one not in its place
    for param, master in param_pairs(state, master_weights, optimizer=optimizer):
        grad = param.grad
        if master is param:
            if grad is not None:
                out.append((grad, grad))
            continue
        was = marks[index] if index < len(marks) else None
        index += 1
        true = master.grad
        if true is None:
            continue  # nothing was unscaled into it
        if grad is None:
            if was is not None:  # cleared by the user (set_to_none) since the unscale
                master.grad = None
                continue
            grad = param.grad = torch.zeros_like(param)  # unscaled without a half gradient (Apex's stash)
        elif (key := (id(grad), grad._version)) != was:  # moved (groups reordered or replaced since: pairs in
            # another order), or written since the unscale (zero_grad): the user's values stand
            moved = {mark[0]: mark for mark in marks if mark is not None} if moved is None else moved
            if moved.get(id(grad)) != key:
                # read only here: a write found since the unscale, made on scaled values, or on true values shown
                # before a clip of the masters' gradients, which the write would undo
                if (not state.shown or state.clips) and bool(grad.any()) and not clipped_nothing(state):
                    refuse_scaled_write(state)
                if state.handed and written(state, master) and bool(grad.any()):  # the masters' written too
                    refuse_both(state)
                if both and bool(grad.any()):  # through a list of the masters not handed out (kept from before)
                    refuse_both(state)
                true.copy_(grad)
                if state.handed:
                    noted_again(state, master)
        out.append((true, grad))
    return out


def rescale_unscaled(
    state: _OptimizerState,
    new_loss_id: int,
    scaler: LossScaler,
    master_weights: Sequence[MasterWeights],
    backend: str,
    shared: SharedGrads | None = None,
) -> None:
    """Scale gradients that unscale_() left with their true values (no step followed) back up to ``scaler``'s
    scale (the scaler of ``new_loss_id``), where the coming backward adds its own; at O2 from the FP32 masters'
    gradients (the ones a clip changed and a ``zero_grad`` cleared) into the half model's. The caller has
    recorded the overflow the unscale found; one found again here is charged by the step's check where it is there
    still (:func:`~lightning_mpx.engine.grad_checks.carry`: a ``zero_grad`` since drops it). ``shared``: the machine's
    :class:`~lightning_mpx.engine.shared_grads.SharedGrads`, when parameters are held by more than one optimizer (a
    gradient another optimizer's stage brought up already is not multiplied again)."""
    old_id = state.loss_id or 0
    state.clear_checks()
    pairs = leftovers(state, master_weights)
    if shared is not None and shared.ids:  # true values in place that another optimizer brought up: not again
        todo = set(map(id, shared.once([true for true, model_grad in pairs if true is model_grad])))
        pairs = [(true, model_grad) for true, model_grad in pairs if true is not model_grad or id(true) in todo]
    sources = [true for true, _ in pairs]
    targets = [model_grad for _, model_grad in pairs]
    if sources:
        scaler.to(sources[0].device)
        found = torch.zeros((), dtype=torch.float32, device=sources[0].device)
        unscale_grads_(
            sources,
            scaler.scale_tensor,
            found,
            out=targets if master_weights else None,
            backend=backend,
            workspace=state.workspace,
        )
        carry(state, old_id, found)  # charged at the step's check if it is there still (a zero_grad drops it)
    if master_weights:
        drop_master_grads(state)  # carried into the half gradients
    state.unscaled_marks, state.unscaled_groups = (), None
    state.shown, state.clips, state.handed, state.masters_left = False, (), None, None
    state.stage = _Stage.READY
    state.loss_id = new_loss_id
    state.grad_scale = None


def rescale_pending(
    state: _OptimizerState,
    new_loss_id: int,
    scalers: Sequence[LossScaler],
    backend: str,
    shared: SharedGrads | None = None,
) -> None:
    """Bring gradients pending for another loss (or for this one at a scale since updated) to ``new_loss_id``'s
    scale, checking them on the way: an overflow they hold now is the loss's they came from, charged to it by the
    step's check where that check finds it still (:func:`~lightning_mpx.engine.grad_checks.carry`). The same loss at a
    scale since updated is not charged: a non-finite value stays so under the multiplication and the backwards that
    add to it, so the step's own check finds it where the user kept the gradients; charged here, it outlived a
    ``zero_grad`` (either way) that dropped it, and the next step, on finite gradients, was skipped and the scale
    halved (GradScaler steps). ``shared`` as for :func:`rescale_unscaled`: a gradient another optimizer brought over
    before this backward is not multiplied again."""
    old_id = state.loss_id or 0
    old_scale = state.grad_scale if state.grad_scale is not None else scalers[old_id].scale_tensor
    grads = [g for p in optimizer_params(state.optimizer) if (g := p.grad) is not None]  # the model's, still scaled
    if shared is not None and shared.ids:  # a gradient two optimizers hold: brought over once
        grads = shared.pending(grads)
    if grads:
        new = scalers[new_loss_id].to(grads[0].device)
        ratio = (new.scale_tensor.double() / old_scale.to(grads[0].device).double()).float()
        found = torch.zeros((), dtype=torch.float32, device=grads[0].device)
        unscale_grads_(grads, ratio, found, backend=backend, workspace=state.workspace)
        if new_loss_id != old_id:  # another loss's overflow: its scaler's, where the step's check finds it still
            carry(state, old_id, found)
        if shared is not None and shared.ids:
            shared.rescaled_now(grads)
    state.loss_id = new_loss_id
    state.grad_scale = None


# -- gradients left by a step ---------------------------------------------------------------------------------------
def present_grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The gradients ``optimizer``'s parameters hold, by C-level maps (no Python per parameter)."""
    params = itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups))
    with torch._C.DisableTorchFunction():  # a torch-function mode (the Apex layer's O1) would run per parameter
        return list(filter(_SOME, map(_GRAD, params)))


def _keys(grads: list[torch.Tensor]) -> Iterator[tuple[int, int]]:
    return zip(map(id, grads), map(_VERSION, grads))


def after_step(state: _OptimizerState, optimizer: torch.optim.Optimizer, *, masters: bool) -> None:
    """End a step of ``optimizer`` (taken or skipped): READY, or STEPPED when its parameters keep gradients, with the
    loss and the scale they carry (``masters``: at O2 the half ones keep theirs unless the unscale showed the true
    values on the model) and the marks that tell a later ``zero_grad`` (either way) apart."""
    loss_id, grad_scale, shown, clips = state.loss_id, state.grad_scale, state.shown, state.clips
    found = state.clips_found  # the flag the clips were made under (their coefficient where they are applied)
    state.reset()
    params = list(itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups)))
    with torch._C.DisableTorchFunction():  # as in present_grads
        grads = list(filter(_SOME, map(_GRAD, params)))
        if grads:
            state.stage = _Stage.STEPPED
            state.loss_id, state.grad_scale, state.clips, state.clips_found = loss_id, grad_scale, clips, found
            state.stepped_true = not masters or shown
            state.stepped_marks = frozenset(zip(map(id, grads), map(_VERSION, grads)))
            state.stepped_ids = tuple(map(id, grads))
            # Not a weak reference to the gradient, which torch.utils.swap_tensors refuses (a model.to() under
            # set_swap_module_params_on_conversion(True), FSDP2's _apply at each of Lightning's stages): one to a
            # mark (an empty set) put in its __dict__, which lives as long as the gradient, and which a swap takes
            # away with the old tensor: a moved gradient is then taken as one the user assigned, which is taken as
            # what the step left (stepped_leftovers), as a kept one is. On an FSDP2 gradient's local shard, not the
            # DTensor (local_tensors' usual case, plain tensors, told here without its call). C-level: no call per
            # tensor.
            marks = list(map(set, itertools.repeat((), len(grads))))
            if set(map(type, grads)) <= _PLAIN:
                list(map(setattr, grads, itertools.repeat(_MARK), marks))
                state.stepped_refs = tuple(map(weakref.ref, marks))
            else:
                state.stepped_refs = tuple(map(_mark, local_tensors(grads), marks))
            state.stepped_params = frozenset(map(id, params))


def _mark(grad: torch.Tensor, mark: set[Any]) -> weakref.ref[Any]:
    """A weak reference to ``mark``, put in ``grad``'s ``__dict__``; to ``grad`` itself where a tensor subclass takes
    no attribute."""
    try:
        setattr(grad, _MARK, mark)
    except AttributeError:
        return weakref.ref(grad)
    return weakref.ref(mark)


def _alive_ids(state: _OptimizerState) -> set[int]:
    """The ids of the gradients the step left that still live: only those ids are theirs (a freed one's id goes to
    the next tensor made, such as one the user assigns)."""
    return set(itertools.compress(state.stepped_ids, map(_SOME, map(_DEREF, state.stepped_refs))))


def _all_cleared(state: _OptimizerState, grads: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> bool:
    """Whether no gradient in ``grads`` (the optimizer's now) is one to take as the step left it: each is a gradient
    the step left, written since (``zero_grad(set_to_none=False)``: the usual loop, told by C-level maps), or a
    gradient of a parameter the optimizer did not hold at the step (a group added since: a backward made it, scaled)."""
    with torch._C.DisableTorchFunction():  # as in present_grads
        marks = state.stepped_marks
        if marks is None:
            return True
        if not marks.isdisjoint(_keys(grads)):
            return False
        if set(map(id, grads)) <= _alive_ids(state):
            return True
    return not _assigned(state, optimizer)


def _assigned(state: _OptimizerState, optimizer: torch.optim.Optimizer) -> set[int]:
    """The ids of the gradients put on ``.grad`` since the step by the user (a new tensor on a parameter the optimizer
    held at the step: gradient surgery, an EMA written back): they are not the step's, nor a backward's (none ran
    since). Python per parameter: only when some gradient is not one the step left."""
    alive, held = _alive_ids(state), state.stepped_params
    with torch._C.DisableTorchFunction():  # as in present_grads
        return {
            id(grad)
            for param in itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups))
            if (grad := param.grad) is not None and id(grad) not in alive and id(param) in held
        }


def late_grads(state: _OptimizerState, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The gradients of the parameters ``optimizer`` did not hold at the step (a group added since, STEPPED): a
    backward's, never unscaled, taken at the scale the step's loss carried (the backward that made them ran before
    it). The loop whose groups stay as they were pays C-level maps only."""
    params = list(itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups)))
    held = state.stepped_params
    if held.issuperset(map(id, params)):
        return []
    with torch._C.DisableTorchFunction():  # as in present_grads
        return [grad for param in params if id(param) not in held and (grad := param.grad) is not None]


def stepped_leftovers(
    state: _OptimizerState, master_weights: Sequence[MasterWeights], optimizer: torch.optim.Optimizer
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(unscaled in place, the half model's): the model's gradients a step left (STEPPED) that the user has not
    cleared since (written in place: ``zero_grad(set_to_none=False)``; gone: ``set_to_none``), and tensors the user
    assigned to ``.grad`` since, taken as what the step left there. Without masters all are unscaled in place; at O2
    the half ones hold the scale of ``loss_id`` (true values when ``stepped_true``), without the clips since the
    unscale. The loop that clears them pays C-level maps only."""
    grads = present_grads(optimizer)
    if not grads or _all_cleared(state, grads, optimizer):
        return [], []
    marks, assigned = state.stepped_marks or frozenset(), _assigned(state, optimizer)

    def kept(grad: torch.Tensor) -> bool:  # the step's own, not written since; or one the user assigned since
        return id(grad) in assigned or (id(grad), grad._version) in marks

    if not master_weights:
        return [g for g in grads if kept(g)], []
    inplace: list[torch.Tensor] = []
    half: list[torch.Tensor] = []
    for param, master in param_pairs(state, master_weights, optimizer=optimizer):
        grad = param.grad
        if grad is not None and kept(grad):
            (inplace if master is param else half).append(grad)
    return inplace, half


def _multiply(state: _OptimizerState, grads: list[torch.Tensor], factor: torch.Tensor, backend: str) -> None:
    """``grads`` times ``factor`` in place; not checked: the step that used them counted their overflow, and one
    still there is found by the next step's check."""
    if grads:
        found = torch.zeros((), dtype=torch.float32, device=factor.device)
        unscale_grads_(grads, factor.to(grads[0].device), found, backend=backend, workspace=state.workspace)


def _apply_clips(state: _OptimizerState, half: list[torch.Tensor], scale: torch.Tensor) -> None:
    """O2: the clips the masters' gradients had before the step, applied to the half ones it left (at ``scale``)."""
    if not half:
        return
    for kind, norm, limit, *added in state.clips:
        grads = [g for g in half if id(g) not in added[0]] if added else half  # a group added since: not clipped
        if not grads:
            continue
        if kind == "norm":
            torch._foreach_mul_(grads, clip_coefficient(norm, limit, state.clips_found).to(grads[0].device))
        else:
            bound = torch.as_tensor(limit, dtype=torch.float32) * scale.cpu()
            for grad in grads:
                grad.clamp_(-bound.to(grad.device), bound.to(grad.device))


def _final(
    state: _OptimizerState, half: list[torch.Tensor], factor: torch.Tensor, backend: str, shared: SharedGrads | None
) -> list[torch.Tensor]:
    """O2, STEPPED: those of the half gradients ``half`` the step left that hold the values it stepped with, another
    optimizer's clip in them (``state.stepped_final``, engine.shared_clips), at the scale of ``loss_id``: times
    ``factor`` (once where another optimizer's stage brings them up too), no clip applied again; returns the others."""
    final = [g for g in half if (id(g), g._version) in state.stepped_final]
    if not final:
        return half
    ids = set(map(id, final))
    _multiply(state, shared.once(final) if shared is not None and shared.ids else final, factor, backend)
    return [g for g in half if id(g) not in ids]


def _true_shown(
    state: _OptimizerState,
    half: list[torch.Tensor],
    one: torch.Tensor,
    scale: torch.Tensor,
    backend: str,
    shared: SharedGrads | None,
) -> list[torch.Tensor]:
    """O2, STEPPED: those of the half gradients ``half`` the step left that hold true values another optimizer's
    unscale showed (``state.stepped_shown``) get the step's clips and are brought to ``scale`` (once where another
    optimizer's stage brings them up too: ``shared``); returns the others (the scale of ``loss_id``)."""
    shown = [g for g in half if (id(g), g._version) in state.stepped_shown]
    if not shown:
        return half
    ids = set(map(id, shown))
    _apply_clips(state, shown, one)
    _multiply(state, shared.once(shown) if shared is not None and shared.ids else shown, scale, backend)
    return [g for g in half if id(g) not in ids]


def rescale_stepped(
    state: _OptimizerState,
    new_loss_id: int,
    scalers: Sequence[LossScaler],
    master_weights: Sequence[MasterWeights],
    backend: str,
    shared: SharedGrads | None = None,
) -> None:
    """Before a backward of ``new_loss_id``: bring the gradients a step left (and the user kept) to its scale, as
    FP32 adds the backward to them; READY after. The usual loop (cleared) pays C-level maps, no Python per parameter.
    ``shared`` as for :func:`rescale_unscaled`."""
    optimizer = state.optimizer_ref()
    grads: list[torch.Tensor] = []
    if optimizer is not None and state.stepped_marks is not None:  # present_grads, written out
        params = itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups))
        with torch._C.DisableTorchFunction():  # as in present_grads
            grads = list(filter(_SOME, map(_GRAD, params)))
    if grads and not _all_cleared(state, grads, optimizer):  # type: ignore[arg-type]
        inplace, half = stepped_leftovers(state, master_weights, optimizer)  # type: ignore[arg-type]
        device = (inplace or half or grads)[0].device
        new = scalers[new_loss_id].to(device).scale_tensor
        if shared is not None and shared.ids:  # a gradient two optimizers' steps left: brought up once
            inplace = shared.once(inplace)
        _multiply(state, inplace, new, backend)
        if half and state.stepped_shown:  # true values another optimizer's unscale showed: up to the new scale
            half = _true_shown(state, half, torch.ones((), device=device), new, backend, shared)
        if half and state.stepped_final:  # another optimizer's clip in them already: to the new scale, no clip
            ratio = (new.double() / _carried_scale(state, scalers).to(device).double()).float()
            half = _final(state, half, ratio, backend, shared)
        if half:
            carried = torch.ones((), device=device) if state.stepped_true else _carried_scale(state, scalers)
            _apply_clips(state, half, carried)
            if state.stepped_true and shared is not None and shared.ids:  # true values two steps left: up once
                half = shared.once(half)
            _multiply(state, half, (new.double() / carried.to(device).double()).float(), backend)
    late = late_grads(state, optimizer) if grads else []  # type: ignore[arg-type]
    carried = _carried_scale(state, scalers) if late else None
    new = scalers[new_loss_id].to(late[0].device).scale_tensor if late else None
    if late and carried is not new:  # another loss's, or the scale an update has changed since
        _multiply(state, late, (new.double() / carried.to(new.device).double()).float(), backend)  # type: ignore
    state.reset()
    state.loss_id = new_loss_id


def resume_stepped(
    state: _OptimizerState,
    scalers: Sequence[LossScaler],
    master_weights: Sequence[MasterWeights],
    optimizer: torch.optim.Optimizer,
    backend: str,
) -> None:
    """Before an unscale with no backward since a step (a second step, a clip): the gradients the step left are
    taken again, as FP32's second step applies them again. Without masters those of the parameters the step held
    hold true values: SKIPPED (checked, not divided again), unless a group added since brings a backward's
    (:func:`late_grads`); then, as at O2, all are brought to the scale those carry: READY at it."""
    if not master_weights:
        grads = present_grads(optimizer)  # written since or not: FP32 applies what is there
        late = {id(g) for g in late_grads(state, optimizer)} if grads else set()
        if late:  # a backward's at the carried scale: the true ones join them there (READY)
            _multiply(state, [g for g in grads if id(g) not in late], _carried_scale(state, scalers), backend)
        loss_id, grad_scale = state.loss_id, state.grad_scale
        state.reset()
        if late:
            state.loss_id, state.grad_scale = loss_id, grad_scale
        elif grads:  # the scale of their backward kept, for a group added later (late_grads)
            state.stage, state.loss_id, state.grad_scale = _Stage.SKIPPED, loss_id, grad_scale
        return
    inplace, half = stepped_leftovers(state, master_weights, optimizer)
    if inplace or half:
        carried = _carried_scale(state, scalers)
        _multiply(state, inplace, carried, backend)
        if half and state.stepped_shown:  # as in rescale_stepped, to the scale the others carry
            half = _true_shown(state, half, torch.ones(()), carried, backend, None)
        if half and state.stepped_final:  # at the scale the others carry already: no clip applied again
            final = state.stepped_final
            half = [g for g in half if (id(g), g._version) not in final]
        if half:
            _apply_clips(state, half, torch.ones(()) if state.stepped_true else carried)
            if state.stepped_true:
                _multiply(state, half, carried, backend)
    loss_id, grad_scale = state.loss_id, state.grad_scale
    state.reset()
    state.loss_id, state.grad_scale = loss_id, grad_scale


def hold_scale(state: _OptimizerState, scaler: LossScaler, *, masters: bool = True) -> None:
    """At an update, O2: the half gradients a step (STEPPED) or an unscale (SKIPPED) left scaled keep the scale they
    carry while ``scaler`` (dynamic) moves on; one small copy, only when such gradients are there. Without
    ``masters`` after a step, for the gradients a group added since may bring (:func:`late_grads`)."""
    if state.grad_scale is not None or not scaler.dynamic:
        return
    if not masters:
        if state.stage is _Stage.STEPPED:
            state.grad_scale = scaler.scale_tensor.clone()
        return
    if state.stepped_true or state.shown:
        return
    if state.stage is _Stage.SKIPPED or present_grads(state.optimizer):
        state.grad_scale = scaler.scale_tensor.clone()
