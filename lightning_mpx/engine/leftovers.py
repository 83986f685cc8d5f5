"""The unscale of an optimizer's gradients, the gradients it leaves behind, and re-scaling them so that one
gradient buffer never mixes two scales.

:func:`unscale_state` divides an optimizer's gradients by their scale (into the FP32 masters at O2) and records
the overflow it finds. An unscale (or a clip) that no step followed leaves gradients with their true values (at O2
in the FP32 masters); a later backward adds scaled values to them, so they are scaled back up first
(:func:`rescale_unscaled`). Gradients of another loss, or of this loss at a scale
:meth:`~lightning_mpx.engine.amp.Amp.update` has changed since, are brought to the new scale (:func:`rescale_pending`).
The user may clear half gradients between an unscale and the step (``zero_grad`` either way): the masters' copies
follow (:func:`follow_cleared_grads`). Plain functions over an optimizer's
:class:`~lightning_mpx.engine.stages._OptimizerState`: no engine is held.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

from lightning_mpx.masters.swap import drop_master_grads, grad_pairs, param_pairs
from lightning_mpx.engine.sharding import Sharding, local_tensor
from lightning_mpx.engine.stages import _OptimizerState, _Stage, optimizer_params
from lightning_mpx.scaling.scaler import LossScaler
from lightning_mpx.masters.weights import MasterWeights
from lightning_mpx.health.telemetry import GradTelemetry
from lightning_mpx.scaling.unscale import GradStats, clip_coefficient, resolve_backend, unscale_grads_

Marks = tuple[tuple[int, int] | None, ...]


def unscale_state(
    state: _OptimizerState,
    scaler: LossScaler,
    master_weights: Sequence[MasterWeights],
    *,
    backend: str,
    refuse_sparse: Callable[[torch.Tensor], None],
    telemetry: GradTelemetry,
    names: Mapping[int, str],
    max_norm: float | None = None,
    sharding: Sharding | None = None,
    marks: bool = True,
) -> None:
    """Unscale the optimizer's gradients with ``scaler`` (the scaler of its ``loss_id``), charge the overflow found
    and move it to UNSCALED; ``max_norm`` clips them to that global norm on the way (the norm is kept in
    ``state.grad_norm``). Telemetry measures the scaled gradients when it was requested.

    ``marks``: at O2, note which half gradients were read (:func:`grad_marks`), for the user code that may run
    before the step (:func:`follow_cleared_grads`); a step that unscales for itself notes them only if it does not
    finish (``StepMachine.keep_marks``).

    ``sharding``: the gradients are FSDP shards (see :mod:`lightning_mpx.engine.sharding`); each rank works on its local
    pieces, and a clip sums the flags and the squared norm across ranks in one all-reduce before it multiplies."""
    loss_id = state.loss_id or 0
    skipped = state.stage is _Stage.SKIPPED
    if skipped:
        # Left unscaled by a batch that did not step, and no backward since: check them (and clip), but do not
        # divide them again.
        sources = [true for true, _ in leftovers(state, master_weights)]
        targets: list[torch.Tensor] | None = None
        copy = False
    else:
        # At O2 torch's kernels unscale the masters' new gradients in place, made with the half gradients' values;
        # the fused kernels read the half gradients and write the masters' in one pass. On "auto" a plain unscale
        # (no clip, no statistics) takes torch's kernels on any device (auto_backend says why); otherwise the first
        # master as last paired picks the route: either route gives the same values on any backend (a wrong guess
        # only costs a copy), so the device of every tensor is left to the unscale's own choice.
        plain = max_norm is None and not telemetry.requested
        copy = bool(master_weights) and _unfused(backend, state.pair_masters[:1], plain)
        sources, targets = grad_pairs(state, master_weights, refuse_sparse, copy=copy)
    device = scaler.device or (sources[0].device if sources else torch.device("cpu"))
    scaler.to(device)
    if skipped:
        factor = torch.ones((), dtype=torch.float32, device=device)
    elif state.grad_scale is not None:  # gradients pending across an update keep the scale they were computed with
        factor = state.grad_scale.double().reciprocal().float()  # in FP64, as GradScaler
    else:
        factor = scaler.unscale_factor()
    found = torch.zeros((), dtype=torch.float32, device=device)
    # Telemetry measures scaled gradients: not the leftovers of a skipped batch, which hold true values.
    stats = telemetry.stats() if telemetry.requested and not skipped else None
    if sharding is None:
        norm = unscale_grads_(
            targets if copy else sources,  # type: ignore[arg-type]
            factor,
            found,
            out=None if copy else targets,
            max_norm=max_norm,
            backend=backend,
            workspace=state.workspace,
            stats=stats,
        )
    else:  # no masters under FSDP: the gradients are unscaled in place, shard by shard
        squares = _unscale_shards(state, sources, factor, found, sharding, max_norm is not None, backend, stats)
    if stats is not None:
        telemetry.record(id(state), sources, optimizer_params(state.optimizer), names, stats)
    state.charge(loss_id, found)
    if sharding is not None:
        norm = None if squares is None else reduce_checks(state, sharding, squares, sources, max_norm)
    state.grad_norm = norm
    state.grad_scale = None
    state.stage = _Stage.UNSCALED
    if master_weights and not skipped and marks:
        state.unscaled_marks = grad_marks(state, master_weights)


def _unfused(backend: str, tensors: list[torch.Tensor], plain: bool) -> bool:
    """Whether an unscale into these masters' gradients runs on torch's kernels rather than the fused ones: a plain
    one (no clip, no statistics) does on ``"auto"`` (see :func:`~lightning_mpx.scaling.unscale.auto_backend`)."""
    if backend == "auto":
        return plain or resolve_backend(tensors) != "triton"
    return backend != "triton"


def _unscale_shards(
    state: _OptimizerState,
    grads: list[torch.Tensor],
    factor: torch.Tensor,
    found: torch.Tensor,
    sharding: Sharding,
    want_norm: bool,
    backend: str,
    stats: GradStats | None,
) -> torch.Tensor | None:
    """Unscale each rank's local shards of ``grads`` in place, flagging non-finite values in ``found``; with
    ``want_norm`` returns this rank's part of the global squared norm (each gradient weighted by
    :meth:`Sharding.weight`), measured in the same pass."""
    local = [local_tensor(g) for g in grads]
    if not want_norm:
        unscale_grads_(local, factor, found, backend=backend, workspace=state.workspace, stats=stats)
        return None
    params = [p for p in optimizer_params(state.optimizer) if p.grad is not None]  # the order of `grads`
    groups = sharding.groups(params)
    if len(groups) == 1:  # the usual case: every gradient a shard, one pass
        ((weight, _),) = groups.items()
        norm = unscale_grads_(
            local, factor, found, compute_norm=True, backend=backend, workspace=state.workspace, stats=stats
        )
        assert norm is not None
        return norm.square() * weight
    squares = torch.zeros((), dtype=torch.float32, device=found.device)
    parts: list[tuple[list[int], GradStats]] = []
    for weight, indices in groups.items():
        part = None if stats is None else GradStats(stats.tiny)
        norm = unscale_grads_(
            [local[i] for i in indices], factor, found, compute_norm=True, backend=backend, stats=part
        )
        assert norm is not None
        squares = squares + norm.square().to(found.device) * weight
        if part is not None:
            parts.append((indices, part))
    if stats is not None:  # the groups' statistics, back in the order of `grads`
        order = torch.tensor([i for indices, _ in parts for i in indices], dtype=torch.int64)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        where = inverse.to(found.device)
        stats.underflow = torch.cat([p.underflow for _, p in parts])[where]  # type: ignore[misc]
        stats.zeros = torch.cat([p.zeros for _, p in parts])[where]  # type: ignore[misc]
        stats.peak = torch.cat([p.peak for _, p in parts])[where]  # type: ignore[misc]
    return squares


def reduce_checks(
    state: _OptimizerState,
    sharding: Sharding,
    squares: torch.Tensor | None,
    grads: list[torch.Tensor],
    max_norm: float | None,
) -> torch.Tensor | None:
    """The step's one collective under FSDP: sum the optimizer's overflow flags (every loss's) and this rank's
    squared norm ``squares`` across ranks, so that every rank holds the same flags; then, given ``max_norm``, clip
    the local shards of ``grads`` by the global norm (left as they are when it is not finite, as
    :func:`~lightning_mpx.scaling.unscale.unscale_grads_`). Returns the global norm when ``squares`` was given."""
    loss_ids = sorted(state.found_by_loss)
    reduced = sharding.reduce([state.found_by_loss[i] for i in loss_ids], squares)
    flags = [torch.clamp(f, max=1.0) for f in reduced[: len(loss_ids)]]  # any rank's overflow, as a 0/1 flag
    state.found_by_loss = dict(zip(loss_ids, flags))
    if flags:
        state.found_inf = torch.stack(flags).amax()
    state.flags_reduced = True
    if squares is None:
        return None
    norm = reduced[-1].clamp(min=0).sqrt()
    if max_norm is not None:
        coef = clip_coefficient(norm, max_norm)
        local = [local_tensor(g) for g in grads]
        by_key: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for tensor in local:
            by_key.setdefault((tensor.device, tensor.dtype), []).append(tensor)
        for (device, _), group in by_key.items():
            torch._foreach_mul_(group, coef.to(device))
    return norm


def local_squares(sharding: Sharding, params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """This rank's part of the global squared norm of ``params``' gradients (already unscaled), by weight."""
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for weight, indices in sharding.groups(params).items():
        grads = [local_tensor(params[i].grad) for i in indices]  # type: ignore[arg-type]
        grads = [g for g in grads if g.numel()]
        if grads:
            norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
            squares = squares + torch.stack([n.to(device) for n in norms]).square().sum() * weight
    return squares


def grad_marks(state: _OptimizerState, master_weights: Sequence[MasterWeights]) -> Marks:
    """Identity and version of each half parameter's gradient (``None`` where it has none), in pair order."""
    param_pairs(state, master_weights)
    params = state.pair_params
    return tuple(None if (g := params[i].grad) is None else (id(g), g._version) for i in state.mastered)


def follow_cleared_grads(state: _OptimizerState, master_weights: Sequence[MasterWeights]) -> None:
    """Between an unscale and the step, the user may clear the half gradients (``zero_grad`` either way, a skipped
    batch): the FP32 master gradients the step would use follow them (see :func:`leftovers`). A step that finds
    them as the unscale left them compares one tuple."""
    if grad_marks(state, master_weights) != state.unscaled_marks:
        leftovers(state, master_weights)
        state.unscaled_marks = grad_marks(state, master_weights)  # taken: a later check looks for later writes only


def leftovers(
    state: _OptimizerState, master_weights: Sequence[MasterWeights]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(gradient with true values, the model's gradient it belongs in) for the gradients an unscale left behind
    that the user has not cleared since.

    Without masters both are the parameter's own gradient (unscaled in place). At O2 the true values sit in the
    master's gradient; the half gradient the unscale read tells whether the user cleared it since (gone, or
    written: ``zero_grad`` either way), in which case the master's copy is dropped (``set_to_none=False``: its
    zeros are taken instead).
    """
    if not master_weights:
        return [(g, g) for p in optimizer_params(state.optimizer) if (g := p.grad) is not None]
    out = []
    marks = state.unscaled_marks
    index = 0
    for param, master in param_pairs(state, master_weights):
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
        state.charge(old_id, found)
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
        state.charge(old_id, found)
    state.loss_id = new_loss_id
    state.grad_scale = None
