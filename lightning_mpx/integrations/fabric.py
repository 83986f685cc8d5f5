"""The Lightning Fabric plugin: ``Fabric(plugins=[FabricMixedPrecisionPlugin("O2")])``.

A :class:`lightning.fabric.plugins.Precision` (an ``FSDPPrecision``, which Fabric's ``FSDPStrategy`` requires) over the
same engine as the Trainer plugin (:class:`~lightning_mpx.engine.amp.Amp`), with the same settings. A Fabric loop stays
as it is::

    mpx = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")
    fabric = Fabric(accelerator="cuda", devices=2, strategy="ddp", plugins=[mpx], loggers=TensorBoardLogger("logs"))
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    for step, (x, y) in enumerate(loader):
        loss = F.cross_entropy(model(x), y)               # inputs cast to half, outputs back to FP32 (O2/O3)
        fabric.backward(loss)                             # scaled; fabric.backward(loss, loss_id=1) for a second loss
        fabric.clip_gradients(model, optimizer, max_norm=1.0)   # on the unscaled gradients
        optimizer.step()                                  # skipped on overflow
        if not mpx.step_was_skipped(optimizer):
            scheduler.step()                              # hold the schedule on a skipped step
        optimizer.zero_grad()
        if step % 50 == 0:
            fabric.log_dict({"loss": loss.item(), **mpx.metrics()}, step=step)

What it does, in Fabric's terms:

* ``fabric.setup``/``setup_module`` convert each model for the opt level (O2/O3: half, batch norm FP32, O2's FP32
  masters). A set-up model's forward runs inside the engine's forward context (O1: the cast policy; O2: loss functions
  in FP32); at O2/O3 its floating inputs are cast to half and its half outputs to FP32, and at O1 its half outputs are
  cast to FP32 too (as Fabric's own ``"16-mixed"`` does), so that a loss computed after the forward runs in FP32.
  ``fabric.autocast()`` is the forward context.
* Fabric hands its optimizers to the strategy, not to the precision plugin: the plugin registers those given to
  ``fabric.setup(model, *optimizers)`` there (read from Fabric's call; single-device and DDP strategies), and meets
  one set up apart (``fabric.setup_optimizers``) at its first unscale or step (O2: the FP32 masters stand in for its
  half parameters during its steps). The masters do not wait for it: the engine keeps the FP32 values a model holds
  at set-up (or loads after it) until each parameter's master is made, whichever optimizer steps first. Two cases
  need an optimizer set up apart registered earlier, and are refused with an error that says so otherwise: several
  losses (``num_losses > 1``: the scale each optimizer's gradients carry depends on it), and loading a checkpoint
  into an O2 optimizer (its FP32 state belongs to the masters); call
  :meth:`FabricMixedPrecisionPlugin.setup_optimizers` for it before the first backward or ``fabric.load``.
* Not aligned with Fabric's own precisions, on purpose (docs/fabric.md): at O1 floating inputs stay FP32 (the cast
  table casts op by op); at O2/O3 the default dtype stays FP32 in ``fabric.init_module()`` and the forward (the
  masters start from the FP32 values built there; losses are computed in FP32).
* ``fabric.clip_gradients`` unscales (one pass: unscale and overflow check), then Fabric clips
  :meth:`~FabricMixedPrecisionPlugin.main_params` with torch's ``clip_grad_norm_`` or ``clip_grad_value_``. On an
  overflow step ``main_params`` is one stand-in: nothing is clipped and the step is skipped; by norm the returned
  norm is the non-finite one (inf, or NaN) with ``error_if_nonfinite=False``, ``0.0`` with Fabric's default
  ``True`` (no error: a dynamic scale's overflow is routine; Fabric's ``"16-mixed"`` raises there).
* The scale is updated once per iteration: at the first forward, backward, :meth:`metrics` or checkpoint after the
  optimizer steps, so several optimizers stepping one after the other count as one iteration. Under DDP the
  overflow flag is reduced across processes before each step, so all ranks skip together. Under
  ``ModelParallelStrategy`` (FSDP2) the model the strategy sharded after ``convert_module`` is handed to the engine as
  a sharded model at the plugin's first call after ``fabric.setup`` (O0, O1, O3; O2 is refused at ``fabric.setup``:
  docs/fabric.md);
  under ``FSDPStrategy`` (FSDP1, wrapped with :attr:`~FabricMixedPrecisionPlugin.mixed_precision_config`) the
  wrapper is, and ``fabric.clip_gradients`` by norm is FSDP1's own clip of the whole model (O2 refused at
  ``fabric.setup``).
* ``mpx/*`` metrics (the Trainer plugin's names) come from :meth:`metrics`, read from the device only when called;
  the plugin's state (loss scalers, counters) goes into ``fabric.save`` as one more entry of the state;
  at O2 a set-up model's ``state_dict()`` (``fabric.save``'s ``{"model": model}``) gives its FP32 masters, which
  the plugin's entry names rather than holds (:mod:`~lightning_mpx.integrations.fabric_checkpoint`).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from types import FrameType
from typing import Any, ContextManager, Iterator

import torch
from torch import nn
from torch.optim import Optimizer
from typing_extensions import Unpack

from lightning_mpx.common.imports import require
from lightning_mpx.engine.amp import Amp
from lightning_mpx.engine.clipping import clip_limit, follow_model_writes
from lightning_mpx.engine.optimizer_state import _Stage
from lightning_mpx.engine.optimizer_step import AUTOCAST_DEVICES
from lightning_mpx.engine.sharding import is_sharded
from lightning_mpx.masters.weights import MasterWeights, convert_module, has_floating_parameters
from lightning_mpx.settings import (
    SETTINGS_OBJECT,
    MixedPrecisionSettings,
    SettingsKeywords,
    keyword_signature,
    settings_of,
    written_settings,
)

require("lightning.fabric", extra="lightning", feature="lightning_mpx.FabricMixedPrecisionPlugin")

from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.plugins.precision.fsdp import FSDPPrecision  # noqa: E402
from lightning.fabric.strategies import FSDPStrategy  # noqa: E402
from lightning.fabric.wrappers import _FabricOptimizer  # noqa: E402
from lightning_utilities.core.apply_func import apply_to_collection  # noqa: E402

from lightning_mpx.casting.checkpointing import builds_graph  # noqa: E402
from lightning_mpx.casting.policy import casts_off_if_on as _casts_off  # noqa: E402
from lightning_mpx.integrations.collectives import all_reduce_max  # noqa: E402
from lightning_mpx.integrations.fabric_bookkeeping import FabricBookkeeping  # noqa: E402
from lightning_mpx.integrations.fabric_clipping import (  # noqa: E402
    clip_for_fabric,
    counted_stand_ins,
    for_fabric_clip,
    forget_unseen_reads,
    note_unseen_clip,
    scaled_for_user,
    settle_reads,
)
from lightning_mpx.integrations.fabric_generate import install_generate  # noqa: E402
from lightning_mpx.integrations.fabric_sharding import (  # noqa: E402
    clipped_together,
    is_fsdp1,
    refuse_o2_sharding,
)
from lightning_mpx.integrations.fp32_export import MastersInStateDict  # noqa: E402
from lightning_mpx.integrations.lightning_conversion import (  # noqa: E402
    holds_masters,
    pick_half_dtype,
    precision_of,
    record_half_dtype,
    refuse_lazy,
)

__all__ = ["FabricMixedPrecisionPlugin"]


class FabricMixedPrecisionPlugin(FabricBookkeeping, FSDPPrecision):
    """Apex-style mixed precision for Lightning Fabric.

    It works with single-device, DDP, ``FSDPStrategy`` (FSDP1) and ``ModelParallelStrategy`` (FSDP2). It is an
    ``FSDPPrecision`` only because Fabric's ``FSDPStrategy`` accepts nothing else; every method of ``FSDPPrecision`` is
    replaced here, so none of its behaviour (autocast, input casts, its ``ShardedGradScaler``) applies under any
    strategy. Its bookkeeping (what it catches up with at each call, the optimizers it meets, its metrics and
    checkpoints) is its base :class:`~lightning_mpx.integrations.fabric_bookkeeping.FabricBookkeeping`.

    Args:
        opt_level: ``"O0"`` (FP32), ``"O1"`` (cast-table policy), ``"O2"`` (half model, FP32 master weights, batch
            norm FP32) or ``"O3"`` (pure half).
        **settings: The keyword settings of :class:`~lightning_mpx.MixedPrecisionPlugin` and
            :class:`~lightning_mpx.engine.amp.Amp` (``half_dtype``, ``num_losses``, ``cast_table``, the loss-scaler
            settings, ``fp32_modules``, ``diagnose_overflows``, ``model_writes``, opt-level overrides such as
            ``keep_batchnorm_fp32``...; typed in :class:`~lightning_mpx.settings.SettingsKeywords`, ``help()`` lists
            each with its default), documented in :class:`~lightning_mpx.settings.MixedPrecisionSettings` and
            checked by the engine here.

    Attributes:
        amp: The :class:`~lightning_mpx.engine.amp.Amp` engine (scalers, masters, overflow records).

    Example::

        fabric = Fabric(plugins=[FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")])
    """

    @keyword_signature()
    def __init__(self, opt_level: str = "O1", **settings: Unpack[SettingsKeywords]) -> None:
        self._opt_level = opt_level
        self._settings = settings_of(opt_level, settings)  # type: ignore[arg-type]
        self.amp = Amp.from_settings(self._settings)  # bad arguments fail at Fabric construction, not mid-setup
        # A Fabric user never calls prepare_optimizer(): the engine's errors name the plugin's call instead.
        self.amp.register_call = (
            "the Fabric plugin registers an optimizer at its first step or unscale: call "
            "plugin.setup_optimizers(optimizer) after fabric.setup() to register it now (the plugin's own "
            "master_params(optimizer) registers it too)"
        )
        # ...so a write over parameters no optimizer holds yet, in the first iteration (a SAM-style first_step), is
        # judged there (FabricBookkeeping._register), not refused at the backward after it (engine.raw_steps)
        self.amp.registers_at_step = True
        # Fabric's own words for it (no half_dtype given: provisional until convert_module picks the device's)
        self.precision = precision_of(self.amp)  # type: ignore[assignment]
        self._modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        # masters made by convert_module, to take from the set-up model; True: the ranks agreed on their FP32 values
        self._unsynced: list[tuple[MasterWeights, bool]] = []
        self._unchecked: list[weakref.ref[nn.Module]] = []  # prepared by convert_module; sharded by the strategy?
        # ...and the frames of the fabric.setup calls that converted them, where the FSDP1 wrapper is found after
        # (fabric_sharding.fsdp1_wrapper): held until the first call after fabric.setup, then let go.
        self._setups: list[tuple[weakref.ref[nn.Module], FrameType]] = []
        # ...and those whose fabric.setup compiles them again after it (the compiled wrapper: one of its locals after).
        self._compiled_setups: list[tuple[weakref.ref[nn.Module], FrameType]] = []
        self._optimizers: weakref.WeakSet[Optimizer] = weakref.WeakSet()
        # main_params handed out since the unscale: the masters' gradients' marks then (fabric_clipping), or None
        self._clipping: weakref.WeakKeyDictionary[Optimizer, Any] = weakref.WeakKeyDictionary()
        # Each converted model's FSDP1 wrapper (FSDPStrategy), found at the first call after fabric.setup.
        self._wrappers: weakref.WeakKeyDictionary[nn.Module, weakref.ref[nn.Module]] = weakref.WeakKeyDictionary()
        self._held = self.amp._checkpoint.held  # the engine's: masters a loaded entry left to the model's entry
        self._flips = False  # a schedule-free optimizer registered: the forward scope runs untraced (forward_context)

    @classmethod
    def from_settings(cls, settings: MixedPrecisionSettings) -> FabricMixedPrecisionPlugin:
        """The plugin of ``settings`` (the same object the Trainer plugin and ``Amp`` take; its warning about ignored
        settings comes once per object)."""
        if not isinstance(settings, MixedPrecisionSettings):
            raise TypeError(f"settings={type(settings).__name__} must be a lightning_mpx.MixedPrecisionSettings.")
        return cls(settings.opt_level, **{SETTINGS_OBJECT: written_settings(settings)})

    # -- pickling (strategy="ddp_spawn" pickles Fabric into each process) ------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """The settings, not the run: each process starts a fresh engine (a run's state is in its checkpoints)."""
        return {"opt_level": self._opt_level, "settings": self._settings}  # the object: it keeps its warning said

    def __setstate__(self, state: dict[str, Any]) -> None:
        settings = state["settings"]
        given = {SETTINGS_OBJECT: settings} if isinstance(settings, MixedPrecisionSettings) else settings
        FabricMixedPrecisionPlugin.__init__(self, state["opt_level"], **given)

    def __repr__(self) -> str:
        # as the Trainer plugin's (the half dtype as given; None: the device's, picked at convert_module)
        return f"{type(self).__name__}({self._opt_level!r}, half_dtype={self.settings.half_dtype!r})"

    def __str__(self) -> str:
        # A Trainer refuses this plugin ("Found invalid type for plugin {plugin}", before any call into it): its
        # message then says which plugin a Trainer takes.
        return f"{self!r} [for Lightning Fabric; a Trainer takes lightning_mpx.MixedPrecisionPlugin]"

    @property
    def opt_level(self) -> str:
        """The opt level, ``"O0"`` to ``"O3"``."""
        return self.amp.opt_level

    @property
    def settings(self) -> MixedPrecisionSettings:
        """The engine's :class:`~lightning_mpx.settings.MixedPrecisionSettings` (what ``shard_model`` reads from the
        plugin passed as its ``precision``)."""
        return self.amp.settings

    @property
    def mixed_precision_config(self) -> Any:
        """The FSDP1 ``MixedPrecision`` of the opt level (:func:`~lightning_mpx.fsdp.fsdp1_mixed_precision`: at O1
        gathered in half, reduced in FP32), which Fabric's ``FSDPStrategy`` wraps the model with, as the Trainer
        plugin's. Where FSDP should not cast (O0) it is an empty ``MixedPrecision`` that FSDP treats as none. At O2
        the strategy's read (``fabric.setup``, ``fabric.init_module``) is refused: O2 cannot train under FSDP1."""
        refuse_o2_sharding(self.amp, sys._getframe(1).f_locals.get("self"))  # the reader: FSDPStrategy, or another
        from torch.distributed.fsdp import MixedPrecision

        from lightning_mpx.integrations.fsdp import fsdp1_mixed_precision

        config = fsdp1_mixed_precision(self.amp.settings)
        # `_module_classes_to_ignore=()`: no module given a policy of its own, exactly what `mixed_precision=None` does.
        return config if config is not None else MixedPrecision(_module_classes_to_ignore=())

    def tensor_init_context(self) -> ContextManager[Any]:
        """Tensors are created as the user asks (``FSDPPrecision``'s default dtype is not set)."""
        return contextlib.nullcontext()

    def module_init_context(self) -> ContextManager[Any]:
        """Modules are built in FP32 (the conversion happens in :meth:`convert_module`)."""
        return contextlib.nullcontext()

    # -- model -------------------------------------------------------------------------------------------------
    def convert_module(self, module: nn.Module) -> nn.Module:
        """Convert ``module`` for the opt level (``fabric.setup`` calls it before moving and wrapping the model).

        Several models (a GAN's, each set up on its own) share the engine: one set of loss scalers, masters per
        model."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"module={type(module).__name__} is not a torch.nn.Module.")
        setup = _fabric_call(sys._getframe(1))  # fabric.setup's frame: its Fabric and the optimizers it was given
        given = setup.f_locals if setup is not None else {}
        caller = given.get("self")  # fabric.setup's Fabric, or not a Fabric
        if module in self._modules:  # set up before: at O2 unsharded, again if another plugin took its masters since
            if not self.amp.properties.master_weights or self.amp.sharded or holds_masters(self.amp, module):
                if isinstance(caller, Fabric) and given.get("optimizers"):  # a new optimizer for it (a next stage)
                    self._meet_at_setup(given["optimizers"], caller.strategy)
                return module
        refuse_o2_sharding(self.amp, caller, module)
        pick_half_dtype(self, caller.device if isinstance(caller, Fabric) else module)  # none given: the device's
        # fabric.setup under DDP: every rank is here together, before the strategy wraps the model; the masters start
        # from rank zero's exact FP32 weights (one broadcast), not from their half rounding that DDP broadcasts.
        agree = isinstance(caller, Fabric) and caller.world_size > 1
        props = self.amp.properties
        if props.casts_model and not has_floating_parameters(module):
            # A parameter-free wrapper (nn.Identity, a model of buffers): nothing to train in half and no masters,
            # which the engine refuses; its floating buffers take the half dtype, as Fabric's own "*-true" precisions
            # cast a whole module, and its inputs and outputs are cast as any set-up model's.
            convert_module(
                module, props.half_dtype, keep_batchnorm_fp32=props.keep_batchnorm_fp32 is not False,
                require_parameters=False,
            )
            record_half_dtype(module, props.half_dtype)
            self._modules.add(module)
            return module
        if props.master_weights:
            refuse_lazy(module, "fabric.setup")  # a clear error, not the engine's on a parameter without a shape
        before = {id(masters) for masters in self.amp.master_weights}
        if self.amp.sharded and not is_sharded(module):
            # A model set up after the engine took a sharded one (a GAN's second model, a head set up mid-run): not
            # sharded yet, as every model Fabric converts (the strategy shards it after this). Converted as the first
            # one was; adopt_sharded hands it over sharded, or refuses it if the strategy left it whole.
            self.amp.sharded = False
            try:
                self.amp.prepare_model(module)
            finally:
                self.amp.sharded = True
        else:
            self.amp.prepare_model(module, rank_zero_fp32=agree)
        if props.master_weights:  # module.state_dict() (fabric.save) gives the FP32 masters, as the Trainer's model
            MastersInStateDict.install(module, self.amp)
        if props.casts_model:  # sharded too (a model set up after the engine took a sharded one): the weights' dtype
            record_half_dtype(module, props.half_dtype)  # LightningModule.dtype: the weights', as Fabric's "bf16-true"
        # Fabric calls generate() on the module itself, past convert_input: at O2/O3 its float inputs cast too.
        install_generate(module, props.half_dtype if props.casts_model else None)
        # The model is moved to its device (and, under DDP, given rank zero's weights) after this: its masters are
        # taken again from the set-up model at the next call into the plugin.
        self._unsynced += [(masters, agree) for masters in self.amp.master_weights if id(masters) not in before]
        self._unchecked.append(weakref.ref(module))
        if setup is not None and given.get("compile_kwargs") is not None:  # fabric.setup compiles it after this
            self._compiled_setups.append((weakref.ref(module), setup))
        if setup is not None and isinstance(getattr(caller, "strategy", None), FSDPStrategy):
            # The wrapper FSDPStrategy puts around the model is one of its locals after it. Only there: the frame holds
            # its callers' (a function of the user's that returned, with its temporaries) until the next call.
            self._setups.append((weakref.ref(module), setup))
        self._modules.add(module)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.amp.log_overflows = torch.distributed.get_rank() == 0
            if torch.distributed.get_world_size() > 1:
                self.amp.found_inf_reducer = all_reduce_max  # every rank makes the same skip decision
        if isinstance(caller, Fabric) and given.get("optimizers"):  # fabric.setup(model, *optimizers)
            self._meet_at_setup(given["optimizers"], caller.strategy)
        return module

    def forward_context(self) -> ContextManager[Any]:
        """The engine's forward context (``fabric.autocast()`` and every set-up model's forward): the O1 cast
        policy; at O2, loss functions in FP32; at O3, a loss on arguments of two floating dtypes in FP32; nothing
        at O0."""
        self._begin()
        if self._flips:
            return _untraced_scope(self.amp)
        return self.amp.forward_context()

    def convert_input(self, data: Any) -> Any:
        """A set-up model's inputs: floating tensors cast to half at O2/O3."""
        self._begin()
        return self.amp.cast_inputs(data) if self.amp.properties.casts_model else data  # (O0/O1: a call saved)

    def convert_output(self, data: Any) -> Any:
        """A set-up model's outputs: half tensors cast to FP32, so that the loss computed from them runs in FP32."""
        props = self.amp.properties  # not the engine's properties of its parts: dynamo cannot call their getters
        if props.casts_model:
            return self.amp.cast_outputs(data)
        if props.opt_level == "O0":
            return data
        half = props.half_dtype
        if type(data) is torch.Tensor:  # the usual output, without apply_to_collection's walk
            return data.float() if data.dtype == half else data
        return apply_to_collection(data, torch.Tensor, lambda t: t.float() if t.dtype == half else t)

    # -- backward ----------------------------------------------------------------------------------------------
    def backward(
        self, tensor: torch.Tensor, model: nn.Module | None, *args: Any, loss_id: int = 0, **kwargs: Any
    ) -> None:
        """Backward on the loss times the scale of ``loss_id`` (``fabric.backward(loss, loss_id=1)``).

        Raises:
            RuntimeError: before ``fabric.setup`` (no model set up, no optimizer registered), naming it: the scaled
                gradients of a model Fabric never set up would reach its optimizer scaled.
        """
        if not (self._modules.data or self._optimizers.data):  # sets: no call per step
            raise RuntimeError(_BEFORE_SETUP)
        if self._clipping.data:  # main_params handed out and no step since: reads only, a write is taken
            forget_unseen_reads(self.amp, self._clipping)
        self._begin()
        if not args and not torch._C._len_torch_function_stack() and not any(
            map(torch.is_autocast_enabled, AUTOCAST_DEVICES)
        ):  # outside every scope, the usual case (casts_off_if_on's test, written out: its call and context saved)
            self.amp.backward(tensor, loss_id, **kwargs)
            return
        with _casts_off():  # fabric.backward called inside fabric.autocast()
            if args:
                scaled = self.amp.scale_loss(tensor, loss_id)
                # Activation checkpointing recomputes with the forward's casts.
                with self.amp.backward_context(create_graph=builds_graph(args, kwargs)):
                    scaled.backward(*args, **kwargs)
            else:
                self.amp.backward(tensor, loss_id, **kwargs)

    # -- optimizer ---------------------------------------------------------------------------------------------
    def setup_optimizers(self, *optimizers: Optimizer) -> None:
        """Register optimizers with the engine now rather than at their first unscale or step (Fabric does not
        hand them to the precision plugin; those given to ``fabric.setup(model, *optimizers)`` are registered
        there, so this is for one set up apart, by ``fabric.setup_optimizers``). Calling it again for an optimizer
        does nothing.

        Needed with several losses (``num_losses > 1``), before the first ``fabric.backward``, and at O2 before
        ``fabric.load`` restores an optimizer's state (which then goes to the FP32 masters, not the half
        parameters). Not needed for the masters themselves: they start from the model's FP32 weights whichever
        optimizer steps first. Takes what ``fabric.setup`` returned or the optimizers themselves."""
        for optimizer in optimizers:
            self._register(_unwrap(optimizer), lazily=False)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Step ``optimizer`` unless its gradients overflowed (unscaling them first if nothing did yet); returns what
        its ``step()`` returned (``None`` when skipped)."""
        optimizer = _unwrap(optimizer)
        # The WeakSets' membership tests as WeakSet.__contains__ makes them (the weak reference looked up in its set
        # of references), at the C level: two calls saved per step. An Optimizer always takes a weak reference.
        if (self._unchecked or self._unsynced or not isinstance(optimizer, Optimizer)
                or weakref.ref(optimizer) not in self._optimizers.data):
            self._register(optimizer)  # (else nothing to do: a call saved per step)
        # The engine records the outcome (a StepOutcome with skip_on_device, read when step_was_skipped() asks) and
        # the scale update it makes due; inside fabric.autocast(), Amp turns the casts off.
        if self._clipping.data:  # main_params handed out: another's reads told before this step writes shared ones
            settle_reads(self.amp, self._clipping, optimizer, itself=False)
        if self._clipping.data and weakref.ref(optimizer) in self._clipping.data:
            # O2: fabric.clip_gradients clipped the masters' gradients with torch's clip, which the engine does not
            # see: the model's get the clipped values, what a step leaves for a loop that keeps its gradients.
            forget_unseen_reads(self.amp, self._clipping, optimizer)
            self.amp.show_unscaled_on_model(optimizer)
        self.amp.step(optimizer, **kwargs)
        # What the optimizer's step returned, as "bf16-mixed" returns it (None on a step skipped on the host, as
        # "16-mixed"'s GradScaler.step); taken, not kept: the engine holds no user value past the step.
        stepper = self.amp._stepper
        returned, stepper.returned = stepper.returned, None
        return returned

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale ``optimizer``'s gradients (once per step; ``fabric.clip_gradients`` calls it). At O2 the true
        values go to the FP32 masters' gradients, and a half copy to the model's.

        Raises:
            ValueError: called by ``fabric.clip_gradients`` with a ``max_norm`` or ``clip_val`` that is not a positive
                number (``math.inf`` is: no clipping), before anything is unscaled. torch's clip takes them and
                flips (negative), zeroes (zero) or poisons (NaN) the gradients the step applies.
        """
        caller = sys._getframe(1)
        name = _CLIP_LIMITS.get(caller.f_code.co_name)  # Fabric's Strategy.clip_gradients_norm/_value: their limit
        # (a strategy's own clip_gradients_norm(self, module, optimizer, **kwargs) has no such local: not checked)
        if name is not None and name in (local := caller.f_locals):
            limit = local[name]
            if type(limit) not in (int, float) or not limit > 0:  # a call only for a bad (or unusual) one
                clip_limit(name, limit)
        optimizer = _unwrap(optimizer)
        self._register(optimizer)
        # FSDP1 wrappers: found when the plugin took the models, or the models themselves when the user wrapped them
        # before fabric.setup (none under the other strategies: nothing per step)
        wrappers = [w for w in (ref() for ref in list(self._wrappers.values())) if w is not None]
        wrappers += [m for m in list(self._modules) if type(m).__name__ == "FullyShardedDataParallel" and is_fsdp1(m)]
        together = clipped_together(optimizer, wrappers, list(self._optimizers)) if wrappers else [optimizer]
        if self._clipping.data:  # main_params handed out: reads told before this clip (or unscale) writes them
            settle_reads(self.amp, self._clipping, optimizer, itself=True)
        for each in together:
            if not self.amp.is_unscaled(each):
                with _casts_off():
                    self.amp.unscale_(each)
            elif self.amp.properties.master_weights:  # unscaled before (by the user): the model's writes since are
                follow_model_writes(self.amp._machine, each)  # what the clip that follows clips, as "bf16-mixed"'s

    def main_params(self, optimizer: Optimizer) -> Iterator[torch.Tensor]:  # type: ignore[override]
        """The tensors the optimizer updates (the FP32 masters at O2), whose gradients ``fabric.clip_gradients``
        clips. On an overflow step once unscaled the step is skipped and there is nothing to clip: one zero stands
        in for them, and nothing real is clipped by value or by norm (any ``norm_type``). By norm Fabric's clip then
        returns the overflow's non-finite norm (inf, or NaN) when called with ``error_if_nonfinite=False``, as its
        own precisions do, and ``0.0`` with its default ``True`` (the stand-in's gradient is zero: no error, where
        ``"16-mixed"`` raises). Reading the overflow flag waits for the device, as the clip's norm does."""
        optimizer = _unwrap(optimizer)
        self._register(optimizer)
        state = self.amp._machine.state(optimizer)  # its stage, read here (is_unscaled's call saved, twice at O2)
        if scaled_for_user(state):  # the user's clip right after fabric.backward: unscaled first
            self.unscale_gradients(optimizer)
        unscaled = state.stage is _Stage.UNSCALED
        if unscaled:
            found = self.amp.found_inf(optimizer)
            if found is not None and self.amp.sharded:
                if for_fabric_clip(sys._getframe(1)):
                    # Found on this rank's shards: every rank must hand its clip the same (a DTensor norm is a
                    # collective).
                    found = found.clone()
                    all_reduce_max(found)
                else:  # the user's own read (a log on rank 0 alone): no collective, the parameters as they are
                    found = None
            # Unsharded, the read the step then takes (Amp.overflowed): one host read of the flag per step, not two.
            # The stand-in is for Fabric's clip alone: the user's own read (a log of the gradients' or weights' norm,
            # torch's clip) got one zero on an overflow step, a norm of 0.0 where GradScaler's unscale_ leaves inf or
            # NaN, a weight norm of 0.0; it gets the parameters, their gradients non-finite, as GradScaler's.
            if (found is not None and (bool(found) if self.amp.sharded else self.amp.overflowed(optimizer))
                    and (self.amp.sharded or for_fabric_clip(sys._getframe(1)))):  # fmt: skip
                args = sys._getframe(1).f_locals  # Fabric's Strategy.clip_gradients_norm (the caller): its arguments
                if not self.amp.sharded and type(args.get("norm_type")) in (int, float) and args["norm_type"] == 0:
                    return iter(counted_stand_ins(self.amp.master_params(optimizer), found.device))
                lenient = args.get("error_if_nonfinite") is False  # whether the user asked for the error
                return iter(_nothing_to_clip(found.device, self._non_finite_norm(optimizer) if lenient else None))
        if unscaled and self.amp.properties.master_weights:
            marks = None
            if not self.amp.sharded:  # Fabric's clip: made here and shown on the model at once (fabric_clipping)
                clipped = clip_for_fabric(self.amp, optimizer, sys._getframe(1))
                if clipped is not None:
                    return iter(clipped)
                # a strategy's own clip: a write after it refused, not lost (a read only: taken at the step)
                marks = note_unseen_clip(self.amp, optimizer, sys._getframe(1))
            self._clipping.setdefault(optimizer, marks)
        return iter(self.amp.master_params(optimizer))

    def _non_finite_norm(self, optimizer: Optimizer) -> torch.Tensor:
        """On an overflow step, the norm Fabric's clip would compute: NaN where a gradient holds one, else inf (one
        pass over the gradients, on overflow steps only; sharded, inf: the NaN may be on another rank)."""
        grads = [p.grad for p in self.amp.master_params(optimizer) if p.grad is not None]
        if self.amp.sharded or not grads:
            return torch.tensor(float("inf"))
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        return torch.where(torch.isnan(norm), norm, float("inf"))

    def master_params(self, optimizer: Optimizer) -> list[torch.Tensor]:
        """The tensors ``optimizer`` updates: the FP32 masters of its half parameters at O2 (a layer frozen since
        ``fabric.setup`` included: its master holds its FP32 weights), its parameters otherwise. Registers the
        optimizer if the plugin has not met it yet. Takes what ``fabric.setup`` returned or the optimizer itself."""
        optimizer = _unwrap(optimizer)
        self._register(optimizer)
        return self.amp.master_params(optimizer)

    def fp32_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """``module.state_dict()`` in FP32, the model unchanged: each half parameter with an FP32 master (or an FP32
        value kept for the master it will get) as that exact value, other half tensors upcast (see
        :meth:`lightning_mpx.engine.amp.Amp.fp32_state_dict`). Takes what ``fabric.setup`` returned or the model itself;
        the keys are the model's own (``fabric.setup``'s wrapper adds no prefix)."""
        self._after_setup()
        return self.amp.fp32_state_dict(module)

    def step_was_skipped(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer``'s most recent step was skipped because its gradients overflowed: hold its
        learning-rate schedule then (``if not mpx.step_was_skipped(optimizer): scheduler.step()``). With
        ``skip_on_device``, asking reads the step's outcome (waiting for the device up to that step)."""
        return self.amp.iteration.skipped(_unwrap(optimizer))


@torch.compiler.disable
def _untraced_scope(amp: Amp) -> ContextManager[Any]:
    """``amp.forward_context()`` never traced, for a schedule-free optimizer: its ``eval()``/``train()`` since the last
    forward redone on the masters (``masters.swap.follow_modes``) in eager code. In a model compiled after
    ``fabric.setup``, dynamo runs ``_FabricModule.forward`` eagerly (its backward hook breaks the graph) and compiles
    each call in it as a frame of its own: traced, the redo made graphs, breaks and recompiles at every flip."""
    return amp.forward_context()


def _fabric_call(frame: FrameType) -> FrameType | None:
    """The frame of the Fabric call that converts a module (``convert_module``'s caller ``frame``): ``fabric.setup``'s
    (its locals: ``self``, its ``optimizers``; after it, the ``module`` it set up) or ``setup_module``'s. The caller
    itself when its ``self`` is a ``Fabric`` (a subclass's own ``setup`` included), else the nearest
    ``Fabric.setup``/``setup_module`` above it (a subclass of the plugin whose ``convert_module`` calls ``super()``, a
    wrapper put on the method); ``None`` when there is none: the plugin then meets the optimizers at their first step
    and takes the device from the module."""
    if isinstance(frame.f_locals.get("self"), Fabric):
        return frame
    codes = (Fabric.setup.__code__, Fabric.setup_module.__code__)
    for _ in range(_FRAMES_SEARCHED):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            break
        if frame.f_code in codes:
            return frame
    return None


# How far up convert_module's caller _fabric_call looks for Fabric's setup (a few wrappers deep).
_FRAMES_SEARCHED = 8

# fabric.backward before anything was set up (Fabric refuses the same under DeepSpeed; "16-mixed" scales silently).
_BEFORE_SETUP = (
    "fabric.backward(loss) was called before fabric.setup(): the plugin has set up no model and knows no optimizer. "
    "It scales the loss and unscales the gradients at the step of an optimizer it knows, so a model Fabric did not "
    "set up would keep scaled gradients (an optimizer stepped by hand applies them scaled; at O2 fabric.setup then "
    "drops them as it casts the model), and it ran its forward without the opt level's casts. Call "
    "fabric.setup(model, optimizer) (or fabric.setup_module(model)) before the first fabric.backward(); for a loss "
    "that trains tensors of your own (no model), register their optimizer first: plugin.setup_optimizers(optimizer)."
)

# The Strategy methods fabric.clip_gradients calls (which call unscale_gradients), by name, and their limit's name.
_CLIP_LIMITS = {"clip_gradients_norm": "max_norm", "clip_gradients_value": "clip_val"}


def _unwrap(optimizer: Any) -> Any:
    """The torch optimizer inside what ``fabric.setup`` returned (Fabric's wrapper subclasses its class)."""
    return optimizer.optimizer if isinstance(optimizer, _FabricOptimizer) else optimizer


def _nothing_to_clip(device: torch.device, norm: torch.Tensor | None = None) -> list[torch.Tensor]:
    """What an overflow step hands Fabric's clip, as a list (torch's clip warns about a generator, refuses an empty
    list, and its infinity norm refuses an empty tensor): one FP32 zero standing in for the parameters, whose
    gradient is ``norm`` (inf or NaN: the clip returns that non-finite norm, by every norm type, as torch's does with
    ``error_if_nonfinite=False``) or zero (``None``: a norm of ``0.0`` and no error). Clipping it changes no real
    gradient: the step is skipped."""
    tensor = torch.zeros(1, device=device)
    tensor.grad = torch.zeros(1, device=device) if norm is None else norm.to(device=device).reshape(1).float()
    return [tensor]

