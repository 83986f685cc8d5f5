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
