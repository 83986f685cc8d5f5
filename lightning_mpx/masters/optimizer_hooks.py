"""The hooks an optimizer with FP32 masters carries (O2): the masters in its groups for its state dicts (saved and
loaded in FP32), and a refusal of a direct ``optimizer.step()``, whose groups would hold the half parameters with
their scaled gradients.

Its groups hold the model's own parameters between steps (see :class:`~lightning_mpx.masters.weights.MasterWeights`);
the swap itself is :mod:`lightning_mpx.masters.swap`'s.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from lightning_mpx.common.dtypes import HALF_DTYPES
from lightning_mpx.engine.optimizer_state import _OptimizerState
from lightning_mpx.masters.pairs import half_state_to_params, param_pairs, state_to_masters, state_to_params_again
from lightning_mpx.masters.state_keys import key_by_masters
from lightning_mpx.masters.store import Masters
from lightning_mpx.masters.swap import (
    HALF_STATE,
    PASS_WEIGHTS,
    check_half_state,
    check_pass_weights,
    follow_modes,
    half_state_keys,
    pass_weights,
    restore_pass,
    swap_in,
    swap_out,
    train_modes,
)


class MasterHooks:
    """The hooks of one optimizer prepared with masters.

    Args:
        state: The optimizer's state (its pairs and whether the masters are swapped in).
        masters: The engine's FP32 masters.
        owner: A weak reference to the engine's step machine that put the hooks on.
    """

    def __init__(self, state: _OptimizerState, masters: Masters, owner: Any = None) -> None:
        self.state = state
        self.masters = masters
        self.owner = owner  # a weak reference to the engine's StepMachine (a later engine releases it from there)
        self.loading_pass: dict[int, torch.Tensor] = {}  # a SAM pass the state dict being loaded holds (PASS_WEIGHTS)
        self.loading_half: dict[int, list[str]] = {}  # the half parameters' state keys it holds (HALF_STATE)
        self.moved: list = []  # the state moved to the masters for the state dict being made (state_to_masters)

    def register(self, optimizer: torch.optim.Optimizer) -> list[RemovableHandle]:
        """Put the hooks on ``optimizer``; returns their handles."""
        return [
            optimizer.register_step_pre_hook(self.refuse_direct_step),
            optimizer.register_state_dict_pre_hook(self.masters_in),
            optimizer.register_state_dict_post_hook(self.masters_out),
            optimizer.register_load_state_dict_pre_hook(self.masters_in_to_load),
            optimizer.register_load_state_dict_post_hook(self.loaded),
        ]

    def masters_in(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        """Before ``state_dict()``: the masters in the groups, and state kept by a half parameter since (outside the
        step: a SAM-style optimizer's ``first_step``) given to its master (:func:`state_to_masters`). A schedule-free
        optimizer's ``eval()``/``train()`` called since the engine last looked is redone on the masters first
        (:func:`follow_modes`), so the state dict holds the flags and the masters' point together."""
        if self.state.train_modes is not None and self.state.swapped is None:
            follow_modes(self.state, self.masters.weights)
        swap_in(self.state, self.masters.weights, recheck=True)
        if self.state.pairs:
            self.moved = state_to_masters(optimizer, self.state)

    def masters_in_to_load(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """Before the optimizer loads a state dict: a half parameter without a master (frozen when the masters were
        made, and frozen again in this run) whose state the checkpoint holds trained in the run that saved it, so
        it gets its master now, and the state loads into the master in FP32 (into the half parameter it would be
        rounded to half). ``Amp.load_state_dict`` then gives the master its saved value. A state dict made between a
        SAM-style optimizer's passes: its perturbed half weights (:data:`PASS_WEIGHTS`) checked, put back by
        :meth:`loaded`."""
        if not fits_groups(optimizer, state_dict):
            return  # torch's load refuses it next (ValueError), after which no post-hook runs to swap back
        saved = state_dict.get(PASS_WEIGHTS)
        self.loading_pass = check_pass_weights(optimizer, saved) if saved is not None and self.state.two_pass else {}
        keys = state_dict.get(HALF_STATE)
        self.loading_half = check_half_state(optimizer, keys) if keys is not None else {}
        if masters_for_loaded(optimizer, state_dict, self.masters):
            self.state.pairs_key = None  # pair them with their new masters
            self.state.mirrors = None
        swap_in(self.state, self.masters.weights, recheck=True)

    def masters_out(self, optimizer: torch.optim.Optimizer, *args: Any) -> Any:
        """After ``state_dict()``: between a SAM-style optimizer's passes, the perturbed half weights its second pass
        runs at added (:data:`PASS_WEIGHTS`; the masters, the model's entry, hold the weights before ``first_step``);
        the state moved from half parameters to their masters named (:data:`HALF_STATE`) and moved back; the groups'
        own lists back."""
        saved = args[0] if args else None
        weights = pass_weights(self.state, self.masters.weights) if self.state.two_pass else None
        if weights and isinstance(saved, dict):
            saved[PASS_WEIGHTS] = weights
        if self.moved:
            moved, self.moved = self.moved, []
            if isinstance(saved, dict):
                saved[HALF_STATE] = half_state_keys(self.state, optimizer, moved)
            state_to_params_again(optimizer, moved)
        swap_out(self.state)
        return saved  # the state_dict post-hook returns the state dict

    def loaded(self, optimizer: torch.optim.Optimizer) -> None:
        """After the optimizer loaded a state dict: the groups' own lists back; a schedule-free optimizer's loaded
        ``train_mode`` flags noted as seen (the masters the checkpoint holds are at that point)."""
        swap_out(self.state)
        key_by_masters(self.state, optimizer)  # torch's load replaced optimizer.state with a plain defaultdict
        if self.state.train_modes is not None:
            self.state.train_modes = train_modes(optimizer)
        if self.loading_half:  # state a half parameter kept (SAM's old_p): back to it, as the run that saved kept it
            keys, self.loading_half = self.loading_half, {}
            half_state_to_params(optimizer, self.state, keys)
        if self.loading_pass:  # loaded between a SAM's passes: the perturbed weights back, its pass open
            saved, self.loading_pass = self.loading_pass, {}
            restore_pass(self.state, self.masters.weights, saved)
            machine = self.owner() if self.owner is not None else None
            if machine is not None:
                machine.forget_writes()  # a load's write, no raw step

    def refuse_direct_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.state.swapped is None and not state_making_step(optimizer, args, kwargs):
            raise RuntimeError(
                "optimizer.step() was called on an optimizer prepared by lightning_mpx with FP32 master weights, "
                "outside Amp.step(): its groups hold the half model parameters and their gradients are still "
                "scaled. Call amp.step(optimizer) instead (the Lightning plugin and the Accelerate adapter do; in a "
                "LightningModule's manual optimization, step the optimizer that self.optimizers() returns, not "
                "self.optimizers(use_pl_optimizer=False), whose step bypasses the plugin; with Fabric, the optimizer "
                "fabric.setup() or fabric.setup_optimizers() returned)."
            )


def state_making_step(optimizer: torch.optim.Optimizer, args: Any = (), kwargs: Any = None) -> bool:
    """Whether this direct ``step(*args, **kwargs)`` is ``torch.distributed.checkpoint``'s ``_init_optim_state`` (its
    ``get_state_dict``/``set_state_dict`` of an optimizer without state): ``step(closure=None)``, no state, every
    ``lr`` 0 and every gradient zero (a user's plain ``optimizer.step()`` at a warm-up's ``lr`` 0 with zero gradients
    is refused as any raw step). Its gradients are dropped so the step does nothing: state made on the half
    parameters would be half and kept by them (the state dict then has no state, as a stateless optimizer's; a load
    gives the masters theirs)."""
    if any(a is not optimizer for a in args) or kwargs != {"closure": None} or optimizer.state:  # args: (optimizer,)
        return False
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(float(group.get("lr", 0.0)) != 0.0 for group in optimizer.param_groups):
        return False
    if not all(p.grad is not None and not p.grad.any() for p in params if p.requires_grad):
        return False
    for p in params:
        p.grad = None
    return True


def fits_groups(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> bool:
    """Whether torch's ``load_state_dict`` will take ``state_dict``'s groups (as many, each as long as the
    optimizer's). One it refuses raises ``ValueError`` after the pre-hooks and before the post-hooks: masters swapped
    in for it would stay in the groups (a ``zero_grad()`` then clears the masters' gradients, not the model's)."""
    saved = state_dict.get("param_groups")
    groups = optimizer.param_groups
    return (isinstance(saved, (list, tuple)) and len(saved) == len(groups)
            and all(len(s.get("params", ())) == len(g["params"]) for s, g in zip(saved, groups)))  # fmt: skip


def masters_for_loaded(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any], masters: Masters) -> bool:
    """Before ``optimizer`` loads ``state_dict``: a master made for each half parameter of its groups that has none
    (frozen when the masters were made) and whose state the checkpoint holds; whether any was made."""
    saved = state_dict.get("state", {})
    saved_groups = state_dict.get("param_groups", [])
    made = False
    if saved and len(saved_groups) == len(optimizer.param_groups):
        for group, saved_group in zip(optimizer.param_groups, saved_groups):
            for param, index in zip(group["params"], saved_group.get("params", ())):
                if index in saved and param.dtype in HALF_DTYPES:
                    for weights in masters.weights:
                        if weights.covers(param) and weights.master_of(param) is param:
                            weights.master_of(param, create=True)
                            made = True
    return made


class SharedGroupHooks:
    """The state-dict hooks of an inner optimizer that shares a prepared wrapper's ``param_groups`` (a Lookahead's
    base optimizer, SAM's ``base_optimizer``): stepped inside the wrapper's step, where the groups hold the masters,
    its state is keyed by the masters, so its own ``state_dict()`` and ``load_state_dict()`` (which a wrapper's
    ``state_dict()`` calls, or the user does) get the masters in its groups for the call, as the wrapper's do.

    Args:
        state: The wrapper's state (its pairs: which master each parameter has).
        masters: The engine's FP32 masters.
    """

    def __init__(self, state: _OptimizerState, masters: Masters) -> None:
        self.state = state
        self.masters = masters
        self.swapped: list[list[torch.Tensor]] | None = None  # the inner groups' own lists during a call
        # The hooks of every prepared wrapper around the same inner optimizer (this one's included): one swaps, the
        # others leave its groups alone (a second would pair the masters the first put in with themselves, and put
        # them back as the groups' own lists).
        self.peers: list[SharedGroupHooks] = [self]

    def register(self, inner: torch.optim.Optimizer) -> list[RemovableHandle]:
        """Put the hooks on ``inner``; returns their handles."""
        for hook in inner._optimizer_state_dict_pre_hooks.values():
            other = getattr(hook, "__self__", None)
            if isinstance(other, SharedGroupHooks) and other is not self:
                other.peers.append(self)
                self.peers = other.peers
                break
        return [
            inner.register_state_dict_pre_hook(self.masters_in),
            inner.register_state_dict_post_hook(self.masters_out),
            inner.register_load_state_dict_pre_hook(self.masters_in_to_load),
            inner.register_load_state_dict_post_hook(self.masters_out),
        ]

    def masters_in(self, inner: torch.optim.Optimizer, *args: Any) -> None:
        """Before a state dict is made or loaded: each parameter of ``inner``'s groups replaced by its master (those
        the wrapper holds already, when the groups are shared and the wrapper's own hooks ran, stay), and state kept
        by a half parameter since given to its master."""
        if any(peer.swapped is not None for peer in self.peers):
            return
        if self.state.swapped is None:
            param_pairs(self.state, self.masters.weights, recheck=True)
        master_of = dict(zip(map(id, self.state.pair_params), self.state.pair_masters))
        self.swapped = [group["params"] for group in inner.param_groups]
        for group, params in zip(inner.param_groups, self.swapped):
            group["params"] = [master_of.get(id(param), param) for param in params]
        if self.state.pairs:
            state_to_masters(inner, self.state)

    def masters_in_to_load(self, inner: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """Before ``inner`` loads a state dict: as :meth:`MasterHooks.masters_in_to_load`, a half parameter frozen
        since before the masters were made, whose state the checkpoint holds, gets its master (the state loads into it
        in FP32), then :meth:`masters_in`."""
        if not fits_groups(inner, state_dict):
            return  # refused by torch's load next, with no post-hook after it
        if self.state.swapped is None and not any(peer.swapped is not None for peer in self.peers):
            if masters_for_loaded(inner, state_dict, self.masters):
                self.state.pairs_key = None
                self.state.mirrors = None
        self.masters_in(inner)

    def masters_out(self, inner: torch.optim.Optimizer, *args: Any) -> Any:
        """After: the groups' own lists back, by position (``load_state_dict`` replaces the group dicts). Outside the
        wrapper's own swap, a master in them goes back to its parameter: a wrapper's ``load_state_dict`` that loads
        its own groups first gives its new group dicts their parameters back and leaves the old ones, which the inner
        optimizer still shares, holding the masters."""
        if self.swapped is not None:
            param_of = None
            if self.state.swapped is None:
                param_of = {id(master): param for param, master in self.state.pairs if master is not param}
            for group, params in zip(inner.param_groups, self.swapped):
                if param_of and any(id(t) in param_of for t in params):
                    params = [param_of.get(id(t), t) for t in params]
                group["params"] = params
            self.swapped = None
        return args[0] if args else None  # the state_dict post-hook returns the state dict
