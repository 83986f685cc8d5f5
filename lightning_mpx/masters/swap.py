"""The step on the FP32 masters (O2): the masters put in the optimizer's groups for the step (or a state-dict call),
the model's writes taken before it, the result copied back after it, the masters' gradients freed.

The pairs themselves (which master each parameter has) are :mod:`lightning_mpx.masters.pairs`'; the step's view of
them, one :class:`~lightning_mpx.masters.weights.Mirror` per prepared model, is cached on the optimizer's
:class:`~lightning_mpx.engine.optimizer_state._OptimizerState`. Plain functions over that state and the list of
``MasterWeights``: no engine is held.
"""

from __future__ import annotations

import collections
import itertools
import operator
from typing import Any, Callable, Sequence

import torch

from lightning_mpx.engine.optimizer_state import _OptimizerState, optimizer_params
from lightning_mpx.masters.mirror import Mirror, handed_over_error, step_mirrored
from lightning_mpx.masters.pairs import param_pairs, state_to_masters
from lightning_mpx.masters.state_keys import has_own_key, key_by_masters, put_by_param
from lightning_mpx.masters.weights import MasterWeights

_PARAMS = operator.itemgetter("params")

#: The key of an O2 optimizer's state dict made between a SAM-style optimizer's passes: the perturbed half weights its
#: second pass runs at, by the parameter's index in the state dict (:func:`pass_weights`, :func:`restore_pass`). The
#: model's entry and the masters hold the weights before ``first_step``. Absent otherwise; loads ignore it elsewhere.
PASS_WEIGHTS = "mpx_pass_weights"


def mirrors(state: _OptimizerState, master_weights: Sequence[MasterWeights], *, compare: bool) -> list[Mirror]:
    """The optimizer's half parameters and their masters, one :class:`Mirror` per prepared model, kept until the
    optimizer's parameter lists change (``compare``: ``model_writes="values"``)."""
    param_pairs(state, master_weights)
    return state.mirrors if state.mirrors is not None else _make_mirrors(state, master_weights, compare)


def _make_mirrors(state: _OptimizerState, master_weights: Sequence[MasterWeights], compare: bool) -> list[Mirror]:
    params = [param for param, master in state.pairs if master is not param]
    made = [m for masters in master_weights if (m := masters.mirror(params, compare=compare)).params]
    if sum(len(mirror.params) for mirror in made) != len(params):
        # Paired with a master when the optimizer was registered, handed over since (a second stage's engine, or
        # made another dtype: diffusers' cast_training_params after prepare) before this first step: refused as a
        # later step refuses it (the step took the stale master, which the parameter's new FP32 data shares, before)
        for masters in master_weights:
            if names := masters.handed_names(params):
                raise handed_over_error(names[0], converted=bool(masters.converted_names(params)))
    state.mirrors = made
    return made

#: The key of an O2 optimizer's state dict naming, by index, the state keys a half parameter kept (outside the step:
#: SAM's ``old_p``) that the state dict holds under its master, in FP32; a load gives them back to the half parameter.
HALF_STATE = "mpx_half_state"


def take_writes_before_pass(
    state: _OptimizerState, master_weights: Sequence[MasterWeights], *, compare: bool = False
) -> None:
    """A SAM-style optimizer (``state.two_pass``), at the first engine backward since its last step: take the writes
    made to the half parameters since that step (a clamp, a layer re-initialised, weights set after set-up) into the
    masters now, before ``first_step`` perturbs them; its step overlooks the writes made after (see
    :func:`step_on_masters`). Through the step's mirrors once a step made them (with its ``model_writes`` mode),
    through the masters themselves before: no mirror is made here, in a mode the step did not choose
    (``compare``: ``model_writes="values"``, every value compared, as the step's mirrors will)."""
    optimizer = state.optimizer_ref()
    held = frozenset(map(id, optimizer_params(optimizer))) if optimizer is not None else frozenset()
    if held and any(not weights.in_pass.isdisjoint(held) for weights in master_weights):
        return  # its pass open already: restored by a load between the passes (restore_pass), no write to take
    if state.mirrors is not None:
        for mirror in state.mirrors:
            mirror.take_writes()
    elif optimizer is not None:
        params = list(optimizer_params(optimizer))
        for weights in master_weights:
            weights.in_pass -= held
            weights.refresh(params, force=compare)
    for weights in master_weights:  # until its step: writes to them are its pass's (MasterWeights.in_pass)
        weights.in_pass |= held


def end_pass(state: _OptimizerState, master_weights: Sequence[MasterWeights]) -> None:
    """A SAM-style optimizer's step (taken or skipped): writes to its parameters are the model's again."""
    optimizer = state.optimizer_ref()
    if optimizer is not None and any(weights.in_pass for weights in master_weights):
        held = frozenset(map(id, optimizer_params(optimizer)))
        for weights in master_weights:
            weights.in_pass -= held


def pass_weights(state: _OptimizerState, master_weights: Sequence[MasterWeights]) -> dict[int, torch.Tensor]:
    """A state dict made between a SAM-style optimizer's first backward and its step (the masters in the groups,
    ``state.swapped`` their own lists): the half values of its parameters with a master, perturbed by ``first_step``,
    by their index in the state dict (torch's: the groups' order), cloned. Empty when no pass is open."""
    if not state.two_pass or state.swapped is None or not any(weights.in_pass for weights in master_weights):
        return {}
    masters = {id(param): master for param, master in state.pairs}
    params = [param for group in state.swapped for param in group]
    return {
        index: param.detach().clone()
        for index, param in enumerate(params)
        if masters.get(id(param), param) is not param and any(id(param) in w.in_pass for w in master_weights)
    }


def half_state_keys(
    state: _OptimizerState, optimizer: torch.optim.Optimizer, moved: list[tuple[torch.Tensor, dict, torch.Tensor, Any]]
) -> dict[int, list[str]]:
    """For a state dict: by index, the keys of the state a half parameter kept that :func:`state_to_masters` moved
    to its master (not the master's own), so that a load gives them back to the half parameter (:data:`HALF_STATE`)."""
    lists = state.swapped if state.swapped is not None else list(map(_PARAMS, optimizer.param_groups))
    index = {id(param): i for i, param in enumerate(itertools.chain.from_iterable(lists))}
    out = {}
    for param, own, _, mine in moved:
        keys = sorted(k for k in own if mine is None or k not in mine)
        if keys and id(param) in index:
            out[index[id(param)]] = keys
    return out


def check_half_state(optimizer: torch.optim.Optimizer, saved: object) -> dict[int, list[str]]:
    """The :data:`HALF_STATE` entry of a state dict ``optimizer`` is to load, checked before anything is loaded.
    Raises ``ValueError`` (nothing loaded) unless each index is one of its parameters' and names a list of keys."""
    count = sum(1 for _ in optimizer_params(optimizer))
    fits = isinstance(saved, dict) and all(
        isinstance(i, int) and 0 <= i < count and isinstance(keys, list) and all(isinstance(k, str) for k in keys)
        for i, keys in saved.items()
    )
    if not fits:
        raise ValueError(
            f"{HALF_STATE} of the optimizer's state dict must map indices of its {count} parameters to lists of state "
            f"keys, got {saved!r:.80}: the checkpoint is another model's; nothing was loaded."
        )
    return saved


def check_pass_weights(optimizer: torch.optim.Optimizer, saved: object) -> dict[int, torch.Tensor]:
    """The :data:`PASS_WEIGHTS` entry of a state dict ``optimizer`` is to load, checked before anything is loaded:
    each index one of its half parameters', of its shape. Raises ``ValueError`` (nothing loaded) otherwise."""
    params = list(optimizer_params(optimizer))
    if not isinstance(saved, dict):
        raise ValueError(f"{PASS_WEIGHTS}={type(saved).__name__} of the optimizer's state dict must be a dict of "
                         "parameter index to tensor; nothing was loaded.")
    for index, value in saved.items():
        param = params[index] if isinstance(index, int) and 0 <= index < len(params) else None
        if param is None or not torch.is_tensor(value) or tuple(value.shape) != tuple(param.shape):
            raise ValueError(
                f"{PASS_WEIGHTS}[{index!r}] of the optimizer's state dict matches none of its {len(params)} "
                "parameters (or not its shape): the checkpoint is another model's; nothing was loaded."
            )
    return saved


def restore_pass(
    state: _OptimizerState, master_weights: Sequence[MasterWeights], saved: dict[int, torch.Tensor]
) -> None:
    """After a state dict made between a SAM-style optimizer's passes was loaded (the model's entry, the masters,
    loaded before it): its half parameters take the perturbed values the saved run's second pass ran at, and its pass
    is open again (``MasterWeights.in_pass``), so that its step steps the loaded masters, not these values."""
    optimizer = state.optimizer_ref()
    if optimizer is None or not saved:
        return
    params = list(optimizer_params(optimizer))
    with torch.no_grad():
        for index, value in saved.items():
            params[index].copy_(value)
    held = frozenset(map(id, params))
    for weights in master_weights:
        weights.in_pass |= held


def undo_pass(state: _OptimizerState, master_weights: Sequence[MasterWeights]) -> None:
    """A SAM-style optimizer's step skipped on the host (an overflow): the masters (the weights before its
    ``first_step``) copied into the model, as its step would have, so a perturbation its ``step()`` was to undo (the
    restore inside it) is not left in the half weights (a float16 overflow's NaN: every later step skipped)."""
    end_pass(state, master_weights)
    if state.mirrors is not None:
        for mirror in state.mirrors:
            mirror.overlook_writes()
            mirror.copy_to_model()
        return
    optimizer = state.optimizer_ref()
    if optimizer is not None:
        params = list(optimizer_params(optimizer))
        for weights in master_weights:
            weights.copy_to_model(params)


def step_on_masters(
    state: _OptimizerState,
    optimizer: torch.optim.Optimizer,
    master_weights: Sequence[MasterWeights],
    step: Callable[[], object],
    *,
    compare: bool,
    judge: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], None] | None = None,
) -> object:
    """Run ``step`` (the optimizer's own step) on the masters: writes made to the model since the last step (loaded
    weights, SWA, EMA...) taken into them (not for a SAM-style optimizer, ``state.two_pass``: its ``first_step``
    perturbed the half weights, and the masters hold the weights to step from; writes before its first pass were
    taken at that pass's backward, :func:`take_writes_before_pass`), the masters in the groups for the
    call, the result copied to the model (after a skip on the device: the masters' unchanged values), and their FP32
    gradients freed. ``judge``: given the pairs found written, before the step (see
    :func:`~lightning_mpx.masters.mirror.step_mirrored`). Returns what ``step`` returned.

    The pairs are taken as the unscale of this step made or checked them (no user code runs between the two), so
    nothing here looks for a changed parameter list again."""
    views = state.mirrors if state.mirrors is not None else _make_mirrors(state, master_weights, compare)
    groups = optimizer.param_groups
    if optimizer.state.__class__ is collections.defaultdict and not state.two_pass and state.train_modes is None:
        # the user's own defaultdict put in since (key_by_masters: not for SAM-style or schedule-free ones)
        key_by_masters(state, optimizer)
    state.swapped = swapped = list(map(_PARAMS, groups))
    for group, masters in zip(groups, state.group_masters):
        group["params"] = masters
    apart = _inners_apart_in(state, groups) if state.inners else None  # a wrapper's inner optimizers (rare)
    # swap_out and drop_master_grads written out: a call each saved at every step (host-bound loops); the mirrors'
    # module is entered once (step_mirrored), as every module of a step (benchmarks/step_walk.py)
    try:
        returned = step_mirrored(views, step, take=not state.two_pass, judge=judge)
    finally:
        for group, params in zip(optimizer.param_groups, swapped):  # by position, as swap_out
            group["params"] = params
        state.swapped = None
        if apart:
            for inner_groups, inner_params in apart:
                for group, params in zip(inner_groups, inner_params):
                    group["params"] = params
    if state.two_pass:
        end_pass(state, master_weights)
    dropped = map(state.pair_masters.__getitem__, state.mastered)  # C-level maps: no Python per parameter
    collections.deque(map(setattr, dropped, itertools.repeat("grad"), itertools.repeat(None)), maxlen=0)
    return returned


def _inners_apart_in(
    state: _OptimizerState, groups: list[dict]
) -> list[tuple[list[dict], list[list[torch.Tensor]]]]:
    """The masters put for the step in the groups of the wrapper's inner optimizers (``state.inners``) that no longer
    share its groups: torch-optimizer's ``Lookahead.load_state_dict`` loads its own groups and then its inner
    optimizer's, and the two hold the same parameters in separate group dicts from then on (the inner one steps its
    own, as in FP32). Returns each such inner optimizer's groups and their own lists, to put back after the step."""
    ids = set(map(id, groups))
    apart = []
    master_of = None
    for ref in state.inners:
        inner = ref()
        if inner is None or inner.param_groups is groups or not ids.isdisjoint(map(id, inner.param_groups)):
            continue  # shared: the wrapper's swap put the masters in them
        if master_of is None:
            master_of = dict(zip(map(id, state.pair_params), state.pair_masters))
        inner_groups = list(inner.param_groups)
        apart.append((inner_groups, [group["params"] for group in inner_groups]))
        for group in inner_groups:
            group["params"] = [master_of.get(id(param), param) for param in group["params"]]
    return apart


def swap_in(state: _OptimizerState, master_weights: Sequence[MasterWeights], *, recheck: bool = False) -> None:
    """Put the masters in the optimizer's groups in place of the model's parameters (no-op when they are);
    ``recheck`` as for :func:`~lightning_mpx.masters.pairs.param_pairs` (the optimizer's state dicts)."""
    if state.swapped is not None:
        return
    param_pairs(state, master_weights, recheck=recheck)
    groups = state.optimizer.param_groups
    state.swapped = [group["params"] for group in groups]
    for group, masters in zip(groups, state.group_masters):
        group["params"] = masters


def swap_out(state: _OptimizerState, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Give the groups their own parameter lists back (no-op when they have them)."""
    if state.swapped is None:
        return
    # By position: load_state_dict replaces the group dicts themselves.
    groups = (state.optimizer if optimizer is None else optimizer).param_groups
    for group, params in zip(groups, state.swapped):
        group["params"] = params
    state.swapped = None


def drop_master_grads(state: _OptimizerState) -> None:
    """Free the FP32 gradients of the optimizer's masters (the half model's own gradients stay): those of the pairs
    as last made, by the unscale that gave them their gradients or a step's swap since. The FP32 gradients were the
    step's: freeing them keeps them out of the next forward's and backward's peak memory."""
    dropped = map(state.pair_masters.__getitem__, state.mastered)  # C-level maps: no Python per parameter
    collections.deque(map(setattr, dropped, itertools.repeat("grad"), itertools.repeat(None)), maxlen=0)


def state_to_params(state: _OptimizerState, master_weights: Sequence[MasterWeights]) -> None:
    """An optimizer the engine lets go of (``Amp.release_optimizer``): its state (Adam's moments, step count), kept
    by its FP32 masters while the engine stepped it, moved to the model's parameters its groups hold, so that its
    ``state_dict()`` works without the engine's hooks and an engine that prepares it again takes the state over."""
    if not master_weights:
        return
    optimizer = state.optimizer_ref()
    if optimizer is None:
        return
    swap_out(state, optimizer)
    for param, master in param_pairs(state, master_weights, optimizer=optimizer):
        if master is not param and has_own_key(optimizer.state, master):
            put_by_param(optimizer.state, param, optimizer.state.pop(master))


def call_on_masters(
    state: _OptimizerState, master_weights: Sequence[MasterWeights], call: Callable[[], object]
) -> None:
    """Run ``call`` (an optimizer's own method that writes its parameters outside a step: a schedule-free optimizer's
    ``eval()``/``train()``, which move them between its two points) on the masters: writes made to the model since
    the last step taken into them first, the masters in the groups for the call (the state a half parameter kept
    since given to its master), then copied into the model, so that the model holds what the call made of them."""
    optimizer = state.optimizer_ref()
    if optimizer is None:
        call()
        return
    params = list(optimizer_params(optimizer)) if state.swapped is None else [p for g in state.swapped for p in g]
    for weights in master_weights:
        weights.refresh(params)
    swap_in(state, master_weights, recheck=True)
    if state.pairs:
        state_to_masters(optimizer, state)
    try:
        call()
    finally:
        swap_out(state)
        for weights in master_weights:
            weights.copy_to_model(params)
        state.backward_versions = None  # the engine's own write of the model, no raw step (engine.raw_steps)


def train_modes(optimizer: torch.optim.Optimizer) -> tuple[object, ...] | None:
    """The ``train_mode`` flag of each of ``optimizer``'s groups (a schedule-free optimizer's), or ``None`` when no
    group carries one. Read as :meth:`Amp.forward_context <lightning_mpx.engine.amp.Amp.forward_context>` reads them
    (from the optimizer's ``__dict__``: traced, an attribute read guards on every value of every group)."""
    if (groups := optimizer.__dict__.get("param_groups")) is None:
        groups = optimizer.param_groups
    return tuple(group.get("train_mode") for group in groups) if any("train_mode" in g for g in groups) else None


def follow_modes(state: _OptimizerState, master_weights: Sequence[MasterWeights]) -> None:
    """A schedule-free optimizer whose ``eval()`` or ``train()`` ran where its groups hold the half parameters (the
    user's, through Fabric's or Lightning's optimizer wrapper), which moved none of them (its state is keyed by their
    masters): the call redone on the masters (:func:`call_on_masters`, its flags put back first), then copied into
    the model. A parameter that is its own master (FP32: batch norm) was moved by the user's call already: its state is
    hidden from the redone one."""
    optimizer = state.optimizer_ref()
    if optimizer is None:
        return
    seen, modes = state.train_modes, train_modes(optimizer)
    state.train_modes = modes
    if seen is not None and modes is not None and len(modes) > len(seen):
        seen += modes[len(seen) :]  # groups added since (add_param_group): the older groups' flags tell a call
    if seen is None or modes is None or len(seen) != len(modes) or modes == seen or len(set(modes)) != 1:
        return  # groups removed since (recorded), or flags not all alike: not a call of eval()/train()
    method = getattr(optimizer, "train" if modes[0] else "eval", None)
    if not callable(method):
        return
    for group, mode in zip(optimizer.param_groups, seen):
        group["train_mode"] = mode
    kept = optimizer.state
    own = [param for param, master in state.pairs if master is param and has_own_key(kept, param)]
    hidden = [(param, kept.pop(param)) for param in own]
    try:
        call_on_masters(state, master_weights, method)
    finally:
        for param, entry in hidden:
            kept[param] = entry
        state.train_modes = train_modes(optimizer)
