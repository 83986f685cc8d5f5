"""The checks of an optimizer's gradients: unscaled (into the FP32 masters at O2), checked for overflow, measured
and clipped, on each rank's local shards under FSDP with the flags and the squared norm summed across ranks once.

:func:`unscale` is the first stage of a step (and what :meth:`~lightning_mpx.engine.amp.Amp.unscale_` and a clip
run): it divides the optimizer's gradients by their scale and charges the overflow it finds to the loss they came
from (:func:`charge`). Under FSDP, :func:`reduce_checks` is the step's one collective. Plain functions over an
optimizer's :class:`~lightning_mpx.engine.optimizer_state._OptimizerState`: no engine is held.
"""

from __future__ import annotations

import functools
import itertools
import operator
from typing import Callable, Mapping, Sequence

import torch

from lightning_mpx.engine.optimizer_state import _OptimizerState, _Stage, optimizer_params
from lightning_mpx.engine.scaled_write import refuse_scaled_write
from lightning_mpx.engine.sharding import Sharding, local_tensors
from lightning_mpx.engine.shared_grads import SharedGrads
from lightning_mpx.health.telemetry import GradTelemetry
from lightning_mpx.masters.pairs import grad_pairs
from lightning_mpx.masters.weights import MasterWeights
from lightning_mpx.scaling.scaler import LossScaler
from lightning_mpx.scaling.unscale import (
    GradStats,
    clip_coefficient,
    has_complex,
    plain_unscale_,
    real_pairs,
    real_views,
    resolve_backend,
    unscale_grads_,
    unscale_real_grads_,
)

_IS_SPARSE = operator.attrgetter("is_sparse")
_PARAMS = operator.itemgetter("params")
_GRAD = operator.attrgetter("grad")
_SOME = functools.partial(operator.is_not, None)


def unscale(
    state: _OptimizerState,
    optimizer: torch.optim.Optimizer,
    scaler: LossScaler,
    master_weights: Sequence[MasterWeights],
    *,
    backend: str,
    refuse_sparse: Callable[[torch.Tensor], None],
    telemetry: GradTelemetry,
    names: Mapping[int, str],
    max_norm: float | None = None,
    sharding: Sharding | None = None,
    true_grads: list[torch.Tensor] | None = None,
    shared: SharedGrads | None = None,
) -> None:
    """Unscale the gradients of ``optimizer`` (the optimizer of ``state``) with ``scaler`` (the scaler of its
    ``loss_id``), charge the overflow found and move it to UNSCALED; ``max_norm`` clips them to that global norm on
    the way (the norm is kept in ``state.grad_norm``). Telemetry measures the scaled gradients when it was requested.

    ``true_grads``: for an optimizer left SKIPPED (unscaled by a batch that did not step, no backward since), the
    gradients that hold true values (those of :func:`lightning_mpx.engine.rescale.leftovers`): checked, not divided
    again.
    At O2 the caller notes which half gradients were read (:func:`lightning_mpx.engine.rescale.grad_marks`) when
    user code may run before the step.

    ``sharding``: the gradients are FSDP shards (see :mod:`lightning_mpx.engine.sharding`); each rank works on its local
    pieces, and a clip sums the flags and the squared norm across ranks in one all-reduce before it multiplies.

    ``shared``: the machine's :class:`~lightning_mpx.engine.shared_grads.SharedGrads`; where parameters are held by
    more than one optimizer (and no masters), a gradient another optimizer's unscale divided since its backward is
    checked (and clipped, measured) here but not divided again."""
    loss_id = state.loss_id or 0
    skipped = state.stage is _Stage.SKIPPED
    # the parameter count, in C (map/len/sum: no Python call per step or per group): see note_complex
    if state.complex_groups != sum(map(len, map(_PARAMS, optimizer.param_groups))):
        note_complex(state, optimizer)
        if shared is not None:  # a group added or removed: the optimizers' overlap found again, before the masters'
            shared.refresh()  # new gradients are made below (a newly shared one's, another optimizer's, noted first)
    if skipped:
        # Left unscaled by a batch that did not step, and no backward since: check them (and clip), but do not
        # divide them again.
        assert true_grads is not None
        sources = true_grads
        targets: list[torch.Tensor] | None = None
        copy = auto_plain = False
    else:
        # At O2 torch's kernels unscale the masters' new gradients in place, made with the half gradients' values;
        # the fused kernels read the half gradients and write the masters' in one pass. On "auto" a plain unscale
        # (no clip, no statistics) takes torch's kernels on any device (auto_backend says why); otherwise the first
        # master as last paired picks the route: either route gives the same values on any backend (a wrong guess
        # only costs a copy), so the device of every tensor is left to the unscale's own choice.
        plain = max_norm is None and not telemetry.requested
        auto_plain = plain and backend == "auto"  # torch's kernels, in place (see auto_backend)
        copy = bool(master_weights) and (auto_plain or _unfused(backend, state.pair_masters[:1], plain))
        if master_weights:
            if shared is not None and shared.masters:  # a shared master's FP32 gradient the user replaced since
                shared.follow(state.pairs)
            sources, targets = grad_pairs(state, optimizer, master_weights, refuse_sparse, copy=copy)
        else:  # own_grads, written out (a call saved per step): C-level maps, no Python per parameter
            params = itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups))
            sources, targets = list(filter(_SOME, map(_GRAD, params))), None
            if any(map(_IS_SPARSE, sources)):  # rare: own_grads refuses the sparse gradient by its parameter
                own_grads(optimizer, refuse_sparse)
    if sharding is not None:  # a group's list changed (a parameter appended, or put in place of another, the count
        # unchanged): what prepare_optimizer refuses, refused. C-level maps, under FSDP only.
        held = tuple(itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups)))
        if len(held) != len(state.sharded_params) or not all(map(operator.is_, held, state.sharded_params)):
            sharding.refuse_gathered(held)
            state.sharded_params = held
    if shared is not None and shared.ids and not skipped:
        if sharding is None:
            _unscale_shared(state, optimizer, scaler, shared, sources, targets, copy, backend=backend,
                            telemetry=telemetry, names=names, max_norm=max_norm)  # fmt: skip
            return
        _raise_shared_shards(state, scaler, shared, sources)  # then divided once below, with the others
    named = sources
    if state.has_complex:  # torch's unscale kernels have no complex case: their real views (no copy)
        sources, targets = real_pairs(sources, targets)
    # The scaler's state is made on the gradients' device when it has none yet (else where it is).
    factor = scaler.unscale_factor(sources[0].device if sources else torch.device("cpu"))
    device = factor.device
    if skipped:
        factor = torch.ones((), dtype=torch.float32, device=device)
    elif state.grad_scale is not None:  # gradients pending across an update keep the scale they were computed with
        factor = state.grad_scale.double().reciprocal().float()  # in FP64, as GradScaler
    found = torch.zeros((), dtype=torch.float32, device=device)
    # Telemetry measures scaled gradients: not the leftovers of a skipped batch, which hold true values.
    stats = telemetry.stats() if telemetry.requested and not skipped else None
    if sharding is None and auto_plain:  # a step's usual unscale: in place, torch's kernel
        norm = plain_unscale_(targets if copy else sources, factor, found)  # type: ignore[arg-type]
    elif sharding is None:
        norm = unscale_real_grads_(
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
        squares = _unscale_shards(
            state, optimizer, sources, factor, found, sharding, max_norm is not None, backend, stats
        )
        if shared is not None and shared.ids:  # true values now, for the other optimizers holding them
            shared.note(sources)
    if stats is not None:
        telemetry.record(id(state), named, optimizer_params(optimizer), names, stats)
    if state.found_inf is None and state.carried_found is None:  # charge's usual case (the first check), written out
        state.flags_reduced, state.found_inf, state.found_by_loss = False, found, {loss_id: found}
    else:
        charge(state, loss_id, found)
    if sharding is not None:
        norm = None if squares is None else reduce_checks(state, sharding, squares, sources, max_norm)
    state.grad_norm = norm
    # grad_scale stays: at O2 the scale the half gradients carry, for what a step leaves; at O1 (the gradients hold
    # true values now) the scale of the backward that made them, for gradients that backward left on parameters the
    # optimizer does not hold yet (a group added after the step: rescale.late_grads).
    state.stage = _Stage.UNSCALED


def _raise_shared_shards(
    state: _OptimizerState, scaler: LossScaler, shared: SharedGrads, sources: list[torch.Tensor]
) -> None:
    """Under FSDP, where parameters are held by more than one optimizer: the gradient shards another optimizer's
    unscale divided in place since their backward (noted in ``shared``) are brought back up to the scale, so that this
    unscale divides them once with the others (exact for a power-of-two scale) and checks, clips and measures them
    across the ranks as it does its own: without it the second optimizer divided them again (its step applied the
    gradient divided by the scale twice)."""
    done = [grad for grad in sources if shared.holds(grad)]
    if done:
        local = local_tensors(done)
        scale = state.grad_scale if state.grad_scale is not None else scaler.scale_tensor
        torch._foreach_mul_(local, scale.to(local[0].device))


def _unscale_shared(
    state: _OptimizerState,
    optimizer: torch.optim.Optimizer,
    scaler: LossScaler,
    shared: SharedGrads,
    sources: list[torch.Tensor],
    targets: list[torch.Tensor] | None,
    copy: bool,
    *,
    backend: str,
    telemetry: GradTelemetry,
    names: Mapping[int, str],
    max_norm: float | None,
) -> None:
    """:func:`unscale` where some parameters are held by more than one optimizer: a gradient unscaled in place (no
    master: O1, O3, and O2's FP32 parameters) that another optimizer's unscale divided since its backward (noted in
    ``shared``) is checked, clipped with the others and measured, not divided again; those divided in place here are
    noted for the other optimizers. ``sources``, ``targets`` and ``copy`` as :func:`unscale` made them (at O2 a
    master's new gradient is made from the half one, which stays scaled: never noted)."""
    loss_id = state.loss_id or 0
    in_place = [targets is None or target is source for source, target in zip(sources, targets or sources)]
    done = [i for i, source in enumerate(sources) if in_place[i] and shared.holds(source)]
    if targets is not None and (clipped := shared.written_after_clip(sources, state)) is not None:
        refuse_scaled_write(clipped)  # another optimizer's clip read it scaled; the user wrote it since
    if targets is not None and (shared.masters or shared.done):  # O2: a shared master's FP32 gradient made already
        written = []
        for i, (source, target) in enumerate(zip(sources, targets or sources)):
            if not in_place[i] and (true := shared.true_of(source)) is not None:
                target.copy_(true)  # its values, not the half gradient divided again
                done.append(i)
                if true is source:  # shown by an earlier unscale, written by the user since: taken here
                    written.append(source)
        if written:
            shared.taken_written(written, state)
    owner = {
        id(p.grad): p for p in itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups)) if p.grad is not None
    }
    if shared.params:  # a gradient another unscale showed the true values in, replaced by the user since: true values
        taken = set(done)
        for i, source in enumerate(sources):
            if i not in taken and shared.replaced(param := owner.get(id(source))):
                if not in_place[i]:
                    targets[i].copy_(source)  # type: ignore[index]
                    shared.took(param, state)  # type: ignore[arg-type]
                done.append(i)
    fresh = sorted(set(range(len(sources))) - set(done))
    work = targets if copy else sources  # unscaled in place (the masters' copies with `copy`), into `out` otherwise
    out = None if copy or targets is None else targets
    first = sources[0].device if sources else torch.device("cpu")
    factor = scaler.unscale_factor(first)
    if state.grad_scale is not None:  # gradients pending across an update keep the scale they were computed with
        factor = state.grad_scale.double().reciprocal().float()
    found = torch.zeros((), dtype=torch.float32, device=factor.device)
    stats = telemetry.stats() if telemetry.requested else None
    norm = None
    fresh_work = [work[i] for i in fresh]  # type: ignore[index]
    fresh_out = None if out is None else [out[i] for i in fresh]
    if state.has_complex:
        fresh_work, fresh_out = real_pairs(fresh_work, fresh_out)
    if fresh or not done:  # divided once, here; measured (scaled) on the way when telemetry asks (no gradients: 0)
        norm = unscale_real_grads_(fresh_work, factor, found, out=fresh_out, max_norm=None if done else max_norm,
                                   backend=backend, workspace=state.workspace, stats=stats)  # fmt: skip
        if stats is not None:
            telemetry.record(id(state), [sources[i] for i in fresh], optimizer_params(optimizer), names, stats)
    if done:  # true values already: checked (factor 1), and clipped with the fresh ones by their global norm
        checked = [(sources if targets is None else targets)[i] for i in done]
        checked = real_views(checked) if state.has_complex else checked
        if max_norm is not None:
            checked = (fresh_work if fresh_out is None else fresh_out) + checked
        ones = torch.ones((), dtype=torch.float32, device=factor.device)
        norm = unscale_real_grads_(checked, ones, found, max_norm=max_norm, backend=backend)
    shared.note(list(itertools.compress(sources, in_place)))
    shared.note_params(
        owner[id(s)] for s in itertools.compress(sources, in_place) if id(s) in owner and id(owner[id(s)]) in shared.ids
    )
    if targets is not None and not all(in_place):
        shared.note_masters(sources, targets)
    if state.found_inf is None and state.carried_found is None:  # charge's usual case, written out
        state.flags_reduced, state.found_inf, state.found_by_loss = False, found, {loss_id: found}
    else:
        charge(state, loss_id, found)
    state.grad_norm = norm if max_norm is not None else None
    state.stage = _Stage.UNSCALED


def note_complex(state: _OptimizerState, optimizer: torch.optim.Optimizer) -> None:
    """Note whether ``optimizer`` holds a complex parameter (its gradients are then unscaled as real views), for the
    number of parameters its groups hold now (kept in ``state.complex_groups``): a group added later, or a parameter
    appended to a group's list, is looked at again at the next unscale (an appended one crashed in torch's kernel,
    "not implemented for 'ComplexFloat'"), and a model without complex parameters pays one sum over its groups per
    step, not a look at every gradient's dtype."""
    state.has_complex = has_complex(list(optimizer_params(optimizer)))
    state.complex_groups = _param_count(optimizer)


def _param_count(optimizer: torch.optim.Optimizer) -> int:
    """The number of parameters in ``optimizer``'s groups (C-level maps: no Python per parameter or group)."""
    return sum(map(len, map(_PARAMS, optimizer.param_groups)))


def charge(state: _OptimizerState, loss_id: int, found: torch.Tensor) -> None:
    """Charge the overflow that one check of the gradients found to ``loss_id``, whose backward ran since the
    previous check; non-finite values found before belong to the loss they were charged to then. The overflow a
    backward's rescale carried (:func:`carry`) is charged first, to its loss, where this check finds one still."""
    carried = state.carried_found
    if carried is not None:
        state.carried_found = None
        for old_id, flag in carried.items():
            charge(state, old_id, flag.to(found.device) * found)
    state.flags_reduced = False
    if state.found_inf is None:
        state.found_inf = found
        state.found_by_loss = {loss_id: found}
        return
    new = found * (state.found_inf == 0)
    seen = state.found_by_loss.get(loss_id)
    state.found_by_loss[loss_id] = new if seen is None else torch.maximum(seen, new)
    state.found_inf = torch.maximum(state.found_inf, found)


def carry(state: _OptimizerState, loss_id: int, found: torch.Tensor) -> None:
    """Keep the overflow found where a backward brought pending gradients to its scale (engine.rescale: unscaled ones
    no step followed, or another loss's) for ``loss_id``, their loss, until the next check, which charges it there
    only if it finds an overflow still (:func:`charge`): non-finite values stay so under the multiplication and the
    backwards that add to them, so a loop that keeps the gradients skips and backs ``loss_id`` off, while a
    ``zero_grad`` (either way) before the step drops them with the overflow, as ``torch.amp.GradScaler`` never sees
    it (charged at once, it skipped the next step, on finite gradients, and halved the scale: 256 -> 128). A new
    overflow of the next backward where the carried one was dropped is charged to ``loss_id`` too (not told apart:
    the step is skipped either way)."""
    carried = state.carried_found
    if carried is None:
        state.carried_found = {loss_id: found}
        return
    seen = carried.get(loss_id)
    carried[loss_id] = found if seen is None else torch.maximum(seen, found)


def own_grads(optimizer: torch.optim.Optimizer, refuse_sparse: Callable[[torch.Tensor], None]) -> list[torch.Tensor]:
    """The gradients of ``optimizer``'s parameters, each unscaled in place (no masters); ``refuse_sparse(param)``
    raises for a parameter with a sparse gradient."""
    params = itertools.chain.from_iterable(map(_PARAMS, optimizer.param_groups))
    grads = list(filter(_SOME, map(_GRAD, params)))  # C-level maps: no Python per parameter
    if any(map(_IS_SPARSE, grads)):  # rare: the parameters are looked up only then
        for param in optimizer_params(optimizer):
            if param.grad is not None and param.grad.is_sparse:
                refuse_sparse(param)
    return grads


def _unfused(backend: str, tensors: list[torch.Tensor], plain: bool) -> bool:
    """Whether an unscale into these masters' gradients runs on torch's kernels rather than the fused ones: a plain
    one (no clip, no statistics) does on ``"auto"`` (see :func:`~lightning_mpx.scaling.unscale.auto_backend`)."""
    if backend == "auto":
        return plain or resolve_backend(tensors) != "triton"
    return backend != "triton"


def _unscale_shards(
    state: _OptimizerState,
    optimizer: torch.optim.Optimizer,
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
    local = local_tensors(grads)
    if not want_norm:
        unscale_grads_(local, factor, found, backend=backend, workspace=state.workspace, stats=stats)
        return None
    params = [p for p in optimizer_params(optimizer) if p.grad is not None]  # the order of `grads`
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
        coef = clip_coefficient(norm, max_norm, state.found_inf)  # an overflow: the gradients as they are
        local = local_tensors(grads)
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
        grads = local_tensors([params[i].grad for i in indices])  # type: ignore[misc]
        grads = real_views([g for g in grads if g.numel()])  # a complex one's norm: its real view's
        if grads:
            norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
            squares = squares + torch.stack([n.to(device) for n in norms]).square().sum() * weight
    return squares
