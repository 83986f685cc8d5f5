"""The optimizers one engine prepared and where each is in its iteration: registered, rescaled before a backward,
unscaled and clipped, checked for the step, and reset by the update, with the overflow flags the update applies.

In the spirit of ``torch.amp.GradScaler``: each optimizer's :class:`~lightning_mpx.engine.optimizer_state._Stage`
moves READY -> UNSCALED on an unscale (or a clip) and back after its step, and :meth:`StepMachine.update` resets them
all. The losses' scalers are the engine's; the masters are :class:`~lightning_mpx.masters.store.Masters`'. The step
itself is :class:`~lightning_mpx.engine.optimizer_step.OptimizerStep`'s, which asks :meth:`StepMachine.check` for the
losses that overflowed; what happens on an overflow (the record, the log, the floor) is
:class:`~lightning_mpx.engine.overflow.Overflows`'.
"""

from __future__ import annotations

import functools
import itertools
import operator
import weakref
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from lightning_mpx.engine.frozen_writes import FrozenWrites, HeldWrites
from lightning_mpx.engine.master_writes import hand_out
from lightning_mpx.engine.optimizer_state import _OptimizerState, _Stage, optimizer_params
from lightning_mpx.engine.raw_steps import _SAM_FIX, UnheldParams, is_two_pass, refuse_base_with_sam, refuse_raw_step
from lightning_mpx.engine.rescale import (
    hold_scale,
    rescale_pending,
    rescale_stepped,
    rescale_unscaled,
    unscale_late,
)
from lightning_mpx.engine.sharding import Sharding
from lightning_mpx.engine.shared_grads import SharedGrads
from lightning_mpx.engine.step_guard import BaseStepGuard, ScaledStepGuard
from lightning_mpx.engine.unscaling import UnscalePath
from lightning_mpx.engine.unsynced import DdpWatch, synced
from lightning_mpx.health.telemetry import GradTelemetry
from lightning_mpx.masters.handover import refuse_handed
from lightning_mpx.masters.mirror import Mirror
from lightning_mpx.masters.optimizer_hooks import MasterHooks, SharedGroupHooks
from lightning_mpx.masters.pairs import param_pairs
from lightning_mpx.masters.state_keys import key_by_masters, key_by_params
from lightning_mpx.masters.store import Masters
from lightning_mpx.masters.swap import end_pass, mirrors, state_to_params, take_writes_before_pass, train_modes
from lightning_mpx.scaling.scaler import LossScaler

_PARAMS = operator.itemgetter("params")
_GRAD = operator.attrgetter("grad")
_VERSION = operator.attrgetter("_version")


class StepMachine(UnscalePath):
    """The prepared optimizers of one engine and their stages; unscaling and checking their gradients is its base
    :class:`~lightning_mpx.engine.unscaling.UnscalePath`'s.

    Args:
        scalers: The engine's loss scalers, one per loss (read, and updated by :meth:`update`).
        masters: The engine's FP32 masters.
        backend: The unscale backend (``unscale_backend``).
        telemetry: The engine's gradient telemetry (measured in the unscale when requested).
        names: Parameter names by ``id``, for errors and telemetry.

    Attributes:
        optimizers: One :class:`~lightning_mpx.engine.optimizer_state._OptimizerState` per prepared optimizer, by
            ``id``.
        iteration_found: The overflow flags, by loss, that the next :meth:`update` applies to the scalers.
        iteration_read: By loss, what the host read of every flag in ``iteration_found`` said (``True``: an
            overflow), or ``None`` when one of them was not read (counted on the device then).
        grad_norms: The latest clip norm of each loss, until the engine's metrics report it.
        sharding: Set when the prepared model is FSDP-sharded: the gradients are each rank's shards, and one
            collective per step makes the flags and the norm global (:mod:`lightning_mpx.engine.sharding`).
    """

    def __init__(
        self,
        scalers: Sequence[LossScaler],
        masters: Masters,
        *,
        backend: str,
        telemetry: GradTelemetry,
        names: dict[int, str],
    ) -> None:
        self.scalers = scalers
        self.masters = masters
        self.backend = backend
        self.telemetry = telemetry
        self.names = names
        self.optimizers: dict[int, _OptimizerState] = {}
        # parameters two of them hold: unscaled once (engine.shared_grads)
        self.shared = SharedGrads(self.optimizers, scalers)
        self.taken: dict[int, weakref.ref[torch.optim.Optimizer]] = {}  # optimizers another engine took over
        self.iteration_found: dict[int, torch.Tensor] = {}
        self.iteration_read: dict[int, bool | None] = {}
        self.grad_norms: dict[int, torch.Tensor] = {}
        self.sharding: Sharding | None = None
        # The engine's steps so far, of any optimizer (engine.raw_steps: a write after one is no raw step).
        self.steps_taken = 0
        # model_writes="values": the writes a SAM-style optimizer's first backward takes (before its step made the
        # mirrors that compare values) are found by comparing values too (masters.swap.take_writes_before_pass).
        self.compare_writes = False
        # The prepared models' parameters that require grad and no registered optimizer holds (engine.raw_steps), found
        # when the models or the registrations change (find_unheld); None when there are none (no cost at a backward).
        self.unheld: UnheldParams | None = None
        # The check for a frozen half teacher written by hand (engine.frozen_writes): None once it ran (no cost after).
        self.frozen_writes: FrozenWrites | None = None
        self.frozen_checked = False
        # The judgment of an EMA child inside the optimizer, called by a step that took hand writes
        # (engine.frozen_writes.HeldWrites): None once it warned (``held_warned``), or with no prepared model; and the
        # engine's count of steps at the last stage change that wrote the parameters (forget_writes: a load).
        self.held_writes: HeldWrites | None = None
        self.held_warned = False
        self.written_at = -1
        # The parameters a load_state_dict wrote (the engine's load hooks) by id: a weak reference, the count of steps
        # then (engine.held_masters), whether it wrote them (False: a strict=False load lacked them; beside_steps).
        self.loaded: dict[int, tuple[weakref.ref[torch.Tensor], int, bool, int]] = {}
        self.loaded_kept = 0
        # A door that registers optimizers at their first step (Fabric's): before any is registered, a write over
        # the parameters no optimizer holds yet is judged there (UnheldParams.judge), not refused at the backward.
        self.registers_at_step = False
        # The ids of the weights an nn.Embedding(max_norm=...) of the prepared models renormalises in place at each
        # forward (engine.raw_steps: no raw step), found with ``unheld``.
        self.renormed: frozenset[int] = frozenset()
        # What the error for an unregistered optimizer tells the user to do: the door's own call (Amp.register_call).
        self.register_call = "call prepare_optimizer() on it first"  # (engine.registry)
        # Under DDP (engine.unsynced): the wrappers around the prepared models (weakly), the forwards' watch that finds
        # them, the ids of the models it watched, whether a wrapper's last forward with grad syncs (SyncNote); the count
        # of steps at the last backward DDP did not synchronise; a raw-step refusal kept for the step (ranks meet).
        self.ddp: tuple[weakref.ref[nn.Module], ...] = ()
        self.ddp_watch: DdpWatch | None = None
        self.ddp_watched, self.ddp_synced = frozenset[int](), dict[int, bool]()
        self.unsynced_at = -1
        self.refused: str | None = None

    def validate(self, optimizer: torch.optim.Optimizer, *, with_masters: bool) -> None:
        """Refuse what cannot be registered: what :func:`refuse_unregistrable` refuses, ``with_masters`` an
        optimizer before any model was prepared for training, and under FSDP one holding gathered parameters."""
        refuse_unregistrable(optimizer, with_masters=with_masters)
        if with_masters and not self.masters.weights:
            raise RuntimeError(
                "prepare_model() must run before prepare_optimizer() with master weights (O2), with train=True: "
                "a model prepared with train=False has no masters for an optimizer to train. (Fabric: call "
                "fabric.setup(model, optimizer) before fabric.backward(), clip_gradients() or a step; Accelerate: "
                "accelerator.prepare(model, optimizer).)"
            )
        if self.sharding is not None:
            self.sharding.refuse_gathered(optimizer_params(optimizer))

    def register(self, optimizer: torch.optim.Optimizer, *, with_masters: bool) -> None:
        """Track ``optimizer`` (once); ``with_masters``: its half parameters get their masters, optimizer state
        made before moves to them, and hooks put the masters in its groups for its state dicts."""
        key = id(optimizer)
        if key in self.optimizers:
            return  # registered before (a framework preparing it twice)
        if with_masters or not all(scaler._unit for scaler in self.scalers):  # SAM and its base optimizer: one of them
            refuse_base_with_sam(optimizer, self.optimizers.values())
            _refuse_registered_inner(optimizer, self.optimizers.values())
        _release_from_other_engines(optimizer, self)  # one engine owns an optimizer: a later stage's takes it over
        self.taken.pop(key, None)
        state = _OptimizerState(weakref.ref(optimizer), two_pass=is_two_pass(optimizer))
        if with_masters:
            # Refuses half parameters of unprepared models; makes missing masters; state made before preparing
            # moves to them.
            param_pairs(state, self.masters.weights)
            state.train_modes = train_modes(optimizer)  # a schedule-free optimizer's flags (masters.swap.follow_modes)
            state.hooks = MasterHooks(state, self.masters, owner=weakref.ref(self)).register(optimizer)
            self.adopt_inners(state, optimizer)
            key_by_masters(state, optimizer)  # optimizer.state[p] by a half parameter: its master's entry
            # an inner optimizer made on its groups later (add_param_group gives each group a new list) at the next
            # making of its pairs: no call per step (the state is passed, not held: no cycle keeping it and its masters
            # alive once the optimizer is gone, tests/test_core_leaks.py)
            state.on_new_pairs = functools.partial(_adopt_later, weakref.ref(self))
        else:  # a direct step with scaled gradients is refused (masters' hooks refuse any direct step)
            guard = ScaledStepGuard(state, self.scalers, owner=weakref.ref(self))
            state.hooks = [optimizer.register_step_pre_hook(guard)]
        base = getattr(optimizer, "base_optimizer", None)
        if state.two_pass and isinstance(base, torch.optim.Optimizer) and base is not optimizer:
            # davda54's second_step (its base step called directly) refused at the call, before any write
            guard = BaseStepGuard(state, self.scalers, with_masters, _SAM_FIX)
            state.hooks.append(base.register_step_pre_hook(guard))
        if self.unheld is not None:  # gradients on its parameters left before it was known keep their scale
            self.unheld.settle(state, optimizer)
        self.optimizers[key] = state
        weakref.finalize(optimizer, self.optimizers.pop, key, None)

    def adopt_inners(self, state: _OptimizerState, optimizer: torch.optim.Optimizer) -> None:
        """Give the inner optimizers that share ``optimizer``'s param_groups and are not registered themselves (a
        Lookahead's base optimizer, SAM's ``base_optimizer``) the state-dict hooks: stepped inside its step, their
        state is keyed by the masters, and a state dict of theirs would find no parameter for it (``KeyError``)."""
        known = {id(ref()) for ref in state.inners}
        for inner in shared_inners(optimizer):
            if id(inner) not in known and id(inner) not in self.optimizers:
                state.hooks.extend(SharedGroupHooks(state, self.masters).register(inner))
                state.inners.append(weakref.ref(inner))

    def release(self, optimizer: torch.optim.Optimizer) -> None:
        """Forget ``optimizer``, remove the hooks put on it and key its state by its own parameters again."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer={type(optimizer).__name__} is not a torch.optim.Optimizer.")
        state = self.optimizers.pop(id(optimizer), None)
        if state is not None:
            for handle in state.hooks:
                handle.remove()
            state_to_params(state, self.masters.weights)  # its state dict works without the hooks
            key_by_params(optimizer)
            if state.two_pass:  # released between a SAM's passes: writes to its parameters are the model's again
                end_pass(state, self.masters.weights)
            for ref in state.inners:  # and the inner optimizers' that shared its groups
                inner = ref()
                if inner is not None:
                    inner_state = _OptimizerState(ref)
                    state_to_params(inner_state, self.masters.weights)

    def master_params(
        self, optimizer: torch.optim.Optimizer, *, with_masters: bool, hand: bool = True
    ) -> list[torch.Tensor]:
        """The tensors ``optimizer`` updates (its masters ``with_masters``, its parameters otherwise); ``hand``: after
        a show, their gradients are handed out for the user's writes (engine.master_writes; ``False``: read by the
        library only)."""
        state = self.state(optimizer)
        if not with_masters:  # C-level maps, no Python per parameter (the Apex habit clips this list every step)
            return list(itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups)))
        pairs = param_pairs(state, self.masters.weights)
        for weights in self.masters.weights:
            if weights.handed:  # a second stage took masters of this engine's: they are not this engine's to give
                refuse_handed(self.masters.weights, [param for param, _ in pairs])
        if hand and state.shown and state.stage is _Stage.UNSCALED:  # a write to their gradients told from the model's
            hand_out(state, pairs, self.shared.ids)
        return [master for _, master in pairs]

    def mirrors(self, state: _OptimizerState, *, compare: bool) -> list[Mirror]:
        """The optimizer's half parameters and their masters, one :class:`Mirror` per prepared model."""
        return mirrors(state, self.masters.weights, compare=compare)

    # -- backward -----------------------------------------------------------------------------------------------
    def before_backward(self, loss_id: int, scaled: torch.Tensor | None = None) -> None:
        """Make every optimizer's gradients carry ``loss_id``'s scale before its backward (see
        :meth:`Amp.scale_loss <lightning_mpx.engine.amp.Amp.scale_loss>`); ``scaled``: the scaled loss, whose
        backward notes the parameters no registered optimizer holds (engine.raw_steps), if any."""
        if self.shared.done:  # SharedGrads.backward, written out (no Python call per step)
            self.shared.done, self.shared.params = {}, {}
        if self.shared.masters:  # with the versions of the FP32 gradients shown (SharedGrads.truths)
            self.shared.masters, self.shared.truths = {}, {}
        if self.ddp_watch is not None:  # the DDP wrappers were met in the forwards before it (engine.unsynced)
            self.ddp_watched = self.ddp_watch.settle()  # those whose forward has not run yet stay watched
            if not self.ddp_watched:
                self.ddp_watch = None  # watched again at a later set-up (a second fit)
        if self.unheld is not None:  # a raw step over them since the last backward is refused
            self.unheld.before_backward(self, loss_id, scaled)
        frozen = self.frozen_writes
        if frozen is not None and self.steps_taken >= frozen.due:  # until its looks are done, at each look
            frozen.at_backward(self)
        # engine.raw_steps' marks only where a raw step after this backward would harm (FP32 masters, or gradients
        # scaled by other than 1): asked at every backward, so a scale that leaves 1 (a checkpoint's) or masters
        # made since are watched from the next backward on; at O0/O1 with a unit scale nothing is noted
        watch = bool(self.masters.weights) or not self.scalers[loss_id]._unit
        for state in self.optimizers.values():
            if state.two_pass and self.masters.weights and (state.stage is _Stage.STEPPED or state.loss_id is None):
                # O2 SAM, its first backward since a step: the user's writes since, taken before first_step perturbs
                take_writes_before_pass(state, self.masters.weights, compare=self.compare_writes)
            if state.stage is _Stage.STEPPED:  # what a step left, unless cleared since (the usual loop: nothing)
                optimizer = state.optimizer_ref()
                groups = optimizer.param_groups if optimizer is not None else ()
                with torch._C.DisableTorchFunction():  # as rescale.present_grads; C-level maps, no Python per param
                    params = tuple(itertools.chain.from_iterable(map(_PARAMS, groups)))
                    kept = any(map(operator.is_not, map(_GRAD, params), itertools.repeat(None)))
                    versions = tuple(map(_VERSION, params)) if watch else None  # engine.raw_steps' marks
                if kept:
                    rescale_stepped(state, loss_id, self.scalers, self.masters.weights, self.backend, self.shared)
                    state.backward_versions, state.noted_at = versions, self.steps_taken
                else:  # rescale_stepped's usual case (every gradient cleared since the step), written out
                    state.reset()
                    state.loss_id = loss_id
                    state.backward_versions = versions  # a raw step before the next backward is told by them
                    state.noted_at = self.steps_taken
            elif state.stage is not _Stage.READY:
                if state.stage is _Stage.UNSCALED:
                    unscale_late(state, self.scalers, self.masters.weights, state.optimizer, self.backend, self.shared)
                    self.record_found(state.found_by_loss)  # an overflow seen by unscale_() counts toward update()
                    # noted again: a write between an unscale (a clip) and this backward is not taken for a raw step at
                    # a later one. Looked at only at O2 (the Apex layer's O1 stash clears gradients itself between
                    # blocks): a torch optimizer stepped after a micro-batch's clip, which leaves the half gradients
                    # scaled, is found as between any accumulated backwards (refused at the step if it stands)
                    _look_for_raw_step(self, state, watch, look=bool(self.masters.weights))
                rescale_unscaled(state, loss_id, self.scalers[loss_id], self.masters.weights, self.backend, self.shared)
            elif state.loss_id is None:
                state.loss_id = loss_id
                optimizer = state.optimizer_ref()
                if optimizer is not None and watch:  # engine.raw_steps' marks, written out (no Python call)
                    with torch._C.DisableTorchFunction():
                        params = itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups))
                        state.backward_versions = tuple(map(_VERSION, params))
                    state.noted_at = self.steps_taken
            else:  # gradients of a backward no step has taken yet: stepped since by an optimizer not prepared?
                # engine.raw_steps, its usual case (accumulation: nothing written since the note) written out: no
                # Python call (_look_for_raw_step's). A note made before an engine step of any optimizer (shared
                # parameters) is void.
                noted = state.backward_versions
                if noted is not None or watch:  # nothing noted and nothing to note: no harm either way
                    optimizer = state.optimizer_ref()
                    groups = optimizer.param_groups if optimizer is not None else ()
                    with torch._C.DisableTorchFunction():
                        versions = tuple(map(_VERSION, itertools.chain.from_iterable(map(_PARAMS, groups))))
                    if noted is not None and versions != noted and state.noted_at == self.steps_taken:
                        _look_for_raw_step(self, state, watch)  # written: judged there (a raw step is refused)
                    else:
                        state.backward_versions = versions if watch else None
                        state.noted_at = self.steps_taken
                if state.loss_id != loss_id or state.grad_scale is not None:
                    rescale_pending(state, loss_id, self.scalers, self.backend, self.shared)
        for ref in self.ddp:  # this backward unsynchronised by DDP (no_sync): a refusal after it waits for the step
            wrapper = ref()
            if wrapper is not None and not synced(wrapper, self.ddp_synced):
                self.unsynced_at = self.steps_taken

    def note_loaded(self, params: Iterable[torch.Tensor], *, written: bool = True) -> None:
        """``params`` are written by a ``load_state_dict`` (its pre-hooks: ``written=False``, a ``strict=False`` one
        lacked them); their versions before it, which its one ``copy_`` each moves by one."""
        steps, loaded = self.steps_taken, self.loaded
        for param in params:
            loaded[id(param)] = (weakref.ref(param), steps, written, param._version)
        if len(loaded) > 2 * self.loaded_kept + 64:  # those let go dropped now and then (amortised over loads)
            self.loaded = {k: noted for k, noted in loaded.items() if noted[0]() is not None}
            self.loaded_kept = len(self.loaded)

    def loaded_since_step(self, param: torch.Tensor, *, written: bool = False) -> bool:
        """Whether a ``load_state_dict`` since the last step wrote ``param`` (or, unless ``written``, lacked it);
        with ``written``, only where nothing wrote it after the load (a raw optimizer's step over loaded weights)."""
        noted = self.loaded.get(id(param))
        if noted is None or noted[0]() is not param or noted[1] != self.steps_taken:
            return False
        return not written or (noted[2] and param._version <= noted[3] + 1)

    def forget_writes(self, *, loaded: bool = False) -> None:
        """Forget the parameter versions noted at the backwards (engine.raw_steps): a stage change of the engine (a
        load, a model prepared, masters refreshed with ``force``, another engine taking over) writes parameters, which
        is no raw step. ``loaded``: a model's load, which notes what it wrote (:meth:`note_loaded`): the backwards'
        notes stay, the load's one write of each parameter left out where they are compared (:func:`_unloaded`), so a
        raw step after it is still told; engine.beside_steps' notes stay too."""
        self.written_at = self.steps_taken  # no hand update for HeldWrites to judge at the next step
        for state in self.optimizers.values():
            if not loaded:
                state.backward_versions = None
            state.kept_writes = []  # a kept write: the user's (engine.kept_writes)
        if self.unheld is not None:
            self.unheld.forget(loaded=loaded)
        if self.frozen_writes is not None:
            self.frozen_writes.forget()

    # -- step and update ----------------------------------------------------------------------------------------
    def update(self) -> None:
        """Close the iteration: reset every optimizer's stage and update the scalers with the flags counted."""
        if self.unheld is not None and self.unheld.scales.pending:  # gradients no optimizer holds yet keep their scale
            self.unheld.scales.carry(self.scalers)
        for state in self.optimizers.values():
            if state.stage is _Stage.UNSCALED:
                self.record_found(state.found_by_loss)
                state.stage = _Stage.SKIPPED
                state.found_by_loss, state.found_inf, state.grad_norm = {}, None, None
            # a step may use the gradients still (at O1 a group added since); nothing to hold at a static scale
            scaler = self.scalers[state.loss_id or 0]
            if state.stage is not _Stage.READY and state.grad_scale is None and scaler.dynamic:
                hold_scale(state, scaler, masters=bool(self.masters.weights))
        for state in self.optimizers.values():
            if (
                state.stage is _Stage.READY
                and state.loss_id is not None
                and state.grad_scale is None
                and state.loss_id in self.iteration_found
            ):
                # Gradients pending across the update keep the scale they were computed with.
                state.grad_scale = self.scalers[state.loss_id].scale_tensor.clone()
        for loss_id, found in self.iteration_found.items():
            self.scalers[loss_id].update(found, overflowed=self.iteration_read.get(loss_id))
        self.iteration_found.clear()
        self.iteration_read.clear()

    def updated_scalers(self) -> list[LossScaler]:
        """The scalers as :meth:`update` would leave them now: each one it would update, a copy updated with the
        flags it would apply (:meth:`~lightning_mpx.scaling.scaler.LossScaler.clone`); the others, themselves.
        Nothing here changes. For a read that may not end the iteration (Fabric's, under a process group) yet shows
        what ending it would: read them, never step with them."""
        found, read = dict(self.iteration_found), dict(self.iteration_read)
        for state in self.optimizers.values():
            if state.stage is _Stage.UNSCALED:  # unscaled, not stepped: update() applies its flags too
                self.record_found(state.found_by_loss, into=(found, read))
        scalers = list(self.scalers)
        for loss_id, flag in found.items():
            scalers[loss_id] = scalers[loss_id].clone()
            scalers[loss_id].update(flag, overflowed=read.get(loss_id))
        return scalers

    def scalers_after_update(self) -> list[dict[str, Any]]:
        """Each scaler's :meth:`~lightning_mpx.scaling.scaler.LossScaler.state_dict` as :meth:`update` would leave it
        now (:meth:`updated_scalers`): for a save that may not end the iteration yet holds what ending it would."""
        return [scaler.state_dict() for scaler in self.updated_scalers()]

    # -- internals ----------------------------------------------------------------------------------------------
    def _unscaled_params(self, optimizer: torch.optim.Optimizer, with_masters: bool) -> list[torch.Tensor]:
        """The tensors whose ``.grad`` holds ``optimizer``'s unscaled gradients (masters at O2), with a gradient."""
        return [p for p in self.master_params(optimizer, with_masters=with_masters, hand=False) if p.grad is not None]


def _release_from_other_engines(optimizer: torch.optim.Optimizer, machine: StepMachine) -> None:
    """Have every other engine that registered ``optimizer`` let go of it (``release``: its hooks off, its state keyed
    by the parameters again) before ``machine`` registers it: a second stage given the first stage's optimizer (a new
    Trainer, a new ``fabric.setup``) would otherwise step it under two engines' hooks, the first refusing the second's
    steps and swapping its own masters in for the state dicts. Found by the hooks the engines put on it."""
    for hook in list(optimizer._optimizer_step_pre_hooks.values()):
        holder = getattr(hook, "__self__", hook)  # MasterHooks' bound method, or a ScaledStepGuard
        owner = getattr(holder, "owner", None) if isinstance(holder, (MasterHooks, ScaledStepGuard)) else None
        other = owner() if owner is not None else None
        if other is not None and other is not machine:
            other.release(optimizer)
            other.taken[id(optimizer)] = weakref.ref(optimizer)  # its error for a later step names the take-over


def refuse_unregistrable(optimizer: object, *, with_masters: bool) -> None:
    """Refuse an ``optimizer`` no engine can register, whatever it holds: not an optimizer, a wrapper that never ran
    ``Optimizer.__init__``, a closure optimizer (LBFGS), and ``with_masters`` (O2) a ``ZeroRedundancyOptimizer``. For
    a front door that checks its arguments before it changes anything (the Apex layer's ``initialize``)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer={type(optimizer).__name__} is not a torch.optim.Optimizer.")
    if not hasattr(optimizer, "_optimizer_step_pre_hooks"):  # a wrapper never calling Optimizer.__init__
        raise TypeError(
            f"optimizer={type(optimizer).__name__} never ran torch.optim.Optimizer.__init__, so it has none of the "
            "step and state-dict hooks lightning_mpx puts on a prepared optimizer: in its __init__, call "
            "torch.optim.Optimizer.__init__(self, inner.param_groups, inner.defaults) before sharing the inner "
            "optimizer's param_groups (a Lookahead wrapper)."
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "optimizer=LBFGS re-evaluates the loss through a closure several times per step, which loss scaling "
            "and step skipping cannot support; use opt_level='O0', or a first-order optimizer."
        )
    if with_masters:
        for inner in (optimizer, *shared_inners(optimizer)):  # a Lookahead's base optimizer steps the masters too
            _refuse_zero_redundancy(inner, optimizer)


def shared_inners(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers among ``optimizer``'s attributes (and theirs, in turn) that share its ``param_groups``: the same
    list, or one of the same group dicts (an inner optimizer made on the wrapper's groups), and ran
    ``Optimizer.__init__`` (the hooks need its tables). A SAM-style optimizer's ``base_optimizer`` is its inner one
    even when their groups came apart (a SAM without davda54's ``load_state_dict`` override, loaded: torch's load
    gives the SAM new group dicts and leaves the base optimizer on the old ones; the step then gives those the
    masters too, ``masters.swap``)."""
    found: list[torch.optim.Optimizer] = []
    seen = {id(optimizer)}
    todo = [optimizer]
    while todo:
        outer = todo.pop()
        groups = outer.param_groups
        ids = set(map(id, groups))
        for name, value in list(vars(outer).items()):
            if (
                isinstance(value, torch.optim.Optimizer)
                and id(value) not in seen
                and hasattr(value, "_optimizer_state_dict_pre_hooks")
                and (
                    value.param_groups is groups
                    or not ids.isdisjoint(map(id, value.param_groups))
                    or (name == "base_optimizer" and is_two_pass(outer))
                )
            ):
                seen.add(id(value))
                found.append(value)
                todo.append(value)
    return found


def _refuse_registered_inner(optimizer: torch.optim.Optimizer, states: Sequence[_OptimizerState] | object) -> None:
    """Refuse registering ``optimizer`` beside a registered optimizer that shares its groups as a wrapper's inner one
    (a Lookahead made around an optimizer prepared before, or the inner one prepared after its wrapper): the wrapper's
    step steps the inner one, whose own hooks took that for a direct step outside the engine's (an error naming a
    cause the user did not have). Registration only, with a walk of the attributes of each."""
    for state in states:  # type: ignore[attr-defined]
        other = state.optimizer_ref()
        if other is None or other is optimizer:
            continue
        if any(inner is other for inner in shared_inners(optimizer)):
            wrapper, inner = optimizer, other
        elif any(inner is optimizer for inner in shared_inners(other)):
            wrapper, inner = other, optimizer
        else:
            continue
        raise ValueError(
            f"optimizer={type(optimizer).__name__}: the wrapper {type(wrapper).__name__} and the optimizer it wraps "
            f"({type(inner).__name__}, sharing its param_groups) cannot both be registered; register the wrapper only "
            "(its step() steps the inner optimizer, on the FP32 masters at O2): build it around an optimizer not "
            "prepared yet, or call release_optimizer() on the inner one first, then prepare_optimizer(), "
            "accelerator.prepare(), fabric.setup() or configure_optimizers() with the wrapper alone."
        )


def _adopt_later(
    machine_ref: weakref.ref[StepMachine], state: _OptimizerState, optimizer: torch.optim.Optimizer
) -> None:
    # the state is passed by its caller (masters.pairs.param_pairs), not held by the partial
    machine = machine_ref()
    if machine is not None and state.optimizer_ref() is optimizer:
        machine.adopt_inners(state, optimizer)


def _refuse_zero_redundancy(optimizer: torch.optim.Optimizer, outer: torch.optim.Optimizer) -> None:
    """Refuse ``torch.distributed.optim.ZeroRedundancyOptimizer`` (``optimizer``, ``outer`` or an inner one of
    ``outer``) with master weights: the engine puts the FP32 masters
    in the wrapper's groups for the step, but ZeRO steps its local optimizer, built on its own groups over the half
    parameters of its shard (which hold no gradient then), and broadcasts those: no weight would ever change."""
    import sys

    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")  # not imported: not one
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        name = "" if outer is optimizer else f"{type(outer).__name__}, a wrapper of a "
        raise ValueError(
            f"optimizer={name}ZeroRedundancyOptimizer cannot step FP32 master weights (opt_level O2): its local "
            "optimizer steps its shard of the model's half parameters and broadcasts them, never the masters, so the "
            "weights would not train. Use O1 with ZeroRedundancyOptimizer (the model stays FP32; it shards the "
            "optimizer state), a plain optimizer at O2 under DDP, or FSDP (lightning_mpx.fsdp) to shard state with "
            "masters."
        )


def _look_for_raw_step(machine: StepMachine, state: _OptimizerState, watch: bool, *, look: bool = True) -> None:
    """At a backward, for ``state``'s gradients of a backward no step has taken yet (pending, or unscaled by a clip
    since): stepped since by an optimizer not prepared? engine.raw_steps, its usual case (accumulation: nothing written
    since the note) written out: no Python call. A note made before an engine step of any optimizer (shared
    parameters) is void. The versions are noted again (only that, without ``look``), so that a write before this
    backward (a clamp between accumulated backwards) is not taken for a raw step at a later one."""
    noted = state.backward_versions
    if noted is None and not watch:  # nothing noted and nothing to note: no harm either way
        return
    optimizer = state.optimizer_ref()
    groups = optimizer.param_groups if optimizer is not None else ()
    with torch._C.DisableTorchFunction():
        versions = tuple(map(_VERSION, itertools.chain.from_iterable(map(_PARAMS, groups))))
    if look and noted is not None and versions != noted and state.noted_at == machine.steps_taken and machine.loaded:
        noted = state.backward_versions = _unloaded(machine, groups, versions, noted)  # a load's write: no raw step
    if look and noted is not None and versions != noted and state.noted_at == machine.steps_taken:
        harmful = bool(machine.masters.weights) or not machine.scalers[state.loss_id or 0]._unit
        refused = refuse_raw_step(
            state,
            machine.masters.weights,
            machine.names,
            harmful=harmful,
            steps_taken=machine.steps_taken,
            renormed=machine.renormed,
            defer=machine.unsynced_at == machine.steps_taken,
        )
        if refused is not None and machine.refused is None:
            machine.refused = refused  # engine.unsynced: raised at the next step, on every rank
    state.backward_versions = versions if watch else None
    state.noted_at = machine.steps_taken


def _unloaded(
    machine: StepMachine, groups: Sequence[dict[str, Any]], versions: tuple[int, ...], noted: tuple[int, ...]
) -> tuple[int, ...]:
    """``noted`` (the versions at the last backward) with each parameter that a ``load_state_dict`` since the last
    step wrote, and nothing after it, taken as noted now: the load's one ``copy_`` is no raw step, a write after it
    (a raw optimizer stepped over the loaded weights) is still told. Asked only where versions changed."""
    params = list(itertools.chain.from_iterable(map(_PARAMS, groups)))
    if len(params) != len(noted):
        return noted
    return tuple(
        now if now != then and machine.loaded_since_step(p, written=True) else then
        for p, now, then in zip(params, versions, noted)
    )
