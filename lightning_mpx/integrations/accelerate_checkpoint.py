"""The engine's file in Accelerate's checkpoints: ``save_state``/``load_state`` write and read the loss scalers, the
FP32 masters and the skip counters of the adapter's :class:`~lightning_mpx.engine.amp.Amp` in :data:`AMP_STATE_NAME`,
next to Accelerate's own files."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from torch import nn

from lightning_mpx.engine.amp import Amp
from lightning_mpx.integrations.fp32_export import masters_into

__all__ = [
    "AMP_STATE_NAME",
    "amp_state_path",
    "masters_into",
    "read_amp_state",
    "warn_frozen_half",
    "write_amp_state",
]

#: The file that ``save_state`` writes the :class:`~lightning_mpx.engine.amp.Amp` state to.
AMP_STATE_NAME = "lightning_mpx_amp.bin"


def warn_frozen_half(
    amp: Amp, module: nn.Module, state: dict[str, Any], call: str, *, keep: str = "MixedPrecisionKwargs", when: str = ""
) -> list[str]:
    """Warn, at an O2 export by ``call`` of ``module``'s ``state`` (after :func:`masters_into`), about its frozen
    parameters (``requires_grad=False``) that ``state`` holds in the half dtype and that ``prepare`` converted to it
    (:attr:`Amp.made_half <lightning_mpx.engine.amp.Amp.made_half>`; not one the user gave in half, where nothing was
    lost): their half rounding, not the FP32 values they had before ``prepare`` (O2 keeps no FP32 copy of them, so
    that a frozen base does not take twice its memory). The warning names them and the ways to keep them exact
    (``keep``: whose ``fp32_modules=`` keeps a module FP32; ``when``: the moment, e.g. ``"before prepare"``). A
    peft model is left out: it exports its adapters, not its base. Returns the names warned about."""
    if not amp.properties.master_weights or amp.sharded or type(module).__module__.split(".")[0] == "peft":
        return []
    halves = (torch.float16, torch.bfloat16)
    names = [
        name
        for name, param in module.named_parameters()
        if not param.requires_grad and isinstance(state.get(name), torch.Tensor) and state[name].dtype in halves
        and amp.made_half(param)
    ]
    if not names:
        return []
    owners = list(dict.fromkeys(name.rpartition(".")[0] or name for name in names))
    shown = ", ".join(map(repr, names[:5])) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    dtype = str(state[names[0]].dtype).removeprefix("torch.")
    warnings.warn(
        f"{call} at O2 exports {len(names)} frozen parameter(s) (requires_grad=False: {shown}) as the {dtype} values "
        f"the model holds: O2 keeps no FP32 copy of a frozen parameter, so these are the {dtype} rounding of the "
        f"values they had {when or 'before prepare'}, not those values (the trained parameters are exported as their "
        f"FP32 masters). To export them exactly, keep their modules in FP32 with {keep}(fp32_modules="
        f"{owners[:5]!r}) or train at O1 (both keep them FP32 in memory), or take them from the checkpoint they came "
        "from.",
        UserWarning,
        stacklevel=3,
    )
    return names


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
