"""The Trainer plugin's hold on per-step learning-rate schedules after a skipped optimizer step.

When an optimizer skips its step (its gradients overflowed), its per-step schedulers must not advance either (as
Accelerate's ``AcceleratedScheduler``; Lightning's "16-mixed" steps them anyway). Lightning's loop steps them right
after the optimizer step, from the strategy's list of scheduler configs; :class:`HeldSchedulers` swaps each such
config in that list for a copy with another ``interval`` until the next batch, so that nothing the user holds is
wrapped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch.optim import Optimizer

from lightning_mpx.common.imports import require

require("lightning.pytorch", extra="lightning", feature="lightning_mpx.MixedPrecisionPlugin")

from lightning.pytorch.core.optimizer import LightningOptimizer  # noqa: E402
from lightning.pytorch.utilities.types import LRSchedulerConfig  # noqa: E402

__all__ = ["HeldSchedulers", "step_configs"]

#: The ``interval`` of a per-step scheduler config while its optimizer's step was skipped: no ``interval`` the loop
#: updates, so the loop leaves it alone until the next batch.
_HELD_INTERVAL = "step (held: the optimizer skipped its step)"


def step_configs(configs: list[Any], optimizer: Optimizer) -> list[int]:
    """The positions of ``optimizer``'s per-step scheduler configs in ``configs``, the strategy's list."""
    found = []
    for index, config in enumerate(configs):
        if not isinstance(config, LRSchedulerConfig) or config.interval != "step":
            continue
        owner = getattr(config.scheduler, "optimizer", None)
        if isinstance(owner, LightningOptimizer):  # unwrap_optimizer, written out: asked at every step
            owner = owner.optimizer
        if owner is not None and owner is not optimizer:
            continue  # another optimizer's schedule (a scheduler without one follows the only optimizer)
        found.append(index)
    return found


class HeldSchedulers:
    """The per-step scheduler configs held out of the loop's scheduler update after a skipped step."""

    def __init__(self) -> None:
        #: (the strategy's config list, index, the config, its held copy in the list), until the next batch. Empty
        #: when nothing is held: the plugin's per-batch hooks test it without a call (no :meth:`release` then).
        self.held: list[tuple[list[Any], int, Any, Any]] = []

    def __bool__(self) -> bool:
        return bool(self.held)

    def hold(self, trainer: Any, optimizer: Optimizer) -> None:
        """Keep the per-step schedulers of ``optimizer``, which skipped its step, out of this batch's scheduler
        update: the optimizer did not move, so neither does its schedule. For the rest of the batch the strategy's
        list holds a copy of each config with another ``interval``, so that the loop does not call
        ``lr_scheduler_step`` for it, and :meth:`release` (at the next training batch) puts the config back."""
        configs = trainer.strategy.lr_scheduler_configs
        for index in step_configs(configs, optimizer):
            config = configs[index]
            held = dataclasses.replace(config, interval=_HELD_INTERVAL)
            configs[index] = held
            self.held.append((configs, index, config, held))

    def release(self) -> None:
        """Put the configs :meth:`hold` took out back into the strategy's list."""
        for configs, index, config, held in self.held:
            if index < len(configs) and configs[index] is held:  # not replaced since (a new fit builds a new list)
                configs[index] = config
        self.held.clear()
