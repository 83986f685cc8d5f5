"""The engine's file in Accelerate's checkpoints: ``save_state``/``load_state`` write and read the loss scalers, the
FP32 masters and the skip counters of the adapter's :class:`~lightning_mpx.engine.amp.Amp` in :data:`AMP_STATE_NAME`,
next to Accelerate's own files."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from lightning_mpx.engine.amp import Amp

__all__ = ["AMP_STATE_NAME", "amp_state_path", "masters_into", "read_amp_state", "write_amp_state"]

#: The file that ``save_state`` writes the :class:`~lightning_mpx.engine.amp.Amp` state to.
AMP_STATE_NAME = "lightning_mpx_amp.bin"


def masters_into(amp: Amp, module: nn.Module, state: dict[str, Any]) -> None:
    """At O2, put the FP32 masters in place of the half weights in ``state`` (``module``'s state dict), in place: the
    weights training produced, FP32 as Accelerate's own ``"bf16"``/``"fp16"`` give them, for ``get_state_dict``,
    ``save_model`` and the model files of ``save_state`` (whose O2 resume takes them to the masters exactly).

    The masters are handed as they are, not copied; an entry without an FP32 value (a frozen half parameter, a LoRA
    base; a half buffer; a model prepared for evaluation only) stays as the model holds it: its upcast would add no
    information and, for a LoRA base, twice the base's memory on its device at every save."""
    if not amp.properties.master_weights or amp.sharded:
        return
    amp.refresh_masters()  # writes made to the model since the last step, as the step will take them
    fp32: dict[int, torch.Tensor] = {}
    for weights in amp._masters.prune():
        fp32.update(weights.fp32_values())  # by id of the half parameter: its master (or the FP32 value kept for it)
    if not fp32:
        return
    for key, value in module.state_dict(keep_vars=True).items():
        master = fp32.get(id(value)) if isinstance(value, torch.Tensor) else None
        if master is not None and key in state:
            state[key] = master.detach()


def write_amp_state(state: dict[str, Any], output_dir: str) -> None:
    """Write the engine's ``state`` into the checkpoint in ``output_dir``."""
    torch.save(state, os.path.join(output_dir, AMP_STATE_NAME))


def amp_state_path(input_dir: str, opt_level: str) -> str:
    """The engine's file in the checkpoint in ``input_dir``; ``FileNotFoundError`` (which says how to start from a
    checkpoint of plain Accelerate) when it has none."""
    path = os.path.join(input_dir, AMP_STATE_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} does not exist: the checkpoint in {input_dir} was not saved by lightning_mpx's Accelerator "
            f"with an opt level, so the loss scale and FP32 masters of mixed_precision={opt_level!r} "
            "cannot be restored. To start this run from the weights of a checkpoint of plain Accelerate, load "
            "them into the model before accelerator.prepare(...) (model.load_state_dict(...), or accelerate's "
            "load_checkpoint_in_model), or after it (FP32 values go to the O2 masters exactly); the optimizer "
            "and the loss scale then start afresh."
        )
    return path


def read_amp_state(path: str) -> dict[str, Any]:
    """The engine's state from its file ``path`` (:func:`amp_state_path`), on the CPU."""
    return torch.load(path, map_location="cpu", weights_only=True)  # type: ignore[no-any-return]
