"""The engine's file in Accelerate's checkpoints: ``save_state``/``load_state`` write and read the loss scalers, the
FP32 masters and the skip counters of the adapter's :class:`~lightning_mpx.engine.amp.Amp` in :data:`AMP_STATE_NAME`,
next to Accelerate's own files. At O2 the masters the checkpoint's model files hold (a prepared model's state dict
gives them) are left out of it and named instead (:func:`masters_left_to_weights`), so that each is written once;
``load_state`` loads the model files after the engine's, and they give those masters exactly. A file that holds them
itself (as written before this release) loads as before. :class:`WholeModelExport` (a base of the adapter's
``Accelerator``) warns when ``save_model`` writes a peft model's base in half at O2."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from lightning_mpx.engine.amp import Amp
from lightning_mpx.engine.checkpoint import MASTERS_IN_STATE_DICT
from lightning_mpx.integrations.accelerate_forward import engine_of
from lightning_mpx.integrations.fabric_checkpoint import masters_left_to_models
from lightning_mpx.integrations.fp32_export import masters_into, warn_frozen_half

__all__ = [
    "AMP_STATE_NAME",
    "WholeModelExport",
    "GRAD_SCALER_NAME",
    "amp_state_path",
    "masters_into",
    "masters_left_to_weights",
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


def masters_left_to_weights(
    amp: Amp, modules: list[nn.Module], weights: list[dict[str, Any]], state: dict[str, Any]
) -> dict[str, Any]:
    """``state`` (the engine's state dict) without the FP32 masters that ``weights`` (the model state dicts
    ``save_state`` writes, of the unwrapped ``modules``) hold bit for bit, named under
    :data:`~lightning_mpx.engine.checkpoint.MASTERS_IN_STATE_DICT` instead; ``state`` itself (every master in it)
    when one of them is not there as its master's exact FP32 value (a save hook changed it, a model saved by FSDP's
    or DeepSpeed's own files), so that a checkpoint never lacks a master."""
    lean = {**state, "master_weights": [dict(m) for m in state.get("master_weights") or ()]}
    lean = masters_left_to_models(amp, modules, lean)
    held = lean.get(MASTERS_IN_STATE_DICT)
    if not held:
        return state
    # By parameter, not by name: the engine names a second model's masters "model1.<name>", its file "<name>".
    written: dict[int, list[torch.Tensor]] = {}
    for module, values in zip(modules, weights):
        tails: dict[str, list[torch.Tensor]] = {}
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                for name in _suffixes(key):
                    tails.setdefault(name, []).append(value)
        for name, param in module.named_parameters(remove_duplicate=False):
            written.setdefault(id(param), []).extend(tails.get(name, ()))
    for weights_of, masters, names in zip(amp._masters.prune(), state["master_weights"], held):
        params = {entry.name: param for entry, param in weights_of._live()}
        for name in names:
            found = written.get(id(params[name]), ()) if name in params else ()
            if not any(v.shape == masters[name].shape and torch.equal(v, masters[name]) for v in found):
                return state
    return lean


def _suffixes(key: str) -> list[str]:
    """``key`` and each of its dotted tails (``module.0.weight``: ``0.weight``, ``weight``): the names it has
    inside a wrapper's state dict."""
    parts = key.split(".")
    return [".".join(parts[i:]) for i in range(len(parts))]


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


class WholeModelExport:
    """``save_model`` of the Accelerate adapter's ``Accelerator`` (a base of it): Accelerate's, then at O2 a warning
    naming a peft model's frozen half base that the file holds (the bfloat16 rounding where Accelerate's ``"bf16"``
    writes the FP32 base). ``get_state_dict`` does not warn for a peft model, whose habit
    ``save_pretrained(state_dict=accelerator.get_state_dict(model))`` keeps only its adapters; ``save_model`` writes
    the whole model, and ``get_state_dict`` has warned already for any other model."""

    amp: Any  # what the Accelerator this is a base of provides (declared here for readers and type checkers)
    distributed_type: Any

    def save_model(self, model: nn.Module, save_directory: Any, max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> None:  # fmt: skip
        """As ``accelerate.Accelerator.save_model``; at O2 a peft model's frozen half base is named in a warning."""
        super().save_model(  # type: ignore[misc]
            model, save_directory, max_shard_size=max_shard_size, safe_serialization=safe_serialization
        )
        module = self.unwrap_model(model)  # type: ignore[attr-defined]
        if self.amp is None or self.distributed_type == "FSDP" or type(module).__module__.split(".")[0] != "peft":
            return
        held = dict(module.named_parameters())  # the frozen ones are in the file as the model holds them
        warn_frozen_half(engine_of(module, self.amp), module, held, "save_model", whole=True)
