"""What the Trainer and Fabric plugins check and record on the models they convert for the opt level.

* Lazy modules (``nn.LazyLinear``, ``nn.LazyConv2d``...): their parameters have no shape until their first forward,
  and O2 makes each parameter's FP32 master when the model is prepared for training (``trainer.fit``,
  ``fabric.setup``), before any forward. O1 and O3 make no masters and train a lazy module as Lightning's own
  precisions do; at O2 the plugins refuse it with the remedy rather than fail inside the engine on a parameter
  without a shape.
* A model trained at O2 before (a second stage: a new Trainer with a new plugin, a new Fabric plugin) or a deep copy
  of one: the engine's new masters start from its FP32 values, taken over from the masters that hold them (which
  let them go) or carried by the copy (:mod:`lightning_mpx.masters.watch`). A plugin given back a model whose masters
  a later stage's plugin took over prepares it again, taking them back (:func:`holds_masters`).
* The checkpoint's ``state_dict`` at O2: the FP32 masters (:func:`masters_into_checkpoint`), so that what reads it
  without the plugin (``LightningModule.load_from_checkpoint``, a run resumed under Lightning's own precision) gets
  the weights that were trained, not their half rounding.
* The dtype Lightning's modules report (``LightningModule.dtype``, kept by Lightning's ``.to()``, which the engine's
  conversion does not go through): at O2/O3 the half dtype, as under Lightning's own ``"bf16-true"``, so that
  ``x.to(self.dtype)`` and ``torch.zeros(..., dtype=self.dtype)`` in a step give what the weights hold.
* The half dtype of a plugin given no ``half_dtype``: picked at set-up for the device the strategy trains on
  (:func:`pick_half_dtype`: bfloat16 on a CPU, float16 elsewhere), and the plugin's ``precision`` (what
  ``trainer.precision`` and Fabric report) with it (:func:`precision_of`).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin
from torch import nn

from lightning_mpx.engine.amp import Amp
from lightning_mpx.engine.checkpoint import MASTERS_IN_STATE_DICT
from lightning_mpx.integrations.fp32_export import masters_into, warn_frozen_half
from lightning_mpx.masters.weights import refuse_lazy  # its home before: the plugins import it from here

__all__ = [
    "frozen_masters_from_checkpoint", "holds_masters", "masters_from_checkpoint", "masters_into_checkpoint",
    "pick_half_dtype", "precision_of", "record_half_dtype", "refuse_lazy",
]


def precision_of(amp: Amp) -> str:
    """The engine's precision in Lightning's own words (``trainer.precision``; its model summary sizes the weights from
    it, Fabric's ThroughputMonitor reads it): what the parameters are stored in, and whether the compute is mixed."""
    prefix = "bf16" if amp.half_dtype == torch.bfloat16 else "16"
    level = amp.opt_level
    return "32-true" if level == "O0" else f"{prefix}-mixed" if level == "O1" else f"{prefix}-true"


def pick_half_dtype(plugin: Any, where: torch.device | nn.Module) -> None:
    """Let ``plugin``'s engine pick its half dtype (none given) for ``where`` (the strategy's root device, or the
    model when no strategy is known), before the model is prepared, and update the plugin's ``precision`` and
    ``settings`` (a fresh engine for another model keeps the pick; pickling keeps ``half_dtype=None``)."""
    plugin.amp.pick_half_dtype(where)
    plugin.precision = precision_of(plugin.amp)
    if "settings" in vars(plugin):  # the Trainer plugin's own copy (Fabric's reads the engine's): one pick, shown both
        plugin.settings = plugin.amp.settings


def record_half_dtype(module: nn.Module, half_dtype: torch.dtype) -> None:
    """Record ``half_dtype`` as the dtype of ``module`` and of its Lightning submodules (``LightningModule.dtype``)
    that hold half tensors, as Lightning's ``module.to(half_dtype)`` does, after the plugin converted it to half
    (O2/O3); a Lightning submodule kept in FP32 whole (``fp32_modules``) keeps its FP32."""
    for sub in module.modules():
        if isinstance(sub, _DeviceDtypeModuleMixin):
            if any(t.dtype == half_dtype for t in itertools.chain(sub.parameters(), sub.buffers())):
                sub._dtype = half_dtype


def holds_masters(amp: Amp, module: nn.Module) -> bool:
    """Whether ``amp`` holds FP32 masters for ``module``'s parameters: not for a model only evaluated so far, nor for
    one whose masters another engine took over since (a later stage's plugin); the plugin then prepares it again."""
    return any(masters.covers(param) for masters in amp.master_weights for param in module.parameters())


def masters_into_checkpoint(
    amp: Amp, module: nn.Module, checkpoint: dict[str, Any], own: Any = None, warned: bool = False
) -> bool:
    """Put ``module``'s FP32 masters in place of its half weights in ``checkpoint["state_dict"]`` (Lightning's copy of
    ``module.state_dict()``) when ``amp`` trains it at O2 (not sharded: FSDP's state dict is FP32 already), as the
    Accelerate adapter's checkpoints do (:func:`~lightning_mpx.integrations.fp32_export.masters_into`: a
    frozen half parameter or a half buffer stays half). A resume at O2 or O3 loads them into the half model (their
    rounding, which it holds already); the masters held there leave the plugin's own entry, ``own`` (its
    ``state_dict()``), which names them instead (:data:`~lightning_mpx.engine.checkpoint.MASTERS_IN_STATE_DICT`: the
    engine takes them from the model's state dict loads, which Lightning makes before it loads the entry, the
    ``current_model_state`` of its ``WeightAveraging`` callbacks included), so that
    the file holds each master once under any CheckpointIO (Lightning's ``AsyncCheckpointIO`` clones every tensor
    one by one, which undid a shared storage). Unless ``warned``, warns about the
    frozen parameters it holds in half that the plugin converted from FP32 (their rounding, see
    :func:`~lightning_mpx.integrations.fp32_export.warn_frozen_half`); returns whether it warned."""
    state = checkpoint.get("state_dict")
    if not isinstance(state, dict) or not amp.properties.master_weights or amp.sharded:
        return False
    if not holds_masters(amp, module):  # a model only evaluated so far, or one a later stage's engine took over
        return False
    replaced = set(masters_into(amp, module, state))
    frozen = [] if warned else warn_frozen_half(
        amp, module, state, "The checkpoint", keep="MixedPrecisionPlugin", when="before trainer.fit"
    )
    saved = own.get("master_weights") if isinstance(own, dict) else None
    if isinstance(saved, list) and saved:
        held: list[list[str]] = []
        for masters in saved:
            names = [
                name for name, copy in masters.items()
                if name in replaced and state[name].dtype == copy.dtype and state[name].shape == copy.shape
            ]
            for name in names:
                del masters[name]
            held.append(names)
        own[MASTERS_IN_STATE_DICT] = held
    return bool(frozen)


def masters_from_checkpoint(checkpoint: dict[str, Any], key: str) -> None:
    """Put back into the plugin's entry ``checkpoint[key]`` the masters it names as held in the checkpoint's
    ``state_dict`` (:data:`~lightning_mpx.engine.checkpoint.MASTERS_IN_STATE_DICT`), in place: an entry that holds
    them itself, as earlier releases wrote it (to load it without the model's state dict). Not for a checkpoint whose
    ``state_dict`` a callback replaced (``WeightAveraging`` saves the average there and the trained weights under
    ``current_model_state``). An entry that holds them already is left as it is. Raises a ``KeyError`` naming the
    keys the ``state_dict`` lacks."""
    own = checkpoint.get(key)
    if not isinstance(own, dict) or MASTERS_IN_STATE_DICT not in own:
        return
    state = checkpoint.get("state_dict")
    state = state if isinstance(state, dict) else {}
    held = own[MASTERS_IN_STATE_DICT]
    missing = [name for names in held for name in names if not isinstance(state.get(name), torch.Tensor)]
    if missing:
        raise KeyError(
            f"the checkpoint's {key!r} entry holds the FP32 master weights of {missing[:5]} in the checkpoint's "
            "'state_dict', which lacks them: the checkpoint's 'state_dict' was changed since it was saved; nothing "
            "was loaded."
        )
    for masters, names in zip(own["master_weights"], held):
        for name in names:
            masters[name] = state[name]
    del own[MASTERS_IN_STATE_DICT]



def frozen_masters_from_checkpoint(module: nn.Module, checkpoint: dict[str, Any], key: str) -> None:
    """Put into the plugin's entry ``checkpoint[key]`` the masters it names as held in the model's state dict for the
    parameters of ``module`` frozen now: the model's load keeps no FP32 value for a frozen parameter (it gets no
    master), which the saving run trained (a layer frozen since). They come from the trained weights:
    ``current_model_state`` where a ``WeightAveraging`` callback saved the average as the ``state_dict``."""
    own = checkpoint.get(key)
    if not isinstance(own, dict) or not own.get(MASTERS_IN_STATE_DICT):
        return
    state = checkpoint.get("current_model_state", checkpoint.get("state_dict"))
    frozen = {name for name, param in module.named_parameters() if not param.requires_grad}
    for masters, names in zip(own["master_weights"], own[MASTERS_IN_STATE_DICT]):
        for name in names:
            value = state.get(name) if isinstance(state, dict) and name in frozen else None
            if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                masters[name] = value
