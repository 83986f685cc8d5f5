"""The Trainer plugin's model set-up (:class:`ModelSetup`, a base of
:class:`~lightning_mpx.integrations.lightning.MixedPrecisionPlugin`): ``convert_module`` converts the LightningModule
for the opt level before the strategy wraps it, ``connect`` registers the optimizers with the engine after."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_mpx.common.imports import require
from lightning_mpx.common.weak import WeakAttribute
from lightning_mpx.engine.amp import Amp
from lightning_mpx.engine.sharding import is_sharded
from lightning_mpx.masters.weights import convert_module

_pl = require("lightning.pytorch", extra="lightning", feature="lightning_mpx.MixedPrecisionPlugin")

from lightning.pytorch.callbacks import BaseFinetuning  # noqa: E402
from lightning.pytorch.strategies import FSDPStrategy  # noqa: E402

from lightning_mpx.integrations.collectives import all_reduce_max  # noqa: E402
from lightning_mpx.integrations.lightning_averages import average_in_fp32  # noqa: E402
from lightning_mpx.integrations.lightning_conversion import (  # noqa: E402
    holds_masters,
    pick_half_dtype,
    record_half_dtype,
    refuse_lazy,
)
from lightning_mpx.integrations.lightning_strategies import shards_model, trainer_of, unwrap_optimizer  # noqa: E402

__all__ = ["ModelSetup", "NOT_FOR_FABRIC"]

#: The error for the Trainer plugin handed to Lightning Fabric, whose precision API it does not implement.
NOT_FOR_FABRIC = (
    "MixedPrecisionPlugin is the Lightning Trainer's precision plugin ({what}). With Lightning Fabric use "
    "lightning_mpx.FabricMixedPrecisionPlugin, which takes the same arguments: "
    "Fabric(plugins=[FabricMixedPrecisionPlugin('O2', ...)])."
)


class ModelSetup:
    """The plugin's ``convert_module`` and ``connect``, over its ``amp`` (:class:`~lightning_mpx.engine.amp.Amp`),
    ``settings``, the evaluation values (``_evaluation``) and the model hooks (``_model_hooks``)."""

    amp: Amp
    settings: Any
    _frozen_warned: bool
    _masters_synced: bool
    _sharded: nn.Module | None
    _evaluation: Any
    _model_hooks: Any
    _gradient_readers: Any

    _module = WeakAttribute()  # the model prepared last, not kept alive: a plugin kept after its fit holds no run

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Convert the LightningModule for the opt level before the strategy wraps it (O2/O3: half, batch norm FP32
        when asked, FP32 masters; input and output casts at the model's boundary).

        FP32 masters are made only when the Trainer is fitting: ``validate``, ``test`` and ``predict`` get the half
        model without them (as Lightning skips the DDP wrapper when not fitting). Before the first ``fit`` such a
        stage keeps the FP32 values the cast replaces and puts them back when it ends, so a later ``fit`` makes its
        masters from the exact FP32 weights.

        Under FSDP nothing is converted here: the model is sharded with the level's policies (FSDP2: by the user
        in ``configure_model``, before this call; FSDP1: by Lightning after it, with :attr:`mixed_precision_config`;
        at O3 it is cast to half here first) and :meth:`connect` prepares the engine with the sharded model."""
        trainer = trainer_of(module)
        if trainer is None and not isinstance(module, _pl.LightningModule):
            raise TypeError(NOT_FOR_FABRIC.format(what=f"module={type(module).__name__} is not a LightningModule"))
        fitting = trainer is None or trainer.state.fn == "fit"
        self._frozen_warned = self._frozen_warned and not fitting
        sharded = trainer is not None and shards_model(trainer.strategy)
        # Under DDP every rank is here together, before DDP wraps the model: the masters start from rank zero's exact
        # FP32 weights (one broadcast), not from their half rounding that DDP broadcasts.
        agree = trainer is not None and trainer.world_size > 1
        # A BaseFinetuning callback (BackboneFinetuning) froze the part it unfreezes later, before this cast: its FP32
        # values are kept for its masters (the memory they will take, as "bf16-mixed" keeps them), not its rounding.
        finetuning = trainer is not None and any(isinstance(c, BaseFinetuning) for c in trainer.callbacks)
        if not sharded and fitting and self.amp.properties.master_weights:
            refuse_lazy(module, "trainer.fit")  # a clear error, not the engine's on a parameter without a shape
        if module is not self._module:
            if ModelSetup._module.held(self):  # a different model (or one collected): a fresh engine
                self.amp.diagnose_overflows = False  # its forward hooks leave the old model
                self.amp = Amp.from_settings(self.settings)
                self._masters_synced = False
                self._sharded = None
            pick_half_dtype(self, module if trainer is None else trainer.strategy.root_device)
            if not sharded:
                self._evaluation.prepare(
                    self.amp, module, fitting=fitting, rank_zero_fp32=agree, keep_frozen=finetuning
                )
            self._module = module
        elif (
            not sharded and self.amp.properties.master_weights and not holds_masters(self.amp, module)
            and (fitting or self._evaluation.restored is module)
        ):
            # Evaluated before (made FP32 again when that stage ended), or taken over since: masters made here when
            # fitting, from its FP32 weights; another evaluation converts the restored model again.
            self._evaluation.prepare(self.amp, module, fitting=fitting, rank_zero_fp32=agree, keep_frozen=finetuning)
            self._masters_synced = False
        if sharded and isinstance(trainer.strategy, FSDPStrategy) and self.amp.properties.casts_model:
            if not self.amp.properties.master_weights:  # O3: FSDP shards the half model (FSDP2: shard_model does)
                keep_bn = bool(self.amp.properties.keep_batchnorm_fp32)
                convert_module(module, self.amp.half_dtype, keep_batchnorm_fp32=keep_bn)
        if self.amp.properties.casts_model:  # sharded too: FSDP2's O3 shards (shard_model) are half, O2's FP32
            record_half_dtype(module, self.amp.half_dtype)  # self.dtype in a step: the weights' dtype, as "bf16-true"
        self._model_hooks.remove()
        fsdp1 = sharded and isinstance(trainer.strategy, FSDPStrategy)
        self._model_hooks.install(module, self.amp, fsdp1=fsdp1)  # O2/O3: the boundary casts; the compiled hand-off
        return module

    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        """Register the optimizers with the engine (O2: masters in place of the half parameters) and set up
        cross-process overflow agreement. The learning-rate schedulers are left as they are: the hooks get the user's
        own objects (a per-step schedule is held on a skipped step by not stepping it, see :meth:`optimizer_step`).

        Under FSDP the engine is prepared here with the sharded model (FSDP1: Lightning's wrapper), which holds
        FSDP's sharded FP32 parameters (the masters at O2); every rank agrees on skipping through the engine's
        one all-reduce per step."""
        trainer = trainer_of(model)
        sharded = trainer is not None and shards_model(trainer.strategy)
        self._gradient_readers.clear()  # a new fit: classes may have changed since the last one
        self.amp._stepper.closed = None  # a new run: the Trainer steps through the engine again
        if sharded:
            if model is not self._sharded:
                if not is_sharded(model):
                    raise ValueError(
                        f"strategy={type(trainer.strategy).__name__}: the model has no FSDP module. Shard it in "
                        "the LightningModule's configure_model: lightning_mpx.fsdp.shard_model(self.model, "
                        "self.trainer.precision_plugin, mesh=self.device_mesh['data_parallel']). With tensor "
                        "parallelism (parallelize_module over device_mesh['tensor_parallel']) call it after "
                        "parallelize_module, with data_parallel_size=1 too: FSDP's FP32 parameters are the masters."
                    )
                self.amp.prepare_model(model, train=trainer.state.fn == "fit")
                self._sharded = model
        elif not self._masters_synced:
            # The model was moved to its device (and, under DDP, given rank zero's weights) after convert_module
            # made the masters: take them again from the weights that will actually be trained.
            for masters in self.amp.master_weights:
                masters.sync_from_model()
            self._masters_synced = True
        if trainer is None or trainer.state.fn == "fit":  # validate/test/predict step nothing: the optimizers kept
            for optimizer in optimizers:  # from an earlier fit may be another model's (this one has no masters)
                self.amp.prepare_optimizer(unwrap_optimizer(optimizer))
        if trainer is not None:
            if not sharded:  # an averaging callback's copy of a model converted before this fit: FP32 as on the first
                average_in_fp32(trainer.callbacks, self._module if self._module is not None else model, self.amp)
            self.amp.log_overflows = trainer.is_global_zero
            distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
            if not sharded and trainer.world_size > 1 and distributed:
                self.amp.found_inf_reducer = all_reduce_max
        return model, optimizers, lr_schedulers
