"""Buffers a half model keeps in FP32 on purpose: rotary inverse frequencies.

A rotary embedding's angles are ``position * inv_freq``: one rounding of ``inv_freq`` to bfloat16 (relative error up
to 2**-9) is multiplied by the position, up to 1.8 rad off at position 4096 (Llama's default base). Hugging Face's
rotary modules (``LlamaRotaryEmbedding`` and the other models' copies, the layer-typed ``sliding_attention_inv_freq``
of Gemma 3 included) make ``inv_freq`` with ``dtype=torch.float`` so that transformers' own bfloat16 model
(``from_pretrained(..., dtype=torch.bfloat16)``) keeps it FP32, and compute the angles in FP32 (``.float()``, autocast
off) and return ``cos``/``sin`` in their input's dtype: an FP32 ``inv_freq`` promotes nothing after them. flash-attn's
``RotaryEmbedding`` recomputes its frequencies in FP32 when they were cast, for the same reason. O2/O3 keep them FP32
as transformers' bfloat16 model does; every other floating buffer (a position table added to half activations, which
in FP32 would promote them and fail at the next half layer) is cast. A table of cos/sin values (litgpt's ``cos`` and
``sin``) is cast too: its rounding is that of the values themselves, not multiplied by a position.

:func:`fp32_tensors` and :func:`restore_fp32_tensors` give the modules made FP32 again after such a cast (an
``fp32_modules`` unit under ``shard_model`` at O3) the exact values they held before it.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_mpx.common.dtypes import set_param_data

__all__ = ["fp32_tensors", "keeps_fp32_buffer", "restore_fp32_tensors"]


def keeps_fp32_buffer(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s floating buffer ``name`` stays FP32 when the model is cast to half (O2/O3).

    True for the inverse frequencies of a rotary embedding as transformers writes one: a module with no parameters
    of its own whose class name contains ``"RotaryEmbedding"`` (the test transformers' ``_init_weights`` uses to find
    them), and a buffer name ending in ``"inv_freq"`` (``inv_freq``, ``original_inv_freq``, Gemma 3's layer-typed
    ``sliding_attention_inv_freq``). A buffer already in half is left as it is: round it yourself before preparing
    (``model.model.rotary_emb.to(torch.bfloat16)``) to get the rounded frequencies.
    """
    if not name.endswith("inv_freq") or "RotaryEmbedding" not in type(module).__name__:
        return False
    return next(iter(module.parameters(recurse=False)), None) is None


def fp32_tensors(module: nn.Module) -> dict[tuple[int, str], torch.Tensor]:
    """The FP32 parameters' values and buffers of ``module``'s submodules before a cast to half (references: no
    copy), by submodule and name, for :func:`restore_fp32_tensors`."""
    found = {}
    for sub in module.modules():
        for table, tensors in (("p", sub._parameters), ("b", sub._buffers)):
            for name, tensor in tensors.items():
                if tensor is not None and tensor.dtype == torch.float32:
                    found[(id(sub), f"{table}:{name}")] = tensor.data if table == "p" else tensor
    return found


def restore_fp32_tensors(module: nn.Module, before: dict[tuple[int, str], torch.Tensor]) -> None:
    """After the cast to half: the parameters and buffers of ``module`` that are FP32 again (an FP32 island's) take
    back the exact values they held before it (from :func:`fp32_tensors`), not the upcast of their rounding."""
    for sub in module.modules():
        for table, tensors in (("p", sub._parameters), ("b", sub._buffers)):
            for name, tensor in tensors.items():
                value = before.get((id(sub), f"{table}:{name}"))
                if value is None or tensor is None or tensor.dtype != torch.float32 or tensor.shape != value.shape:
                    continue
                if table == "p":
                    set_param_data(tensor, value)  # a tensor-parallel DTensor: its local shard too
                else:
                    tensors[name] = value
