"""The Fabric plugin's models under Fabric's FSDP strategies: ``ModelParallelStrategy`` (FSDP2, ``fully_shard`` in
``parallelize_fn``) shards a model in place after :meth:`FabricMixedPrecisionPlugin.convert_module` prepared it, and
``FSDPStrategy`` (FSDP1) wraps it; the plugin hands the engine the sharded form at its first call after
``fabric.setup``, and refuses what cannot work (O2, whose masters FSDP's FP32 shards would be; sharded and unsharded
models together). The state is the plugin's (its ``_unchecked``, ``_modules``, ``_wrappers``); this holds the code.
"""

from __future__ import annotations

import gc
import weakref
from typing import TYPE_CHECKING, Any, Iterable

from torch import nn
from torch.optim import Optimizer

from lightning_mpx.common.dtypes import dtype_name
from lightning_mpx.engine.optimizer_state import optimizer_params
from lightning_mpx.engine.sharding import is_sharded
from lightning_mpx.masters.weights import has_floating_parameters

if TYPE_CHECKING:
    from lightning_mpx.engine.amp import Amp
    from lightning_mpx.integrations.fabric import FabricMixedPrecisionPlugin


def adopt_sharded(plugin: FabricMixedPrecisionPlugin) -> None:
    """Fabric's strategies shard a model after :meth:`convert_module` prepared it: ``ModelParallelStrategy``
    (``fully_shard`` in its ``parallelize_fn``) in place, ``FSDPStrategy`` (FSDP1) by wrapping it. Prepared again
    as a sharded model (O0, O1, O3; FSDP1: its wrapper), so that the engine works on each rank's shards and its
    policies are checked; refused at O2, whose masters FSDP's FP32 shards are, and next to a model the strategy
    left whole (whichever was set up first)."""
    modules = [sharded_form(plugin, m) for m in (ref() for ref in plugin._unchecked) if m is not None]
    sharded = [m for m in modules if is_sharded(m)]
    if not sharded and not plugin.amp.sharded:
        forget_setups(plugin)
        return
    if plugin.amp.properties.master_weights:
        raise RuntimeError(o2_refusal(plugin.amp.opt_level, dtype_name(plugin.amp.half_dtype), fsdp1=any(
            is_fsdp1(m) for m in sharded)))
    prepared = [sharded_form(plugin, m) for m in plugin._modules if has_floating_parameters(m)]
    unsharded = [m for m in prepared if not is_sharded(m)]
    if unsharded:
        # Whichever was set up first: under ModelParallelStrategy a model parallelize_fn leaves whole is not
        # data parallel (its gradients are not reduced), and the engine counts its gradients as the same on every
        # rank. Refused at every call, not only the first.
        level = plugin.amp.opt_level
        whole = ", ".join(sorted({type(m).__name__ for m in unsharded}))
        shards = ", ".join(sorted({type(m).__name__ for m in prepared if is_sharded(m)}))
        raise ValueError(
            f"FabricMixedPrecisionPlugin({level!r}) was given models sharded by FSDP ({shards}) and models not "
            f"sharded ({whole}): one plugin trains either sharded models or unsharded ones. Under "
            "ModelParallelStrategy, shard every model you fabric.setup in parallelize_fn (fully_shard, or "
            "lightning_mpx.fsdp.shard_model(model, plugin, mesh=mesh['data_parallel'])), a frozen one too."
        )
    forget_setups(plugin)  # refused above at every call, not only the first
    for module in sharded:
        plugin.amp.prepare_model(module)  # the engine then reduces the flags itself, once per step


def forget_setups(plugin: FabricMixedPrecisionPlugin) -> None:
    """The models converted since the last call are taken: their ``fabric.setup`` frames are let go (they hold what
    the call's locals held, and its caller's frame)."""
    plugin._unchecked.clear()
    plugin._setups.clear()


def sharded_form(plugin: FabricMixedPrecisionPlugin, module: nn.Module) -> nn.Module:
    """``module``, or the FSDP1 wrapper Fabric's ``FSDPStrategy`` put around it (found once, then kept)."""
    known = plugin._wrappers.get(module)
    if known is not None:
        wrapper = known()
    else:
        setups = [frame for ref, frame in plugin._setups if ref() is module]
        wrapper = fsdp1_wrapper(module, setups) if setups else fsdp1_wrapper_by_referrers(module)
    if wrapper is None:
        return module
    # A weak reference: the wrapper holds the module, which would then never leave the dictionary.
    plugin._wrappers[module] = weakref.ref(wrapper)
    return wrapper


def refuse_o2_sharding(amp: Amp, caller: Any, module: nn.Module | None = None) -> None:
    """At O2, refuse a model that Fabric's ``ModelParallelStrategy`` or ``FSDPStrategy`` will shard, as soon as the
    plugin can tell: ``caller`` is the object whose method called into the plugin (``fabric.setup`` converting the
    model: the ``Fabric``; ``FSDPStrategy`` reading the FSDP1 config to wrap it, at ``fabric.setup`` or
    ``fabric.init_module``: the strategy). Another caller (Lightning's throughput monitor reads the config under every
    strategy) is let through; the plugin's first call after ``fabric.setup`` refuses such a model anyway. ``module``:
    the model ``fabric.setup`` converts; one sharded already (``lightning_mpx.fsdp.shard_model`` or ``fully_shard``
    before ``fabric.setup``, under any other strategy) is refused in words of that path."""
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import FSDPStrategy, ModelParallelStrategy

    if not amp.properties.master_weights:
        return
    strategy = caller.strategy if isinstance(caller, Fabric) else caller
    if isinstance(strategy, (FSDPStrategy, ModelParallelStrategy)):
        fsdp1 = isinstance(strategy, FSDPStrategy)
        raise RuntimeError(o2_refusal(amp.opt_level, dtype_name(amp.half_dtype), fsdp1=fsdp1))
    if module is not None and is_sharded(module):
        raise RuntimeError(presharded_refusal(amp.opt_level, module, type(strategy).__name__))


def presharded_refusal(level: str, module: nn.Module, strategy: str) -> str:
    """Why O2 cannot train a model sharded by FSDP before ``fabric.setup`` under a strategy that does not shard
    (``strategy``: its class name), and what to use."""
    return (
        f"FabricMixedPrecisionPlugin({level!r}) cannot train {type(module).__name__}, which FSDP sharded before "
        f"fabric.setup (lightning_mpx.fsdp.shard_model or fully_shard), under Fabric's {strategy}: the plugin's "
        f"{level} makes its own FP32 master weights of the model fabric.setup gives it and cannot train FSDP's FP32 "
        "shards as them. Set the model up unsharded (the plugin makes its masters), use opt_level='O1' (or 'O3') "
        f"for the sharded model, or train it with the core lightning_mpx.Amp({level!r}), whose masters are FSDP's "
        "FP32 shards."
    )


def o2_refusal(level: str, half: str, *, fsdp1: bool) -> str:
    """Why O2 cannot train a model Fabric's strategy shards after ``convert_module`` cast it, and what to use."""
    if fsdp1:
        return (
            f"FabricMixedPrecisionPlugin({level!r}) cannot train a model sharded by FSDP1 (Fabric's FSDPStrategy): "
            f"fabric.setup converts the model to {half} before the strategy wraps it, so FSDP flattens and shards the "
            f"{half} weights and its FP32 flat parameters, which are {level}'s master weights under FSDP, never exist "
            f"(the FP32 values would be lost to their {half} rounding). Use opt_level='O1' (or 'O3') with this "
            "strategy, or Lightning's Trainer with lightning_mpx.MixedPrecisionPlugin('O2') and strategy='fsdp' "
            "(it wraps the FP32 model)."
        )
    return (
        f"FabricMixedPrecisionPlugin({level!r}) cannot train a model sharded by FSDP (Fabric's "
        f"ModelParallelStrategy, fully_shard in parallelize_fn): fabric.setup converts the model to {half} "
        f"before the strategy shards it, so FSDP shards the {half} weights and its FP32 shards, which are "
        f"{level}'s master weights under FSDP, never exist. Use opt_level='O1' (or 'O3') with this strategy, "
        "Lightning's Trainer with lightning_mpx.MixedPrecisionPlugin and ModelParallelStrategy (shard_model "
        "in configure_model), or the core lightning_mpx.Amp with lightning_mpx.fsdp.shard_model."
    )


def clipped_together(optimizer: Optimizer, models: list[nn.Module], known: list[Optimizer]) -> list[Optimizer]:
    """``optimizer``, and every optimizer in ``known`` over the same FSDP1 wrapper (``models``): Fabric's clip
    by norm unscales ``optimizer`` only, then clips the whole model (``FullyShardedDataParallel.clip_grad_norm_``),
    whose norm would count the other optimizers' gradients still scaled."""
    mine = {id(p) for p in optimizer_params(optimizer)}
    roots = [m for m in models if any(id(p) in mine for p in m.parameters())]
    if not roots:
        return [optimizer]
    together, covered = [optimizer], set(mine)
    root_params = {id(p): p for root in roots for p in root.parameters()}
    for other in known:
        params = {id(p) for p in optimizer_params(other)}
        if other is not optimizer and params & root_params.keys():
            together.append(other)
            covered |= params
    # requires_grad, not grad: the same answer on every rank (a rank's shard of a parameter may be empty)
    uncovered = [p for key, p in root_params.items() if key not in covered and p.requires_grad]
    if uncovered:
        raise RuntimeError(
            f"fabric.clip_gradients(model, optimizer={type(optimizer).__name__}) under FSDPStrategy clips the "
            f"whole FSDP1 model, but {len(uncovered)} of its trainable parameters belong to no optimizer the plugin "
            "knows: their gradients are still scaled and would count in the norm. Call "
            "plugin.setup_optimizers(optimizer, other_optimizer, ...) with every optimizer over the model after "
            "fabric.setup()."
        )
    return together


def is_fsdp1(module: nn.Module) -> bool:
    """Whether ``module`` holds an FSDP1 wrapper (``FullyShardedDataParallel``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in module.modules())


def fsdp1_wrapper(module: nn.Module, setups: Iterable[Any]) -> nn.Module | None:
    """The FSDP1 wrapper whose wrapped module is ``module``, or ``None``.

    Fabric's ``FSDPStrategy`` wraps the model after :meth:`FabricMixedPrecisionPlugin.convert_module` and hands the
    plugin nothing after that; but the ``fabric.setup`` (or ``setup_module``) call that converted it holds it after:
    its local ``module`` is the ``_FabricModule`` it returned, whose ``_forward_module`` is the wrapper (through
    ``torch.compile``'s ``OptimizedModule`` when the model was compiled before ``fabric.setup``). ``setups``: the
    frames of those calls, which the plugin keeps until its first call after ``fabric.setup``. Read once per model,
    at that call, and only when FSDP1 flattened the model's parameters; nothing in the heap is searched (the garbage
    collector does not see what ``gc.freeze()`` froze, as a user does before forking data-loader workers)."""
    if not any(getattr(p, "_fsdp_flattened", False) for p in module.parameters()):
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel

    for frame in setups:
        for value in list(frame.f_locals.values()):
            for _ in range(_WRAPPERS_FOLLOWED):  # _FabricModule -> (OptimizedModule ->) FSDP1 wrapper
                if not isinstance(value, nn.Module):
                    break
                if isinstance(value, FullyShardedDataParallel) and value._fsdp_wrapped_module is module:
                    return value
                inner = value._modules  # registered submodules only: FSDP1 forwards missing attributes inwards
                value = inner.get("_forward_module", inner.get("_orig_mod"))
    return None


def fsdp1_wrapper_by_referrers(module: nn.Module) -> nn.Module | None:
    """:func:`fsdp1_wrapper` for a model the plugin converted outside any ``fabric.setup`` (its ``convert_module``
    called by hand): the wrapper looked for among what refers to ``module``, once per model. Blind to what
    ``gc.freeze()`` froze: a model set up by Fabric is found through its ``fabric.setup`` call instead."""
    if not any(getattr(p, "_fsdp_flattened", False) for p in module.parameters()):
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel

    frontier: list[Any] = [module]
    for _ in range(3):  # module <- wrapper._modules <- (wrapper.__dict__ <-) wrapper
        found = gc.get_referrers(*frontier)
        for ref in found:
            if isinstance(ref, FullyShardedDataParallel) and ref._fsdp_wrapped_module is module:
                return ref
        frontier = [ref for ref in found if isinstance(ref, dict)]
        if not frontier:
            break
    return None


# How many wrappers fsdp1_wrapper follows inwards from a local of fabric.setup (_FabricModule, OptimizedModule).
_WRAPPERS_FOLLOWED = 4
