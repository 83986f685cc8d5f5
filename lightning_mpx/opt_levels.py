"""Opt levels O0-O3: Apex's presets as frozen, validated properties.

``resolve_properties("O2", keep_batchnorm_fp32=False)`` starts from a preset, applies keyword overrides and
refuses combinations that cannot work together, with a message that says why.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any, Literal, Mapping, Union

import torch

from lightning_mpx.common.dtypes import dtype_name, parse_half_dtype

LossScale = Union[float, Literal["dynamic"]]

OPT_LEVELS: tuple[str, ...] = ("O0", "O1", "O2", "O3")

#: One line per preset, for help texts, logs and error messages.
DESCRIPTIONS: Mapping[str, str] = MappingProxyType({
    "O0": "Pure FP32 training: nothing is cast, static loss scale 1.0 (the accuracy baseline).",
    "O1": "Cast-table policy: the model stays FP32, matmuls and convolutions run in half, "
    "softmax, reductions and losses in FP32; dynamic loss scaling.",
    "O2": "Half model with batch norm kept FP32, FP32 master weights for the optimizer; dynamic loss scaling.",
    "O3": "Pure half: the whole model in half precision, no master weights, static loss scale 1.0 "
    "(a speed baseline, not for accuracy).",
})

_FP32_MAX = float(torch.finfo(torch.float32).max)  # the scale lives in an FP32 tensor
_OVERRIDABLE = ("cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32", "master_weights", "loss_scale")


@dataclass(frozen=True)
class Properties:
    """What an opt level does, field by field (Apex's ``amp.Properties``, frozen and validated).

    Attributes:
        opt_level: The preset this started from (``"O0"`` to ``"O3"``).
        cast_model_type: dtype the model's floating-point parameters are cast to, or ``None`` to leave the model as
            it is (O1).
        patch_torch_functions: Apply the cast-table policy to torch functions during the forward pass (O1).
        keep_batchnorm_fp32: Keep batch-norm modules in FP32 when the model is cast to half; ``None`` where the model
            is not cast. ``None`` given with a half model is resolved here, once: the level's value where its preset
            casts the model (O2: ``True``, O3: ``False``), else ``True``.
        master_weights: Keep FP32 master copies of half parameters for the optimizer to update.
        loss_scale: ``"dynamic"`` or a positive static scale.
        half_dtype: The low-precision dtype: ``torch.float16`` or ``torch.bfloat16``.
    """

    opt_level: str
    cast_model_type: torch.dtype | None
    patch_torch_functions: bool
    keep_batchnorm_fp32: bool | None
    master_weights: bool
    loss_scale: LossScale
    half_dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        _check_opt_level(self.opt_level)
        if self.half_dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(
                f"half_dtype={self.half_dtype!r} is not a half-precision dtype; valid choices: torch.float16, "
                "torch.bfloat16."
            )
        if self.cast_model_type not in (None, torch.float32, self.half_dtype):
            raise ValueError(
                f"cast_model_type={self.cast_model_type!r} disagrees with half_dtype={self.half_dtype!r}; valid "
                f"choices: None (leave the model as it is), torch.float32, {self.half_dtype!r}."
            )
        for name in ("patch_torch_functions", "master_weights"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}={getattr(self, name)!r} must be True or False.")
        _check_loss_scale(self.loss_scale)
        model_is_half = self.cast_model_type == self.half_dtype
        if self.master_weights and not model_is_half:
            raise ValueError(
                f"master_weights=True needs a model cast to half (cast_model_type={self.half_dtype!r}), but "
                f"cast_model_type={self.cast_model_type!r}: FP32 master copies of FP32 parameters would be "
                "duplicates. Use opt_level='O2', or leave master_weights=False."
            )
        if self.keep_batchnorm_fp32 is None and model_is_half:
            # The one reading of None on a half model (every converter reads this field as a bool): the level's
            # value where its preset casts the model (O2: True, O3: False), else True (batch norm's statistics need
            # FP32's range), as an override given as None means.
            preset = _preset(self.opt_level, self.half_dtype).keep_batchnorm_fp32
            object.__setattr__(self, "keep_batchnorm_fp32", True if preset is None else preset)
        if self.keep_batchnorm_fp32 is not None:
            if not isinstance(self.keep_batchnorm_fp32, bool):
                raise TypeError(f"keep_batchnorm_fp32={self.keep_batchnorm_fp32!r} must be True, False or None.")
            if not model_is_half:
                raise ValueError(
                    f"keep_batchnorm_fp32={self.keep_batchnorm_fp32!r} only applies when the model is cast to half, "
                    f"but cast_model_type={self.cast_model_type!r}"
                    + (
                        ": with the cast-table policy batch norm already runs in FP32. Leave it None."
                        if self.patch_torch_functions
                        else ". Leave it None, or use opt_level='O2' or 'O3'."
                    )
                )

    @property
    def description(self) -> str:
        """One line on what these properties do: the preset's description with the loss scaling actually in use (a
        bfloat16 preset or an override can change it), the half dtype (except at O0, which casts nothing) and the
        overrides of the preset, named as keywords.

        Example:
            >>> resolve_properties("O2", half_dtype="bfloat16", keep_batchnorm_fp32=False).description.split("; ")[-1]
            'static loss scale 1.0. Half dtype: bfloat16. Overrides: keep_batchnorm_fp32=False.'
        """
        text = DESCRIPTIONS[self.opt_level]
        actual = "dynamic loss scaling" if self.dynamic_loss_scale else f"static loss scale {float(self.loss_scale)}"  # type: ignore[arg-type]
        for clause in ("dynamic loss scaling", "static loss scale 1.0"):
            if clause in text and clause != actual:
                text = text.replace(clause, actual)
        if self.opt_level != "O0":
            text += f" Half dtype: {dtype_name(self.half_dtype)}."
        preset = _preset(self.opt_level, self.half_dtype)
        changed = [
            f"{name}={_fmt(getattr(self, name))}"
            for name in _OVERRIDABLE
            if name != "loss_scale" and getattr(self, name) != getattr(preset, name)
        ]
        if changed:
            text += f" Overrides: {', '.join(changed)}."
        return text

    @functools.cached_property  # read at every forward's input and output casts: a dict lookup after the first
    def casts_model(self) -> bool:
        """Whether the model's parameters are cast to the half dtype."""
        return self.cast_model_type == self.half_dtype

    @property
    def has_cast_policy(self) -> bool:
        """Whether the forward pass runs under a cast policy: the cast table (``patch_torch_functions``), at O2 (a
        half model with FP32 masters) the policy that runs loss functions in FP32, at O3 (a half model without) the
        one that runs a loss on arguments of two floating dtypes in the widest."""
        return self.patch_torch_functions or self.casts_model

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == "dynamic"

    def __str__(self) -> str:
        parts = [f"{f.name}={_fmt(getattr(self, f.name))}" for f in fields(self)]
        return "Properties(" + ", ".join(parts) + ")"


def _fmt(value: Any) -> str:
    return dtype_name(value) if isinstance(value, torch.dtype) else repr(value)


def _check_opt_level(opt_level: object) -> str:
    if isinstance(opt_level, str) and opt_level in OPT_LEVELS:
        return opt_level
    choices = ", ".join(repr(level) for level in OPT_LEVELS)
    hint = ""
    if isinstance(opt_level, str):
        if len(opt_level) == 2 and opt_level[0] == "0" and opt_level[1] in "0123":
            hint = f" The prefix is the letter O, not the digit zero: did you mean 'O{opt_level[1]}'?"
        elif len(opt_level) == 2 and opt_level[0] == "o" and opt_level[1] in "0123":
            hint = f" Opt levels are written with a capital letter O: did you mean 'O{opt_level[1]}'?"
        else:
            half = {"16": "float16", "fp16": "float16", "float16": "float16", "half": "float16", "bf16": "bfloat16",
                    "bfloat16": "bfloat16"}.get(opt_level.lower().removesuffix("-mixed").removesuffix("-true"))
            if half is not None:  # a framework's precision string (Lightning's "bf16-mixed", Accelerate's "fp16")
                hint = (f" {opt_level!r} is a precision setting (Lightning's precision=, Accelerate's "
                        f"mixed_precision=), not an opt level: pass 'O1' (the model stays FP32) or 'O2' (a half "
                        f"model with FP32 masters) with half_dtype={half!r}.")
    raise ValueError(f"opt_level={opt_level!r} is not an opt level; valid choices: {choices}.{hint}")


def _check_loss_scale(loss_scale: object) -> None:
    if loss_scale == "dynamic":
        return
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)):
        raise ValueError(f"loss_scale={loss_scale!r} is not valid; valid choices: 'dynamic' or a positive number.")
    if not math.isfinite(loss_scale) or loss_scale <= 0 or loss_scale > _FP32_MAX:
        raise ValueError(
            f"loss_scale={loss_scale!r} must be a positive finite number; valid choices: 'dynamic' or a positive "
            "number such as 1.0 or 128.0."
        )


def _preset(opt_level: str, half: torch.dtype) -> Properties:
    bf16 = half == torch.bfloat16
    # bfloat16 has FP32's exponent range: gradients do not underflow, so no scaling is needed by default.
    dynamic: LossScale = 1.0 if bf16 else "dynamic"
    if opt_level == "O0":
        return Properties("O0", torch.float32, False, None, False, 1.0, half)
    if opt_level == "O1":
        return Properties("O1", None, True, None, False, dynamic, half)
    if opt_level == "O2":
        return Properties("O2", half, False, True, True, dynamic, half)
    return Properties("O3", half, False, False, False, 1.0, half)


def resolve_properties(
    opt_level: str,
    *,
    half_dtype: str | torch.dtype = "float16",
    **overrides: Any,
) -> Properties:
    """Build the properties of ``opt_level`` with keyword overrides applied and validated.

    Args:
        opt_level: ``"O0"``, ``"O1"``, ``"O2"`` or ``"O3"`` (the letter O).
        half_dtype: ``"float16"`` (default) or ``"bfloat16"`` (also ``"fp16"``, ``"bf16"`` or a torch dtype). With
            bfloat16 the default loss scale is a static 1.0; pass ``loss_scale="dynamic"`` to scale anyway.
        **overrides: Any of ``cast_model_type``, ``patch_torch_functions``, ``keep_batchnorm_fp32``,
            ``master_weights``, ``loss_scale``. ``cast_model_type`` also accepts ``"half"`` and ``"float32"``.

    Returns:
        The frozen :class:`Properties`.

    Raises:
        ValueError: for an unknown opt level or dtype, a non-positive scale, or an inconsistent combination.
        TypeError: for an unknown override name.

    Example:
        >>> resolve_properties("O2", keep_batchnorm_fp32=False).keep_batchnorm_fp32
        False
    """
    _check_opt_level(opt_level)
    half = parse_half_dtype(half_dtype)
    unknown = sorted(set(overrides) - set(_OVERRIDABLE))
    if unknown:
        raise TypeError(
            f"unknown opt-level override(s) {', '.join(map(repr, unknown))}; valid choices: {', '.join(_OVERRIDABLE)}."
        )
    props = _preset(opt_level, half)
    if "cast_model_type" in overrides:
        overrides["cast_model_type"] = _parse_cast_model_type(overrides["cast_model_type"], half)
    return replace(props, **overrides)


def _parse_cast_model_type(value: object, half: torch.dtype) -> torch.dtype | None:
    if value is None or value in (torch.float32, half):
        return value  # type: ignore[return-value]
    if isinstance(value, str):
        lowered = value.lower()
        if lowered in ("float32", "fp32", "float"):
            return torch.float32
        if lowered in ("half", dtype_name(half)):
            return half
    raise ValueError(
        f"cast_model_type={value!r} is not valid with half_dtype={half!r}; valid choices: None, 'float32', 'half', "
        f"torch.float32, {half!r}."
    )
