"""Parsing of user-facing dtype arguments."""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

import torch

#: The accepted spellings of each half dtype.
_HALF_DTYPE_NAMES: Mapping[str, torch.dtype] = MappingProxyType({
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
})

HALF_DTYPES = (torch.float16, torch.bfloat16)
#: The accepted spellings, lower case (``parse_half_dtype`` takes any case).
HALF_DTYPE_NAMES: frozenset[str] = frozenset(_HALF_DTYPE_NAMES)


def parse_half_dtype(value: str | torch.dtype, *, argument: str = "half_dtype") -> torch.dtype:
    """Turn ``"float16"``/``"bf16"``/``torch.float16``... into a torch half dtype.

    Raises:
        ValueError: naming ``argument``, the value and the valid choices.
    """
    if isinstance(value, torch.dtype):
        if value in HALF_DTYPES:
            return value
    elif isinstance(value, str) and value.lower() in _HALF_DTYPE_NAMES:
        return _HALF_DTYPE_NAMES[value.lower()]
    choices = ", ".join(repr(name) for name in _HALF_DTYPE_NAMES) + ", torch.float16, torch.bfloat16"
    raise ValueError(f"{argument}={value!r} is not a half-precision dtype; valid choices: {choices}.")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def set_param_data(param: torch.Tensor, value: torch.Tensor, *, name: str = "a parameter") -> None:
    """``param`` takes ``value`` (its data in another dtype) in place, keeping its identity (an optimizer holding it
    stays valid). A plain tensor's ``.data`` is replaced; a tensor subclass (a tensor-parallel ``DTensor``) is swapped
    whole, as ``nn.Module.to`` does: its ``.data =`` changes its dtype but not its local shard's. As with
    ``nn.Module.to``, such a swap drops the hooks and attributes set on it.

    Raises:
        RuntimeError: naming ``name`` when torch refuses the swap (a weak reference to it, a graph still holding it).
    """
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if not is_traceable_wrapper_subclass(param):
        param.data = value
        return
    cast = torch.nn.Parameter(value.detach(), requires_grad=param.requires_grad)
    try:
        torch.utils.swap_tensors(param, cast)
    except RuntimeError as error:
        raise RuntimeError(
            f"{name} ({type(param).__name__}) cannot change dtype in place: torch.utils.swap_tensors refused "
            f"({error}). "
            "Cast the model before anything holds a weak reference to its parameters (torch.compile) or runs a "
            "forward whose graph is kept."
        ) from error
