"""The unscale entry point: one call that unscales gradients, flags non-finite values and measures their norm.

:func:`unscale_grads_` works in place, or from half model gradients into FP32 master gradients (``out=``). It can
also clip by the global L2 norm of the unscaled gradients. Backends:

* ``"foreach"``: torch's multi-tensor kernels (``_amp_foreach_non_finite_check_and_unscale_``, ``_foreach_norm``);
* ``"reference"``: a plain per-tensor loop, the readable twin that tests hold the others to;
* ``"auto"``: the fastest available for the tensors' device (``"foreach"`` for now; fused GPU kernels plug in here).

No backend waits for the device: the flag and the norm stay device tensors.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Mapping, Sequence

import torch

Tensors = Sequence[torch.Tensor]

_CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


def unscale_grads_(
    grads: Tensors,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    *,
    out: Tensors | None = None,
    compute_norm: bool = False,
    max_norm: float | None = None,
    backend: str = "auto",
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
            does; implies ``compute_norm``.
        backend: ``"auto"``, ``"foreach"`` or ``"reference"``.

    Returns:
        The norm as a 0-d FP32 tensor when asked for, else ``None``.
    """
    if out is not None and len(out) != len(grads):
        raise ValueError(f"out has {len(out)} tensors but grads has {len(grads)}; they must match one to one.")
    if max_norm is not None and (not isinstance(max_norm, (int, float)) or max_norm <= 0):
        raise ValueError(f"max_norm={max_norm!r} must be a positive number.")
    implementation = _BACKENDS.get(backend)
    if implementation is None:
        raise ValueError(f"backend={backend!r} is not an unscale backend; valid choices: {', '.join(BACKENDS)}.")
    if backend == "auto":
        implementation = _BACKENDS[resolve_backend(grads)]
    return implementation(grads, inv_scale, found_inf, out, compute_norm or max_norm is not None, max_norm)


def resolve_backend(grads: Tensors) -> str:
    """The backend that ``"auto"`` picks for these tensors."""
    return "foreach"


def _foreach(
    grads: Tensors,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    out: Tensors | None,
    want_norm: bool,
    max_norm: float | None,
) -> torch.Tensor | None:
    targets = list(grads if out is None else out)
    if out is not None:
        for src, dst in _grouped_pairs(grads, targets):
            torch._foreach_copy_(dst, src)
    norms: list[torch.Tensor] = []
    for (device, _), group in _grouped(targets).items():
        flag = found_inf if device == found_inf.device else torch.zeros_like(found_inf, device=device)
        scale = inv_scale if inv_scale.device == device else inv_scale.to(device, non_blocking=True)
        torch._amp_foreach_non_finite_check_and_unscale_(group, flag, scale.reshape(1) if scale.dim() else scale)
        if flag is not found_inf:
            found_inf.copy_(torch.maximum(found_inf, flag.to(found_inf.device)))
        if want_norm:
            norms.extend(n.to(found_inf.device) for n in torch._foreach_norm(group, 2.0, dtype=torch.float32))
    if not want_norm:
        return None
    total = _global_norm(norms, found_inf.device)
    if max_norm is not None:
        coef = torch.clamp(max_norm / (total + _CLIP_EPS), max=1.0)
        for (device, _), group in _grouped(targets).items():
            torch._foreach_mul_(group, coef.to(device))
    return total


def _reference(
    grads: Tensors,
    inv_scale: torch.Tensor,
    found_inf: torch.Tensor,
    out: Tensors | None,
    want_norm: bool,
    max_norm: float | None,
) -> torch.Tensor | None:
    targets = list(grads if out is None else out)
    squares = torch.zeros((), dtype=torch.float32, device=found_inf.device)
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
        coef = torch.clamp(max_norm / (total + _CLIP_EPS), max=1.0)
        for target in targets:
            target.mul_(coef.to(target.device))
    return total


def _global_norm(norms: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not norms:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def _grouped(tensors: Tensors) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return groups


def _grouped_pairs(src: Tensors, dst: Tensors) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    groups: dict[tuple[torch.device, torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for s, d in zip(src, dst):
        pair = groups.setdefault((d.device, s.dtype, d.dtype), ([], []))
        pair[0].append(s)
        pair[1].append(d)
    return list(groups.values())


_Backend = Callable[
    [Tensors, torch.Tensor, torch.Tensor, "Tensors | None", bool, "float | None"], "torch.Tensor | None"
]
_BACKENDS: Mapping[str, _Backend] = MappingProxyType({"auto": _foreach, "foreach": _foreach, "reference": _reference})
#: The names accepted by ``backend=``.
BACKENDS: tuple[str, ...] = tuple(_BACKENDS)
