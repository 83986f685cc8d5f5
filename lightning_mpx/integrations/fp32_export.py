"""The FP32 masters in a framework's copy of a model's state dict, at O2: what every front door exports or checkpoints
as the model's weights (Accelerate's ``get_state_dict``/``save_model``/``save_state``, the ``transformers.Trainer``
mixin's ``save_model``, the Lightning plugin's checkpoints), so that what reads them without lightning_mpx gets the
weights training produced, not their half rounding."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_mpx.engine.amp import Amp

__all__ = ["masters_into"]


def masters_into(amp: Amp, module: nn.Module, state: dict[str, Any]) -> list[str]:
    """At O2, put the FP32 masters in place of the half weights in ``state`` (``module``'s state dict), in place: the
    weights training produced, FP32 as the frameworks' own mixed precisions give them.

    The masters are handed as they are, not copied; an entry without an FP32 value (a frozen half parameter, a LoRA
    base; a half buffer; a model prepared for evaluation only) stays as the model holds it: its upcast would add no
    information and, for a LoRA base, twice the base's memory on its device at every save. Returns the keys replaced."""
    if not amp.properties.master_weights or amp.sharded:
        return []
    amp.refresh_masters()  # writes made to the model since the last step, as the step will take them
    fp32: dict[int, torch.Tensor] = {}
    for weights in amp._masters.prune():
        fp32.update(weights.fp32_values())  # by id of the half parameter: its master (or the FP32 value kept for it)
    replaced: list[str] = []
    for key, value in module.state_dict(keep_vars=True).items() if fp32 else ():
        master = fp32.get(id(value)) if isinstance(value, torch.Tensor) else None
        if master is not None and key in state:
            state[key] = master.detach()
            replaced.append(key)
    return replaced
