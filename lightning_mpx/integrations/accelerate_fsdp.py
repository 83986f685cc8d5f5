"""The FSDP part of the Accelerate adapter (:mod:`lightning_mpx.integrations.accelerate`): what the opt level needs from
Accelerate's ``FullyShardedDataParallelPlugin`` and from the model before Accelerate shards it.

Accelerate shards the model itself (FSDP2: ``fully_shard`` on the auto-wrapped blocks, then the root, all with the
plugin's one ``mixed_precision_policy``; FSDP1: the ``FullyShardedDataParallel`` wrapper). The adapter gives the plugin
the level's block policy (:func:`lightning_mpx.integrations.fsdp.mixed_precision_policy`; FSDP1:
:func:`~lightning_mpx.integrations.fsdp.fsdp1_mixed_precision`), and before Accelerate shards (:func:`before_sharding`)
it casts the model as the level needs (O3: half; O1/O2: trainable half parameters to FP32, since FSDP's FP32 shards are
the masters) and, with FSDP2, shards the FP32 islands (batch norm, ``fp32_modules``) as units of their own with the
island policy; Accelerate's auto-wrap leaves modules that are already sharded alone. The root's casts (inputs to half at
O3, outputs to FP32) are the adapter's forward wrapper's. :class:`ShardedPreparation` is the part of the adapter's
``Accelerator`` that prepares models and optimizers under FSDP: the level's casts before Accelerate shards, the engine
on the sharded model after.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch
from torch import nn

from lightning_mpx.casting.aside import around_fsdp_hooks
from lightning_mpx.engine.sharding import guard_fsdp_setup, is_sharded
from lightning_mpx.integrations.accelerate_forward import install_forward
from lightning_mpx.integrations.accelerate_optimizer import AmpOptimizer, params_of
from lightning_mpx.masters.weights import convert_module
from lightning_mpx.settings import MixedPrecisionSettings

if TYPE_CHECKING:
    from lightning_mpx.engine.amp import Amp

__all__ = ["ShardedPreparation", "before_sharding", "fsdp_policy", "refuse_settings", "swap_parameters"]


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
            f"mixed_precision={level!r} gives FSDP the opt level's own policy (lightning_mpx.fsdp."
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
    from lightning_mpx.health.promotion import _module_to_fp32
    from lightning_mpx.integrations.fsdp import _buffers_to, _islands, _mode, mixed_precision_policy
    from lightning_mpx.masters.fp32_buffers import fp32_tensors, restore_fp32_tensors

    if is_sharded(model):
        # sharded by the user (e.g. lightning_mpx.integrations.fsdp.shard_model): Accelerate keeps it, the engine
        # checks it
        return {}
    props = settings.properties
    mode = _mode(props)
    islands = _islands(model, settings, mode, require_match=True)
    if mode.name == "half":
        exact = [(island, fp32_tensors(island)) for _, island in islands]
        convert_module(model, mode.half, keep_batchnorm_fp32=mode.batchnorm_islands)
        for island, kept in exact:
            _module_to_fp32(island)  # fp32_modules, with the exact values they held (not their rounding's upcast)
            restore_fp32_tensors(island, kept)
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


class ShardedPreparation:
    """The preparation of models and optimizers under Accelerate's FSDP, for the adapter's ``Accelerator`` (a base
    class ahead of ``accelerate.Accelerator``, whose ``prepare``/``prepare_model`` its ``super()`` calls reach).

    FSDP2: the level's casts and FP32 islands before Accelerate shards, then the engine on the sharded model and the
    optimizers once Accelerate has swapped their parameters for the shards. FSDP1: the level's casts before
    Accelerate wraps the model, the engine on the wrapped model.
    """

    amp: Amp | None
    _native_view: bool
    _deferred: list[AmpOptimizer] | None

    @contextlib.contextmanager
    def _as_native(self) -> Iterator[None]:
        """Accelerate's own preparation code reads ``mixed_precision`` as ``"no"`` inside (its FSDP paths upcast
        half parameters otherwise; the opt level has decided the dtypes already)."""
        self._native_view = True
        try:
            yield
        finally:
            self._native_view = False

    @property
    def _fsdp_gather(self) -> str:
        return self.mpx_kwargs.fsdp_gather if self.mpx_kwargs is not None else "half"

    def _fsdp2_shard_kwargs(self) -> dict[str, Any]:
        """``fully_shard``'s mesh, offload and reshard settings, as Accelerate's ``fsdp2_prepare_model`` takes them."""
        plugin = self.state.fsdp_plugin
        mesh = getattr(self, "torch_device_mesh", None)
        return {
            "mesh": mesh[tuple(self.parallelism_config.fsdp_dim_names)] if mesh is not None else None,
            "reshard_after_forward": plugin.reshard_after_forward,
            "offload_policy": plugin.cpu_offload,
        }

    def _prepare_fsdp2_models(self, args: tuple[Any, ...], device_placement: list[bool] | None) -> Any:
        """FSDP2: the level's casts and FP32 islands first, then Accelerate (which prepares the optimizers, shards the
        model, and swaps the optimizers' parameters for the shards), then the engine on the sharded model and the
        optimizers as they are now."""
        assert self.amp is not None
        optimizers = [a for a in args if isinstance(a, torch.optim.Optimizer)]
        for model in args:
            if isinstance(model, nn.Module) and not getattr(model, "_is_accelerate_prepared", False):
                mapping = before_sharding(
                    model, self.amp.settings, 2, self._fsdp2_shard_kwargs(), gather=self._fsdp_gather
                )
                swap_parameters(optimizers, mapping)
        self._deferred = []
        try:
            with self._as_native():
                prepared = super().prepare(*args, device_placement=device_placement)
            deferred = self._deferred
        finally:
            self._deferred = None
        for obj in prepared if isinstance(prepared, (tuple, list)) else (prepared,):  # a list from FSDP2
            if isinstance(obj, nn.Module) and obj not in self._converted:
                if self.amp.properties.has_cast_policy:
                    for unit in obj.modules():  # FSDP's gathers and frees run without the forward's cast mode
                        around_fsdp_hooks(unit)
                self.amp.prepare_model(obj)  # sharded: no conversion, no masters; the policies are checked
                self._converted.add(obj)
                install_forward(self.amp, obj)
                if self.amp.properties.master_weights:  # FSDP sets its units up in its root's pre-hook, before the
                    # forward wrapper: half parameters unfrozen before the first forward named there (first call only)
                    guard_fsdp_setup(obj, self.amp._machine)
        for wrapped in deferred:
            self.amp.prepare_optimizer(wrapped.optimizer)  # after the swap: it holds the shards now
        return prepared

    def _prepare_fsdp1_model(self, model: nn.Module, device_placement: bool | None, evaluation_mode: bool) -> nn.Module:
        """FSDP1: the level's casts before Accelerate wraps the model, the engine on the wrapped model."""
        assert self.amp is not None
        if self.is_fsdp2 or getattr(model, "_is_accelerate_prepared", False) or model in self._converted:
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        before_sharding(model, self.amp.settings, 1, {}, gather=self._fsdp_gather)
        install_forward(self.amp, model)  # on the inner module: the wrapper's forward calls it
        with self._as_native():
            prepared = super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        self.amp.prepare_model(prepared, train=not evaluation_mode)
        self._converted.add(model)
        self._converted.add(prepared)
        return prepared

    def _check_sharded_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Refuse an optimizer that does not hold the prepared (sharded) model's parameters: FSDP1 replaces them
        with flat shards when it wraps the model, and an optimizer made before would train tensors nothing uses."""
        known = {id(p) for model in self._models for p in model.parameters()}
        params = list(params_of(optimizer))
        stale = sum(id(p) not in known for p in params)
        if stale:
            raise ValueError(
                f"optimizer={type(optimizer).__name__} holds {stale} of {len(params)} parameter(s) that are not the "
                "parameters of a model this Accelerator sharded with FSDP (FSDP1 replaces them with flat shards when "
                "it wraps the model): prepare the model first, then make the optimizer from it: `model = "
                "accelerator.prepare(model); optimizer = accelerator.prepare(AdamW(model.parameters()))`."
            )
