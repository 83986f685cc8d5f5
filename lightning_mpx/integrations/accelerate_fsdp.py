"""The FSDP part of the Accelerate adapter (:mod:`lightning_mpx.integrations.accelerate`): what the opt level needs from
Accelerate's ``FullyShardedDataParallelPlugin`` and from the model before Accelerate shards it.

Accelerate shards the model itself (FSDP2: ``fully_shard`` on the auto-wrapped blocks, then the root, all with the
plugin's one ``mixed_precision_policy``; FSDP1: the ``FullyShardedDataParallel`` wrapper). The adapter gives the plugin
the level's block policy (:func:`lightning_mpx.integrations.fsdp.mixed_precision_policy`; FSDP1:
:func:`~lightning_mpx.integrations.fsdp.fsdp1_mixed_precision`), and before Accelerate shards (:func:`before_sharding`) it casts the model as the level needs (O3: half; O1/O2: trainable
half parameters to FP32, since FSDP's FP32 shards are the masters) and, with FSDP2, shards the FP32 islands (batch
norm, ``fp32_modules``) as units of their own with the island policy; Accelerate's auto-wrap leaves modules that are
already sharded alone. The root's casts (inputs to half at O3, outputs to FP32) are the adapter's forward wrapper's.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from lightning_mpx.engine.sharding import is_sharded
from lightning_mpx.masters.weights import convert_module
from lightning_mpx.settings import MixedPrecisionSettings

__all__ = ["before_sharding", "fsdp_policy", "refuse_settings", "swap_parameters"]


def fsdp_policy(settings: MixedPrecisionSettings, fsdp_version: int, gather: str = "half") -> Any:
    """The policy for the plugin's ``mixed_precision_policy``: FSDP2's block ``MixedPrecisionPolicy`` (Accelerate
    gives the same one to every unit, the root included) or FSDP1's ``MixedPrecision`` (``None``: no casts).
    ``gather``: O1's all-gather dtype (a ValueError names the choices, and refuses ``"fp32"`` at O2/O3)."""
    from lightning_mpx.integrations.fsdp import fsdp1_mixed_precision, mixed_precision_policy

    if fsdp_version == 2:
        return mixed_precision_policy(settings, role="block", gather=gather)  # type: ignore[arg-type]
    return fsdp1_mixed_precision(settings, gather=gather)  # type: ignore[arg-type]


def refuse_settings(settings: MixedPrecisionSettings, plugin: Any) -> None:
    """Raise ``ValueError`` for what cannot hold under Accelerate's FSDP with an opt level."""
    props = settings.properties
    level = props.opt_level
    if props.casts_model and settings.scaler.on_floor == "promote":
        raise ValueError(
            f"on_floor='promote' cannot work with FSDP at mixed_precision={level!r}: promoting a module to FP32 "
            "changes its parameters' dtype and compute dtype, which FSDP fixes when Accelerate shards the model. Use "
            "MixedPrecisionKwargs(on_floor='raise') (or 'warn'/'continue'), and name the modules to keep in FP32 up "
            "front with MixedPrecisionKwargs(fp32_modules=[...]): they become FP32 FSDP units."
        )
    if getattr(plugin, "mixed_precision_policy", None) is not None:
        raise ValueError(
            f"fsdp_plugin.mixed_precision_policy={plugin.mixed_precision_policy!r} was set, but "
            f"mixed_precision={level!r} gives FSDP the opt level's own policy (lightning_mpx.integrations.fsdp."
            f"{'mixed_precision_policy' if plugin.fsdp_version == 2 else 'fsdp1_mixed_precision'}); leave "
            "mixed_precision_policy unset (None), or use Accelerate's mixed_precision='bf16'/'fp16' with your policy."
        )


def before_sharding(
    model: nn.Module,
    settings: MixedPrecisionSettings,
    fsdp_version: int,
    shard_kwargs: dict[str, Any],
    *,
    gather: str = "half",
) -> dict[int, torch.Tensor]:
    """Prepare ``model`` for Accelerate's sharding, in place; returns ``{id(old parameter): new parameter}`` for the
    parameters that FSDP2 islands replaced (an optimizer built on the model must hold the new ones).

    Casts: O3, the model to half (batch norm kept FP32 where the level says so, ``fp32_modules`` FP32); O1/O2,
    trainable half parameters to FP32 (Accelerate's own FSDP upcast, which the adapter turns off so that O3 stays
    half); O2, floating buffers outside the islands to half (an FP32 buffer would promote activations). With FSDP2 the
    FP32 islands are then sharded with the island policy (``shard_kwargs``: ``fully_shard``'s mesh, offload and
    reshard settings from the plugin; ``gather``: O1's all-gather dtype, for the islands' policy)."""
    from lightning_mpx.integrations.fsdp import _buffers_to, _islands, _mode, mixed_precision_policy
    from lightning_mpx.health.promotion import _module_to_fp32

    if is_sharded(model):
        return {}  # sharded by the user (e.g. lightning_mpx.integrations.fsdp.shard_model): Accelerate keeps it, the engine checks it
    props = settings.properties
    mode = _mode(props)
    islands = _islands(model, settings, mode, require_match=True)
    if mode.name == "half":
        convert_module(model, mode.half, keep_batchnorm_fp32=mode.batchnorm_islands)
        for _, island in islands:
            _module_to_fp32(island)
    else:
        for param in model.parameters():
            if param.requires_grad and param.is_floating_point() and param.dtype != torch.float32:
                param.data = param.data.float()
        if mode.name == "masters":
            _buffers_to(model, mode.half, skip={id(m) for _, m in islands})
    if fsdp_version != 2 or not islands:
        return {}
    from torch.distributed.fsdp import fully_shard

    before = dict(model.named_parameters())
    policy = mixed_precision_policy(settings, role="fp32", gather=gather)  # type: ignore[arg-type]
    for _, island in islands:
        fully_shard(island, mp_policy=policy, **shard_kwargs)
    after = dict(model.named_parameters())
    return {id(old): after[name] for name, old in before.items() if after.get(name) is not old}


def swap_parameters(optimizers: Iterable[torch.optim.Optimizer], mapping: dict[int, torch.Tensor]) -> None:
    """Replace, in each optimizer's parameter groups, the parameters that :func:`before_sharding` replaced."""
    if not mapping:
        return
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [mapping.get(id(p), p) for p in group["params"]]
