"""The cast :meth:`Amp.prepare_model <lightning_mpx.engine.amp.Amp.prepare_model>` makes of a model, in place, and the
FP32 values it keeps through that cast (the parts of :meth:`PreparedModels.prepare
<lightning_mpx.engine.preparation.PreparedModels.prepare>` that change dtypes): :func:`_convert` (half at O2/O3, FP32
at O0); before it, the values held (:func:`values_before_cast`: the ``fp32_modules`` parameters' and those the masters
are made from) and the FP32 buffers (:func:`_fp32_buffers`); after it, the pinned parameters and buffers given back
their exact values (:func:`_keep_fp32_values`, :func:`_keep_fp32_buffers`), the submodules tied to a pinned one run in
FP32 (:func:`run_tied_in_fp32`), and O1's FP32 weights taken from an O2 engine's masters (:func:`_fp32_from_masters`).
All run at ``prepare_model`` only, never per step.
"""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch
from torch import nn

from lightning_mpx.common.dtypes import HALF_DTYPES, set_param_data
from lightning_mpx.health.promotion import _Fp32Boundary, _half_reference, _module_to_fp32, matches
from lightning_mpx.masters.watch import WatchedParameter, release_masters
from lightning_mpx.masters.weights import convert_module
from lightning_mpx.opt_levels import Properties


def _convert(module: nn.Module, props: Properties) -> None:
    """Cast ``module`` in place for the opt level: half at O2/O3 (batch norm FP32 when ``keep_batchnorm_fp32``),
    half parameters to FP32 at O0."""
    if props.casts_model:
        convert_module(module, props.half_dtype, keep_batchnorm_fp32=props.keep_batchnorm_fp32 is not False)
    elif props.cast_model_type == torch.float32:
        for param in module.parameters():
            if param.dtype in (torch.float16, torch.bfloat16):
                set_param_data(param, param.data.float())  # a tensor-parallel DTensor: its local shard too


def values_before_cast(
    module: nn.Module,
    props: Properties,
    prefix: str,
    patterns: Sequence[str],
    *,
    masters: bool,
    frozen: bool,
    agreed: dict[int, torch.Tensor] | None,
) -> tuple[dict[int, torch.Tensor], list[nn.Module]]:
    """Before the cast to half (O2/O3): the FP32 values to hold through it, by parameter ``id`` (the tensors
    themselves, or an FP32 copy of another floating dtype), and the submodules tied to the ``fp32_modules`` ones
    (``patterns``; see :func:`_pinned_params`). Held: the pinned parameters' own values, and with ``masters`` (the
    masters are made from FP32 values) the trainable parameters' for their masters (``frozen``: the frozen ones' too;
    ``agreed``: under a process group, only those the ranks agreed on). Nothing at O0 and O1, which do not cast."""
    before_cast: dict[int, torch.Tensor] = {}
    if not props.casts_model:
        return before_cast, []
    pinned, tied = _pinned_params(module, prefix, patterns)
    for param in module.parameters():
        # A model loaded in another floating dtype (float16 for a bfloat16 run, float64) too: its values in
        # FP32 (exact from a half dtype), not the rounding of the cast to the run's half dtype.
        # (Not a half parameter of an earlier engine, or a deep copy's: it hands over its FP32 values.)
        if param.dtype == props.half_dtype or not param.is_floating_point() or param.is_complex():
            continue
        if param.dtype != torch.float32 and type(param) is WatchedParameter:
            continue
        # Under a process group, only the values the ranks agreed on (rank zero's: see masters/rank_zero.py).
        kept = masters and (param.requires_grad or frozen) and (agreed is None or id(param) in agreed)
        if id(param) in pinned or kept:
            before_cast[id(param)] = param.data if param.dtype == torch.float32 else param.data.float()
    return before_cast, tied


def _pinned_params(module: nn.Module, prefix: str, patterns: Sequence[str]) -> tuple[set[int], list[nn.Module]]:
    """``id`` of the parameters kept FP32 at O2/O3, and the submodules tied to the pinned ones.

    The pinned parameters are those of the submodules that ``fp32_modules`` patterns name, and of every submodule
    that shares a parameter with one of those (a tied input embedding of a pinned ``lm_head``): a shared parameter is
    one tensor, so it cannot be FP32 in one module and half in the other. Such a tied submodule runs in FP32 too
    (see :func:`run_tied_in_fp32`), found again for the parameters it adds, until none is left.

    Raises:
        ValueError: when the module that shares a pinned parameter is the root model or holds a pinned module (it
            cannot run in FP32 without running the pinned module's surroundings in FP32), naming the tie.
    """
    if not patterns:
        return set(), []
    modules = list(module.named_modules())
    tops = [name for name, _ in modules if name and any(matches(prefix + name, pattern) for pattern in patterns)]
    params = {id(p): f"{name}.{pname}" for name, sub in modules if name in tops for pname, p in sub.named_parameters()}
    tied: list[nn.Module] = []
    changed = True
    while changed:
        changed = False
        for name, sub in modules:
            if any(name == top or name.startswith(top + ".") for top in tops):
                continue
            shared = [(pname, p) for pname, p in sub.named_parameters(recurse=False) if id(p) in params]
            if not shared:
                continue
            pname, param = shared[0]
            owner = "the root model" if not name else f"{prefix + name!r}"
            holds = [top for top in tops if not name or top.startswith(name + ".")]
            if holds:
                raise ValueError(
                    f"fp32_modules pins {prefix + holds[0]!r}, whose parameter {prefix + params[id(param)]!r} is also "
                    f"{owner}'s own parameter {prefix + (name + '.' if name else '') + pname!r} (tied weights); "
                    f"{owner} holds the pinned module and cannot run in FP32 around it. Pin a module that holds "
                    "both users of the parameter, untie the weights, or use opt_level='O1', whose FP32 modules keep "
                    "every parameter FP32."
                )
            tops.append(name)
            tied.append(sub)
            for sub_pname, p in sub.named_parameters():
                params.setdefault(id(p), f"{name}.{sub_pname}")
            changed = True
    return set(params), tied


def _fp32_from_masters(module: nn.Module) -> None:
    """O1 given an O2-trained model: its half parameters with masters become FP32 with the masters' exact values
    (the model O1 expects, not its rounding trained in half), as ``model.float()`` would make them."""
    with torch.no_grad():
        for param in module.parameters():
            if type(param) is WatchedParameter and param.dtype in HALF_DTYPES:
                param.data = param.data.float()
    release_masters(module)  # anything left (a frozen half parameter) stays half, let go


def _fp32_buffers(module: nn.Module) -> dict[tuple[int, str], torch.Tensor]:
    """The FP32 buffers of ``module``'s submodules before the cast (references: no copy), for
    :func:`_keep_fp32_buffers`."""
    return {
        (id(sub), name): buffer
        for sub in module.modules()
        for name, buffer in sub._buffers.items()
        if buffer is not None and buffer.dtype == torch.float32
    }


def _keep_fp32_buffers(module: nn.Module, before: dict[tuple[int, str], torch.Tensor]) -> None:
    """After the cast to half: buffers FP32 again (an ``fp32_modules`` module's, a tied module's) take back the
    exact values they held before it, not the upcast of their rounding (a constant of 3.14159 was 9.7e-4 off)."""
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            value = before.get((id(sub), name))
            if (
                value is not None
                and buffer is not None
                and buffer is not value
                and buffer.dtype == torch.float32
                and buffer.shape == value.shape
                and buffer.device == value.device
            ):
                sub._buffers[name] = value


def _keep_fp32_values(
    module: nn.Module,
    before_cast: dict[int, torch.Tensor],
    agreed: dict[int, torch.Tensor] | None = None,
    *,
    frozen: bool = False,
) -> dict[int, torch.Tensor]:
    """After the cast to half: parameters FP32 again (``fp32_modules``) take back the exact values they held
    before it, not their rounding; returns the FP32 values of the half parameters, for their masters (``agreed``:
    rank zero's, for the parameters half before the cast too, a second stage's; ``frozen``: the frozen ones' too)."""
    initial = {}
    with torch.no_grad():
        for param in module.parameters():
            value = before_cast.get(id(param))
            if value is None and agreed is not None:
                value = agreed.get(id(param))
            if value is None or value.shape != param.shape:
                continue
            if param.dtype == torch.float32 and param.data_ptr() != value.data_ptr():
                param.data = value  # pinned FP32 by fp32_modules after the cast: its own values, exactly
            elif param.dtype in HALF_DTYPES and (param.requires_grad or frozen):
                initial[id(param)] = value
    return initial


def run_tied_in_fp32(
    module: nn.Module,
    tied: list[nn.Module],
    hooks: weakref.WeakKeyDictionary[nn.Module, list[Any]],
    half: torch.dtype,
) -> None:
    """O2/O3: the submodules of ``module`` that share a parameter with an ``fp32_modules`` module (a tied input
    embedding of ``lm_head``) run in FP32 as well, with that one FP32 parameter: their floating inputs are cast to
    FP32 and their FP32 outputs to ``half``, so the half layers after them get half inputs; the hooks' handles go in
    ``hooks[module]``."""
    for sub in tied:
        _module_to_fp32(sub)
    if module in hooks:  # prepared again (evaluated, then trained): hooked once
        return
    boundary = _Fp32Boundary(policy=False, out_dtype=half, reference=_half_reference(module, half))
    # The same order as the pinned modules' hooks: inputs after any other pre-hook, outputs before any other hook.
    hooks[module] = [
        handle
        for sub in tied
        for handle in (
            sub.register_forward_pre_hook(boundary.pre, with_kwargs=True),
            sub.register_forward_hook(boundary.post, prepend=True, always_call=True),
        )
    ]
