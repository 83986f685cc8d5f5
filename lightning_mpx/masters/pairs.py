"""Which FP32 master each parameter of an optimizer has (O2), and where its unscaled gradient goes.

The masters themselves belong to :class:`~lightning_mpx.masters.weights.MasterWeights` (one per prepared model); what
is here pairs each parameter an optimizer holds with its master, cached on the optimizer's
:class:`~lightning_mpx.engine.optimizer_state._OptimizerState` (made when a parameter needs one), and gives the unscale
its (scaled gradient, master gradient) pairs. Putting the masters in the groups for a step is
:mod:`lightning_mpx.masters.swap`'s. Plain functions over that state and the list of ``MasterWeights``: no engine is
held.
"""

from __future__ import annotations

import collections
import itertools
import operator
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from lightning_mpx.common.user_frames import user_stacklevel
from lightning_mpx.engine.optimizer_state import _OptimizerState
from lightning_mpx.masters.state_keys import has_own_key, put_by_param
from lightning_mpx.masters.weights import MasterWeights
from lightning_mpx.settings import _rank_zero

Pairs = list[tuple[torch.Tensor, torch.Tensor]]
_IS_SPARSE = operator.attrgetter("is_sparse")
_HALF = (torch.float16, torch.bfloat16)
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_GRAD = operator.attrgetter("grad")
_SHAPE = operator.attrgetter("shape")
_PARAMS = operator.itemgetter("params")
_ALIGN = 64  # elements of 4 bytes: 256 bytes


class StrayParameterError(ValueError):
    """An optimizer holds trainable half parameters no prepared model covers (``params``), so none has a master;
    the engine names them where its prepared models hold them (a parameter set on one after preparing)."""

    def __init__(self, message: str, params: list[torch.Tensor]) -> None:
        super().__init__(message)
        self.params = params


def _any_needs_master(params: list[torch.Tensor]) -> bool:
    """Whether a parameter paired with itself now requires a gradient or has one. C-level maps: it runs once per
    step, over what is most of a LoRA model's parameters (its frozen base)."""
    has_grad = map(operator.is_not, map(_GRAD, params), itertools.repeat(None))
    return any(map(_REQUIRES_GRAD, params)) or any(has_grad)


def master_for(master_weights: Sequence[MasterWeights], param: torch.Tensor) -> torch.Tensor | None:
    """The master of a model parameter, made now if it has none yet and needs one: it requires a gradient or has
    one, or its FP32 value is kept (trainable when it was prepared, frozen since: the value becomes its master at no
    cost, as it would have at a registration before the freeze, so every front door ends with the same masters). A
    parameter frozen before it was prepared that an optimizer holds (a LoRA model's base, an optimizer over
    ``model.parameters()``) is its own until then: it is never stepped, and an FP32 copy of a frozen base would cost
    twice its half memory again. ``None`` for a trainable half parameter that belongs to no prepared model."""
    for masters in master_weights:
        if masters.covers(param):
            needed = param.requires_grad or param.grad is not None or masters.keeps_value(param)
            return masters.master_of(param, create=needed)
    if param.dtype in (torch.float16, torch.bfloat16) and param.requires_grad:
        return None
    return param


#: The warning of :func:`warn_from_rounding` for a model prepared for evaluation only, then for training.
_EVALUATED_FIRST = (
    "lightning_mpx: {count} parameter(s) ({shown}) were cast to half at O2 when the model was prepared for evaluation "
    "only (accelerator.prepare_model(model, evaluation_mode=True), Amp.prepare_model(model, train=False); "
    "transformers' Trainer: evaluate() or predict() before train() on a Trainer made without a train_dataset), which "
    "keeps no FP32 value; prepared for training since, "
    "their FP32 masters start from their half rounding, not from the FP32 weights the model held (which FP32 and "
    "the frameworks' own bf16/fp16 train from). Prepare the model for training first (with its optimizer; the "
    "Trainer: give it the train_dataset when it is made) and evaluate it then, or load its FP32 weights again now "
    "(model.load_state_dict(fp32_state_dict), or a checkpoint with accelerator.load_state: FP32 values go to the "
    "masters exactly; a run resumed so needs nothing more)."
)


def warn_from_rounding(master_weights: Sequence[MasterWeights]) -> None:
    """Once per model: warn that masters were made from the half rounding of parameters frozen when the model was
    cast (unfrozen since: a backbone fine-tuned after its head), naming a few and the remedy. Called where masters
    are made (a rebuild of an optimizer's pairs), never per step; on rank zero, pointing at the user's line."""
    for masters in master_weights:
        names, masters.from_rounding = masters.from_rounding, []
        if not names or masters.rounding_warned:
            continue
        masters.rounding_warned = True
        if not _rank_zero():  # the same model on every rank: one warning
            continue
        if masters.rounding_cause == "evaluation":  # those another optimizer will make too: every one named now
            names += [name for name in masters.rounded_to_come() if name not in names]
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        if masters.rounding_cause == "evaluation":
            warnings.warn(_EVALUATED_FIRST.format(count=len(names), shown=shown), UserWarning,
                          stacklevel=user_stacklevel())  # fmt: skip
            continue
        warnings.warn(
            f"lightning_mpx: {len(names)} parameter(s) ({shown}) were frozen when the model was cast to half at O2, "
            "so no FP32 value was kept for them; unfrozen since, their FP32 masters start from their half rounding, "
            "which can be as large as a fine-tune's moves. Freeze them after set-up instead (Lightning: in "
            "on_fit_start; or after fabric.setup / accelerator.prepare / amp.prepare_model), which keeps their FP32 "
            "values (4 bytes a parameter), or keep that part FP32 with fp32_modules.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def param_pairs(
    state: _OptimizerState,
    master_weights: Sequence[MasterWeights],
    *,
    recheck: bool = False,
    optimizer: torch.optim.Optimizer | None = None,
) -> Pairs:
    """``(model parameter, its FP32 master or itself)`` for each of the optimizer's parameters, cached per
    optimizer, with each group's list of masters.

    The cache is rebuilt when a parameter group is added or removed, or a group's parameter list is replaced or
    changes length: what ``add_param_group`` and ordinary code do, and (``recheck``) when a half parameter paired
    with itself (frozen then) requires a gradient or has one (unfrozen in place). A half parameter gets its master
    here once it requires a gradient, as Apex made masters for the parameters that require one; the optimizer's
    state loaded after that goes to the master. Swapping one tensor for another inside a group's list in place, at
    the same length, is not detected (nothing in torch or Lightning does that).

    ``recheck``: also look for a half parameter paired with itself that requires a gradient now (unfrozen in place):
    done once per step, by the unscale (:func:`grad_pairs`), and where the masters are asked for or the optimizer's
    state is saved or loaded; the other calls of a step take the pairs as they are. ``optimizer``: the state's
    optimizer, when the caller holds it (the step does).
    """
    optimizer = state.optimizer if optimizer is None else optimizer
    if state.swapped is not None:
        return state.pairs  # the groups hold the masters right now
    lists = list(map(_PARAMS, optimizer.param_groups))
    key = tuple(zip(map(id, lists), map(len, lists)))  # C-level maps: it runs at every step
    if key != state.pairs_key or (recheck and state.unmastered and _any_needs_master(state.unmastered)):
        group_masters = []
        stray = []
        for group in optimizer.param_groups:
            masters = []
            for param in group["params"]:
                master = master_for(master_weights, param)
                if master is None:
                    stray.append(param)
                    master = param
                masters.append(master)
            group_masters.append(masters)
        if stray:
            raise StrayParameterError(
                f"optimizer holds {len(stray)} half parameter(s) that belong to no model prepared for training "
                f"(first: shape {tuple(stray[0].shape)}, {stray[0].dtype}); call prepare_model() (with "
                "train=True) on every model whose parameters it trains.",
                stray,
            )
        # Optimizer state kept by a parameter that has a master now (made before the optimizer was prepared, or
        # loaded before its master was made) is the master's: FP32, as the master steps.
        moved = optimizer.state
        for group, masters in zip(optimizer.param_groups, group_masters):
            for param, master in zip(group["params"], masters):
                if master is not param and has_own_key(moved, param) and not has_own_key(moved, master):
                    moved[master] = {
                        k: v.float() if torch.is_tensor(v) and v.is_floating_point() and k != "step" else v
                        for k, v in moved.pop(param).items()
                    }
        state.group_masters = group_masters
        state.pairs = [
            (param, master)
            for group, masters in zip(optimizer.param_groups, group_masters)
            for param, master in zip(group["params"], masters)
        ]
        state.pairs_key = key
        warn_from_rounding(master_weights)
        state.last_params = lists[-1] if lists else None
        state.unmastered = [param for param, master in state.pairs if master is param and param.dtype in _HALF]
        state.pair_params = [param for param, _ in state.pairs]
        state.pair_masters = [master for _, master in state.pairs]
        state.mastered = [i for i, (param, master) in enumerate(state.pairs) if master is not param]
        state.grad_layout = None
        state.mirrors = None
        if state.on_new_pairs is not None:  # inner optimizers made on the groups since get their hooks
            state.on_new_pairs(state, optimizer)
    return state.pairs


def grad_pairs(
    state: _OptimizerState,
    optimizer: torch.optim.Optimizer,
    master_weights: Sequence[MasterWeights],
    refuse_sparse: Callable[[torch.Tensor], None],
    *,
    copy: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(scaled gradients, where their unscaled values go) for the parameters of ``optimizer`` (the optimizer of
    ``state``), at O2 (without masters every gradient is unscaled in place: see
    :func:`lightning_mpx.engine.grad_checks.own_grads`).

    At O2 the unscaled values go to the masters' ``.grad``; a master whose parameter has no gradient this step
    gets none either, so the optimizer never steps it on an old one. A master's new FP32 gradient is empty, for a
    kernel that reads the half gradient and writes it (the fused one), or with ``copy`` already holds the half
    gradient's values, for an unscale in place (torch's kernels: one C call per tensor makes and fills it, where an
    empty buffer and a copy into it take two). ``refuse_sparse(param)`` raises for a parameter with a sparse
    gradient.
    """
    # once per step: a parameter unfrozen in place (param_pairs' cache check, written out: its usual case)
    lists = list(map(_PARAMS, optimizer.param_groups))
    if (
        state.swapped is not None
        or tuple(zip(map(id, lists), map(len, lists))) != state.pairs_key
        or (state.unmastered and _any_needs_master(state.unmastered))
    ):
        param_pairs(state, master_weights, recheck=True, optimizer=optimizer)
    pairs = state.pairs
    # The usual step, every master's parameter with a dense gradient, read with C-level maps; a parameter's own
    # gradient is its master's (the master is the parameter), and a master of its own gets a new FP32 gradient. A
    # parameter that is its own master and has no gradient (a frozen base the optimizer holds, as a LoRA fine-tune's
    # AdamW(model.parameters()) does) is left out, as torch's optimizers skip it.
    grads = list(map(_GRAD, state.pair_params))
    mastered = state.mastered
    halves = list(map(grads.__getitem__, mastered))
    present: list[torch.Tensor] | None = grads
    if any(map(operator.is_, grads, itertools.repeat(None))):
        every_master_has_one = not any(map(operator.is_, halves, itertools.repeat(None)))
        present = [grad for grad in grads if grad is not None] if every_master_has_one else None
    if present is not None and not any(map(_IS_SPARSE, present)):
        masters = state.pair_masters
        targets = grads.copy()
        layout = state.grad_layout
        # Made again when the masters changed shape since (a write through `.data` taken by refresh_masters): the
        # copy into the views would broadcast, not raise, so the shapes are compared every step (once).
        fits = bool(layout) and tuple(map(_SHAPE, halves)) == layout.shapes  # type: ignore[union-attr]
        if layout is None or (layout and not fits):
            _take_reshaped(state, master_weights)
            layout = state.grad_layout = GradLayout.of(list(map(masters.__getitem__, mastered))) or False
            fits = bool(layout) and layout.fits(halves)  # type: ignore[union-attr]
        if fits:
            assert layout
            new = layout.new()
            if copy:
                torch._foreach_copy_(new, halves)
            # C-level maps: each master's gradient set, and the targets list, without Python per parameter
            gaining = map(masters.__getitem__, mastered)
            collections.deque(map(setattr, gaining, itertools.repeat("grad"), new), maxlen=0)
            collections.deque(map(targets.__setitem__, mastered, new), maxlen=0)
        else:  # gradients of their own (a per-parameter loop already): a resize taken here too, as above
            _take_reshaped(state, master_weights)
            for index in mastered:
                master = masters[index]
                targets[index] = master.grad = _master_grad(master, grads[index], copy)
        return present, targets if present is grads else [target for target in targets if target is not None]
    sources = []
    targets: list[torch.Tensor] = []
    _take_reshaped(state, master_weights)  # a resize, as on the usual path
    for param, master in pairs:
        grad = param.grad
        if grad is None:
            if master is not param:
                master.grad = None
            continue
        if grad.is_sparse:
            refuse_sparse(param)
        sources.append(grad)
        if master is param:
            targets.append(grad)
        else:
            target = master.grad = _master_grad(master, grad, copy)
            targets.append(target)
    return sources, targets


@dataclass(frozen=True)
class GradLayout:
    """The masters' new FP32 gradients of a step as views of one buffer: one allocation, and (for an unscale in
    place) one multi-tensor copy of the half gradients into them, where a gradient per master took an allocation and
    a copy kernel each (a launch per parameter on a GPU). Each view starts 256 bytes into the buffer or a multiple of
    it, as the caching allocator aligns a buffer of its own, so that vectorized kernels read it as fast.

    The buffer is freed with the last of its views: when the step ends (:func:`~lightning_mpx.masters.swap.
    drop_master_grads`), as the gradients of their own were.
    """

    dtype: torch.dtype
    device: torch.device
    total: int
    shapes: tuple[torch.Size, ...]
    strides: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]

    @classmethod
    def of(cls, masters: list[torch.Tensor]) -> GradLayout | None:
        """The layout for ``masters``, or ``None`` when they cannot share a buffer (fewer than two, several
        devices or dtypes, a master that is not contiguous: its gradient keeps its layout)."""
        if len(masters) < 2:
            return None
        first = masters[0]
        if any(m.dtype != first.dtype or m.device != first.device or not m.is_contiguous() for m in masters):
            return None
        offsets, total = [], 0
        for master in masters:
            offsets.append(total)
            total += -(-master.numel() // _ALIGN) * _ALIGN
        return cls(first.dtype, first.device, total, tuple(m.shape for m in masters),
                   tuple(m.stride() for m in masters), tuple(offsets))  # fmt: skip

    def fits(self, grads: list[torch.Tensor]) -> bool:
        """Whether ``grads`` (the half gradients of the masters, in order) have the shapes of the views."""
        return tuple(map(_SHAPE, grads)) == self.shapes

    def new(self) -> list[torch.Tensor]:
        """New (uninitialized) gradients, one per master, views of one new buffer."""
        flat = torch.empty(self.total, dtype=self.dtype, device=self.device)
        return list(map(flat.as_strided, self.shapes, self.strides, self.offsets))


def state_to_masters(
    optimizer: torch.optim.Optimizer, state: _OptimizerState
) -> list[tuple[torch.Tensor, dict, torch.Tensor, dict | None]]:
    """Before a state dict is made (the masters in the groups): optimizer state kept by a half parameter that has a
    master goes to the master (FP32, as :func:`param_pairs` moves it), merged into a new entry with the master's own
    where it has one (its keys win). Such state is written outside the engine's step, where the groups hold the half
    parameters: a SAM-style optimizer's ``first_step`` keeps ``old_p`` there (an empty entry once its restore pops it).
    Left there, torch's ``state_dict()`` finds a key in no group and raises ``KeyError``. Returns each move (the
    parameter, its entry, the master, the master's entry before or ``None``), for :func:`state_to_params_again`. The
    usual case (no such state) is told by ids, with C-level maps: a tensor's ``__hash__`` is a Python call."""
    kept = optimizer.state
    held = set(map(id, kept))
    if held.isdisjoint(map(id, map(state.pair_params.__getitem__, state.mastered))):
        return []
    moved = []
    for param, master in state.pairs:
        if master is param or id(param) not in held:
            continue
        own = kept.pop(param)
        entry = {
            k: v.float() if torch.is_tensor(v) and v.is_floating_point() and k != "step" else v for k, v in own.items()
        }
        mine = kept.get(master)
        if mine is not None:
            kept[master] = {**entry, **mine}
        elif entry:
            kept[master] = entry
        moved.append((param, own, master, mine))
    return moved


def state_to_params_again(
    optimizer: torch.optim.Optimizer, moved: list[tuple[torch.Tensor, dict, torch.Tensor, dict | None]]
) -> None:
    """After the state dict was made: the moves of :func:`state_to_masters` undone (the state dict keeps the moved
    entries), so that the run goes on with its state where it was: a restore inside a SAM-style optimizer's
    ``step()`` (the masters in its groups) finds no ``old_p`` of a step before and writes no master with it."""
    kept = optimizer.state
    for param, own, master, mine in moved:
        put_by_param(kept, param, own)
        if mine is None:
            kept.pop(master, None)
        else:
            kept[master] = mine


def half_state_to_params(
    optimizer: torch.optim.Optimizer, state: _OptimizerState, keys: dict[int, list[str]]
) -> None:
    """After a state dict was loaded (the groups' own lists back): the keys ``keys`` names, by index, that a half
    parameter kept when it was made (:func:`state_to_masters` moved them to its master, in FP32) moved back to it in
    its dtype, as the run that saved it kept them (``old_p``: its half values, exact)."""
    kept = optimizer.state
    params = [param for group in optimizer.param_groups for param in group["params"]]
    masters = {id(param): master for param, master in state.pairs}
    for index, names in keys.items():
        param = params[index]
        master = masters.get(id(param), param)
        entry = kept.get(master)
        if master is param or entry is None:
            continue
        for name in names:
            if name in entry:
                value = entry.pop(name)
                cast = torch.is_tensor(value) and value.is_floating_point() and name != "step"
                kept.setdefault(param, {})[name] = value.to(param.dtype) if cast else value  # not the master's
        if not entry:
            kept.pop(master)


def _take_reshaped(state: _OptimizerState, master_weights: Sequence[MasterWeights]) -> None:
    """Take into their masters the parameters whose shape changed since (``p.data = t`` of another shape: Hugging
    Face's ``resize_token_embeddings``), before their gradients go to the masters: the step would take them after."""
    params, masters_of = state.pair_params, state.pair_masters
    reshaped = [params[i] for i in state.mastered if params[i].shape != masters_of[i].shape]
    for masters in master_weights if reshaped else ():
        masters.refresh(reshaped)


def _master_grad(master: torch.Tensor, grad: torch.Tensor, copy: bool) -> torch.Tensor:
    """A new FP32 gradient for ``master``: ``grad``'s values (``copy``) or empty. The previous step's is freed
    when the step ends (:func:`drop_master_grads`), so a new one costs no more memory than reusing it would, and it
    cannot carry an old value into a step."""
    if copy:
        # .float(), not .to(dtype, copy=True): the same kernel for a half gradient, with half the call's cost; a
        # copy even when the dtypes agree (an FP32 parameter with a master of its own).
        return grad.float() if grad.dtype in _HALF else grad.to(master.dtype, copy=True)
    return torch.empty_like(master)
