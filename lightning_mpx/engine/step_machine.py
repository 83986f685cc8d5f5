"""The per-optimizer step machine of one engine: the prepared optimizers and where each is in its iteration, the
overflow flags the next update applies, and the gradient norms not yet reported.

In the spirit of ``torch.amp.GradScaler``: each optimizer's :class:`~lightning_mpx.engine.stages._Stage` moves READY ->
UNSCALED on an unscale (or a clip) and back after its step, and :meth:`StepMachine.update` resets them all. The
losses' scalers are the engine's; the masters are :class:`~lightning_mpx.masters.store.Masters`'. What happens on an
overflow (the record, the log, the floor) is the engine's: :meth:`StepMachine.check` only says which losses
overflowed.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch

from lightning_mpx.engine.leftovers import (
    follow_cleared_grads,
    grad_marks,
    local_squares,
    reduce_checks,
    rescale_pending,
    rescale_unscaled,
    unscale_state,
)
from lightning_mpx.masters.swap import drop_master_grads, mirrors, param_pairs, swap_in, swap_out
from lightning_mpx.common.dtypes import HALF_DTYPES
from lightning_mpx.masters.store import Masters
from lightning_mpx.engine.sharding import Sharding, local_tensor
from lightning_mpx.engine.stages import _OptimizerState, _Stage, optimizer_params
from lightning_mpx.scaling.scaler import LossScaler
from lightning_mpx.masters.weights import Mirror
from lightning_mpx.health.telemetry import GradTelemetry


class StepMachine:
    """The prepared optimizers of one engine and their stages.

    Args:
        scalers: The engine's loss scalers, one per loss (read, and updated by :meth:`update`).
        masters: The engine's FP32 masters.
        backend: The unscale backend (``unscale_backend``).
        telemetry: The engine's gradient telemetry (measured in the unscale when requested).
        names: Parameter names by ``id``, for errors and telemetry.

    Attributes:
        optimizers: One :class:`~lightning_mpx.engine.stages._OptimizerState` per prepared optimizer, by ``id``.
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
        self.iteration_found: dict[int, torch.Tensor] = {}
        self.iteration_read: dict[int, bool | None] = {}
        self.grad_norms: dict[int, torch.Tensor] = {}
        self.sharding: Sharding | None = None
        # What the error for an optimizer not registered tells the user to do: the front door's own call where it
        # registers optimizers itself (Amp.register_call).
        self.register_call = "call prepare_optimizer() on it first"

    # -- registration -------------------------------------------------------------------------------------------
    def state(self, optimizer: torch.optim.Optimizer) -> _OptimizerState:
        state = self.optimizers.get(id(optimizer))
        if state is None:
            raise RuntimeError(
                f"optimizer={type(optimizer).__name__} was not registered; {self.register_call}."
            )
        return state

    def validate(self, optimizer: torch.optim.Optimizer, *, with_masters: bool) -> None:
        """Refuse what cannot be registered: not an optimizer, a closure optimizer (LBFGS), or, ``with_masters``,
        an optimizer before any model was prepared for training."""
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
                "a model prepared with train=False has no masters for an optimizer to train."
            )

    def register(self, optimizer: torch.optim.Optimizer, *, with_masters: bool) -> None:
        """Track ``optimizer`` (once); ``with_masters``: its half parameters get their masters, optimizer state
        made before moves to them, and hooks put the masters in its groups for its state dicts."""
        key = id(optimizer)
        if key in self.optimizers:
            return  # registered before (a framework preparing it twice)
        state = _OptimizerState(weakref.ref(optimizer))
        if with_masters:
            # Refuses half parameters of unprepared models; makes missing masters; state made before preparing
            # moves to them.
            param_pairs(state, self.masters.weights)
            state.hooks = [
                optimizer.register_step_pre_hook(self._refuse_direct_step),
                optimizer.register_state_dict_pre_hook(self._masters_in_hook),
                optimizer.register_state_dict_post_hook(self._masters_out_hook),
                optimizer.register_load_state_dict_pre_hook(self._masters_in_to_load_hook),
                optimizer.register_load_state_dict_post_hook(self._masters_out_hook),
            ]
        self.optimizers[key] = state
        weakref.finalize(optimizer, self.optimizers.pop, key, None)

    def release(self, optimizer: torch.optim.Optimizer) -> None:
        """Forget ``optimizer`` and remove the hooks put on it."""
        state = self.optimizers.pop(id(optimizer), None)
        if state is not None:
            for handle in state.hooks:
                handle.remove()

    def master_params(self, optimizer: torch.optim.Optimizer, *, with_masters: bool) -> list[torch.Tensor]:
        """The tensors ``optimizer`` updates (its masters ``with_masters``, its parameters otherwise)."""
        state = self.state(optimizer)
        if not with_masters:
            return list(optimizer_params(optimizer))
        return [master for _, master in param_pairs(state, self.masters.weights)]

    def mirrors(self, state: _OptimizerState, *, compare: bool) -> list[Mirror]:
        """The optimizer's half parameters and their masters, one :class:`Mirror` per prepared model."""
        return mirrors(state, self.masters.weights, compare=compare)

    def _masters_in_hook(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        swap_in(self.state(optimizer), self.masters.weights, recheck=True)

    def _masters_in_to_load_hook(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """Before the optimizer loads a state dict: a half parameter without a master (frozen when the masters were
        made, and frozen again in this run) whose state the checkpoint holds trained in the run that saved it, so
        it gets its master now, and the state loads into the master in FP32 (into the half parameter it would be
        rounded to half). ``Amp.load_state_dict`` then gives the master its saved value."""
        state = self.state(optimizer)
        saved = state_dict.get("state", {})
        saved_groups = state_dict.get("param_groups", [])
        if saved and len(saved_groups) == len(optimizer.param_groups):
            made = False
            for group, saved_group in zip(optimizer.param_groups, saved_groups):
                for param, index in zip(group["params"], saved_group.get("params", ())):
                    if index in saved and param.dtype in HALF_DTYPES:
                        for masters in self.masters.weights:
                            if masters.covers(param) and masters.master_of(param) is param:
                                masters.master_of(param, create=True)
                                made = True
            if made:
                state.pairs_key = None  # pair them with their new masters
                state.mirrors = None
        swap_in(state, self.masters.weights, recheck=True)

    def _masters_out_hook(self, optimizer: torch.optim.Optimizer, *args: Any) -> Any:
        swap_out(self.state(optimizer))
        return args[0] if args else None  # the state_dict post-hook returns the state dict

    def _refuse_direct_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.state(optimizer).swapped is None:
            raise RuntimeError(
                "optimizer.step() was called on an optimizer prepared by lightning_mpx with FP32 master weights, "
                "outside Amp.step(): its groups hold the half model parameters and their gradients are still "
                "scaled. Call amp.step(optimizer) instead (the Lightning plugin and the Accelerate adapter do)."
            )

    # -- backward -----------------------------------------------------------------------------------------------
    def before_backward(self, loss_id: int) -> None:
        """Make every optimizer's gradients carry ``loss_id``'s scale before its backward (see
        :meth:`Amp.scale_loss <lightning_mpx.engine.amp.Amp.scale_loss>`)."""
        for state in self.optimizers.values():
            if state.stage is not _Stage.READY:
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
        state = self.state(optimizer)
        if state.stage is _Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since its last step() or update() (directly or "
                "through clip_grad_norm_()/clip_grad_value_()); call step() (or update()) before unscaling again."
            )
        self._unscale(state)
        if self.masters.weights:
            # As after torch.amp.GradScaler.unscale_(): the model's own gradients hold the true values (a half copy;
            # the FP32 ones the step uses stay in the masters), so code that clips or inspects them works. A write
            # to them before the step is taken into the masters.
            self.show_unscaled_on_model(optimizer)

    def clip_grad_norm_(self, optimizer: torch.optim.Optimizer, max_norm: float, *, with_masters: bool) -> torch.Tensor:
        """:meth:`Amp.clip_grad_norm_ <lightning_mpx.engine.amp.Amp.clip_grad_norm_>`."""
        state = self.state(optimizer)
        if state.stage is not _Stage.UNSCALED:
            self._unscale(state, max_norm=float(max_norm))
        else:
            if self.masters.weights:
                # The model's gradients, written since the unscale, are clipped.
                follow_cleared_grads(state, self.masters.weights)
            params = self._unscaled_params(optimizer, with_masters)
            if self.sharding is not None:  # the global norm: this rank's squares, summed with the flags
                device = state.found_inf.device if state.found_inf is not None else torch.device("cpu")
                squares = local_squares(self.sharding, params, device)
                grads = [p.grad for p in params if p.grad is not None]
                state.grad_norm = reduce_checks(state, self.sharding, squares, grads, float(max_norm))
            else:
                state.grad_norm = _clip_unscaled(params, float(max_norm))
        assert state.grad_norm is not None
        self.grad_norms[state.loss_id or 0] = state.grad_norm
        return state.grad_norm

    def clip_grad_value_(self, optimizer: torch.optim.Optimizer, clip_value: float, *, with_masters: bool) -> None:
        """:meth:`Amp.clip_grad_value_ <lightning_mpx.engine.amp.Amp.clip_grad_value_>`."""
        state = self.state(optimizer)
        if state.stage is not _Stage.UNSCALED:
            self._unscale(state)
        elif self.masters.weights:
            follow_cleared_grads(state, self.masters.weights)  # as in clip_grad_norm_
        params = self._unscaled_params(optimizer, with_masters)
        if self.sharding is not None:  # elementwise: each rank clamps its own shards
            for param in params:
                local_tensor(param.grad).clamp_(-clip_value, clip_value)  # type: ignore[arg-type]
        elif params:  # torch's clip refuses an empty list
            torch.nn.utils.clip_grad_value_(params, clip_value)

    def show_unscaled_on_model(self, optimizer: torch.optim.Optimizer) -> None:
        """:meth:`Amp.show_unscaled_on_model <lightning_mpx.engine.amp.Amp.show_unscaled_on_model>`."""
        state = self.state(optimizer)
        master_weights = self.masters.weights
        if not master_weights or state.stage is not _Stage.UNSCALED:
            return
        follow_cleared_grads(state, master_weights)
        for param, master in param_pairs(state, master_weights):
            if master is not param and master.grad is not None:
                if param.grad is None:
                    param.grad = master.grad.to(param.dtype)
                else:
                    param.grad.copy_(master.grad)
        state.unscaled_marks = grad_marks(state, master_weights)  # the copies are ours, not the user's writes

    # -- step and update ----------------------------------------------------------------------------------------
    def check(
        self, optimizer: torch.optim.Optimizer, reducer: Any
    ) -> tuple[_OptimizerState, list[int]]:
        """Unscale ``optimizer``'s gradients unless done, reduce its flags with ``reducer`` (when set), count them
        toward the next update and read them on the host; returns its state and the losses that overflowed.

        An unscale made here is followed by the step at once, with no user code in between, so the half gradients
        it read are noted (for a later unscale, clip or backward to see what the user cleared since) only if the step
        does not finish: :meth:`keep_marks`, called here and by ``Amp.step`` when an error leaves the step."""
        state = self._unscaled_for_step(optimizer)
        try:
            return state, self._read_flags(state, reducer)
        except BaseException:
            self.keep_marks(state)
            raise

    def check_on_device(
        self, optimizer: torch.optim.Optimizer, reducer: Any
    ) -> tuple[_OptimizerState, list[int], torch.Tensor]:
        """:meth:`check` without the host read: unscale unless done, reduce the flags with ``reducer`` (when set)
        and count them toward the next update on the device. Returns the state, the losses whose gradients the
        optimizer holds and their flags (FP32, 1.0 on overflow: one per loss, or the one loss's own 0-d flag), for
        a step that skips on the device."""
        state = self._unscaled_for_step(optimizer)
        try:
            loss_ids = sorted(state.found_by_loss)
            if len(loss_ids) == 1 and reducer is None:  # the usual case: the one flag as it is, no kernel
                flags = state.found_by_loss[loss_ids[0]]
                self.record_found({loss_ids[0]: flags})  # unread: the update counts on the device
                return state, loss_ids, flags
            flags = torch.stack([state.found_by_loss[i].reshape(()) for i in loss_ids])
            if reducer is not None:
                reducer(flags)
            self.record_found(dict(zip(loss_ids, flags.unbind(0))))
            return state, loss_ids, flags
        except BaseException:
            self.keep_marks(state)
            raise

    def _unscaled_for_step(self, optimizer: torch.optim.Optimizer) -> _OptimizerState:
        """``optimizer``'s state with its gradients unscaled for the step that follows at once (unscaled now without
        noting the half gradients read, see :meth:`check`; or, unscaled before, with the user's clears since taken)."""
        state = self.state(optimizer)
        if state.stage is not _Stage.UNSCALED:
            self._unscale(state, marks=False)
        elif self.masters.weights:
            follow_cleared_grads(state, self.masters.weights)
        return state

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
            overflowed = found.item() > 0
            self.record_found({loss_id: found}, read={loss_id: overflowed})
            return [loss_id] if overflowed else []
        # One tensor for the reduction across processes and one host read; all ranks then agree loss by loss.
        flags = (
            state.found_by_loss[loss_ids[0]].reshape(1)  # one loss, the usual case: a view, no kernel
            if len(loss_ids) == 1
            else torch.stack([state.found_by_loss[i].reshape(()) for i in loss_ids])
        )
        if reducer is not None:
            reducer(flags)
        read = {i: flag > 0 for i, flag in zip(loss_ids, flags.tolist())}
        self.record_found(dict(zip(loss_ids, flags.unbind(0))), read=read)
        return [i for i in loss_ids if read[i]]

    def step(
        self,
        state: _OptimizerState,
        step_kwargs: dict[str, Any],
        *,
        compare: bool,
        found_inf: torch.Tensor | None = None,
    ) -> None:
        """Step the optimizer of ``state`` (on its masters, with the model's writes taken and the result copied
        back, at O2), then finish its step. ``found_inf``: the overflow flag (1.0 on overflow) handed to an
        optimizer that skips on the device (``_step_supports_amp_scaling``, as ``GradScaler`` hands it), with the
        gradients already unscaled."""
        optimizer = state.optimizer
        if not self.masters.weights:
            _step(optimizer, step_kwargs, found_inf)
        else:
            mirrors = self.mirrors(state, compare=compare)
            for mirror in mirrors:
                mirror.take_writes()  # writes to the model since the last step (loaded weights, SWA, EMA...)
            swap_in(state, self.masters.weights)  # the masters stand in for the parameters for the step
            try:
                _step(optimizer, step_kwargs, found_inf)
            finally:
                swap_out(state)
            for mirror in mirrors:
                mirror.copy_to_model()  # after a skip on the device: the masters' unchanged values
        self.finish(state)

    def finish(self, state: _OptimizerState) -> None:
        """End a step, stepped or skipped."""
        if self.masters.weights:
            # The FP32 gradients were the step's: freeing them keeps them out of the next forward's and backward's
            # peak memory. The half gradients are the user's, cleared by their zero_grad as in any loop.
            drop_master_grads(state)
        state.reset()

    def update(self) -> None:
        """Close the iteration: reset every optimizer's stage and update the scalers with the flags counted."""
        for state in self.optimizers.values():
            if state.stage is _Stage.UNSCALED:
                self.record_found(state.found_by_loss)
                state.stage = _Stage.SKIPPED
                state.found_by_loss, state.found_inf, state.grad_norm = {}, None, None
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

    def _unscale(self, state: _OptimizerState, max_norm: float | None = None, *, marks: bool = True) -> None:
        unscale_state(
            state,
            self.scalers[state.loss_id or 0],
            self.masters.weights,
            backend=self.backend,
            refuse_sparse=self.refuse_sparse,
            telemetry=self.telemetry,
            names=self.names,
            max_norm=max_norm,
            sharding=self.sharding,
            marks=marks,
        )


def _step(optimizer: torch.optim.Optimizer, step_kwargs: dict[str, Any], found_inf: torch.Tensor | None) -> None:
    """``optimizer.step(**step_kwargs)``; with ``found_inf``, the flag and no scale set on the optimizer for the call,
    the attributes torch's fused optimizers read (``GradScaler.step`` sets and deletes them the same way)."""
    if found_inf is None:
        optimizer.step(**step_kwargs)
        return
    optimizer.grad_scale = None  # type: ignore[attr-defined]  (the gradients are unscaled already)
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        optimizer.step(**step_kwargs)
    finally:
        del optimizer.grad_scale  # type: ignore[attr-defined]
        del optimizer.found_inf  # type: ignore[attr-defined]


def _clip_unscaled(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(params, max_norm)`` with its two halves (torch >= 2.6), the coefficient
    left at 1 for a non-finite norm (see :meth:`Amp.clip_grad_norm_ <lightning_mpx.engine.amp.Amp.clip_grad_norm_>`);
    older torch: its clip as it is."""
    get_norm = getattr(torch.nn.utils, "get_total_norm", None)
    clip_with = getattr(torch.nn.utils, "clip_grads_with_norm_", None)
    if get_norm is None or clip_with is None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    total = get_norm([p.grad for p in params if p.grad is not None])
    # A norm of 0 makes torch's coefficient max_norm / 1e-6, clamped to 1: the gradients are multiplied by one.
    clip_with(params, max_norm, torch.where(torch.isfinite(total), total, 0.0))
    return total
