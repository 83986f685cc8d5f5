"""The unscale entry point: one call that unscales gradients, flags non-finite values and measures their norm.

:func:`unscale_grads_` works in place, or from half model gradients into FP32 master gradients (``out=``). It can
also clip by the global L2 norm of the unscaled gradients. Backends:

* ``"foreach"``: torch's multi-tensor kernels (``_amp_foreach_non_finite_check_and_unscale_``, ``_foreach_norm``);
* ``"reference"``: a plain per-tensor loop, the readable twin that tests hold the others to;
* ``"triton"``: fused multi-tensor kernels written in Triton (:mod:`lightning_mpx.scaling.triton_unscale`): each pass
  reads and writes every element once, the norm needs no extra pass, and clipping by norm costs one read-only pass plus
  one multiply pass. CUDA tensors (CPU tensors only under ``TRITON_INTERPRET=1``, as the tests run it);
* ``"auto"``: on CUDA tensors with triton installed, ``"triton"`` where fusion saves passes (a norm, clipping,
  statistics, bfloat16 gradients unscaled in place) and ``"foreach"`` for a plain unscale, in place or into FP32
  master gradients, and for :func:`cast_copy_` (torch's kernels serve those in one launch each with less host work
  than the fused kernels' table upkeep, see :func:`auto_backend`); ``"foreach"`` on any other tensors.

No backend waits for the device: the flag and the norm stay device tensors. The fused backend keeps its pointer and
chunk tables in an :class:`UnscaleWorkspace` that the caller owns and passes back on every step.

On request (``stats=GradStats(tiny)``, a logging step) the same call also measures the *scaled* gradients, per tensor:
how many elements are below the half dtype's smallest normal number (zero included), how many of them are exactly
zero, and the largest magnitude. The fused backend takes them in the pass that unscales (a compile-time flag: calls
without ``stats`` run the kernels they ran before); the foreach and reference backends take them with a few extra
reads before they unscale.
"""

from __future__ import annotations

import importlib.util
import itertools
import operator
import os
import sys
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import torch

from lightning_mpx.scaling.workspace import (
    UnscaleWorkspace,  # its public import path stays lightning_mpx.scaling.unscale
)

Tensors = Sequence[torch.Tensor]

_CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_
_IS_CUDA = operator.attrgetter("is_cuda")
_IS_CPU = operator.attrgetter("is_cpu")
_DEVICE = operator.attrgetter("device")
_DTYPE = operator.attrgetter("dtype")
_COMPLEX = frozenset({torch.complex32, torch.complex64, torch.complex128})


@dataclass
class GradStats:
    """Per-tensor statistics of the scaled gradients, filled in by ``unscale_grads_(..., stats=...)``.

    The values measured are the gradients as they are before the multiply by ``inv_scale`` (whatever their storage
    dtype: FP32 at O1, half at O2), so that the thresholds of the half dtype tell what the half backward could hold.

    Args:
        tiny: The threshold: an element whose magnitude is below it counts as underflowing. Pass
            ``torch.finfo(half_dtype).tiny``, the smallest normal number (subnormal or flushed to zero below it).

    Attributes:
        underflow: int64 ``[len(grads)]`` on the flag's device: per tensor, the elements with ``|x| < tiny`` (zeros
            included, NaN not), or ``None`` before the call.
        zeros: int64 ``[len(grads)]``: per tensor, the elements that are exactly zero (``+0`` or ``-0``; a subset of
            ``underflow``). Rows of an embedding absent from the batch, units a ReLU switched off and masked positions
            have exact zero gradients whatever the scale; values that the half backward flushed to zero do too.
        peak: FP32 ``[len(grads)]``: per tensor, the largest ``|x|`` (``inf`` when it holds inf or NaN; 0 when empty).
    """

    tiny: float
    underflow: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    peak: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if isinstance(self.tiny, bool) or not isinstance(self.tiny, (int, float)) or not self.tiny > 0:
            raise ValueError(f"tiny={self.tiny!r} must be a positive number (torch.finfo(half_dtype).tiny).")


def unscale_grads_(
    grads: Tensors,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    out: Tensors | None = None,
    compute_norm: bool = False,
    max_norm: float | None = None,
    backend: str = "auto",
    workspace: UnscaleWorkspace | None = None,
    stats: GradStats | None = None,
) -> torch.Tensor | None:
    """Unscale ``grads`` by ``inv_scale`` and record non-finite values in ``found_inf``.

    Args:
        grads: Gradients (FP32, FP16 or BF16). Unscaled in place unless ``out`` is given.
        inv_scale: 0-d or one-element FP32 tensor holding ``1 / scale``.
        found_inf: 0-d or one-element FP32 tensor; set to 1.0 when any gradient holds inf or NaN, left as it is
            otherwise (so one flag can collect several calls).
        out: Tensors of the same shapes (FP32 master gradients) that receive the unscaled values; ``grads`` are then
            only read.
        compute_norm: Return the global L2 norm of the unscaled gradients (before any clipping).
        max_norm: Also clip the unscaled gradients to this global L2 norm, as ``torch.nn.utils.clip_grad_norm_``
            does (bit for bit), except on an overflow (``found_inf`` set): the gradients are then unscaled but not
            clipped (the step is skipped anyway), where torch's clip would make zeros of the finite values and NaN
            of the infinite ones, hiding which kind of value overflowed from the overflow record. An infinite norm
            of finite gradients (their squares overflow FP32) is torch's: coefficient 0. Implies ``compute_norm``.
        backend: ``"auto"``, ``"foreach"``, ``"reference"`` or ``"triton"``.
        workspace: Where the ``"triton"`` backend keeps its tables across calls; pass the same one every step
            (without one, the tables are rebuilt on every call).
        stats: Also measure the scaled gradients (see :class:`GradStats`); its tensors are replaced by new ones.

    Returns:
        The norm as a 0-d FP32 tensor when asked for, else ``None``.

    Complex gradients (a spectral layer's) are taken as their real views (:func:`real_views`): the flag, the norm
    and the clip are those of the complex values, ``stats`` count their real and imaginary parts apart.

    Raises:
        ValueError: for an unknown backend, or ``backend="triton"`` with CPU tensors outside ``TRITON_INTERPRET=1``.
        TypeError: for an ``inv_scale`` or ``found_inf`` that is not a tensor (a Python float).
        ImportError: for ``backend="triton"`` when triton is not installed.
    """
    for name, value in (("inv_scale", inv_scale), ("found_inf", found_inf)):
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"{name}={value!r} must be a one-element FP32 torch.Tensor on the gradients' device, e.g. "
                f"{'torch.tensor([1 / scale])' if name == 'inv_scale' else 'torch.zeros(1)'}."
            )
    if has_complex(grads) or (out is not None and has_complex(out)):
        grads, out = real_pairs(grads, out)
    return unscale_real_grads_(
        grads, inv_scale, found_inf, out=out, compute_norm=compute_norm, max_norm=max_norm, backend=backend,
        workspace=workspace, stats=stats,
    )  # fmt: skip


def unscale_real_grads_(
    grads: Tensors,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    out: Tensors | None = None,
    compute_norm: bool = False,
    max_norm: float | None = None,
    backend: str = "auto",
    workspace: UnscaleWorkspace | None = None,
    stats: GradStats | None = None,
) -> torch.Tensor | None:
    """:func:`unscale_grads_` for gradients known to hold no complex tensor (the engine knows its parameters'
    dtypes and passes the complex ones as :func:`real_views`): no scan of the dtypes on every step."""
    if out is not None and len(out) != len(grads):
        raise ValueError(f"out has {len(out)} tensors but grads has {len(grads)}; they must match one to one.")
    if max_norm is not None and (not isinstance(max_norm, (int, float)) or max_norm <= 0):
        raise ValueError(f"max_norm={max_norm!r} must be a positive number.")
    implementation = _BACKENDS.get(backend)
    if implementation is None:
        raise ValueError(f"backend={backend!r} is not an unscale backend; valid choices: {', '.join(BACKENDS)}.")
    want_norm = compute_norm or max_norm is not None
    if backend == "auto":
        implementation = _BACKENDS[auto_backend(grads, out, norm=want_norm, stats=stats is not None)]
    if stats is not None:
        if not isinstance(stats, GradStats):
            raise TypeError(f"stats={type(stats).__name__} must be a lightning_mpx.unscale.GradStats or None.")
        return implementation(grads, inv_scale, found_inf, out, want_norm, max_norm, workspace, stats)
    return implementation(grads, inv_scale, found_inf, out, want_norm, max_norm, workspace)


def has_complex(tensors: Tensors) -> bool:
    """Whether any of ``tensors`` is complex (C-level maps: no Python per tensor)."""
    return not _COMPLEX.isdisjoint(map(_DTYPE, tensors))


def real_views(tensors: Tensors) -> list[torch.Tensor]:
    """``tensors`` with each complex one as ``torch.view_as_real`` (a view of its memory, real and imaginary parts
    as a last dimension of 2: no copy). torch's unscale kernels have no complex case (``GradScaler`` fails on one);
    on the view, an infinite or NaN part sets the flag, the L2 norm is the complex one's and a clip scales both
    parts, as each does for the complex values."""
    return [torch.view_as_real(t) if t.is_complex() else t for t in tensors]


def real_pairs(grads: Tensors, out: Tensors | None) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """:func:`real_views` of ``grads`` and ``out``, a target that is its source (unscaled in place) kept as its
    source's very view, so that the unscale still sees the pair as one tensor."""
    views = real_views(grads)
    if out is None:
        return views, None
    targets = [
        view if target is grad else torch.view_as_real(target) if target.is_complex() else target
        for grad, view, target in zip(grads, views, out)
    ]
    return views, targets


def plain_unscale_(grads: Tensors, inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
    """``unscale_grads_(grads, inv_scale, found_inf)`` on ``"auto"``, in place, with no norm, clip or statistics (a
    step's usual unscale, which :func:`auto_backend` gives torch's kernels): in the usual case (every gradient on the
    flag's and the factor's device, and on CUDA one dtype that is not bfloat16) torch's multi-tensor kernel at once,
    one Python call where :func:`unscale_grads_` takes six (a host-bound step pays each); otherwise that route.
    The caller passes complex gradients as :func:`real_views` (the engine knows which parameters are complex)."""
    device = found_inf.device
    if grads and inv_scale.device == device and (
        (device.type == "cpu" and all(map(_IS_CPU, grads)))
        or (
            len(set(map(_DEVICE, grads))) == 1
            and grads[0].device == device
            and len(dtypes := set(map(_DTYPE, grads))) == 1
            and torch.bfloat16 not in dtypes
        )
    ):
        scale = inv_scale.reshape(1) if inv_scale.dim() else inv_scale
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, scale)
        return
    unscale_grads_(grads, inv_scale, found_inf)


def resolve_backend(tensors: Tensors) -> str:
    """Whether the fused kernels can serve these tensors at all: ``"triton"`` when they are all CUDA tensors and
    triton is installed (outside its interpreter), else ``"foreach"``. ``"auto"`` takes it for an unscale with a
    norm, a clip or statistics (:func:`auto_backend`); a plain unscale and :func:`cast_copy_` take torch's kernels."""
    if tensors and all(map(_IS_CUDA, tensors)) and _triton_available() and not _interpreter_requested():
        return "triton"
    return "foreach"


def auto_backend(grads: Tensors, out: Tensors | None = None, *, norm: bool = False, stats: bool = False) -> str:
    """The backend that ``backend="auto"`` runs for an :func:`unscale_grads_` call: :func:`resolve_backend`'s,
    except for a plain unscale (no norm, clip or statistics), which is ``"foreach"``: in place (O1's step without a
    clip) unless a gradient is bfloat16, and into FP32 master gradients (``out``: O2's step without a clip).

    A step that does not clip is host-bound on a GPU unless the model is large, and there torch's kernels cost
    less: ``GradScaler``'s multi-tensor kernel unscales in one launch, and at O2 each master's gradient is a cast of
    its half gradient, where the fused kernels pay per call for their table key, the check of every tensor's address
    and the upload of the new gradient buffers' addresses (about 0.35 ms a step of a CIFAR ResNet-18 at O2 on an
    H100, the fused route 1.13x slower per step there, ``benchmarks/results/gpu/2026-11-26d-h100``). What fusion
    saves there is memory traffic: at O2 the cast and the in-place unscale move 14 bytes per element against the
    fused pass's 6. The fused kernels keep norms, clipping, statistics and bfloat16 gradients unscaled in place
    (whose torch kernel on CUDA is missing; the foreach twin then takes two more passes); ``backend="triton"``
    gives them every call."""
    in_place = out is None or all(map(operator.is_, grads, out))
    backend = resolve_backend(grads if out is None or in_place else [*grads, *out])
    if backend != "triton" or norm or stats:
        return backend
    if in_place and torch.bfloat16 in set(map(_DTYPE, grads)):
        return backend
    return "foreach"


def cast_copy_(
    dst: Tensors, src: Tensors, *, backend: str = "auto", workspace: UnscaleWorkspace | None = None
) -> None:
    """``dst[i].copy_(src[i])`` for every pair, casting (FP32 master parameters into half model parameters).

    Args:
        dst: Destination tensors (FP32, FP16 or BF16).
        src: Source tensors of the same shapes.
        backend: ``"auto"`` (``"foreach"``: torch's multi-tensor copy, one launch per device and dtype pair on
            CUDA, with less host work than the fused kernel), ``"foreach"``, ``"reference"`` or ``"triton"``.
        workspace: Table cache of the ``"triton"`` backend.
    """
    if len(dst) != len(src):
        raise ValueError(f"dst has {len(dst)} tensors but src has {len(src)}; they must match one to one.")
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is not a copy backend; valid choices: {', '.join(BACKENDS)}.")
    if backend == "reference":
        with torch.no_grad():
            for d, s in zip(dst, src):
                d.copy_(s)
        return
    if backend == "triton":
        workspace = UnscaleWorkspace() if workspace is None else workspace
        kernels, plan = _triton_plan(src, dst, workspace, "cast_copy_")
        if plan.supported:
            kernels.copy(plan, workspace)  # a kernel launch: no autograd
            return
        # Several devices or layouts the kernels do not take: the foreach twin below does the copy.
    for s_group, d_group in _grouped_pairs(src, dst):
        _foreach_copy_(d_group, s_group)


def _triton_available() -> bool:
    return "triton" in sys.modules or importlib.util.find_spec("triton") is not None


def _interpreter_requested() -> bool:
    # Under TRITON_INTERPRET=1 the kernels run on the host and cannot read CUDA memory.
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _triton_plan(src: Tensors, dst: Tensors, workspace: UnscaleWorkspace, what: str) -> tuple[Any, Any]:
    """The kernel module and the plan for these tensors: the workspace's cached one, or a new one after checking
    that the tensors can go to the kernels at all.

    A cached plan is found only for tensors with the same sizes, dtypes, devices and layouts as the ones it was
    checked and built for, so a step that finds one does no per-tensor Python work beyond building the key; new
    addresses (new gradient buffers) are uploaded into the plan without rebuilding its table.
    """
    from lightning_mpx.common.imports import require

    require("triton", extra="triton", feature=f"{what}(backend='triton')")
    from lightning_mpx.scaling import triton_unscale as kernels

    plan_key = kernels.key(src, dst)
    plan = kernels.cached(workspace, plan_key)
    if plan is None:
        _check_triton_devices(kernels, [*src, *dst])
        plan = kernels.plan(workspace, plan_key, src, dst)
    if plan.supported:
        kernels.bind(plan, src, dst)
    return kernels, plan


def _check_triton_devices(kernels: Any, tensors: Tensors) -> None:
    interpreted = kernels.interpreting()
    wrong = next((t for t in tensors if t.is_cuda == interpreted), None)
    if wrong is not None:
        if interpreted:
            raise ValueError(
                f"backend='triton' got a tensor on {wrong.device}, but its kernels run in triton's interpreter "
                "(TRITON_INTERPRET=1), which takes CPU tensors only; valid choices for CUDA tensors there: auto, "
                "foreach, reference."
            )
        raise ValueError(
            f"backend='triton' runs on CUDA tensors, but got a tensor on {wrong.device}; valid choices for it: "
            "auto, foreach, reference (CPU tensors work with 'triton' only under TRITON_INTERPRET=1)."
        )


def _triton(
    grads: Tensors,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    out: Tensors | None,
    want_norm: bool,
    max_norm: float | None,
    workspace: UnscaleWorkspace | None,
    stats: GradStats | None = None,
) -> torch.Tensor | None:
    if workspace is None:
        workspace = UnscaleWorkspace()
    kernels, plan = _triton_plan(grads, grads if out is None else out, workspace, "unscale_grads_")
    if not plan.supported:
        # Several devices, non-dense layouts or other dtypes: the foreach twin gives the same answers.
        return _foreach(grads, inv_scale, found_inf, out, want_norm, max_norm, None, stats)
    if stats is None:
        return kernels.unscale(plan, inv_scale, found_inf, want_norm, max_norm, workspace)  # type: ignore[no-any-return]
    norm: torch.Tensor | None = kernels.unscale(
        plan, inv_scale, found_inf, want_norm, max_norm, workspace, stats_tiny=float(stats.tiny)
    )
    stats.underflow, stats.zeros, stats.peak = kernels.tensor_stats(plan, len(grads), found_inf.device)
    return norm


_BF16_FALLBACK_ELEMENTS = 1 << 26


def foreach_check_and_unscale_(group: Tensors, found_inf: torch.Tensor, inv_scale: torch.Tensor) -> None:
    """Multiply one device's and dtype's tensors by ``inv_scale`` in place and raise ``found_inf`` on a non-finite.

    torch's ``_amp_foreach_non_finite_check_and_unscale_`` does both in one multi-tensor kernel, multiplying in FP32
    and rounding once, but its CUDA build refuses bfloat16 ("not implemented for 'BFloat16'", torch 2.11, found on an
    H100). A bfloat16 ``_foreach_mul_`` by the FP32 scale tensor would round the scale to bfloat16 first (a second
    rounding, up to 2**-9 off for a scale that is not a power of two), so there the products are taken in FP32 on
    copies of at most 2**26 elements at a time, checked with an infinity norm and rounded once into the gradients.
    """
    if not group or group[0].dtype != torch.bfloat16 or group[0].device.type == "cpu":
        torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale)
        return
    scale = inv_scale.reshape(()).float()
    batch: list[torch.Tensor] = []
    size = 0
    for index, tensor in enumerate(group):
        if tensor.numel():  # an infinity norm of no elements is an error
            batch.append(tensor)
            size += tensor.numel()
        if batch and (size >= _BF16_FALLBACK_ELEMENTS or index == len(group) - 1):
            wide = [t.float() for t in batch]
            torch._foreach_mul_(wide, scale)
            peaks = torch.stack(torch._foreach_norm(wide, float("inf")))
            found_inf.copy_(torch.maximum(found_inf, (~torch.isfinite(peaks)).any().to(found_inf.dtype)))
            torch._foreach_copy_(batch, wide)
            batch, size = [], 0


def _foreach(
    grads: Tensors,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    out: Tensors | None,
    want_norm: bool,
    max_norm: float | None,
    workspace: UnscaleWorkspace | None = None,
    stats: GradStats | None = None,
) -> torch.Tensor | None:
    if stats is not None:
        _foreach_stats(grads, stats, found_inf.device)  # before the unscale: the scaled values
    targets = list(grads if out is None else out)
    # A pair whose target is the gradient itself (O1: no masters; at O2 an FP32 parameter, batch norm's, that is its
    # own master) is unscaled in place: a copy into itself would change nothing. C-level maps pick the others.
    if out is not None:
        moved = list(map(operator.is_not, grads, targets))
        if any(moved):
            sources = list(itertools.compress(grads, moved))
            for src, dst in _grouped_pairs(sources, list(itertools.compress(targets, moved))):
                torch._foreach_copy_(dst, src)
    norms: list[torch.Tensor] = []
    for (device, _), group in _grouped(targets).items():
        flag = found_inf if device == found_inf.device else torch.zeros_like(found_inf, device=device)
        scale = inv_scale if inv_scale.device == device else inv_scale.to(device, non_blocking=True)
        foreach_check_and_unscale_(group, flag, scale.reshape(1) if scale.dim() else scale)
        if flag is not found_inf:
            found_inf.copy_(torch.maximum(found_inf, flag.to(found_inf.device)))
        if want_norm:
            norms.extend(n.to(found_inf.device) for n in torch._foreach_norm(group, 2.0, dtype=torch.float32))
    if not want_norm:
        return None
    total = _global_norm(norms, found_inf.device)
    if max_norm is not None:
        coef = clip_coefficient(total, max_norm, found_inf)
        for (device, _), group in _grouped(targets).items():
            torch._foreach_mul_(group, coef.to(device))
    return total


def clip_coefficient(total: torch.Tensor, max_norm: float, found_inf: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``'s coefficient for a global norm ``total``, or 1 on an overflow step (the
    gradients keep their values for the overflow record; the step is skipped): where ``found_inf`` (the check of
    those gradients) is set, or, without it, where ``total`` is not finite. Given ``found_inf``, an infinite norm of
    finite gradients (their squares overflow FP32: gradients above about 1.8e19, a diverging run) gets torch's
    coefficient, 0, as the step is not skipped: left unclipped, those gradients were applied whole."""
    if found_inf is None:
        return torch.where(torch.isfinite(total), torch.clamp(max_norm / (total + _CLIP_EPS), max=1.0), 1.0)
    return torch.where(found_inf.reshape(()) == 0, torch.clamp(max_norm / (total + _CLIP_EPS), max=1.0), 1.0)


def _reference(
    grads: Tensors,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    out: Tensors | None,
    want_norm: bool,
    max_norm: float | None,
    workspace: UnscaleWorkspace | None = None,
    stats: GradStats | None = None,
) -> torch.Tensor | None:
    targets = list(grads if out is None else out)
    squares = torch.zeros((), dtype=torch.float32, device=found_inf.device)
    if stats is not None:
        under, zeros, peaks = [], [], []
        for grad in grads:  # before the unscale: the scaled values
            magnitude = grad.detach().float().abs()
            magnitude = torch.where(magnitude.isnan(), torch.inf, magnitude)  # NaN counts as infinitely large
            under.append((magnitude < stats.tiny).sum().to(found_inf.device))
            zeros.append((magnitude == 0).sum().to(found_inf.device))
            peak = magnitude.max() if magnitude.numel() else magnitude.new_zeros(())
            peaks.append(peak.to(found_inf.device))
        empty = torch.zeros(0, device=found_inf.device)
        stats.underflow = (torch.stack(under) if under else empty).to(torch.int64)
        stats.zeros = (torch.stack(zeros) if zeros else empty).to(torch.int64)
        stats.peak = (torch.stack(peaks) if peaks else empty).to(torch.float32)
    for index, target in enumerate(targets):
        if out is not None:
            target.copy_(grads[index])
        target.mul_(inv_scale.to(target.device).reshape(()))
        if not torch.isfinite(target).all():
            found_inf.fill_(1.0)
        if want_norm:
            squares = squares + target.float().square().sum().to(found_inf.device)
    if not want_norm:
        return None
    total = squares.sqrt()
    if max_norm is not None:
        coef = clip_coefficient(total, max_norm, found_inf)
        for target in targets:
            target.mul_(coef.to(target.device))
    return total


def _foreach_stats(grads: Tensors, stats: GradStats, device: torch.device) -> None:
    """:class:`GradStats` with torch's multi-tensor kernels, on copies of at most 2**26 elements at a time.

    For each batch: ``|x| / tiny`` rounded down is zero exactly for the elements below ``tiny`` (the division is by
    a power of two: exact), so an L0 norm (count of nonzero elements, NaN and inf included) counts the others; the
    L0 norm of the gradients themselves counts their non-zero elements; the largest magnitude is an infinity norm
    (NaN propagates and is then read as inf). Empty tensors get 0, 0 and 0.
    """
    scale = 1.0 / stats.tiny
    numels = [t.numel() for t in grads]
    positions: list[int] = []
    kept: list[torch.Tensor] = []  # per batch: non-underflowing counts, FP32
    nonzero: list[torch.Tensor] = []  # per batch: non-zero counts, FP32
    peaks: list[torch.Tensor] = []
    for (_, _), indices in _grouped_indices(grads).items():
        batch: list[int] = []
        size = 0
        for position, index in enumerate(indices):
            batch.append(index)
            size += numels[index]
            if size >= _BF16_FALLBACK_ELEMENTS or position == len(indices) - 1:
                tensors = [grads[i].detach() for i in batch]
                peaks.append(torch.stack(torch._foreach_norm(tensors, float("inf"), dtype=torch.float32)).to(device))
                nonzero.append(torch.stack(torch._foreach_norm(tensors, 0, dtype=torch.float32)).to(device))
                magnitudes = torch._foreach_abs(tensors)
                torch._foreach_mul_(magnitudes, scale)
                torch._foreach_floor_(magnitudes)
                kept.append(torch.stack(torch._foreach_norm(magnitudes, 0, dtype=torch.float32)).to(device))
                del magnitudes
                positions += batch
                batch, size = [], 0
    underflow = torch.zeros(len(grads), dtype=torch.int64, device=device)
    zeros = torch.zeros(len(grads), dtype=torch.int64, device=device)
    peak = torch.zeros(len(grads), dtype=torch.float32, device=device)
    if positions:
        where = torch.tensor(positions, dtype=torch.int64).to(device, non_blocking=True)
        numel = torch.tensor([numels[i] for i in positions], dtype=torch.float64).to(device, non_blocking=True)
        underflow.index_copy_(0, where, (numel - torch.cat(kept).double()).round().to(torch.int64))
        zeros.index_copy_(0, where, (numel - torch.cat(nonzero).double()).round().to(torch.int64))
        found = torch.cat(peaks)
        peak.index_copy_(0, where, torch.where(found.isnan(), torch.inf, found))
    stats.underflow, stats.zeros, stats.peak = underflow, zeros, peak


def _grouped_indices(tensors: Tensors) -> dict[tuple[torch.device, torch.dtype], list[int]]:
    """Indices of the non-empty tensors, by device and dtype (an infinity norm of no elements is an error)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for index, tensor in enumerate(tensors):
        if tensor.numel():
            groups.setdefault((tensor.device, tensor.dtype), []).append(index)
    return groups


def _global_norm(norms: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not norms:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def _grouped(tensors: Tensors) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    # The usual case, every tensor on one device in one dtype, is one group, found with C-level maps rather than
    # a Python call per tensor. torch's CPU kernels (a loop over the tensors) take any mix of dtypes: on the CPU
    # only the device makes groups.
    if tensors and (
        all(map(_IS_CPU, tensors))
        or (len(set(map(_DTYPE, tensors))) == 1 and len(set(map(_DEVICE, tensors))) == 1)
    ):
        first = tensors[0]
        return {(first.device, first.dtype): list(tensors)}
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return groups


def _foreach_copy_(dst: Tensors, src: Tensors) -> None:
    """``torch._foreach_copy_(dst, src)`` with gradients off (parameters are written): ``torch.no_grad()``'s effect
    without its Python context manager, which a step would pay on every copy."""
    grad_mode = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        torch._foreach_copy_(dst, src)
    finally:
        torch._C._set_grad_enabled(grad_mode)


def _one_copy_group(src: Tensors, dst: Tensors) -> bool:
    """Whether torch's multi-tensor copy takes every pair in one group: the usual case (O2: half gradients into FP32
    masters, or the masters into the model, on one device), found with C-level maps; on the CPU, where torch's copy
    is a loop over the pairs that takes any mix of dtypes, always."""
    return bool(src) and (
        (all(map(_IS_CPU, dst)) and all(map(_IS_CPU, src)))
        or (len(set(map(_DTYPE, src))) == 1 and len(set(map(_DTYPE, dst))) == 1 and len(set(map(_DEVICE, dst))) == 1)
    )


def _grouped_pairs(src: Tensors, dst: Tensors) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    if _one_copy_group(src, dst):
        return [(list(src), list(dst))]
    groups: dict[tuple[torch.device, torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for s, d in zip(src, dst):
        pair = groups.setdefault((d.device, s.dtype, d.dtype), ([], []))
        pair[0].append(s)
        pair[1].append(d)
    return list(groups.values())


_Backend = Callable[..., "torch.Tensor | None"]
_BACKENDS: Mapping[str, _Backend] = MappingProxyType(
    {"auto": _foreach, "foreach": _foreach, "reference": _reference, "triton": _triton}
)
#: The names accepted by ``backend=``.
BACKENDS: tuple[str, ...] = tuple(_BACKENDS)
