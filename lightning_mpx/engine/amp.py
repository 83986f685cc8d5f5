"""The framework-agnostic mixed-precision engine: opt level + cast policy + loss scalers + master weights.

:class:`Amp` is what the Lightning plugin and the Accelerate adapter drive; it also works in a plain loop::

    amp = Amp("O2")
    model = amp.prepare_model(model)
    optimizer = amp.prepare_optimizer(torch.optim.AdamW(model.parameters()))
    for x, y in data:
        with amp.forward_context():
            loss = loss_fn(amp.cast_outputs(model(amp.cast_inputs(x))), y)
        amp.backward(loss)
        amp.clip_grad_norm_(optimizer, 1.0)   # optional: clips the unscaled gradients
        amp.step(optimizer)                   # skipped (returns False) when gradients overflowed
        amp.update()                          # once per iteration: adjusts the scale(s)
        optimizer.zero_grad()
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Sequence

import torch
from torch import nn
from typing_extensions import Unpack

from lightning_mpx.casting.policy import CastPolicy
from lightning_mpx.engine.amp_forward import AmpForward
from lightning_mpx.engine.clipping import clip_norm, clip_value_, show_unscaled
from lightning_mpx.engine.optimizer_state import _OptimizerState, _Stage, backward_loss, loss_index
from lightning_mpx.engine.optimizer_step import AUTOCAST_DEVICES, without_casts
from lightning_mpx.engine.outcome import StepOutcome

# _EngineHook's old import path here keeps working (lightning_mpx.apex's hooks).
from lightning_mpx.engine.preparation import PreparedModels, _EngineHook  # noqa: F401
from lightning_mpx.engine.raw_steps import find_unheld
from lightning_mpx.engine.sharding import refuse_unfrozen_half
from lightning_mpx.engine.surgery import adopt_new_parameters
from lightning_mpx.masters.pairs import StrayParameterError, param_pairs
from lightning_mpx.masters.swap import call_on_masters, train_modes

# MODEL_WRITES is defined with the other settings; its old import path here keeps working.
from lightning_mpx.settings import (  # noqa: F401
    DEFAULTS,
    MODEL_WRITES,
    MixedPrecisionSettings,
    OnFloor,
    SettingsKeywords,
    check_flag,
    keyword_signature,
)


class Amp(AmpForward):
    """Mixed precision for one training run: a facade over parts that each own their state (the optimizers'
    :class:`~lightning_mpx.engine.optimizers.StepMachine`, the step :class:`~lightning_mpx.engine.optimizer_step.
    OptimizerStep`, the models :class:`~lightning_mpx.engine.preparation.PreparedModels`, the checkpoint
    :class:`~lightning_mpx.engine.checkpoint.EngineState`, the masters :class:`~lightning_mpx.masters.store.Masters`,
    the overflows :class:`~lightning_mpx.engine.overflow.Overflows`, the scalers, the cast policy, the promotion, the
    forensics); its records (the step outcomes read late, the metrics, the checkpoint) are read and written by its
    base :class:`~lightning_mpx.engine.amp_records.AmpRecords`, its FP32 masters are read (and exported) through its
    base :class:`~lightning_mpx.engine.amp_masters.AmpMasters`, and its forward's scope and casts are its base
    :class:`~lightning_mpx.engine.amp_forward.AmpForward`'s.

    Args:
        opt_level, **settings: The opt level (``"O0"`` to ``"O3"``) and the settings, each documented and checked in
            :class:`~lightning_mpx.settings.MixedPrecisionSettings` and :class:`~lightning_mpx.settings.ScalerSettings`
            (:meth:`from_settings` takes them whole); their keywords and types are
            :class:`~lightning_mpx.settings.SettingsKeywords` (``help(Amp)`` lists each with its default), and an
            unknown keyword raises ``TypeError`` naming it.

    Attributes:
        settings: The validated :class:`~lightning_mpx.settings.MixedPrecisionSettings` the engine was built from.
        found_inf_reducer: Optional callable that reduces an optimizer's overflow flag in place across processes
            (the adapters set it under a distributed strategy) so that every rank makes the same skip decision.
        telemetry: The :class:`~lightning_mpx.health.telemetry.GradTelemetry` behind :meth:`request_telemetry`.
        iteration: The :class:`~lightning_mpx.engine.iteration.Iteration` in progress: each optimizer's last
            :meth:`step` outcome (``iteration.skipped(optimizer)``), whether :meth:`update` is due.
    """

    @keyword_signature()
    def __init__(self, opt_level: str = "O1", **settings: Unpack[SettingsKeywords]) -> None:
        self._configure(MixedPrecisionSettings.from_kwargs(opt_level, **settings))

    @classmethod
    def from_settings(cls, settings: MixedPrecisionSettings) -> Amp:
        """The engine of ``settings``: the same as ``Amp(settings.opt_level, **settings.to_kwargs())``."""
        if not isinstance(settings, MixedPrecisionSettings):
            raise TypeError(f"settings={type(settings).__name__} must be a lightning_mpx.MixedPrecisionSettings.")
        amp = cls.__new__(cls)
        amp._configure(settings)
        return amp

    def _state(self, optimizer: torch.optim.Optimizer) -> _OptimizerState:
        return self._machine.state(optimizer)

    @property
    def promoted_modules(self) -> dict[str, dict[str, Any]]:
        """The modules ``on_floor="promote"`` promoted to FP32, each with its evidence (``step``, ``origin``,
        ``region``, ``scale``, ``culprits``, ``parameters``)."""
        return dict(self.promotion.promoted)

    def prepare_model(
        self, module: nn.Module, *, train: bool = True, rank_zero_fp32: bool = False, keep_frozen_fp32: bool = False
    ) -> nn.Module:
        """Convert ``module`` for the opt level (in place) and return it: half at O2/O3 (batch norm FP32 when
        ``keep_batchnorm_fp32``), half parameters FP32 at O0, as it is at O1. At O2 the FP32 masters of the
        parameters an optimizer holds are made by :meth:`prepare_optimizer` (a half submodule no optimizer trains
        gets none). ``train=False``: a model only evaluated, with no masters (an optimizer over its half parameters
        is refused); preparing it again with ``train=True`` adds them (once).

        A model that PyTorch FSDP has already sharded (``fully_shard``, or the FSDP1 wrapper: prepare the wrapped
        model) is not converted and gets no masters: FSDP's mixed-precision policy computes in half and, at O2, its
        sharded FP32 parameters are the masters. Its policies are checked against the opt level
        (:func:`lightning_mpx.integrations.fsdp.check_sharded_model`), and the scaler then works on each rank's shards
        with one all-reduce per step (the overflow flags and the global gradient norm).

        Under a process group of several ranks the masters start from the half weights (each rank's FP32 values may
        differ; DDP broadcasts rank zero's half weights), unless ``rank_zero_fp32``: then one FP32 broadcast (a
        collective: call it on every rank together, before DDP wraps the model) gives every rank rank zero's exact
        FP32 values, which the masters start from, as the Lightning, Fabric and Accelerate doors do.

        ``keep_frozen_fp32``: at O2 keep the FP32 values of the parameters frozen now too (4 bytes a parameter), so a
        part unfrozen later (a backbone fine-tuned after its head) gets its master from them, not from its half
        rounding (the Trainer plugin does so when a ``BaseFinetuning`` callback is given)."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"module={type(module).__name__} is not a torch.nn.Module.")
        flags = {"train": train, "rank_zero_fp32": rank_zero_fp32, "keep_frozen_fp32": keep_frozen_fp32}
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise TypeError(f"{name}={value!r} must be True or False.")
        self.pick_half_dtype(module)  # with no half_dtype given: the device's, once (bfloat16 on a CPU)
        self._machine.forget_writes()  # converting writes the parameters: no raw step (engine.raw_steps)
        self._models.prepare(module, train=train, rank_zero_fp32=rank_zero_fp32, keep_frozen_fp32=keep_frozen_fp32)
        find_unheld(self._models, self._machine)  # its parameters no optimizer holds (engine.raw_steps)
        return module

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Register ``optimizer`` (prepare its model first); for O2 its parameters become the FP32 masters (those
        that require a gradient, and those frozen since :meth:`prepare_model`, from their kept FP32 values; one
        frozen before it, a LoRA model's base, gets its master at its first gradient if it is unfrozen). A closure
        optimizer (LBFGS), which loss scaling cannot support, is refused with a ValueError."""
        self._machine.validate(optimizer, with_masters=self._with_masters)
        if self.settings.skip_on_device:
            self._stepper.refuse_device_skip(optimizer)
        self.promotion.check_patterns_matched()
        if self._with_masters:  # parameters set on a prepared model since: a new module, an untie's clone
            adopt_new_parameters(self._models, optimizer)
        try:
            self._machine.register(optimizer, with_masters=self._with_masters)
            self._machine.shared.refresh()  # an overlap with the optimizers registered before (engine.shared_grads)
        except StrayParameterError as error:  # named where a prepared model holds it (on this error's path only)
            raise self._models.name_stray(error) from None
        find_unheld(self._models, self._machine)  # the models' parameters no optimizer holds now (engine.raw_steps)
        return optimizer

    def judge_first_writes(self, optimizer: torch.optim.Optimizer) -> frozenset[int]:
        """Before registering ``optimizer`` where the front door meets it at its first step (``registers_at_step``):
        refuse a raw step over its parameters since the first backward (an error naming it), and return the ids of
        the parameters a SAM-style ``optimizer`` held and wrote since then (its ``first_step``'s: state it kept for
        them, ``old_p``, is its own). Nothing to judge (the usual case): an empty set."""
        unheld = self._machine.unheld
        return frozenset() if unheld is None else unheld.judge(self._machine, optimizer)

    def _groups_changed(self, optimizer: torch.optim.Optimizer) -> None:
        """A registered ``optimizer`` whose parameter groups were added or removed since its pairs were made (seen
        at a forward, see :meth:`forward_context`): prepared again (a module added since is made half with FP32
        masters, :func:`~lightning_mpx.engine.surgery.adopt_new_parameters`) and its pairs made now, so that the
        check does not fire again before its step."""
        self.prepare_optimizer(optimizer)
        state = self._machine.optimizers.get(id(optimizer))
        if state is not None:
            try:
                param_pairs(state, self._machine.masters.weights)
            except StrayParameterError as error:  # named where a prepared model holds it
                raise self._models.name_stray(error) from None

    def release_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Forget ``optimizer`` and remove the hooks put on it (its masters stay with their model; its state, at O2
        kept by the masters, is keyed by its own parameters again); its steps pending on the device
        (``skip_on_device``) are read first."""
        self.read_step_outcomes()
        self._machine.release(optimizer)
        self._machine.shared.refresh()
        find_unheld(self._models, self._machine)

    # -- backward -----------------------------------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor, loss_id: int = 0) -> torch.Tensor:
        """``loss`` times the scale of ``loss_id`` (an ``int``, numpy integers included). Every optimizer's pending
        gradients are brought to this scale first (another loss's, from before an :meth:`update` that changed their
        scale, or left unscaled by :meth:`unscale_` or a clip without a :meth:`step`), so one buffer never mixes two
        scales; so are those a :meth:`step` left and the user kept (not zeroed since): they add up as in FP32.
        Bringing them over checks them (but for what a step left, whose check that step made): a non-finite value
        found then is charged to the loss it came from, and the optimizer's next :meth:`step` is skipped even if the
        gradients are zeroed before it (as after :meth:`unscale_`: a check made decides the step)."""
        loss_id = loss_id if type(loss_id) is int and 0 <= loss_id < len(self.scalers) else self._loss_index(loss_id)
        # the steps skipped on the device in earlier iterations, settled before new gradients come
        if self._pending.steps:
            self._pending.settle(before=self.iteration.index)  # every rank is here: their records are merged now
        scaled = self.scalers[loss_id].scale(loss)
        if self.forensics.watch.active:  # a device flag, no sync
            self.forensics.watch.observe_loss(loss)
        self._machine.before_backward(loss_id, scaled)
        return scaled

    def backward(self, loss: torch.Tensor, loss_id: int = 0, **backward_kwargs: Any) -> None:
        """``scale_loss(loss, loss_id).backward(**backward_kwargs)`` inside :meth:`backward_context`."""
        usual = type(loss) is torch.Tensor and loss.requires_grad and loss.numel() == 1 and loss.is_floating_point()
        # else: refused (a keyword Tensor.backward does not take too, before anything is noted)
        loss = loss if usual and not backward_kwargs else backward_loss(loss, backward_kwargs)
        # scale_loss(loss, loss_id), written out (a call saved per step)
        loss_id = loss_id if type(loss_id) is int and 0 <= loss_id < len(self.scalers) else self._loss_index(loss_id)
        if self._pending.steps:
            self._pending.settle(before=self.iteration.index)
        scaled = self.scalers[loss_id].scale(loss)
        if self.forensics.watch.active:
            self.forensics.watch.observe_loss(loss)
        self._machine.before_backward(loss_id, scaled)
        try:  # no call per step: the except clause runs only when the backward raised
            if self.policy is None:
                scaled.backward(**backward_kwargs)
            # inside forward_context() the backward is not the forward's to cast; backward_context(), without the hook
            elif torch._C._len_torch_function_stack() or any(map(torch.is_autocast_enabled, AUTOCAST_DEVICES)):
                without_casts(self.policy.backward, scaled, **backward_kwargs)
            else:  # the usual case (without_casts' check, written out)
                self.policy.backward(scaled, **backward_kwargs)
        except (RuntimeError, AssertionError) as error:  # FSDP at O2 on half parameters unfrozen: said so, by name
            refuse_unfrozen_half(self._machine.sharding, error)
            raise

    def backward_context(self, *, create_graph: bool = False) -> ContextManager[Any]:
        """The scope of a backward pass (``create_graph``: it builds a graph): activation checkpointing recomputes
        with the forward's casts inside it (:meth:`~lightning_mpx.casting.policy.CastPolicy.recompute_scope`)."""
        return _backward_scope(self.policy, create_graph)

    # -- optimizer step -----------------------------------------------------------------------------------------
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale ``optimizer``'s gradients (into the FP32 masters at O2, with a half copy on the model) and record
        overflow; once per step.

        Raises:
            RuntimeError: if called twice for the same optimizer without a :meth:`step` or :meth:`update` between.
        """
        self._machine.unscale_(optimizer)

    def found_inf(self, optimizer: torch.optim.Optimizer, loss_id: int | None = None) -> torch.Tensor | None:
        """The overflow flag (a device tensor, nonzero on overflow) that the checks of ``optimizer``'s gradients since
        its last step found: all losses together, or those charged to ``loss_id``; ``None`` when nothing was checked.
        Reading it on the host waits for the device."""
        return self._machine.found_inf(optimizer, None if loss_id is None else self._loss_index(loss_id))

    def overflowed(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the checks of ``optimizer``'s gradients since its last step found an overflow (``False`` when
        nothing was checked): a host read, which waits for the device, made once per check: a :meth:`step` that
        follows with no check between does not read again (``found_inf`` is the flag itself, without a read)."""
        return self._machine.overflowed(optimizer)

    def share_overflow(self, optimizers: Sequence[torch.optim.Optimizer], loss_id: int = 0) -> None:
        """Charge an overflow of ``loss_id`` to ``optimizers``: their next :meth:`step` is skipped and counted as any
        overflow (Apex's ``scale_loss`` skips every optimizer an overflowing block names)."""
        self._machine.share_overflow(optimizers, self._loss_index(loss_id))

    def is_unscaled(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s gradients have been unscaled since its last :meth:`step` or :meth:`update`."""
        return self._machine.state(optimizer).stage is _Stage.UNSCALED

    def clip_grad_norm_(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Clip ``optimizer``'s unscaled gradients (unscaling them first) to a global L2 norm; returns the norm
        before clipping. As ``torch.nn.utils.clip_grad_norm_`` (bit for bit), except that a non-finite norm (an
        overflow: the step is skipped) leaves the gradients as they are, so :attr:`last_overflow` tells inf from NaN."""
        return clip_norm(self._machine, optimizer, max_norm, with_masters=self._with_masters)

    def clip_grad_value_(self, optimizer: torch.optim.Optimizer, clip_value: float) -> None:
        """Clamp ``optimizer``'s unscaled gradients to ``[-clip_value, clip_value]``."""
        clip_value_(self._machine, optimizer, clip_value, with_masters=self._with_masters)

    def call_on_masters(self, optimizer: torch.optim.Optimizer, call: Callable[[], object]) -> None:
        """Run ``call``, a method of ``optimizer`` that writes its parameters outside a step (a schedule-free
        optimizer's ``eval()``/``train()``), on what it trains: at O2 the FP32 masters, then copied into the half
        model (the model's writes since the last step taken into them first); otherwise as it is."""
        if not self._with_masters or not self._machine.masters.weights:
            call()
            return
        state = self._machine.state(optimizer)
        try:
            call_on_masters(state, self._machine.masters.weights, call)
        finally:
            state.train_modes = state.train_modes if state.train_modes is None else train_modes(optimizer)

    def show_unscaled_on_model(self, optimizer: torch.optim.Optimizer) -> None:
        """At O2, copy the unscaled FP32 master gradients into the half model's gradients (rounded), for code that
        reads the model's gradients between the unscale and the step (Lightning's ``on_before_optimizer_step``,
        ``grad_norm(self)``); the masters' FP32 gradients stay what the step uses."""
        show_unscaled(self._machine, optimizer)

    def step(self, optimizer: torch.optim.Optimizer, **step_kwargs: Any) -> bool | StepOutcome:
        """Step ``optimizer`` unless its gradients overflowed (then nothing changes, and the overflow counts against the
        losses whose gradients held it); returns whether it stepped. Any optimizer but a fused Adam/AdamW, or any with
        ``skip_on_device=False``, has the overflow flags read on the host: one sync per step, as ``GradScaler``.

        A fused Adam/AdamW (``skip_on_device``, by default) gets the flag in its own step, which skips on the device,
        and the host does not wait: the return value is then a :class:`~lightning_mpx.StepOutcome`, which behaves as the
        same ``bool``. The overflow is counted, logged and acted on (``on_floor``) when it is read: then, or at the
        latest at the first :meth:`scale_loss` (backward) or :meth:`step` after the next :meth:`update`, at
        :meth:`read_step_outcomes`, :meth:`state_dict` or :meth:`release_optimizer`. Its record names the parameters
        whose gradients are still there when it is read (not after ``zero_grad()``). A read is never a collective: under
        a process group (``found_inf_reducer``) it counts the overflow, and the record is merged across ranks, logged
        and ``on_floor`` applied at that next backward or step (or :meth:`settle_step_outcomes`), where every rank is.
        While the forensics' forward watch runs (``diagnose_overflows``, or after an overflow at the floor until a step
        that does not overflow) it is read and settled at the step, as its record is of the forward before it.

        Raises:
            LossScaleFloorError: on overflow at the floor with ``on_floor="raise"`` (the step is skipped first; with
                ``skip_on_device``, raised where the overflow is read, or under a process group where it is settled).
        """
        if self._checkpoint.held.pending:  # a lean entry loaded: are the masters it left to the model's entry given?
            self._checkpoint.held.check(self)
        outcome = self._stepper.step(
            optimizer, step_kwargs, reducer=self.found_inf_reducer, iteration=self.iteration.index,
            compare=self.model_writes == "values",
        )
        self.iteration.record(optimizer, outcome)  # not read: a StepOutcome is read when a door asks
        return outcome

    def update(self) -> None:
        """Close the iteration (once, after the real step; no host sync): update the scale of every loss whose
        optimizers stepped, skipped or were unscaled since the last call, reset every optimizer's stage (as
        ``torch.amp.GradScaler.update()``; one unscaled without a step keeps its gradients as true values), and
        clear the cast cache."""
        self._machine.update()
        shared = self._machine.shared
        if shared.done or shared.masters or shared.rescaled:  # its notes: held no longer than the iteration
            shared.clear()
        self.iteration.close()
        self._stepper.returned = None  # the optimizer's step's value: a door that hands it on took it before
        if self.policy is not None:
            self.policy.clear_cache()
        self.telemetry.requested = False  # a request covers one iteration

    def end_iteration(self) -> bool:
        """:meth:`update` if a :meth:`step` ran since the last one (a front door's iteration ends); whether it did."""
        due = self.iteration.update_pending
        if due:
            self.update()
        return due

    # -- internals ----------------------------------------------------------------------------------------------
    def _loss_index(self, loss_id: int) -> int:
        return loss_index(loss_id, len(self.scalers))


def _backward_scope(policy: CastPolicy | None, create_graph: object) -> ContextManager[Any]:
    """:meth:`Amp.backward_context`'s scope: ``policy``'s recompute scope, or none without a policy (O0)."""
    check_flag("create_graph", create_graph)
    return policy.recompute_scope(create_graph=create_graph) if policy is not None else contextlib.nullcontext()

