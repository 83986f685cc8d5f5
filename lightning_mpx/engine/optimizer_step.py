"""The optimizer step of one engine, as one pipeline: check the gradients, step or skip, finish.

:meth:`OptimizerStep.step` reads as the step is: the optimizer's gradients unscaled and checked (the local ones, or
each rank's shards under FSDP) with the flags reduced once across ranks and read on the host
(:meth:`~lightning_mpx.engine.optimizers.StepMachine.check`); on overflow the step is skipped, recorded and the floor's
policy applied (:class:`~lightning_mpx.engine.overflow.Overflows`); otherwise the optimizer steps, on the FP32 masters
at O2 with the result copied back to the model (:func:`~lightning_mpx.masters.swap.step_on_masters`); then the
optimizer is ready for its next iteration. The scale is updated once per iteration by ``Amp.update``.

Each stage is a call into the module named for it, and none calls back here: a step enters each of the package's
modules at most once (``benchmarks/step_walk.py``).

An optimizer that can skip its own step on the device (a fused Adam/AdamW; ``skip_on_device``, by default) gets the
flags in its step instead of their being read first, and the host reads what the step did later
(:mod:`lightning_mpx.engine.outcome`): :meth:`OptimizerStep.examine` and :meth:`OptimizerStep.settle` are the rest of
such a step, done when it is read and where every rank is. Which path an optimizer takes is decided at its first step
(again when its parameter groups change), never per step.
"""

from __future__ import annotations

import functools
import itertools
import operator
from typing import Any, Callable

import torch

from lightning_mpx.casting.policy import casts_off_if_on
from lightning_mpx.engine.kept_writes import judge_kept
from lightning_mpx.engine.optimizer_state import _OptimizerState, optimizer_params
from lightning_mpx.engine.optimizers import StepMachine
from lightning_mpx.engine.outcome import PendingStep, PendingSteps, StepOutcome, device_skip_refusal
from lightning_mpx.engine.overflow import MasterOf, Overflows
from lightning_mpx.engine.rescale import after_step
from lightning_mpx.health.forensics import OverflowForensics
from lightning_mpx.masters.swap import drop_master_grads, step_on_masters, undo_pass

Reducer = Callable[[torch.Tensor], None]
_SCALE_TENSOR = operator.attrgetter("scale_tensor")
_SCALE = operator.attrgetter("_scale")  # LossScaler.scale_tensor's value once made (None before)
#: The devices whose ``torch.autocast`` :func:`without_casts` looks at (as ``casts_off_if_on``): a caller that tells
#: ``torch._C._len_torch_function_stack() or any(map(torch.is_autocast_enabled, AUTOCAST_DEVICES))`` (C calls only)
#: is false calls without it, the usual case at no Python call.
AUTOCAST_DEVICES = ("cpu", "cuda")


def without_casts(call: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)`` inside :func:`~lightning_mpx.casting.policy.casts_off_if_on`'s context when a
    torch-function mode or ``torch.autocast`` is on (a backward or step called inside ``forward_context()``), else
    as it is: the usual loop pays one call here, not the four of a context that does nothing."""
    if torch._C._len_torch_function_stack() or any(map(torch.is_autocast_enabled, AUTOCAST_DEVICES)):
        with casts_off_if_on():
            return call(*args, **kwargs)
    return call(*args, **kwargs)


class OptimizerStep:
    """The step of the optimizers one engine prepared, and its steps skipped on the device not settled yet.

    Args:
        machine: The engine's optimizers and their stages.
        overflows: The engine's overflow steps (recorded, logged, the floor's policy).
        forensics: The engine's overflow forensics (its forward watch ends with a step that does not overflow).
        master_of: The FP32 master of a model parameter, for the overflow records.
        skip_on_device: Where steps skip (``skip_on_device``): ``None`` on the device for each optimizer that can
            (:meth:`refusal`), on the host for the rest; ``True`` on the device (an optimizer that cannot is
            refused); ``False`` on the host.

    Attributes:
        steps: ``step()`` calls so far, all optimizers (``OverflowRecord.step``).
        pending: The steps skipped on the device that are not settled yet.
        closed: ``None``, or why :meth:`step` is refused (the message of its ``RuntimeError``): set by a front door
            whose run ended (the Trainer plugin's teardown), cleared when the next one starts.
        returned: What the last step's ``optimizer.step(...)`` returned (a torch optimizer: the closure's loss, so
            ``None``; a custom one: anything), ``None`` after a step skipped on the host (as ``GradScaler.step``
            returns): the front doors hand it to the user as Lightning's and Fabric's precisions do, taking it before
            :meth:`Amp.update <lightning_mpx.engine.amp.Amp.update>`, which drops it (no user value is held past the
            iteration by a door that does not hand it on: the core, Accelerate, the HF Trainer).
    """

    def __init__(
        self,
        machine: StepMachine,
        overflows: Overflows,
        forensics: OverflowForensics,
        *,
        master_of: MasterOf,
        skip_on_device: bool | None,
    ) -> None:
        self.machine = machine
        self.overflows = overflows
        self.forensics = forensics
        self.master_of = master_of
        self.skip_on_device = skip_on_device
        self.steps = 0
        self.closed: str | None = None
        self.returned: Any = None
        self.pending = PendingSteps(self.examine, self.settle, forensics.watch)

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        step_kwargs: dict[str, Any],
        *,
        reducer: Reducer | None,
        iteration: int,
        compare: bool,
    ) -> bool | StepOutcome:
        """:meth:`Amp.step <lightning_mpx.engine.amp.Amp.step>`: ``reducer`` reduces the flags across processes
        (``found_inf_reducer``), ``iteration`` is the engine's (its ``update()`` calls so far), ``compare``: compare
        the model's values with the masters' every step (``model_writes="values"``)."""
        if self.closed is not None:
            raise RuntimeError(self.closed)
        state = self.machine.optimizers.get(id(optimizer))
        if state is None:
            self.machine.state(optimizer)  # raises: the optimizer was not registered
        assert state is not None
        if step_kwargs.get("closure") is not None:
            raise ValueError(
                "closure: loss scaling cannot re-run a closure inside the optimizer step; run the closure first, "
                "then call step() without it."
            )
        if self.machine.unheld is not None:  # a raw optimizer stepped since the backward (engine.beside_steps)
            self.machine.unheld.before_step(self.machine, optimizer)
        if state.kept_writes:  # a write between accumulated backwards like a raw step's: still there? (kept_writes)
            judge_kept(state, self.machine)
        if self.machine.refused is not None and reducer is None and self.machine.sharding is None:
            refused, self.machine.refused = self.machine.refused, None  # no rank to meet (engine.unsynced)
            raise RuntimeError(refused)
        # decided at the first step and when the number of groups changes (_on_device): a comparison per step
        on_device = state.on_device if state.decided_groups == len(optimizer.param_groups) else self._on_device(
            optimizer, state
        )
        if self.pending.steps:
            # Every rank is here: their records are merged now. A step on the device leaves those of the iteration
            # under way pending (it does not wait for another optimizer's step); a host read waits for the device up
            # to here anyway, and settles them all first, so that the records come in the host path's order.
            self.pending.settle(before=iteration if on_device else None)
        self.steps += 1
        if on_device:
            # The step skipped on the device: the flags to the optimizer's step, their host copy queued behind it.
            loss_ids, flags = self.machine.check_on_device(state, optimizer, reducer)
            found = flags if flags.dim() == 0 else flags.amax() if len(loss_ids) > 1 else flags.reshape(())
            scalers = list(map(self.machine.scalers.__getitem__, loss_ids))
            # their scale_tensor, read without the property's call when made (by their backward's scale())
            scales = list(map(_SCALE, scalers))
            if any(map(operator.is_, scales, itertools.repeat(None))):
                scales = list(map(_SCALE_TENSOR, scalers))
            gather = reducer is not None or self.machine.sharding is not None
            pending = PendingStep(
                optimizer, loss_ids, flags, scales, step=self.steps - 1, iteration=iteration, gather=gather,
                read=self.pending.read, shared=state.shared_overflow,
            )
            try:
                if self.machine.masters.weights or torch._C._len_torch_function_stack() or any(
                        map(torch.is_autocast_enabled, AUTOCAST_DEVICES)):
                    self._take_step(optimizer, state, step_kwargs, compare, found_inf=found)
                else:  # _take_step's usual case (no masters, no casts on), written out: a call saved per step
                    optimizer.grad_scale = None  # type: ignore[attr-defined]
                    optimizer.found_inf = found  # type: ignore[attr-defined]
                    try:
                        self.returned = optimizer.step(**step_kwargs)
                    finally:
                        del optimizer.grad_scale  # type: ignore[attr-defined]
                        del optimizer.found_inf  # type: ignore[attr-defined]
            except BaseException:
                self.machine.keep_marks(state)  # the step did not finish (an optimizer's error, an interrupt)
                raise
            self.machine.steps_taken += 1  # engine.raw_steps: parameters written by an engine step
            after_step(state, optimizer, masters=bool(self.machine.masters.weights))
            if self.machine.shared.masters:  # noted FP32 gradients of shared masters: let go once all stepped
                self.machine.shared.settled(state)
            if self.machine.unheld is not None:  # a raw optimizer stepped after it (engine.beside_steps)
                self.machine.unheld.after_step(self.machine)
            self.pending.steps.append(pending)  # PendingSteps.add, written out
            if self.forensics.watch.active:
                # The forward watch's record is of this step's forward, which the next forward replaces: settle it
                # now (every rank is in this step).
                self.pending.settle()
            return pending.outcome
        # Unscale and check the gradients (or shards), the flags reduced once across ranks, read, counted.
        overflowed = self.machine.check(state, optimizer, reducer)
        try:
            if overflowed:
                self.returned = None  # as GradScaler.step returns on a skip
                gather = reducer is not None or self.machine.sharding is not None
                self._skip(optimizer, state, overflowed, gather=gather, iteration=iteration)
                return False
            if self.forensics.watch.active:
                self.forensics.stepped()  # an automatic watch ends with the first step that does not overflow
            self._take_step(optimizer, state, step_kwargs, compare)
        except BaseException:
            self.machine.keep_marks(state)  # the step did not finish (an optimizer's error, an interrupt)
            raise
        self.machine.steps_taken += 1  # engine.raw_steps: parameters written by an engine step
        after_step(state, optimizer, masters=bool(self.machine.masters.weights))  # its gradients, left for FP32's loop
        if self.machine.shared.masters:  # noted FP32 gradients of shared masters: let go once all stepped
            self.machine.shared.settled(state)
        if self.machine.unheld is not None:  # a raw optimizer stepped after it (engine.beside_steps)
            self.machine.unheld.after_step(self.machine)
        return True

    def _skip(
        self,
        optimizer: torch.optim.Optimizer,
        state: _OptimizerState,
        overflowed: list[int],
        *,
        gather: bool,
        iteration: int,
    ) -> None:
        """An overflow step: recorded (merged across ranks when ``gather``), finished without a step, then the
        floor's policy (which may raise)."""
        refused, self.machine.refused = (self.machine.refused, None) if gather else (None, self.machine.refused)
        self.overflows.record(
            optimizer, overflowed, names=self.machine.names, master_of=self.master_of, step=self.steps - 1,
            gather=gather, iteration=iteration, shared=state.shared_overflow, refused=refused,
        )
        self._finish(optimizer, state)
        self.overflows.at_floor(optimizer, overflowed)

    def _take_step(
        self,
        optimizer: torch.optim.Optimizer,
        state: _OptimizerState,
        step_kwargs: dict[str, Any],
        compare: bool,
        found_inf: torch.Tensor | None = None,
        casts_off: bool = False,
    ) -> None:
        """``optimizer.step(**step_kwargs)``, on the FP32 masters at O2 (the model's writes taken before, the result
        copied back after); what it returns kept in :attr:`returned`. ``found_inf``: the overflow flag (1.0 on
        overflow) handed to an optimizer that skips on the device (``_step_supports_amp_scaling``), with no scale set,
        the gradients being unscaled already: the attributes torch's fused optimizers read, set and deleted as
        ``GradScaler.step`` does.

        Called inside ``forward_context()`` (a torch-function mode or autocast on: ``without_casts``' check, written
        out), it runs again with the casts off (``casts_off``): the optimizer runs in its own dtypes."""
        casts_on = torch._C._len_torch_function_stack() or any(map(torch.is_autocast_enabled, AUTOCAST_DEVICES))
        if casts_on and not casts_off:
            return without_casts(self._take_step, optimizer, state, step_kwargs, compare, found_inf, True)
        if found_inf is not None:
            optimizer.grad_scale = None  # type: ignore[attr-defined]
            optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        try:
            master_weights = self.machine.masters.weights
            if master_weights:
                step = functools.partial(optimizer.step, **step_kwargs)
                self.returned = step_on_masters(
                    state, optimizer, master_weights, step, compare=compare, judge=self.machine.held_writes
                )  # an EMA child inside the optimizer, judged where the step takes hand writes (engine.frozen_writes)
                if self.machine.masters.lent:  # handed out by a state dict before the step, which wrote them over
                    self.machine.masters.forget_lent(optimizer_params(optimizer))  # a p.data write after it stays
            else:
                self.returned = optimizer.step(**step_kwargs)
        finally:
            if found_inf is not None:
                del optimizer.grad_scale  # type: ignore[attr-defined]
                del optimizer.found_inf  # type: ignore[attr-defined]

    def _finish(self, optimizer: torch.optim.Optimizer, state: _OptimizerState) -> None:
        """End a step that did not run (skipped on the host): the masters' FP32 gradients freed, the model's left as
        after any step (:func:`~lightning_mpx.engine.rescale.after_step`)."""
        if self.machine.masters.weights:
            drop_master_grads(state)  # the half gradients are the user's, cleared by their zero_grad as in any loop
            if state.two_pass:  # SAM: its first_step's perturbation undone, as its step would have
                undo_pass(state, self.machine.masters.weights)
        self.machine.steps_taken += 1  # engine.raw_steps: parameters written by an engine step
        after_step(state, optimizer, masters=bool(self.machine.masters.weights))
        if self.machine.shared.masters:  # noted FP32 gradients of shared masters: let go once all stepped
            self.machine.shared.settled(state)
        if self.machine.unheld is not None:  # a raw optimizer stepped after it (engine.beside_steps)
            self.machine.unheld.after_step(self.machine)

    # -- skip_on_device -----------------------------------------------------------------------------------------
    def refusal(self, optimizer: torch.optim.Optimizer) -> str | None:
        """Why ``optimizer``'s step cannot skip on the device in this engine (``None`` when it can)."""
        sharding = self.machine.sharding
        if sharding is not None and sharding.shards:
            return "the model is sharded by FSDP1 (FSDP2's fully_shard can skip on the device)"
        if any(scaler.on_floor == "promote" for scaler in self.machine.scalers):
            return "on_floor='promote' changes the model before the next forward"
        return device_skip_refusal(optimizer)

    def refuse_device_skip(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise a ValueError when ``optimizer`` cannot skip its step on the device (``skip_on_device=True``)."""
        refusal = self.refusal(optimizer)
        if refusal is not None:
            raise ValueError(
                f"skip_on_device=True needs a step that can be skipped on the device, but {refusal}: use "
                "torch.optim.Adam or AdamW with fused=True (not under FSDP1), or skip_on_device=None (the "
                "default: on the device where it can be) or False (on the host)."
            )

    def _on_device(self, optimizer: torch.optim.Optimizer, state: _OptimizerState) -> bool:
        """Whether ``optimizer``'s steps skip on the device: decided at its first step and again when its number of
        parameter groups changes (``add_param_group``), before anything moves."""
        groups = len(optimizer.param_groups)
        if state.decided_groups != groups:
            if self.machine.sharding is not None:
                # A group added after an evaluation may hold the root's gathered copies, which would never train.
                self.machine.sharding.refuse_gathered(optimizer_params(optimizer))
            if self.skip_on_device is None:
                state.on_device = self.refusal(optimizer) is None  # auto: the rest read on the host
            elif self.skip_on_device:
                self.refuse_device_skip(optimizer)  # a group that cannot skip would step anyway
                state.on_device = True
            else:
                state.on_device = False
            state.decided_groups = groups
        return state.on_device

    def examine(self, pending: PendingStep) -> None:
        """What :meth:`step` does on the host after its read on this process alone, for a step skipped on the
        device and read now: an overflow is counted and this process's record built (its gradients may still be
        there; none when the optimizer was dropped since)."""
        if pending.overflowed:
            pending.examined = self.overflows.examine(
                pending.optimizer(), pending.overflowed, names=self.machine.names, master_of=self.master_of,
                step=pending.step, scales=pending.scales,
            )

    def settle(self, pending: PendingStep) -> None:
        """The rest of what :meth:`step` does on the host, for a step skipped on the device, read and examined:
        the record merged across ranks (``pending.gather``: every rank is here, and each takes part, whenever it
        read the step), logged, ``on_floor``."""
        overflowed, scales = pending.overflowed, pending.scales
        assert overflowed is not None and scales is not None  # read before it is settled
        if not overflowed:
            if self.forensics.watch.active:
                self.forensics.stepped()
            return
        assert pending.examined is not None  # examined at its read
        refused = None
        if pending.gather:  # a raw-step refusal kept for a step where ranks meet (engine.unsynced)
            refused, self.machine.refused = self.machine.refused, None
        self.overflows.settle(
            pending.examined, overflowed, gather=pending.gather, iteration=pending.iteration, scales=scales,
            shared=pending.shared, refused=refused,
        )
        optimizer = pending.optimizer()
        if optimizer is None:  # dropped since: recorded, no floor to apply to it
            return
        self.overflows.at_floor(optimizer, overflowed, scales)
