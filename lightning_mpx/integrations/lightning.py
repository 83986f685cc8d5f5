"""The Lightning plugin: ``Trainer(plugins=[MixedPrecisionPlugin("O1")])``.

A :class:`lightning.pytorch.plugins.Precision` that hands every precision decision to the core engine
(:class:`~lightning_mpx.engine.amp.Amp`). What it adds is the glue to Lightning's training loop:

* the O1 cast policy is active in training, validation, test and predict steps (at O2, the policy that runs loss
  functions in FP32); at O2/O3 the model is converted before the strategy wraps it, and its inputs and outputs are
  cast at the model's boundary (Apex's behaviour: the model sees half inputs, the loss sees FP32 outputs);
* backward scales the loss and hands it to the LightningModule's ``backward`` hook
  (``self.manual_backward(loss, loss_id=1)`` picks a loss's own scaler);
* the optimizer step unscales once (before the hooks that read gradients: ``on_before_optimizer_step``,
  ``configure_gradient_clipping``), clips the unscaled gradients (at O2 the model's own gradients show the clipped
  values too), skips on overflow, and the scale is updated once per iteration. On a skipped step the loop does not
  call ``lr_scheduler_step`` for that optimizer's per-step schedulers, which the hook receives as the user's own
  objects;
* ``mpx/*`` metrics reach the Trainer's loggers at its logging cadence, and the plugin's state goes into checkpoints;
* the plugin pickles as its settings (``strategy="ddp_spawn"``): each process starts a fresh engine;
* under FSDP (``ModelParallelStrategy``, FSDP2: shard in ``configure_model`` with
  :func:`lightning_mpx.integrations.fsdp.shard_model`; ``FSDPStrategy``, FSDP1: Lightning wraps the model with
  :attr:`MixedPrecisionPlugin.mixed_precision_config`) FSDP's sharded FP32 parameters are the masters and its
  mixed-precision policy computes in half; the engine steps each rank's shards with one all-reduce per step.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, ContextManager

import torch
from torch import nn
from torch.optim import Optimizer
from typing_extensions import Unpack

from lightning_mpx.casting.checkpointing import builds_graph
from lightning_mpx.common.containers import read_floats
from lightning_mpx.common.imports import require
from lightning_mpx.engine.amp import Amp
from lightning_mpx.engine.optimizer_step import AUTOCAST_DEVICES, without_casts
from lightning_mpx.engine.outcome import StepOutcome
from lightning_mpx.engine.sharding import refuse_unfrozen_half
from lightning_mpx.scaling.scaler import LossScaler
from lightning_mpx.scaling.view import GradScalerView
from lightning_mpx.settings import (
    SETTINGS_OBJECT,
    MixedPrecisionSettings,
    SettingsKeywords,
    keyword_signature,
    settings_of,
    written_settings,
)

_pl = require("lightning.pytorch", extra="lightning", feature="lightning_mpx.MixedPrecisionPlugin")

from lightning.pytorch.core.optimizer import LightningOptimizer  # noqa: E402
from lightning.pytorch.plugins.precision import FSDPPrecision, Precision  # noqa: E402

from lightning_mpx.integrations.lightning_averages import take_averages  # noqa: E402
from lightning_mpx.integrations.lightning_checkpoints import CheckpointHooks, LentMasters  # noqa: E402
from lightning_mpx.integrations.lightning_clipping import GradientClipping  # noqa: E402
from lightning_mpx.integrations.lightning_conversion import (  # noqa: E402
    precision_of,
)
from lightning_mpx.integrations.lightning_evaluation import EvaluationValues  # noqa: E402
from lightning_mpx.integrations.lightning_gradient_readers import GradientReaders  # noqa: E402
from lightning_mpx.integrations.lightning_manual import ManualStep  # noqa: E402
from lightning_mpx.integrations.lightning_model_hooks import (  # noqa: E402
    ModelHooks,
    note_replaced_data,
    note_uncast_input,
)
from lightning_mpx.integrations.lightning_range_test import RangeTest  # noqa: E402
from lightning_mpx.integrations.lightning_schedulers import HeldSchedulers, step_configs  # noqa: E402
from lightning_mpx.integrations.lightning_setup import NOT_FOR_FABRIC, ModelSetup  # noqa: E402
from lightning_mpx.integrations.lightning_strategies import (  # noqa: E402
    NewOptimizers,
    adopt_optimizer,
    fsdp1_config,
    trainer_of,
    unwrap_optimizer,
)
from lightning_mpx.integrations.metric_counts import log_metrics  # noqa: E402

__all__ = ["MixedPrecisionPlugin"]

#: Lightning's own ``backward`` hook: the plugin runs its body directly (see :meth:`MixedPrecisionPlugin.backward`).
_DEFAULT_BACKWARD = _pl.LightningModule.backward


class MixedPrecisionPlugin(ModelSetup, GradientClipping, CheckpointHooks, FSDPPrecision):
    """Apex-style mixed precision for the Lightning Trainer.

    It works with single-device, DDP and FSDP strategies. It is an ``FSDPPrecision`` only because Lightning's
    ``FSDPStrategy`` accepts nothing else; every method of ``FSDPPrecision`` is replaced here, so none of its
    behaviour (autocast, input casts, its ``ShardedGradScaler``) applies under any strategy.

    Args:
        opt_level: ``"O0"`` (FP32), ``"O1"`` (cast-table policy), ``"O2"`` (half model, FP32 master weights, batch
            norm FP32) or ``"O3"`` (pure half).
        **settings: The engine's settings (``half_dtype``, ``num_losses``, the loss scaler's, ``fp32_modules``,
            opt-level overrides such as ``keep_batchnorm_fp32``...; typed in
            :class:`~lightning_mpx.settings.SettingsKeywords`, ``help()`` lists each with its default), each
            documented and checked in :class:`~lightning_mpx.settings.MixedPrecisionSettings` (the scaler's in
            :class:`~lightning_mpx.settings.ScalerSettings`); :meth:`from_settings` takes them whole.
            In manual optimization choose a loss with ``self.manual_backward(loss, loss_id=i)``;
            ``fp32_modules`` patterns match the LightningModule's ``named_modules()`` names; the overflow record of
            ``diagnose_overflows`` is ``plugin.amp.last_overflow``.

    Attributes:
        settings: The :class:`~lightning_mpx.settings.MixedPrecisionSettings` the plugin was built from.
        amp: The :class:`~lightning_mpx.engine.amp.Amp` engine that does the work.

    Example::

        trainer = Trainer(plugins=[MixedPrecisionPlugin("O2", keep_batchnorm_fp32=True)], gradient_clip_val=1.0)

        # FSDP2: shard in configure_model with the level's per-module policies
        class Model(LightningModule):
            def configure_model(self):
                shard_model(self.model, self.trainer.precision_plugin, mesh=self.device_mesh["data_parallel"])

        Trainer(strategy=ModelParallelStrategy(), plugins=[MixedPrecisionPlugin("O2")])
        Trainer(strategy="fsdp", plugins=[MixedPrecisionPlugin("O2")])  # FSDP1: Lightning wraps the model
    """

    @keyword_signature()
    def __init__(self, opt_level: str = "O1", **settings: Unpack[SettingsKeywords]) -> None:
        inherited = set(vars(self))  # a subclass's attributes set before this __init__ (kept by pickling)
        # Built now so that bad arguments fail at Trainer construction, not mid-setup.
        self.settings = settings_of(opt_level, settings)  # type: ignore[arg-type]
        self._opt_level = opt_level
        self.amp = Amp.from_settings(self.settings)
        # ``trainer.precision`` (no half_dtype given: provisional until convert_module picks the device's)
        self.precision = precision_of(self.amp)  # type: ignore[assignment]
        self._module: nn.Module | None = None
        self._sharded: nn.Module | None = None  # under FSDP: the sharded model the engine was prepared with
        self._model_hooks = ModelHooks()  # boundary casts and the compiled hand-off, on the LightningModule
        self._masters_synced = False
        self._frozen_warned = False  # the O2 checkpoint's warning about frozen half parameters: once per fit
        self._lent = LentMasters()  # the masters the checkpoint entry holds live within Lightning's dump_checkpoint
        self._log_step: int | None = None  # the step to log the mpx metrics at, once the scale is updated
        # Per-step scheduler configs held out of the loop's scheduler update after a skipped step, until the next batch.
        self._held = HeldSchedulers()
        self._gradient_readers = GradientReaders()  # which hooks read the gradients, asked once per fit and class
        self._range_test = RangeTest()  # Lightning's learning-rate range test (Tuner.lr_find)
        self._new_optimizers = NewOptimizers()  # made mid-fit by strategy.setup_optimizers: registered before a step
        self._manual_step = ManualStep()  # whether a manual-optimization training step runs (its reads end nothing)
        self._evaluation = EvaluationValues()  # prepares the model; O2 before the first fit: FP32 values for a stage
        # Last: what this __init__ built, which pickling leaves out and rebuilds from the settings (__getstate__).
        self._built_here = frozenset(vars(self)) - inherited | {"_built_here"}

    # -- pickling ------------------------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """The plugin's settings, not its run: ``strategy="ddp_spawn"`` pickles the Trainer into each new process,
        where the plugin starts afresh (a new engine; the run's state, loss scales and FP32 masters, is restored from
        checkpoints). A subclass's own attributes are kept."""
        extra = {name: value for name, value in vars(self).items() if name not in self._built_here}
        # The settings object written (not the copy a pick made: each process picks for its own device) itself: it
        # keeps whether its warning about ignored settings was said.
        return {"opt_level": self._opt_level, "settings": written_settings(self.settings), "extra": extra}

    def __setstate__(self, state: dict[str, Any]) -> None:
        settings = state["settings"]
        given = {SETTINGS_OBJECT: settings} if isinstance(settings, MixedPrecisionSettings) else settings
        MixedPrecisionPlugin.__init__(self, state["opt_level"], **given)
        self.__dict__.update(state["extra"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._opt_level!r}, half_dtype={self.settings.half_dtype!r})"

    def __str__(self) -> str:
        # Lightning refuses the plugin with a precision= of its own ("Received both `precision=bf16-mixed` and
        # `plugins={plugin}`. Choose one."): its message then says which of the two to drop.
        return f"{self!r} [sets the Trainer's precision ({self.precision}) itself: pass no precision= with it]"

    @classmethod
    def from_settings(cls, settings: MixedPrecisionSettings) -> MixedPrecisionPlugin:
        """The plugin of ``settings``, as ``MixedPrecisionPlugin(settings.opt_level, **settings.to_kwargs())`` but
        with that object itself as :attr:`settings` (its warning about ignored settings comes once per object, however
        many front doors it is handed to)."""
        if not isinstance(settings, MixedPrecisionSettings):
            raise TypeError(f"settings={type(settings).__name__} must be a lightning_mpx.MixedPrecisionSettings.")
        return cls(settings.opt_level, **{SETTINGS_OBJECT: written_settings(settings)})

    @property
    def opt_level(self) -> str:
        """The opt level, ``"O0"`` to ``"O3"``."""
        return self.amp.opt_level

    # -- model: convert_module and connect come from ModelSetup (lightning_setup.py) ---------------------------

    @property
    def mixed_precision_config(self) -> Any:
        """The FSDP1 ``MixedPrecision`` of the opt level (:func:`~lightning_mpx.fsdp.fsdp1_mixed_precision`),
        which Lightning's ``FSDPStrategy`` wraps the model with. Where FSDP should not cast (O0) it is an empty
        ``MixedPrecision`` that FSDP treats as none (Lightning's throughput monitor reads its ``reduce_dtype``)."""
        return fsdp1_config(self.settings)

    def tensor_init_context(self) -> ContextManager[Any]:
        """Tensors are created as the user asks (the conversion happens in :meth:`convert_module`)."""
        return contextlib.nullcontext()

    def module_init_context(self) -> ContextManager[Any]:
        """Modules are built in FP32 (the conversion happens in :meth:`convert_module`)."""
        return contextlib.nullcontext()

    def forward_context(self) -> ContextManager[Any]:  # type: ignore[override]
        """``Amp.forward_context``: the O1 cast policy; at O2, loss functions in FP32; nothing at O0 and O3."""
        return self.amp.forward_context()  # the engine's own context, not one wrapped in another per step

    def train_step_context(self) -> ContextManager[Any]:  # type: ignore[override]
        """The training step's context (:meth:`forward_context`); the previous iteration's scale update first."""
        # A new training step starts (``with plugin.train_step_context():`` enters it at once): the previous
        # iteration is over, so its scale update is due now.
        if self.amp.iteration.update_pending or self._log_step is not None:  # (usually ended at the step already)
            self._end_iteration()
        if self._held.held:  # usually released at convert_input already (not called for a dataloader_iter)
            self._held.release()
        new = self._new_optimizers  # optimizers made mid-fit (strategy.setup_optimizers): registered before the forward
        if new.strategy is None or getattr(new.strategy, "_optimizers", None) is not new.seen:
            new.register(self.amp, self._module)
        inner = self.forward_context()
        if getattr(self._module, "automatic_optimization", True):
            return inner  # its iteration ends inside the step, at its one optimizer step
        return self._manual_step.scope(inner)  # marks a manual step as running (its reads end no iteration)

    def convert_input(self, data: Any) -> Any:
        """The batch as it is; a new training batch also ends the previous step's hold on its schedulers, and reads
        the steps skipped on the device (``skip_on_device``) while their gradients are still there (Lightning
        zeroes them after the next training step)."""
        self.amp.read_step_outcomes()
        if self._held.held:
            trainer = trainer_of(self._module) if self._module is not None else None
            if trainer is None or trainer.training:
                # The first call into the plugin for a new training batch, before the on_train_batch_start hooks
                # (callbacks such as LearningRateMonitor read the configs there); validation batches in between keep
                # the hold in place, for the loop's update of plateau schedulers after validation.
                self._held.release()
        return data  # the model's boundary (or FSDP's root policy) casts what the model takes

    def convert_output(self, data: Any) -> Any:
        """The step's output as it is (at O2/O3 the model's boundary cast its outputs to FP32)."""
        return data

    # -- backward ------------------------------------------------------------------------------------------------
    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:  # type: ignore[override]
        if module is None or getattr(module, "_fabric", None) is not None:  # fabric.backward(loss), not the Trainer
            raise TypeError(NOT_FOR_FABRIC.format(what="fabric.backward() is not the Trainer's backward"))
        return Precision.pre_backward(self, tensor, module)  # the callbacks' hook; FSDPPrecision's scaler is not used

    def backward(  # type: ignore[override]
        self,
        tensor: torch.Tensor,
        model: Any,
        optimizer: Any,
        *args: Any,
        loss_id: int = 0,
        **kwargs: Any,
    ) -> None:
        """Backward on the loss times the scale of ``loss_id`` (``self.manual_backward(loss, loss_id=1)``): the
        scaled loss goes to the LightningModule's ``backward`` hook, as with Lightning's own precision plugins."""
        # A manual backward runs inside the training step's cast scope: casts off there (without_casts' test, written
        # out: an automatic backward, outside every scope, pays no call for it).
        if torch._C._len_torch_function_stack() or any(map(torch.is_autocast_enabled, AUTOCAST_DEVICES)):
            without_casts(_scaled_backward, self.amp, tensor, model, args, loss_id, kwargs)
        else:
            _scaled_backward(self.amp, tensor, model, args, loss_id, kwargs)

    # -- optimizer step ------------------------------------------------------------------------------------------
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: Any,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """Run the closure, unscale once, call the hooks and clip, then step unless the gradients overflowed."""
        if isinstance(optimizer, LightningOptimizer):  # unwrap_optimizer, written out: a call saved at every step
            optimizer = optimizer.optimizer
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                "optimizer=LBFGS re-evaluates the loss through its closure several times per step, which loss "
                "scaling and step skipping cannot support; use a first-order optimizer or Trainer precision '32'."
            )
        if self._held.held:
            self._held.release()
        trainer = model.trainer
        self._range_test.enter(self.amp, trainer)
        # Asked once per step: the answer holds until the loop counts the step, after this returns, unless the step
        # stops the training (asked again below, as Lightning logs a stopping step).
        logging = bool(trainer.loggers) and trainer._logger_connector.should_update_logs
        if logging:
            # A logging step: its unscale measures underflow and headroom (Amp.update() ends the request).
            self.amp.request_telemetry()
        closure_result = closure()
        automatic = model.automatic_optimization
        skip_backward = closure_result is None and automatic  # training_step returned None: nothing to step
        # A manual step runs inside the training step's cast scope: casts off there (as in backward).
        if torch._C._len_torch_function_stack() or any(map(torch.is_autocast_enabled, AUTOCAST_DEVICES)):
            stepped = without_casts(self._hooks_and_step, model, trainer.callbacks, optimizer, skip_backward, kwargs)
        else:
            stepped = self._hooks_and_step(model, trainer.callbacks, optimizer, skip_backward, kwargs)
        # The optimizer's step's value, taken before amp.update() below drops it (the engine keeps no user value).
        stepper = self.amp._stepper
        returned, stepper.returned = stepper.returned, None
        if skip_backward:
            return closure_result
        # A step skipped on the device is read here only when a per-step schedule must be held on a skip (its update
        # comes before the next batch); otherwise at the next batch, backward or logging step.
        if automatic and (
            not isinstance(stepped, StepOutcome)
            or ((configs := trainer.strategy.lr_scheduler_configs) and step_configs(configs, optimizer))
        ):
            if not stepped:
                self._held.hold(trainer, optimizer)
        if not logging and trainer.should_stop and trainer.loggers:
            logging = trainer._logger_connector.should_update_logs
        if logging and self._log_step is None:
            self._log_step = trainer.fit_loop.epoch_loop._batches_that_stepped
        if automatic:  # one optimizer per iteration: the iteration ends with its step (_end_iteration, written out)
            self.amp.update()  # due: the step ran
            if self._log_step is not None:
                self._log_metrics()
        # As "bf16-mixed" returns optimizer.step(closure=closure): what the optimizer's step returned (a custom
        # optimizer's value, taken above), else the closure's result (what torch's optimizers return); None on a step
        # skipped on the host, as "16-mixed"'s GradScaler.step.
        if stepped is False:
            return None
        return closure_result if returned is None else returned

    def _hooks_and_step(
        self, model: Any, callbacks: list[Any], optimizer: Optimizer, skip_backward: bool, kwargs: dict[str, Any]
    ) -> Any:
        """The closure ran: unscale if the module or one of the Trainer's ``callbacks`` reads the gradients, the hooks
        and the clip, then the step (``None`` without one: the training step returned ``None``)."""
        try:
            unscaled = skip_backward or self.amp.is_unscaled(optimizer)  # (nothing to unscale, or done already)
        except RuntimeError:  # not registered: an optimizer made since fit started (strategy.setup_optimizers)
            unscaled = adopt_optimizer(self.amp, model.trainer, optimizer)
        readers = self._gradient_readers
        if not unscaled and readers.read_gradients(model, callbacks, plugin_clips=self._clip_overridden):
            # Hooks must see true gradients (Lightning's MixedPrecision unscales here too). Without such hooks the
            # unscale is left to the clip (one fused pass) or to the step. At O2 unscale_ also leaves the true values
            # on the model's own gradients.
            self.amp.unscale_(optimizer)
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, then gradient clipping
        if skip_backward:
            return None
        return self.amp.step(optimizer, **kwargs)  # the engine records it (step_was_skipped reads it there)

    def step_was_skipped(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer``'s most recent step was skipped because its gradients overflowed (with
        ``skip_on_device``, asking reads it)."""
        return self.amp.iteration.skipped(unwrap_optimizer(optimizer))

    # -- metrics, checkpoints, teardown --------------------------------------------------------------------------
    @property
    def scaler(self) -> GradScalerView | None:  # type: ignore[override]
        """Loss 0's scaler as ``torch.amp.GradScaler``'s read API shows it, for code ported from ``"16-mixed"``
        (``self.trainer.precision_plugin.scaler.get_scale()``, ``trainer.scaler.state_dict()``): a read-only
        :class:`~lightning_mpx.scaling.view.GradScalerView` of the engine's (``amp.scalers[i]`` for loss ``i``) when
        its scale is dynamic; ``None`` for a static scale (bfloat16's default, a fixed ``loss_scale``), as
        ``"bf16-mixed"``'s."""
        return GradScalerView(self, "trainer") if self.amp.scalers[0].dynamic else None

    def _read_scalers(self) -> list[LossScaler]:
        """The engine's scalers, its finished iteration's scale update done (what :meth:`metrics` shows)."""
        if not self._manual_step.running:
            self._end_iteration(log=False)
        return list(self.amp.scalers)

    def metrics(self) -> dict[str, float]:
        """The current ``mpx/*`` metrics as Python numbers (this reads device values: it syncs), counts since the
        previous call (the plugin's logs read on their own: a call takes nothing from the next log). Inside a manual
        training step the iteration is not over: the scale shown is the one before its update."""
        if not self._manual_step.running:
            self._end_iteration(log=False)
        self.amp.read_step_outcomes()
        return read_floats(self.amp.metrics())  # one host read, not one per metric

    def teardown(self) -> None:
        self._end_iteration()
        self._range_test.leave(self.amp)
        trainer = trainer_of(self._module) if self._module is not None else None
        if trainer is not None and trainer.interrupted:  # Lightning tears down while it handles the run's exception
            note_uncast_input(sys.exc_info()[1], self.amp)
            note_replaced_data(sys.exc_info()[1], self.amp)
        elif trainer is not None and trainer.state.fn == "fit" and self._sharded is None:
            take_averages(trainer.callbacks, self._module, self.amp)  # written in at on_train_end (not if it raised)
        # Every rank tears down: the last steps skipped on the device are settled (their records merged across
        # ranks, logged, their floor applied).
        self.amp.settle_step_outcomes()
        self.amp.follow_optimizer_modes()  # on_train_end's optimizer.eval() (schedule-free): the model at its point
        self._held.release()
        self._new_optimizers.forget()
        self._model_hooks.remove()
        self._evaluation.restore()  # an evaluation before the first fit: the model is the user's FP32 model again
        self.amp._stepper.closed = (  # the weights stay as the run left them
            f"{type(self).__name__}.amp.step() was called after the Trainer's teardown (the end of trainer.fit(), "
            "validate() or test()): the Trainer steps the optimizers through the engine inside trainer.fit(). Call "
            "trainer.fit() again to train on, or build an engine of your own for a loop of your own "
            "(lightning_mpx.Amp.from_settings(plugin.settings), then prepare_model() and prepare_optimizer())."
        )

    # -- internals -----------------------------------------------------------------------------------------------
    def _end_iteration(self, log: bool = True) -> None:
        """Update the scales of the iteration that ended, then log its metrics if it was a logging step."""
        if self.amp.iteration.update_pending:  # Amp.end_iteration's test, without its call
            self.amp.update()
        if log and self._log_step is not None:
            self._log_metrics()

    def _log_metrics(self) -> None:
        """Log the ``mpx/*`` metrics of the logging step that ended (``_log_step``) to the Trainer's loggers."""
        step, self._log_step = self._log_step, None
        trainer = self._module.trainer if isinstance(self._module, _pl.LightningModule) else None
        if trainer is not None:
            log_metrics(self.amp, trainer.loggers, step)


def _scaled_backward(
    amp: Amp, tensor: torch.Tensor, model: Any, args: tuple[Any, ...], loss_id: int, kwargs: dict[str, Any]
) -> None:
    """:meth:`MixedPrecisionPlugin.backward`'s work: the scaled loss to the LightningModule's ``backward`` hook."""
    scaled = amp.scale_loss(tensor, loss_id)
    policy = amp.policy
    hook = getattr(model, "backward", None)
    default = getattr(hook, "__func__", None) is _DEFAULT_BACKWARD
    try:  # no call per step: the except clause runs only when the backward raised
        if policy is not None and default and not getattr(model, "_fabric", None):
            # The hook is LightningModule.backward itself, neither overridden nor wrapped: its body, loss.backward(),
            # in the policy's recompute scope without a call into the policy's hook. Anything else (an override, or a
            # wrapper over the default such as mock.patch.object(..., wraps=...), which Lightning's is_overridden sees
            # through) is called.
            policy.backward(scaled, *args, **kwargs)
            return
        # Activation checkpointing recomputes with the forward's casts.
        with amp.backward_context(create_graph=builds_graph(args, kwargs)):
            model.backward(scaled, *args, **kwargs)
    except (RuntimeError, AssertionError) as error:  # FSDP at O2 on half parameters unfrozen: said so, by name
        refuse_unfrozen_half(amp._machine.sharding, error)
        raise
