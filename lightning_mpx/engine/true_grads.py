"""The true values of gradients, as FP32 training holds them on ``.grad``, read from an optimizer's stage: between a
backward and the step the model's gradients carry the loss scale (at O2 the unscale puts the true values in the FP32
masters' gradients, and a clip since changes those), so what FP32 would hold is made from the stage's record (the
scale carried, whether an unscale showed the true values on the model, the clips since the unscale). Read by
:meth:`~lightning_mpx.engine.amp.Amp.true_grads` (``engine.amp_masters``) and, for a master that becomes shared after
another optimizer's step, by :mod:`~lightning_mpx.engine.newly_shared`. Nothing is changed.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lightning_mpx.engine.optimizer_state import _OptimizerState, _Stage
from lightning_mpx.scaling.scaler import LossScaler
from lightning_mpx.scaling.unscale import clip_coefficient


def carried_scale(state: _OptimizerState, scalers: Sequence[LossScaler]) -> torch.Tensor:
    """The scale the half gradients a step left carry (that of ``loss_id``, as it was at the step)."""
    return state.grad_scale if state.grad_scale is not None else scalers[state.loss_id or 0].scale_tensor


def true_grad(
    state: _OptimizerState, scalers: Sequence[LossScaler], param: torch.Tensor, master: torch.Tensor
) -> torch.Tensor | None:
    """O2: a new FP32 tensor of the true value of half ``param``'s gradient as the state of its optimizer has it now,
    what FP32 training holds on ``.grad`` there (``None`` without a gradient): between an unscale and the step the
    master's (clipped as the step uses it); otherwise the half gradient divided by the scale it carries (not where
    the unscale showed true values on the model, or a step left them), with the clips since the unscale applied (as
    FP32's clip wrote them into its gradients). Nothing is changed."""
    if state.stage is _Stage.UNSCALED and master is not param and master.grad is not None:
        return master.grad.detach().clone()
    grad = param.grad
    if grad is None:
        return None
    value = grad.detach().to(torch.float32, copy=True)
    if not (state.shown or (state.stage is _Stage.STEPPED and state.stepped_true)):
        value.div_(carried_scale(state, scalers).to(value.device))
    if state.stage is _Stage.STEPPED and (id(grad), grad._version) in state.stepped_final:
        return value  # another optimizer's clip in it already, and this one's (engine.shared_clips)
    for kind, norm, limit, *added in state.clips:
        if added and id(grad) in added[0]:
            continue  # in a group added after that clip (unscale_late)
        if kind == "norm":
            value.mul_(clip_coefficient(norm, limit, state.clips_found).to(value.device))
        else:
            value.clamp_(-limit, limit)
    return value


def unscaled_grad(state: _OptimizerState, scalers: Sequence[LossScaler], param: torch.Tensor) -> torch.Tensor | None:
    """The true value of the gradient of ``param``, a parameter without a master (O1's FP32 model, batch norm or
    ``fp32_modules`` at O2, O3's half model), as FP32 training holds it (``None`` without a gradient): after a
    backward and before the unscale (``READY``) a new FP32 tensor, its ``.grad`` divided by the scale it carries;
    otherwise its ``.grad`` itself (the unscale wrote the true values in place). Nothing is changed."""
    grad = param.grad
    if grad is None or state.stage is not _Stage.READY or state.loss_id is None:
        return grad
    return grad.detach().to(torch.float32, copy=True).div_(carried_scale(state, scalers).to(grad.device))
