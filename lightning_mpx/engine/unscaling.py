"""The unscale path of a :class:`~lightning_mpx.engine.optimizers.StepMachine` (its base :class:`UnscalePath`): the
gradients of one optimizer unscaled and checked for inf/NaN in one pass (:func:`~lightning_mpx.engine.grad_checks.
unscale`), by :meth:`~UnscalePath.unscale_` or a clip before the step, or by the step's own check, which reduces the
overflow flags across ranks once and reads them on the host (:meth:`~UnscalePath.check`) or leaves them on the device
(:meth:`~UnscalePath.check_on_device`); and the flags read for the user (:meth:`~UnscalePath.overflowed`,
:meth:`~UnscalePath.found_inf`, :meth:`~UnscalePath.share_overflow`). Finding a registered optimizer's state is its
base :class:`~lightning_mpx.engine.registry.Registry`'s; registering, the stages before a backward and the update stay
on the machine.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch

from lightning_mpx.engine import data_writes
from lightning_mpx.engine.clipping import show_unscaled
from lightning_mpx.engine.grad_checks import reduce_checks, unscale
from lightning_mpx.engine.master_writes import any_written, charge_written
from lightning_mpx.engine.masters_left import moved
from lightning_mpx.engine.optimizer_state import _OptimizerState, _Stage
from lightning_mpx.engine.registry import Registry
from lightning_mpx.engine.rescale import (
    follow_cleared_grads,
    grad_marks,
    leftovers,
    resume_stepped,
    unscale_late,
)
from lightning_mpx.engine.sharding import Sharding
from lightning_mpx.engine.shared_grads import SharedGrads
from lightning_mpx.health.telemetry import GradTelemetry
from lightning_mpx.masters.handover import refuse_handed
from lightning_mpx.masters.store import Masters
from lightning_mpx.scaling.scaler import LossScaler

_PARAMS = operator.itemgetter("params")


class UnscalePath(Registry):
    """The base of :class:`~lightning_mpx.engine.optimizers.StepMachine` that unscales and checks an optimizer's
    gradients (the attributes below are the machine's, see it)."""

    scalers: Sequence[LossScaler]
    masters: Masters
    backend: str
    telemetry: GradTelemetry
    names: dict[int, str]
    optimizers: dict[int, _OptimizerState]
    iteration_found: dict[int, torch.Tensor]
    iteration_read: dict[int, bool | None]
    sharding: Sharding | None
    refused: str | None  # a raw-step refusal kept for the step, where ranks meet (engine.unsynced)
    shared: SharedGrads  # parameters held by more than one optimizer (engine.shared_grads)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """:meth:`Amp.unscale_ <lightning_mpx.engine.amp.Amp.unscale_>`."""
        state = self.optimizers.get(id(optimizer)) or self.state(optimizer)  # state() raises for an unknown one
        if state.stage is _Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since its last step() or update() (directly or "
                "through clip_grad_norm_()/clip_grad_value_()); call step() (or update()) before unscaling again."
            )
        if not self.masters.weights:
            self._unscale(state, optimizer=optimizer)
            return
        # As after torch.amp.GradScaler.unscale_(): the model's own gradients hold the true values (a half copy;
        # the FP32 ones the step uses stay in the masters), so code that clips or inspects them works. A write
        # to them before the step is taken into the masters. show_unscaled notes the half gradients after its
        # copies: the unscale's own note, overwritten at once, is made only if the copies do not finish.
        self._unscale(state, optimizer=optimizer, note=False)
        try:
            show_unscaled(self, optimizer, fresh=True)
        except BaseException:
            self.keep_marks(state)
            raise

    # -- the step's check ---------------------------------------------------------------------------------------
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
                    sharding=self.sharding, shared=self.shared)  # fmt: skip
        elif state.stage is not _Stage.UNSCALED or self.masters.weights:  # unscaled by a clip: nothing to do at O1
            self._unscaled_for_step(state, optimizer)
        elif (noted := state.unscaled_groups) is not None and (  # a group added or swapped since (as below)
            len(lists := tuple(map(_PARAMS, optimizer.param_groups))) != len(noted[0])
            or not all(map(operator.is_, lists, noted[0])) or tuple(map(len, lists)) != noted[1]
        ):  # fmt: skip
            unscale_late(state, self.scalers, (), optimizer, self.backend, self.shared)  # a group added since (below)
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
                if self.refused is not None:  # every rank skips this step and raises it (engine.unsynced)
                    flags.fill_(1.0)
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
            return
        if self.masters.weights:
            if self.shared.masters:  # a shared master's FP32 gradient freed by another optimizer's step since
                self.shared.restore(state.pairs)
            # the masters' gradients written since the engine left them (engine.masters_left's moved, written out),
            # told before the model's writes are taken into them
            left = state.masters_left
            written = left is not None and (left[0]._version != left[1] or (left[2] is not None and moved(state)))
            # or those amp.master_params() handed out (engine.master_writes); tested inline: no call on a plain step
            handed = bool(state.handed) and any_written(state)
            follow_cleared_grads(state, self.masters.weights, optimizer)
            if written or handed:  # shown on the model: what the step leaves there is what it steps with, as FP32's
                show_unscaled(self, optimizer, fresh=True)
            if handed and len(self.optimizers) > 1:  # a clip over several optimizers' masters: NaN from another's inf
                charge_written(state)
            if state.data_watch is not None:  # told above (engine.data_writes)
                data_writes.ended(state)
        # a group added since the unscale (add_param_group), or put in place of one (param_groups assigned, a list
        # replaced, at any length): told by the lists and their lengths, C-level (rescale.unscale_late)
        if (noted := state.unscaled_groups) is not None and (
            len(lists := tuple(map(_PARAMS, optimizer.param_groups))) != len(noted[0])
            or not all(map(operator.is_, lists, noted[0])) or tuple(map(len, lists)) != noted[1]
        ):  # fmt: skip
            unscale_late(state, self.scalers, self.masters.weights, optimizer, self.backend, self.shared)

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
            if self.refused is not None:  # every rank skips this step and raises it (engine.unsynced)
                flags.fill_(1.0)
            reducer(flags)
        read = {i: flag > 0 for i, flag in zip(loss_ids, flags.tolist())}
        self.record_found(dict(zip(loss_ids, flags.unbind(0))), read=read)
        return [i for i in loss_ids if read[i]]

    def record_found(
        self,
        found_by_loss: dict[int, torch.Tensor],
        read: dict[int, bool] | None = None,
        *,
        into: tuple[dict[int, torch.Tensor], dict[int, bool | None]] | None = None,
    ) -> None:
        """Add overflow flags to the ones the next :meth:`update` applies, loss by loss; ``read``: what the host read
        of each of them said (the step reads them), so that the update need not look again. ``into``: copies of
        (``iteration_found``, ``iteration_read``) to add them to instead (the engine's left as they are)."""
        found_now, read_now = (self.iteration_found, self.iteration_read) if into is None else into
        for loss_id, found in found_by_loss.items():
            seen = found_now.get(loss_id)
            found_now[loss_id] = found if seen is None else torch.maximum(seen, found)
            known = None if read is None else read.get(loss_id)
            if seen is None:
                read_now[loss_id] = known
            elif known is None or read_now.get(loss_id) is None:
                read_now[loss_id] = None  # one flag of the iteration was not read: the device counts
            else:
                read_now[loss_id] = bool(read_now[loss_id]) or known

    # -- the flags, read ----------------------------------------------------------------------------------------
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

    def overflowed_together(self, optimizers: Sequence[torch.optim.Optimizer]) -> list[bool]:
        """:meth:`overflowed` for each of ``optimizers``, from one host read instead of one each (a joint clip over
        several optimizers): the flags not read yet are stacked and read together, and each read is noted as
        :meth:`overflowed` notes it, so that the optimizer's step does not read its flag again. Flags on different
        devices are read one by one."""
        unread: list[tuple[_OptimizerState, torch.Tensor]] = []
        for optimizer in optimizers:
            state = self.state(optimizer)
            flags = state.found_by_loss
            flag = next(iter(flags.values())) if len(flags) == 1 else state.found_inf
            memo = state.flag_read
            if flag is not None and (memo is None or memo[0] is not flag):
                unread.append((state, flag))
        if len(unread) > 1 and all(flag.device == unread[0][1].device for _, flag in unread):
            values = torch.stack([flag.reshape(()) for _, flag in unread]).tolist()
            for (state, flag), value in zip(unread, values):
                state.flag_read = (flag, value > 0)
        return [self.overflowed(optimizer) for optimizer in optimizers]  # noted: no read left but a lone flag's

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

    # -- internals ----------------------------------------------------------------------------------------------
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
        note: bool = True,
    ) -> None:
        """Unscale the optimizer's gradients (:func:`~lightning_mpx.engine.grad_checks.unscale`); ``marks``: at O2,
        note which half gradients were read, for the user code that may run before the step
        (:func:`~lightning_mpx.engine.rescale.follow_cleared_grads`); a step that unscales for itself notes them only
        if it does not finish (:meth:`keep_marks`); ``note=False``: noted by the caller (:meth:`unscale_`)."""
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
            shared=self.shared,
        )
        if weights and not skipped and marks and note:  # note=False: the caller notes them (unscale_)
            state.unscaled_marks = grad_marks(state, weights, optimizer)
            if state.data_habit is not False:  # looked at for writes through .data (engine.data_writes)
                data_writes.note(state)
        if marks:  # user code may add a group before the step (rescale.note_groups, written out: no call)
            lists = tuple(map(_PARAMS, optimizer.param_groups))
            state.unscaled_groups = (lists, tuple(map(len, lists)))
