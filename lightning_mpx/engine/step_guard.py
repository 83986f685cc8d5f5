"""The step pre-hook of a prepared optimizer without FP32 masters (O0, O1, O3; O2 under FSDP): a direct
``optimizer.step()`` while its gradients still carry the loss scale is refused.

Such a step bypasses the engine (``Amp.step``, which unscales, checks and skips on overflow): with a dynamic scale
(65536 by default at float16) it applies the gradients multiplied by the scale, and the weights turn NaN without an
error. An optimizer with masters refuses any direct step already (:mod:`lightning_mpx.masters.optimizer_hooks`). The
hook is put on the optimizer when the engine registers it and removed when the engine lets it go
(``Amp.release_optimizer``); nothing else is patched. At a step it reads one attribute of the optimizer's state (the
engine's own step has unscaled already), so it costs one Python call per step.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from lightning_mpx.engine.optimizer_state import _OptimizerState, _Stage
from lightning_mpx.scaling.scaler import LossScaler

__all__ = ["ScaledStepGuard"]


class ScaledStepGuard:
    """Refuse ``optimizer.step()`` outside the engine while the optimizer's gradients are scaled.

    Args:
        state: The optimizer's state in the engine (its stage: gradients scaled since a backward, or unscaled).
        scalers: The engine's loss scalers (a static scale of 1 scales nothing: such a step is left alone).
        owner: A weak reference to the engine's step machine that put the hook on.
    """

    def __init__(self, state: _OptimizerState, scalers: Sequence[LossScaler], owner: Any = None) -> None:
        self.state = state
        self.scalers = scalers
        self.owner = owner  # a weak reference to the engine's StepMachine (a later engine releases it from there)

    def __call__(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        state = self.state
        if state.stage is not _Stage.READY or state.loss_id is None:  # the engine's step (unscaled), or no backward
            return
        scaler = self.scalers[state.loss_id]
        if scaler._unit:
            return
        kind = "dynamic" if scaler.dynamic else "static"
        raise RuntimeError(
            f"optimizer.step() was called on the {type(optimizer).__name__} prepared by lightning_mpx outside "
            f"Amp.step(), while its gradients still carry the {kind} loss scale ({scaler.get_scale():g}): it would "
            "apply them multiplied by it (the weights turn inf/NaN). Step through the engine, which unscales them and "
            "skips a step that overflowed: with the core API, amp.step(optimizer) (or amp.unscale_(optimizer) before "
            "this step); in a LightningModule's manual optimization, the optimizer self.optimizers() returns, not "
            "self.optimizers(use_pl_optimizer=False); with Fabric, the optimizer fabric.setup() returned; with "
            "lightning_mpx.accelerate.Accelerator, the optimizer accelerator.prepare() returned."
        )
