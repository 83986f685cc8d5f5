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

__all__ = ["BaseStepGuard", "ScaledStepGuard"]


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


class BaseStepGuard:
    """Refuse a SAM-style two-pass optimizer's ``base_optimizer.step()`` called outside the engine's step (davda54's
    ``second_step``: restore, then the base step directly), at the call and before any write.

    Put on the base optimizer when the engine registers the SAM-style optimizer holding it (one with a callable
    ``first_step`` and a ``base_optimizer``: :func:`~lightning_mpx.engine.raw_steps.is_two_pass`); removed with that
    optimizer's other hooks. The engine's step (the door's ``optimizer.step()``, whose ``step()`` runs the base step)
    passes: at O2 the masters stand in the groups then (``state.swapped``), elsewhere the gradients are unscaled. A
    base step with unscaled gradients (after ``amp.unscale_``) or under a scale of 1 without masters passes too, as
    :class:`ScaledStepGuard` lets a direct step pass. One Python call per base step, for SAM-style optimizers only.

    Args:
        state: The SAM-style optimizer's state in the engine.
        scalers: The engine's loss scalers.
        masters: Whether the optimizer's parameters have FP32 masters (O2).
        message: The recipe to name (docs/master_weights.md, "SAM and two-pass optimizers").
    """

    def __init__(self, state: _OptimizerState, scalers: Sequence[LossScaler], masters: bool, message: str) -> None:
        self.state = state
        self.scalers = scalers
        self.masters = masters
        self.message = message

    def __call__(self, base: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        state = self.state
        if self.masters:
            if state.swapped is not None:  # the engine's step on the masters
                return
        elif state.stage is not _Stage.READY or state.loss_id is None or self.scalers[state.loss_id]._unit:
            return
        optimizer = state.optimizer_ref()
        name = type(optimizer).__name__ if optimizer is not None else "optimizer"
        raise RuntimeError(
            f"the SAM-style two-pass optimizer {name} prepared by lightning_mpx had its base_optimizer.step() "
            f"({type(base).__name__}) called outside the engine's step (davda54's second_step steps it itself), "
            f"{self.message}"
        )
