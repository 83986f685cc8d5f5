"""What the Trainer plugin (:mod:`lightning_mpx.integrations.lightning`) needs to know of Lightning's strategies and
wrappers: whether a strategy shards the model with FSDP (and which it refuses), FSDP1's mixed-precision config, the
Trainer of a wrapped model, and the optimizer inside a ``LightningOptimizer``."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_mpx.common.imports import require
from lightning_mpx.settings import MixedPrecisionSettings

_pl = require("lightning.pytorch", extra="lightning", feature="lightning_mpx.MixedPrecisionPlugin")

from lightning.pytorch.core.optimizer import LightningOptimizer  # noqa: E402
from lightning.pytorch.strategies import (  # noqa: E402
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
)

__all__ = ["adopt_optimizer", "fsdp1_config", "shards_model", "trainer_of", "unwrap_optimizer"]

#: Strategies whose model is one ordinary module per process: the plugin converts it and makes FP32 masters.
_REPLICATED_STRATEGIES = (SingleDeviceStrategy, DDPStrategy)
#: Strategies that shard the model with FSDP: FSDP's own sharded parameters are the masters.
_SHARDED_STRATEGIES = (FSDPStrategy, ModelParallelStrategy)


def shards_model(strategy: Any) -> bool:
    """Whether ``strategy`` shards the model with FSDP; a strategy the plugin cannot step is refused."""
    if isinstance(strategy, DeepSpeedStrategy):  # a DDPStrategy subclass: asked first
        raise ValueError(
            f"strategy={type(strategy).__name__} is not supported by MixedPrecisionPlugin: DeepSpeed runs its "
            "own fp16/bf16 engine and loss scaler. Configure mixed precision in DeepSpeed's config instead "
            "(its \"fp16\" or \"bf16\" section, or Trainer(precision=\"16-mixed\") with strategy=\"deepspeed\")."
        )
    if isinstance(strategy, _SHARDED_STRATEGIES):
        return True
    if isinstance(strategy, _REPLICATED_STRATEGIES):
        return False
    raise ValueError(
        f"strategy={type(strategy).__name__} is not supported by MixedPrecisionPlugin; supported: single-device, "
        "DDP (strategy='ddp'), FSDP (strategy='fsdp') and ModelParallelStrategy (FSDP2)."
    )


def fsdp1_config(settings: MixedPrecisionSettings) -> Any:
    """The FSDP1 ``MixedPrecision`` of ``settings`` for Lightning's ``FSDPStrategy``. Where FSDP should not cast (O0)
    it is an empty ``MixedPrecision`` that FSDP treats as none (Lightning's throughput monitor reads its
    ``reduce_dtype``)."""
    # Imported here: FSDP is only needed (and only importable in torch builds with torch.distributed) under FSDP.
    from torch.distributed.fsdp import MixedPrecision

    from lightning_mpx.integrations.fsdp import fsdp1_mixed_precision

    config = fsdp1_mixed_precision(settings)
    if config is None:
        # `_module_classes_to_ignore=()`: no module given a policy of its own (FSDP's default singles out batch
        # norm), exactly what `mixed_precision=None` does.
        return MixedPrecision(_module_classes_to_ignore=())
    # The root's inputs are not cast: Lightning reaches training_step through the root's forward, so they are the
    # whole batch (targets too). The plugin's boundary casts cast the model's own inputs (O2/O3), as on one device.
    return dataclasses.replace(config, cast_root_forward_inputs=False)


def unwrap_optimizer(optimizer: Any) -> Optimizer:
    """The torch optimizer inside a ``LightningOptimizer`` (which Lightning builds as a subclass of the optimizer's
    own class, so an ``isinstance(..., Optimizer)`` test cannot tell them apart)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def adopt_optimizer(amp: Any, trainer: Any, optimizer: Optimizer) -> bool:
    """Register ``optimizer``, which the engine did not know at its step, if it is one of the Trainer's: made since
    ``fit`` started (``trainer.strategy.setup_optimizers(trainer)`` after a resize or an added head), which Lightning
    hands to no precision plugin. Returns whether it is unscaled (no: just registered); any other optimizer gets the
    engine's own error."""
    if any(unwrap_optimizer(held) is optimizer for held in trainer.strategy.optimizers):
        amp.prepare_optimizer(optimizer)
    return amp.is_unscaled(optimizer)  # raises for an optimizer the Trainer does not hold


class NewOptimizers:
    """The Trainer's optimizers made since fit started (``trainer.strategy.setup_optimizers(trainer)`` in a callback,
    after an added head or a resize), which Lightning hands to no precision plugin: registered when the next training
    step starts, before its forward (a module added since is then made half with FP32 masters, as at set-up), not at
    their first step, after it. Per training step the plugin compares ``strategy._optimizers`` (the list behind
    ``strategy.optimizers``) by identity with ``seen``, inline: attribute reads, no Python call; :meth:`register` runs
    when no strategy was found yet or that list was replaced."""

    __slots__ = ("seen", "strategy")

    def __init__(self) -> None:
        self.strategy: Any = None  # the fit's strategy, found at its first training step (dropped at teardown)
        self.seen: list[Any] | None = None  # its list of optimizers last looked at

    def register(self, amp: Any, module: nn.Module | None) -> None:
        """Register each optimizer of the strategy's list (one registered already is left as it is)."""
        trainer = trainer_of(module) if module is not None else None
        strategy = trainer.strategy if trainer is not None else None
        if strategy is None:
            return
        self.strategy = strategy
        optimizers = getattr(strategy, "_optimizers", None)
        if optimizers is self.seen:
            return
        self.seen = optimizers
        for optimizer in strategy.optimizers:
            amp.prepare_optimizer(unwrap_optimizer(optimizer))

    def forget(self) -> None:
        self.strategy = self.seen = None


def trainer_of(model: nn.Module) -> Any:
    """The Trainer of the LightningModule ``model`` is or wraps (DDP's and Lightning's wrappers), or ``None``."""
    module = getattr(model, "module", model)  # DDP
    module = getattr(module, "_forward_module", module)  # Lightning's wrapper inside DDP
    try:
        return module.trainer if isinstance(module, _pl.LightningModule) else None
    except RuntimeError:  # not attached to a Trainer
        return None
