"""The engine's file in Accelerate's checkpoints: ``save_state``/``load_state`` write and read the loss scalers, the
FP32 masters and the skip counters of the adapter's :class:`~lightning_mpx.engine.amp.Amp` in :data:`AMP_STATE_NAME`,
next to Accelerate's own files."""

from __future__ import annotations

import os
from typing import Any

import torch

from lightning_mpx.integrations.fp32_export import masters_into, warn_frozen_half

__all__ = [
    "AMP_STATE_NAME",
    "GRAD_SCALER_NAME",
    "amp_state_path",
    "masters_into",
    "read_amp_state",
    "warn_frozen_half",
    "write_amp_state",
]

#: The file that ``save_state`` writes the :class:`~lightning_mpx.engine.amp.Amp` state to.
AMP_STATE_NAME = "lightning_mpx_amp.bin"


#: The file Accelerate's own ``"fp16"`` keeps its ``GradScaler``'s state in (``accelerate.utils.SCALER_NAME``).
GRAD_SCALER_NAME = "scaler.pt"


def write_amp_state(state: dict[str, Any], output_dir: str, scalers: Any = ()) -> None:
    """Write the engine's ``state`` into the checkpoint in ``output_dir``, and, given ``scalers`` (the engine's loss
    scalers), :data:`GRAD_SCALER_NAME` in ``GradScaler``'s format, which ``load_state`` of Accelerate's own
    ``"fp16"`` requires (it fails on a missing file): the dynamic scale of loss 0, or for a static scale (a setting
    a ``GradScaler``, always dynamic, cannot hold) a fresh ``GradScaler``'s state, where ``"fp16"`` starts without
    a checkpoint (as Lightning's ``"16-mixed"`` starts at its ``init_scale``)."""
    torch.save(state, os.path.join(output_dir, AMP_STATE_NAME))
    if scalers and state.get("scalers"):
        native = scalers[0].grad_scaler_state(state["scalers"][0])
        if native is None:
            native = torch.amp.GradScaler("cpu").state_dict()  # its scale is a Python float, not a tensor
        torch.save(native, os.path.join(output_dir, GRAD_SCALER_NAME))


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
            "load_checkpoint_in_model), or after it (FP32 values go to the O2 masters exactly), and keep the "
            "optimizer's state (its moments) with prepared_optimizer.load_state_dict(torch.load(os.path.join("
            f"{input_dir!r}, 'optimizer.bin'))) after prepare (optimizer_1.bin for the second...); the loss scale "
            "starts from init_scale (a scaler.pt of Accelerate's 'fp16': MixedPrecisionKwargs(init_scale="
            "torch.load(<its path>)['scale']))."
        )
    return path


def read_amp_state(path: str) -> dict[str, Any]:
    """The engine's state from its file ``path`` (:func:`amp_state_path`), on the CPU."""
    return torch.load(path, map_location="cpu", weights_only=True)  # type: ignore[no-any-return]
