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

import itertools
import operator
import weakref
from typing import Any, Sequence

import torch

from lightning_mpx.engine.clipping import show_unscaled
from lightning_mpx.engine.grad_checks import reduce_checks, unscale
from lightning_mpx.engine.optimizer_state import _OptimizerState, _Stage, optimizer_params
from lightning_mpx.engine.rescale import (
    follow_cleared_grads,
    grad_marks,
    hold_scale,
    leftovers,
    rescale_pending,
    rescale_stepped,
    rescale_unscaled,
    resume_stepped,
)
from lightning_mpx.engine.sharding import Sharding
from lightning_mpx.engine.step_guard import ScaledStepGuard
from lightning_mpx.health.telemetry import GradTelemetry
from lightning_mpx.masters.handover import refuse_handed
from lightning_mpx.masters.optimizer_hooks import MasterHooks
from lightning_mpx.masters.pairs import param_pairs
from lightning_mpx.masters.store import Masters
from lightning_mpx.masters.swap import mirrors, state_to_params
from lightning_mpx.masters.weights import Mirror
from lightning_mpx.scaling.scaler import LossScaler

_PARAMS = operator.itemgetter("params")
_GRAD = operator.attrgetter("grad")


class StepMachine:
    """The prepared optimizers of one engine and their stages.

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
        self.taken: dict[int, weakref.ref[torch.optim.Optimizer]] = {}  # optimizers another engine took over
        self.iteration_found: dict[int, torch.Tensor] = {}
        self.iteration_read: dict[int, bool | None] = {}
        self.grad_norms: dict[int, torch.Tensor] = {}
        self.sharding: Sharding | None = None
        # What the error for an optimizer not registered tells the user to do: the front door's own call where it
        # registers optimizers itself (Amp.register_call).
        self.register_call = "call prepare_optimizer() on it first"

    @property
    def register_call(self) -> str:
        return self._register_call

    @register_call.setter
    def register_call(self, value: str) -> None:
        if not isinstance(value, str) or not value:
            raise TypeError(f"register_call={value!r} must be a non-empty str (the words that end the error).")
        self._register_call = value

    # -- registration -------------------------------------------------------------------------------------------
    def state(self, optimizer: torch.optim.Optimizer) -> _OptimizerState:
        state = self.optimizers.get(id(optimizer))
        if state is None:
            taken = self.taken.get(id(optimizer))
            if taken is not None and taken() is optimizer:
                raise RuntimeError(
                    f"optimizer={type(optimizer).__name__} was taken over by another engine that registered it since "
                    "(a later stage's prepare_optimizer(), Trainer or fabric.setup()): an optimizer is stepped by one "
                    "engine at a time. Step it through that engine; to step it through this one again, prepare its "
                    f"model with this one again, then {self.register_call} (that takes both back). Two engines "
                    "training at once need an optimizer each."
                )
            raise RuntimeError(
                f"optimizer={type(optimizer).__name__} was not registered; {self.register_call}."
            )
        return state

    def validate(self, optimizer: torch.optim.Optimizer, *, with_masters: bool) -> None:
        """Refuse what cannot be registered: not an optimizer, a closure optimizer (LBFGS), ``with_masters`` an
        optimizer before any model was prepared for training, and under FSDP one holding gathered parameters."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer={type(optimizer).__name__} is not a torch.optim.Optimizer.")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                "optimizer=LBFGS re-evaluates the loss through a closure several times per step, which loss scaling "
                "and step skipping cannot support; use opt_level='O0', or a first-order optimizer."
            )
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
        _release_from_other_engines(optimizer, self)  # one engine owns an optimizer: a later stage's takes it over
        self.taken.pop(key, None)
        state = _OptimizerState(weakref.ref(optimizer))
        if with_masters:
            # Refuses half parameters of unprepared models; makes missing masters; state made before preparing
            # moves to them.
            param_pairs(state, self.masters.weights)
            state.hooks = MasterHooks(state, self.masters, owner=weakref.ref(self)).register(optimizer)
        else:  # a direct step with scaled gradients is refused (masters' hooks refuse any direct step)
            guard = ScaledStepGuard(state, self.scalers, owner=weakref.ref(self))
            state.hooks = [optimizer.register_step_pre_hook(guard)]
        self.optimizers[key] = state
        weakref.finalize(optimizer, self.optimizers.pop, key, None)

    def release(self, optimizer: torch.optim.Optimizer) -> None:
        """Forget ``optimizer``, remove the hooks put on it and key its state by its own parameters again."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer={type(optimizer).__name__} is not a torch.optim.Optimizer.")
        state = self.optimizers.pop(id(optimizer), None)
        if state is not None:
            for handle in state.hooks:
                handle.remove()
            state_to_params(state, self.masters.weights)  # its state dict works without the hooks

    def master_params(self, optimizer: torch.optim.Optimizer, *, with_masters: bool) -> list[torch.Tensor]:
        """The tensors ``optimizer`` updates (its masters ``with_masters``, its parameters otherwise)."""
        state = self.state(optimizer)
        if not with_masters:
            return list(optimizer_params(optimizer))
        pairs = param_pairs(state, self.masters.weights)
        for weights in self.masters.weights:
            if weights.handed:  # a second stage took masters of this engine's: they are not this engine's to give
                refuse_handed(self.masters.weights, [param for param, _ in pairs])
        return [master for _, master in pairs]

    def mirrors(self, state: _OptimizerState, *, compare: bool) -> list[Mirror]:
        """The optimizer's half parameters and their masters, one :class:`Mirror` per prepared model."""
        return mirrors(state, self.masters.weights, compare=compare)

    def found_inf(self, optimizer: torch.optim.Optimizer, loss_id: int | None) -> torch.Tensor | None:
        """The overflow flag of ``optimizer``'s checks since its last step: all losses together, or ``loss_id``'s."""
        state = self.state(optimizer)
        return state.found_inf if loss_id is None else state.found_by_loss.get(loss_id)

    def overflowed(self, optimizer: torch.optim.Optimizer) -> bool:
        """:meth:`Amp.overflowed <lightning_mpx.engine.amp.Amp.overflowed>`."""
        state = self.state(optimizer)
        flags = state.found_by_loss
        flag = next(iter(flags.values())) if len(flags) == 1 else state.found_inf  # the one _read_flags reads
        if flag is None:
            return False
        memo = state.flag_read
        if memo is None or memo[0] is not flag:
            memo = state.flag_read = (flag, bool(flag.item() > 0))
        return memo[1]

    def share_overflow(self, optimizers: Sequence[torch.optim.Optimizer], loss_id: int) -> None:
        """:meth:`Amp.share_overflow <lightning_mpx.engine.amp.Amp.share_overflow>`."""
        if isinstance(optimizers, torch.optim.Optimizer) or not isinstance(optimizers, (list, tuple)):
            raise TypeError(
                f"optimizers={type(optimizers).__name__} must be a list or tuple of prepared optimizers; for one, "
                "pass [optimizer]."
            )
        for optimizer in optimizers:
            state = self.state(optimizer)
            seen = state.found_by_loss.get(loss_id)
            like = seen if seen is not None else state.found_inf
            device = None if like is None else like.device
            state.found_by_loss[loss_id] = torch.ones((), dtype=torch.float32, device=device)
            state.shared_overflow = True
            state.found_inf = torch.stack([f.reshape(()) for f in state.found_by_loss.values()]).amax()

    # -- backward -----------------------------------------------------------------------------------------------
    def before_backward(self, loss_id: int) -> None:
        """Make every optimizer's gradients carry ``loss_id``'s scale before its backward (see
        :meth:`Amp.scale_loss <lightning_mpx.engine.amp.Amp.scale_loss>`)."""
        for state in self.optimizers.values():
            if state.stage is _Stage.STEPPED:  # what a step left, unless cleared since (the usual loop: nothing)
                optimizer = state.optimizer_ref()
                groups = optimizer.param_groups if optimizer is not None else ()
                with torch._C.DisableTorchFunction():  # as rescale.present_grads; C-level maps, no Python per param
                    params = itertools.chain.from_iterable(map(_PARAMS, groups))
                    kept = any(map(operator.is_not, map(_GRAD, params), itertools.repeat(None)))
                if kept:
                    rescale_stepped(state, loss_id, self.scalers, self.masters.weights, self.backend)
                else:  # rescale_stepped's usual case (every gradient cleared since the step), written out
                    state.reset()
                    state.loss_id = loss_id
            elif state.stage is not _Stage.READY:
                if state.stage is _Stage.UNSCALED:
                    self.record_found(state.found_by_loss)  # an overflow seen by unscale_() counts toward update()
                rescale_unscaled(state, loss_id, self.scalers[loss_id], self.masters.weights, self.backend)
            elif state.loss_id is None:
                state.loss_id = loss_id
            elif state.loss_id != loss_id or state.grad_scale is not None:
                rescale_pending(state, loss_id, self.scalers, self.backend)

    # -- unscale and clip ---------------------------------------------------------------------------------------
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """:meth:`Amp.unscale_ <lightning_mpx.engine.amp.Amp.unscale_>`."""
        state = self.optimizers.get(id(optimizer)) or self.state(optimizer)  # state() raises for an unknown one
        if state.stage is _Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since its last step() or update() (directly or "
                "through clip_grad_norm_()/clip_grad_value_()); call step() (or update()) before unscaling again."
            )
        self._unscale(state, optimizer=optimizer)
        if self.masters.weights:
            # As after torch.amp.GradScaler.unscale_(): the model's own gradients hold the true values (a half copy;
            # the FP32 ones the step uses stay in the masters), so code that clips or inspects them works. A write
            # to them before the step is taken into the masters.
            show_unscaled(self, optimizer, fresh=True)

    # -- step and update ----------------------------------------------------------------------------------------
    def check(self, state: _OptimizerState, optimizer: torch.optim.Optimizer, reducer: Any) -> list[int]:
        """Unscale the gradients of ``optimizer`` (the optimizer of ``state``) unless done (the local ones, or each
        rank's shards), reduce its flags once across ranks (``reducer`` when set; under FSDP one collective with the
        squared norm), count them toward the next update and read them on the host; returns the losses that
        overflowed.

        An unscale made here is followed by the step at once, with no user code in between, so the half gradients
        it read are noted (for a later unscale, clip or backward to see what the user cleared since) only if the step
        does not finish: :meth:`keep_marks`, called here and by ``Amp.step`` when an error leaves the step."""
        self._unscaled_for_step(state, optimizer)
        try:
            return self._read_flags(state, reducer)
        except BaseException:
            self.keep_marks(state)
            raise

    def check_on_device(
        self, state: _OptimizerState, optimizer: torch.optim.Optimizer, reducer: Any
    ) -> tuple[list[int], torch.Tensor]:
        """:meth:`check` without the host read: unscale unless done, reduce the flags with ``reducer`` (when set)
        and count them toward the next update on the device. Returns the losses whose gradients the optimizer holds
        and their flags (FP32, 1.0 on overflow: one per loss, or the one loss's own 0-d flag), for
        a step that skips on the device."""
        if state.stage is _Stage.READY:  # _unscale's usual case (a backward since the step), written out
            unscale(state, optimizer, self.scalers[state.loss_id or 0], self.masters.weights, backend=self.backend,
                    refuse_sparse=self.refuse_sparse, telemetry=self.telemetry, names=self.names,
                    sharding=self.sharding)  # fmt: skip
        elif state.stage is not _Stage.UNSCALED or self.masters.weights:  # unscaled by a clip: nothing to do at O1
            self._unscaled_for_step(state, optimizer)
        try:
            if self.sharding is not None:  # the step's collective (unless a clip made it): every rank's flags agree
                if not state.flags_reduced:
                    reduce_checks(state, self.sharding, None, [], None)
                reducer = None
            loss_ids = sorted(state.found_by_loss)
            if len(loss_ids) == 1 and reducer is None:  # the usual case: the one flag as it is, no kernel
                flags = state.found_by_loss[loss_ids[0]]
                if loss_ids[0] in self.iteration_found:  # unread: the update counts on the device
                    self.record_found({loss_ids[0]: flags})
                else:  # record_found's usual case (the first flag of the iteration), written out
                    self.iteration_found[loss_ids[0]], self.iteration_read[loss_ids[0]] = flags, None
                return loss_ids, flags
            flags = torch.stack([state.found_by_loss[i].reshape(()) for i in loss_ids])
            if reducer is not None:
                reducer(flags)
            self.record_found(dict(zip(loss_ids, flags.unbind(0))))
            return loss_ids, flags
        except BaseException:
            self.keep_marks(state)
            raise

    def _unscaled_for_step(self, state: _OptimizerState, optimizer: torch.optim.Optimizer) -> None:
        """The gradients unscaled for the step that follows at once (unscaled now without noting the half gradients
        read, see :meth:`check`; or, unscaled before, with the user's clears since taken)."""
        if state.stage is not _Stage.UNSCALED:
            self._unscale(state, marks=False, optimizer=optimizer)
        elif self.masters.weights:
            follow_cleared_grads(state, self.masters.weights, optimizer)

    def keep_marks(self, state: _OptimizerState) -> None:
        """Note the half gradients an unscale read, when :meth:`check` unscaled without noting them and its step did
        not finish (an error): the calls after it then treat the gradients as any unscale leaves them."""
        if self.masters.weights and state.stage is _Stage.UNSCALED and not state.unscaled_marks:
            state.unscaled_marks = grad_marks(state, self.masters.weights)

    def _read_flags(self, state: _OptimizerState, reducer: Any) -> list[int]:
        """Reduce the state's flags with ``reducer`` (when set), count them toward the next update and read them on
        the host; returns the losses that overflowed."""
        if self.sharding is not None:  # the step's collective, unless a clip made it already
            if not state.flags_reduced:
                reduce_checks(state, self.sharding, None, [], None)
            reducer = None
        loss_ids = sorted(state.found_by_loss)
        if len(loss_ids) == 1 and reducer is None:  # the usual case: one loss, one process's flag, read as it is
            (loss_id,) = loss_ids
            found = state.found_by_loss[loss_id]
            memo = state.flag_read  # read already by overflowed(): the same flag, not written since
            overflowed = memo[1] if memo is not None and memo[0] is found else found.item() > 0
            self.record_found({loss_id: found}, read={loss_id: overflowed})
            return [loss_id] if overflowed else []
        # One tensor for the reduction across processes and one host read; all ranks then agree loss by loss.
        flags = (
            state.found_by_loss[loss_ids[0]].reshape(1)  # one loss, the usual case: a view, no kernel
            if len(loss_ids) == 1
            else torch.stack([state.found_by_loss[i].reshape(()) for i in loss_ids])
        )
        if reducer is not None:
            state.flag_read = None  # the reduction writes the flags in place
            reducer(flags)
        read = {i: flag > 0 for i, flag in zip(loss_ids, flags.tolist())}
        self.record_found(dict(zip(loss_ids, flags.unbind(0))), read=read)
        return [i for i in loss_ids if read[i]]

    def update(self) -> None:
        """Close the iteration: reset every optimizer's stage and update the scalers with the flags counted."""
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

    def record_found(self, found_by_loss: dict[int, torch.Tensor], read: dict[int, bool] | None = None) -> None:
        """Add overflow flags to the ones the next :meth:`update` applies, loss by loss; ``read``: what the host read
        of each of them said (the step reads them), so that the update need not look again."""
        for loss_id, found in found_by_loss.items():
            seen = self.iteration_found.get(loss_id)
            self.iteration_found[loss_id] = found if seen is None else torch.maximum(seen, found)
            known = None if read is None else read.get(loss_id)
            if seen is None:
                self.iteration_read[loss_id] = known
            elif known is None or self.iteration_read.get(loss_id) is None:
                self.iteration_read[loss_id] = None  # one flag of the iteration was not read: the device counts
            else:
                self.iteration_read[loss_id] = bool(self.iteration_read[loss_id]) or known

    # -- internals ----------------------------------------------------------------------------------------------
    def _unscaled_params(self, optimizer: torch.optim.Optimizer, with_masters: bool) -> list[torch.Tensor]:
        """The tensors whose ``.grad`` holds ``optimizer``'s unscaled gradients (masters at O2), with a gradient."""
        return [p for p in self.master_params(optimizer, with_masters=with_masters) if p.grad is not None]

    def refuse_sparse(self, param: torch.Tensor) -> None:
        name = self.names.get(id(param), "an unnamed parameter")
        raise ValueError(
            f"parameter {name} has a sparse gradient, which lightning_mpx cannot unscale or check for overflow; "
            "it needs dense gradients (for example nn.Embedding(..., sparse=False), the default)."
        )

    def _unscale(
        self,
        state: _OptimizerState,
        max_norm: float | None = None,
        *,
        marks: bool = True,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        """Unscale the optimizer's gradients (:func:`~lightning_mpx.engine.grad_checks.unscale`); ``marks``: at O2,
        note which half gradients were read, for the user code that may run before the step
        (:func:`~lightning_mpx.engine.rescale.follow_cleared_grads`); a step that unscales for itself notes them only
        if it does not finish (:meth:`keep_marks`)."""
        weights = self.masters.weights
        optimizer = state.optimizer if optimizer is None else optimizer
        for held in weights if marks else ():  # unscale_() or a clip; a step's own unscale is refused by its Mirror
            if held.handed:
                refuse_handed(weights, [p for group in optimizer.param_groups for p in group["params"]])
        if state.stage is _Stage.STEPPED:  # no backward since a step: what it left, taken again
            resume_stepped(state, self.scalers, weights, optimizer, self.backend)
        skipped = state.stage is _Stage.SKIPPED
        unscale(
            state,
            optimizer,
            self.scalers[state.loss_id or 0],
            weights,
            backend=self.backend,
            refuse_sparse=self.refuse_sparse,
            telemetry=self.telemetry,
            names=self.names,
            max_norm=max_norm,
            sharding=self.sharding,
            true_grads=[true for true, _ in leftovers(state, weights, optimizer)] if skipped else None,
        )
        if weights and not skipped and marks:
            state.unscaled_marks = grad_marks(state, weights, optimizer)


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
