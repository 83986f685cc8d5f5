"""Gradients carried across a point of the iteration: left unscaled by an unscale no step followed, cleared by the
user since, or pending for another loss or at a scale :meth:`~lightning_mpx.engine.amp.Amp.update` has changed since.

An unscale (or a clip) that no step followed leaves gradients with their true values (at O2 in the FP32 masters):
:func:`leftovers`. A later backward adds scaled values to them, so they are scaled back up first
(:func:`rescale_unscaled`). Gradients of another loss, or of this loss at a changed scale, are brought to the new
scale (:func:`rescale_pending`), so that one gradient buffer never mixes two scales. The user may clear half
gradients between an unscale and the step (``zero_grad`` either way): the masters' copies follow
(:func:`follow_cleared_grads`, by the marks :func:`grad_marks` notes). Plain functions over an optimizer's
:class:`~lightning_mpx.engine.optimizer_state._OptimizerState`: no engine is held.
"""

from __future__ import annotations

from typing import Sequence

import torch

from lightning_mpx.engine.grad_checks import charge
from lightning_mpx.engine.optimizer_state import _OptimizerState, _Stage, optimizer_params
from lightning_mpx.masters.pairs import param_pairs
from lightning_mpx.masters.swap import drop_master_grads
from lightning_mpx.masters.weights import MasterWeights
from lightning_mpx.scaling.scaler import LossScaler
from lightning_mpx.scaling.unscale import unscale_grads_

Marks = tuple[tuple[int, int] | None, ...]


def grad_marks(
    state: _OptimizerState, master_weights: Sequence[MasterWeights], optimizer: torch.optim.Optimizer | None = None
) -> Marks:
    """Identity and version of each half parameter's gradient (``None`` where it has none), in pair order;
    ``optimizer``: the state's, when the caller holds it (a step does)."""
    param_pairs(state, master_weights, optimizer=optimizer)
    params = state.pair_params
    return tuple(None if (g := params[i].grad) is None else (id(g), g._version) for i in state.mastered)


def follow_cleared_grads(
    state: _OptimizerState, master_weights: Sequence[MasterWeights], optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Between an unscale and the step, the user may clear the half gradients (``zero_grad`` either way, a skipped
    batch): the FP32 master gradients the step would use follow them (see :func:`leftovers`). A step that finds
    them as the unscale left them compares one tuple. ``optimizer`` as for :func:`grad_marks`."""
    if grad_marks(state, master_weights, optimizer) != state.unscaled_marks:
        leftovers(state, master_weights, optimizer)
        # taken: a later check looks for later writes only
        state.unscaled_marks = grad_marks(state, master_weights, optimizer)


def leftovers(
    state: _OptimizerState, master_weights: Sequence[MasterWeights], optimizer: torch.optim.Optimizer | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(gradient with true values, the model's gradient it belongs in) for the gradients an unscale left behind
    that the user has not cleared since.

    Without masters both are the parameter's own gradient (unscaled in place). At O2 the true values sit in the
    master's gradient; the half gradient the unscale read tells whether the user cleared it since (gone, or
    written: ``zero_grad`` either way), in which case the master's copy is dropped (``set_to_none=False``: its
    zeros are taken instead). ``optimizer`` as for :func:`grad_marks`.
    """
    if not master_weights:
        optimizer = state.optimizer if optimizer is None else optimizer
        return [(g, g) for p in optimizer_params(optimizer) if (g := p.grad) is not None]
    out = []
    marks = state.unscaled_marks
    index = 0
    for param, master in param_pairs(state, master_weights, optimizer=optimizer):
        grad = param.grad
        if master is param:
            if grad is not None:
                out.append((grad, grad))
            continue
        was = marks[index] if index < len(marks) else None
        index += 1
        true = master.grad
        if true is None:
            continue  # nothing was unscaled into it
        if grad is None:
            if was is not None:  # cleared by the user (set_to_none) since the unscale
                master.grad = None
                continue
            grad = param.grad = torch.zeros_like(param)  # unscaled without a half gradient (Apex's stash)
        elif (id(grad), grad._version) != was:  # written since the unscale (zero_grad): the user's values stand
            true.copy_(grad)
        out.append((true, grad))
    return out


def rescale_unscaled(
    state: _OptimizerState,
    new_loss_id: int,
    scaler: LossScaler,
    master_weights: Sequence[MasterWeights],
    backend: str,
) -> None:
    """Scale gradients that unscale_() left with their true values (no step followed) back up to ``scaler``'s
    scale (the scaler of ``new_loss_id``), where the coming backward adds its own; at O2 from the FP32 masters'
    gradients (the ones a clip changed and a ``zero_grad`` cleared) into the half model's. The caller has
    recorded the overflow the unscale found."""
    old_id = state.loss_id or 0
    state.clear_checks()
    pairs = leftovers(state, master_weights)
    sources = [true for true, _ in pairs]
    targets = [model_grad for _, model_grad in pairs]
    if sources:
        scaler.to(sources[0].device)
        found = torch.zeros((), dtype=torch.float32, device=sources[0].device)
        unscale_grads_(
            sources,
            scaler.scale_tensor,
            found,
            out=targets if master_weights else None,
            backend=backend,
            workspace=state.workspace,
        )
        charge(state, old_id, found)
    if master_weights:
        drop_master_grads(state)  # carried into the half gradients
    state.unscaled_marks = ()
    state.stage = _Stage.READY
    state.loss_id = new_loss_id
    state.grad_scale = None


def rescale_pending(state: _OptimizerState, new_loss_id: int, scalers: Sequence[LossScaler], backend: str) -> None:
    """Bring gradients pending for another loss (or for this one at a scale since updated) to ``new_loss_id``'s
    scale, checking them on the way: what they hold now is charged to the loss they came from."""
    old_id = state.loss_id or 0
    old_scale = state.grad_scale if state.grad_scale is not None else scalers[old_id].scale_tensor
    grads = [g for p in optimizer_params(state.optimizer) if (g := p.grad) is not None]  # the model's, still scaled
    if grads:
        new = scalers[new_loss_id].to(grads[0].device)
        ratio = (new.scale_tensor.double() / old_scale.to(grads[0].device).double()).float()
        found = torch.zeros((), dtype=torch.float32, device=grads[0].device)
        unscale_grads_(grads, ratio, found, backend=backend, workspace=state.workspace)
        charge(state, old_id, found)
    state.loss_id = new_loss_id
    state.grad_scale = None
