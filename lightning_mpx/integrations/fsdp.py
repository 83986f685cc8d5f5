"""FSDP's mixed-precision policies for an opt level, and a helper for users who shard their model by hand.

With FSDP the opt level is carried out partly by FSDP itself: its sharded parameters are what the optimizer steps,
and its mixed-precision policy decides the dtype of the all-gathered parameters (the compute dtype), of the
gradient reduction, and the casts of each sharded module's inputs and outputs. What each level does:

* **O0**: FSDP without a mixed-precision policy: everything FP32.
* **O1**: the model stays FP32 (sharded FP32 parameters); by default FSDP gathers it in half
  (``param_dtype=half``, ``reduce_dtype=float32``) and the cast-table policy runs on top (its FP32 ops upcast the
  gathered half weights). ``gather="fp32"`` is Apex's exact O1 (an FP32 gather, the policy casts each weight when
  an op uses it), at a memory cost: the half copies the policy makes stay alive until the backward (measured: about
  45% of the model's FP32 bytes on every rank). FSDP casts no inputs or outputs at O1: the cast table decides per op.
  Batch norm and ``fp32_modules`` are FP32 islands gathered in FP32 (batch norm gathered in half fails in torch's
  ``batch_norm``, whose weights and running statistics must share a dtype); their outputs stay FP32.
* **O2**: FSDP's sharded FP32 parameters are the master weights (no second copy); compute runs in half because
  FSDP gathers in half; gradients are reduced in FP32 (the reduce-scatter sums across ranks in FP32, so half
  gradients finite on each rank cannot overflow in the sum, and the unscale reads FP32); the root casts its inputs
  to half and its outputs to FP32. Batch norm (when ``keep_batchnorm_fp32``) and ``fp32_modules`` are FP32 islands:
  FSDP units of their own gathered in FP32, their inputs cast to FP32 and their outputs back to half (without that
  cast the next half ``Linear`` fails with "mat1 and mat2 must have the same dtype").
* **O3**: the model is cast to half before sharding (batch norm kept FP32 when the properties say so, as an
  island); no policy but the root's casts (inputs to half, outputs to FP32); gradients and optimizer in half.

:func:`shard_model` applies ``fully_shard`` bottom-up with these policies; :func:`mixed_precision_policy` gives one
policy for users who call ``fully_shard`` themselves; :func:`fsdp1_mixed_precision` is the ``MixedPrecision`` of
FSDP1 (``FullyShardedDataParallel``); :func:`check_sharded_model` refuses a sharded model that does not fit the
level (called by :meth:`Amp.prepare_model <lightning_mpx.engine.amp.Amp.prepare_model>` on a sharded model).

``precision`` is everywhere an opt-level string (``"O2"``: the default settings; no half dtype given, so float16
when CUDA is available, else bfloat16), a
:class:`~lightning_mpx.settings.MixedPrecisionSettings`, or an object with a ``settings`` attribute holding one
(:class:`~lightning_mpx.engine.amp.Amp`, :class:`~lightning_mpx.integrations.lightning.MixedPrecisionPlugin`,
:class:`~lightning_mpx.integrations.fabric.FabricMixedPrecisionPlugin`): pass the plugin itself to get its half dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Iterable, Literal

import torch
from torch import nn
from torch.distributed.fsdp import (
    MixedPrecision,
    MixedPrecisionPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_mpx.casting.aside import around_hooks
from lightning_mpx.common.compat import torch_release
from lightning_mpx.common.dtypes import dtype_name
from lightning_mpx.common.keywords import checks_keywords
from lightning_mpx.engine.sharding import reshard_gathered
from lightning_mpx.health.promotion import _module_to_fp32
from lightning_mpx.integrations.fsdp_checks import (
    _F32,
    _clean,
    _islands,
    _mode,
    check_sharded_model,
    resolve_settings,
)
from lightning_mpx.integrations.fsdp_mesh import warn_one_rank_mesh
from lightning_mpx.integrations.fsdp_plan import check_same_plan, done_plan, record_plan, shard_plan
from lightning_mpx.masters.fp32_buffers import fp32_tensors, keeps_fp32_buffer, restore_fp32_tensors
from lightning_mpx.masters.weights import convert_module
from lightning_mpx.opt_levels import Properties
from lightning_mpx.settings import check_choice

__all__ = [
    "GATHER_CHOICES",
    "ROLE_CHOICES",
    "check_sharded_model",
    "fsdp1_mixed_precision",
    "mixed_precision_policy",
    "reshard_gathered",
    "resolve_settings",
    "shard_model",
]

Gather = Literal["half", "fp32"]
Role = Literal["root", "block", "fp32"]
#: ``gather``: the dtype FSDP all-gathers the FP32 parameters in at O1 (``"fp32"``: Apex's exact O1).
GATHER_CHOICES: tuple[str, ...] = ("half", "fp32")
#: ``role``: the outermost FSDP unit, a unit in between (a transformer block), or an FP32 island.
ROLE_CHOICES: tuple[str, ...] = ("root", "block", "fp32")


def _check_gather(props: Properties, gather: object) -> None:
    check_choice("gather", gather, GATHER_CHOICES, quote=True)
    if gather == "fp32" and props.casts_model:
        raise ValueError(
            f"gather='fp32' does not apply at opt_level={props.opt_level!r}: it is O1's opt-in to Apex's exact FP32 "
            f"all-gather; at {props.opt_level} the model computes in {dtype_name(props.half_dtype)}, which FSDP's "
            "half all-gather provides. Use gather='half' (the default)."
        )


# -- FSDP2 -------------------------------------------------------------------------------------------------------
@checks_keywords("mixed_precision_policy()")
def mixed_precision_policy(precision: object, *, role: Role = "block", gather: Gather = "half") -> MixedPrecisionPolicy:
    """The FSDP2 ``MixedPrecisionPolicy`` of one sharded module for an opt level (see the module docstring).

    Shard bottom-up: the FP32 islands with ``role="fp32"``, then the blocks with ``role="block"``, then the whole
    model with ``role="root"`` (or let :func:`shard_model` do it)::

        for layer in model.layers:
            fully_shard(layer, mp_policy=mixed_precision_policy(plugin))
        fully_shard(model, mp_policy=mixed_precision_policy(plugin, role="root"))

    Args:
        precision: The opt level (see :func:`resolve_settings`).
        role: ``"root"``: the outermost module (casts its inputs to the compute dtype and, at O2/O3, its outputs to
            FP32, as ``Amp.cast_inputs``/``cast_outputs`` do without FSDP); ``"block"``: a module in between;
            ``"fp32"``: an FP32 island (batch norm at O1 and where ``keep_batchnorm_fp32``, ``fp32_modules``):
            gathered and reduced in FP32, its inputs cast to FP32 and, at O2/O3, its outputs back to the half dtype.
        gather: ``"half"`` (default) or ``"fp32"``: the all-gather dtype at O1 (``"fp32"`` is Apex's exact O1 and
            keeps half copies of the weights alive until the backward). Ignored at O0; only ``"half"`` at O2/O3.

    Raises:
        ValueError: for a ``role`` or ``gather`` that is not valid (naming the choices).
    """
    props = resolve_settings(precision).properties
    check_choice("role", role, ROLE_CHOICES, quote=True)
    _check_gather(props, gather)
    mode = _mode(props)
    half = mode.half
    if mode.name == "fp32":
        return MixedPrecisionPolicy()
    if mode.name == "cast_table":
        if role == "fp32":  # promotion's O1 boundary: FP32 inputs, outputs left FP32
            return MixedPrecisionPolicy(param_dtype=_F32, reduce_dtype=_F32, cast_forward_inputs=True)
        # No input casts: the cast table decides per op (an FP32 op keeps its FP32 inputs unrounded).
        if gather == "fp32":
            return MixedPrecisionPolicy(cast_forward_inputs=False)
        return MixedPrecisionPolicy(param_dtype=half, reduce_dtype=_F32, cast_forward_inputs=False)
    if role == "fp32":  # O2/O3 island: the next half module needs half inputs
        return MixedPrecisionPolicy(param_dtype=_F32, reduce_dtype=_F32, output_dtype=half, cast_forward_inputs=True)
    if mode.name == "masters":  # O2
        output = _F32 if role == "root" else None
        return MixedPrecisionPolicy(param_dtype=half, reduce_dtype=_F32, output_dtype=output, cast_forward_inputs=True)
    # O3: the parameters are half already (param_dtype=half gathers them as they are); only the root casts.
    if role == "root":
        return MixedPrecisionPolicy(param_dtype=half, output_dtype=_F32, cast_forward_inputs=True)
    return MixedPrecisionPolicy()


@checks_keywords("shard_model()")  # a misspelt keyword (block=) names the valid ones (Python's TypeError named none)
def shard_model(
    module: nn.Module,
    precision: object,
    *,
    mesh: Any = None,
    blocks: Iterable[nn.Module] | type[nn.Module] | tuple[type[nn.Module], ...] | None = None,
    reshard_after_forward: bool | int | None = None,
    gather: Gather = "half",
) -> nn.Module:
    """Shard ``module`` with FSDP2's ``fully_shard`` and the policies of an opt level, bottom-up, in place.

    In order: the FP32 islands (batch-norm modules at O1 and where the level keeps batch norm FP32, modules matching
    ``fp32_modules``; none at O0), then ``blocks`` (the inner ones first; blocks inside an island are part of the
    island's unit), then the root. At O2 the model stays FP32 (FSDP's shards are the masters) and its floating
    buffers outside the islands are cast to half, as without FSDP; at O3 the model is cast to half first
    (:func:`~lightning_mpx.masters.weights.convert_module`), the islands kept FP32. In a Lightning
    ``configure_model`` with ``ModelParallelStrategy``::

        def configure_model(self):
            shard_model(self.model, self.trainer.precision_plugin, mesh=self.device_mesh["data_parallel"],
                        blocks=TransformerBlock)

    Args:
        module: The unsharded model.
        precision: The opt level (see :func:`resolve_settings`); pass the plugin to share its half dtype.
        mesh: The device mesh (``None``: FSDP's default, the whole world).
        blocks: The modules to shard as units of their own: submodules of ``module``, or a module class (a tuple
            of classes) whose instances are. ``None``: only the islands and the root.
        reshard_after_forward: Passed to ``fully_shard`` for every unit. ``None`` (the default, FSDP's own):
            units reshard after their forward and the root keeps its parameters gathered for the backward that
            follows (one all-gather per step less than ``True``). A forward with no backward (an evaluation) then
            leaves the root gathered, and ``model.parameters()`` returns the gathered copies until the next backward:
            build optimizers before evaluating, or call ``model.reshard()`` first (``Amp.prepare_optimizer`` refuses
            an optimizer that holds gathered parameters).
        gather: O1's all-gather dtype (see :func:`mixed_precision_policy`).

    Called again on a model it sharded (Lightning calls ``configure_model`` at every stage: ``fit`` then ``test``,
    ``validate`` then ``fit``), ``shard_model`` returns the model as it is when the arguments agree with the first
    call's (the same level's policies, half dtype, FP32 islands, blocks, ``gather``, mesh and
    ``reshard_after_forward``); FSDP cannot change a sharded model, so arguments that differ raise ``ValueError``
    naming each one.

    Returns:
        ``module``, sharded.

    Raises:
        ValueError: for a module sharded by something else than ``shard_model`` (``fully_shard`` by hand, FSDP1), a
            module ``shard_model`` sharded with other arguments, a ``gather`` not valid at the level, blocks that are
            not submodules, or an ``fp32_modules`` pattern that matches no module. TypeError: for arguments of the
            wrong type.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module={type(module).__name__} must be a torch.nn.Module.")
    settings = resolve_settings(precision)
    props = settings.properties
    _check_gather(props, gather)
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, (bool, int)):
        raise TypeError(
            f"reshard_after_forward={reshard_after_forward!r} must be None, True, False or an int (see fully_shard)."
        )
    done = done_plan(module)
    mode = _mode(props)
    islands = _islands(module, settings, mode, require_match=True)
    island_set = {id(m) for _, m in islands}
    _refuse_tied_islands(module, islands)
    units = _resolve_blocks(module, blocks)
    inside = {id(m) for _, island in islands for m in island.modules()}
    units = [unit for unit in units if id(unit) not in inside]  # blocks inside an island are part of its unit
    names = {id(m): _clean(n) for n, m in module.named_modules()}
    plan = shard_plan(props, mode.name, mode.half, names, islands, units, mesh, reshard_after_forward, gather)
    if done is not None:
        check_same_plan(module, done, plan)
        return module  # sharded by an earlier call with these arguments (a Lightning hook called at every stage)
    warn_one_rank_mesh(module, mesh)  # ModelParallelStrategy()'s default 'data_parallel' mesh: weights drift apart
    if mode.name == "half":
        exact = [(island, fp32_tensors(island)) for _, island in islands]
        convert_module(module, mode.half, keep_batchnorm_fp32=mode.batchnorm_islands)
        for island, before in exact:
            _module_to_fp32(island)  # fp32_modules (batch norm was kept FP32 above), with their exact values
            restore_fp32_tensors(island, before)
    elif mode.name == "masters":
        _buffers_to(module, mode.half, skip=island_set)
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    block_policy = mixed_precision_policy(settings, role="block", gather=gather)
    shards = [(island, mixed_precision_policy(settings, role="fp32", gather=gather)) for _, island in islands]
    shards += [(unit, block_policy) for unit in units]
    shards.append((module, mixed_precision_policy(settings, role="root", gather=gather)))
    for unit, policy in shards:
        policy = _complex_unit_policy(unit, policy, names)
        if props.has_cast_policy:
            # FSDP's forward hooks (the gathers and frees, hundreds of torch calls per unit) run without the cast
            # mode, which would be handed each of them.
            around_hooks(unit, functools.partial(fully_shard, unit, mp_policy=policy, **kwargs))
        else:
            fully_shard(unit, mp_policy=policy, **kwargs)
    # The model carries what was done to it, so that a second call can tell "the same again" from a conflict.
    record_plan(module, plan)
    return module


def _refuse_tied_islands(module: nn.Module, islands: list[tuple[str, nn.Module]]) -> None:
    """Refuse an FP32 island that shares a parameter with a module outside it (an ``lm_head`` tied to the input
    embedding): FSDP2 keeps a parameter in one unit (its own error named no fix ``shard_model`` takes, and at O3 the
    tied FP32 weight outside the island was refused as a model not cast before sharding)."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(_clean(name))
    for island_name, island in islands:
        inside = island_name + "."
        for name in (n for p in island.parameters() for n in names.get(id(p), ()) if not n.startswith(inside)):
            raise ValueError(
                f"shard_model: the FP32 unit {island_name!r} (batch norm or fp32_modules) shares a parameter with "
                f"{name!r} outside it (tied weights); FSDP2 keeps a parameter in one unit. Leave {island_name!r} out "
                "of fp32_modules (or untie the weights) to shard this model."
            )


def _complex_unit_policy(unit: nn.Module, policy: MixedPrecisionPolicy, names: dict[int, str]) -> MixedPrecisionPolicy:
    """``policy``, for a unit about to be sharded, or the one its complex parameters (spectral layers) need.

    FSDP2 gathers and reduces a unit's parameters as one buffer of one dtype: a unit of complex parameters only is
    reduced in their dtype (an FP32 reduction failed in FSDP's backward with "torch.cat(): input types can't be
    cast"); one that mixes them with real parameters is refused
    here, naming them (FSDP's own "expects uniform original parameter dtype" named neither unit nor parameter)."""
    own = [(n, p) for n, p in unit.named_parameters() if p.requires_grad and not isinstance(p, DTensor)]
    complex_names = [n for n, p in own if p.is_complex()]
    if not complex_names:
        return policy
    if len(complex_names) < len(own):
        unit_name = names.get(id(unit)) or "<root>"
        raise ValueError(
            f"shard_model: the unit {unit_name!r} holds complex parameters ({', '.join(complex_names)}) beside real "
            "ones; FSDP2 shards a unit's parameters as one buffer of one dtype. Give them units of their own: pass "
            "the modules of the real parameters (or of the complex ones) in blocks=."
        )
    if policy.param_dtype is not None and not _gathers_complex_as_is():
        raise ValueError(
            f"shard_model: the unit {names.get(id(unit)) or '<root>'!r} holds complex parameters "
            f"({', '.join(complex_names)}), which torch {torch.__version__}'s FSDP2 would gather as "
            f"{dtype_name(policy.param_dtype)}, dropping their imaginary parts; torch>=2.13 gathers them as they are. "
            "Upgrade torch, or keep the complex parameters out of shard_model (DDP trains them)."
        )
    return dataclasses.replace(policy, reduce_dtype=None)  # FSDP gathers a complex parameter as it is already


def _gathers_complex_as_is() -> bool:
    """Whether this torch's FSDP2 gathers a complex parameter as it is: torch 2.13's ``FSDPParam.init_dtype_attrs``
    leaves a non-floating parameter's dtype alone, 2.11's casts it to the policy's real ``param_dtype``, silently
    dropping the imaginary part (2.12 leaves it alone, as 2.13 does). Asked of that method itself, so a source build
    or nightly (``2.13.0a0+git...``, before 2.13 in torch's version compare) is judged by what it does; by the
    release number where the method is not there to ask."""
    probe = types.SimpleNamespace(sharded_param=torch.zeros(1, dtype=torch.complex64))
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam  # private: asked, else the release

        FSDPParam.init_dtype_attrs(probe, MixedPrecisionPolicy(param_dtype=torch.bfloat16))  # type: ignore[arg-type]
    except Exception:
        return (torch_release(torch.__version__) or (2, 13)) >= (2, 13)
    return getattr(probe, "param_dtype", torch.bfloat16) is None


def _resolve_blocks(module: nn.Module, blocks: object) -> list[nn.Module]:
    """``blocks`` as submodules of ``module`` (not the root), deepest first (so ``fully_shard`` goes bottom-up)."""
    if blocks is None:
        return []
    depth = {id(m): name.count(".") + 1 for name, m in module.named_modules() if name}
    if isinstance(blocks, type) or (isinstance(blocks, tuple) and blocks and all(isinstance(b, type) for b in blocks)):
        classes = blocks if isinstance(blocks, tuple) else (blocks,)
        bad = [c for c in classes if not issubclass(c, nn.Module)]
        if bad:
            raise TypeError(f"blocks={blocks!r} holds {bad[0]!r}, which is not a torch.nn.Module class.")
        found = [m for name, m in module.named_modules() if name and isinstance(m, classes)]
        if not found:
            present = sorted({type(m).__name__ for name, m in module.named_modules() if name})
            raise ValueError(
                f"blocks={blocks!r} matches no submodule of module={type(module).__name__}; its submodules are of "
                f"the classes {', '.join(present) or 'none'}."
            )
    else:
        if isinstance(blocks, nn.Module) or isinstance(blocks, (str, bytes)):
            raise TypeError(
                f"blocks={type(blocks).__name__} must be an iterable of submodules (e.g. model.layers as a list) or a "
                "module class or a tuple of module classes."
            )
        try:
            found = list(blocks)  # type: ignore[call-overload]
        except TypeError:
            raise TypeError(
                f"blocks={blocks!r} must be an iterable of submodules, a module class or a tuple of module classes."
            ) from None
        for block in found:
            if not isinstance(block, nn.Module):
                raise TypeError(f"blocks holds {block!r} ({type(block).__name__}); each entry must be a submodule.")
            if block is module:
                raise ValueError(
                    "blocks holds the model itself; the root is always sharded last (with role='root'): list its "
                    "submodules only."
                )
            if id(block) not in depth:
                raise ValueError(
                    f"blocks holds a {type(block).__name__} that is not a submodule of module="
                    f"{type(module).__name__}; valid choices: modules from module.modules()."
                )
    unique = list({id(m): m for m in found}.values())
    return sorted(unique, key=lambda m: -depth[id(m)])


def _buffers_to(module: nn.Module, dtype: torch.dtype, *, skip: set[int]) -> None:
    """Cast the floating buffers of ``module`` outside the modules (and their submodules) in ``skip`` to ``dtype``:
    at O2 the model computes in half, and an FP32 buffer (a position table) would promote activations to FP32.
    Rotary inverse frequencies stay FP32 (:func:`~lightning_mpx.masters.fp32_buffers.keeps_fp32_buffer`)."""
    skipped = {id(inner) for outer in module.modules() if id(outer) in skip for inner in outer.modules()}
    for submodule in module.modules():
        if id(submodule) in skipped:
            continue
        for name, buffer in submodule._buffers.items():
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != dtype:
                if keeps_fp32_buffer(submodule, name):  # rotary frequencies, as convert_module keeps them
                    continue
                submodule._buffers[name] = buffer.to(dtype)


# -- FSDP1 -------------------------------------------------------------------------------------------------------
@checks_keywords("fsdp1_mixed_precision()")
def fsdp1_mixed_precision(precision: object, *, gather: Gather = "half") -> MixedPrecision | None:
    """FSDP1's ``MixedPrecision`` for an opt level (``FullyShardedDataParallel(..., mixed_precision=...)``), or
    ``None`` where FSDP1 should not cast (O0, and O1 with ``gather="fp32"``).

    O1: gathered in half, reduced in FP32, no input casts (the cast table decides). O2: gathered in half, reduced in
    FP32, buffers in half, the root's inputs cast to half. Batch norm, at O1 and where the level keeps it FP32, is
    left out through ``_module_classes_to_ignore`` (FSDP1 then wraps each batch-norm module as a unit of its own without
    mixed precision, *only when an* ``auto_wrap_policy`` *is given*). O3: the model must be cast to half before
    wrapping (:func:`~lightning_mpx.masters.weights.convert_module`); the policy only casts the root's inputs to half
    (``param_dtype`` is the parameters' own dtype, so nothing is re-gathered) and leaves batch norm out as at O2.
    FSDP1 has no output cast and no name-based units: ``fp32_modules`` need units of their own through the
    ``auto_wrap_policy`` (:func:`check_sharded_model` refuses them gathered in half).

    Raises:
        ValueError: for a ``gather`` that is not valid at the level.
    """
    props = resolve_settings(precision).properties
    _check_gather(props, gather)
    mode = _mode(props)
    half = mode.half
    if mode.name == "fp32" or (mode.name == "cast_table" and gather == "fp32"):
        return None
    ignore: tuple[type[nn.Module], ...] = (_BatchNorm,) if mode.batchnorm_islands else ()
    if mode.name == "cast_table":
        return MixedPrecision(
            param_dtype=half,
            reduce_dtype=_F32,
            cast_forward_inputs=False,
            cast_root_forward_inputs=False,
            _module_classes_to_ignore=ignore,
        )
    if mode.name == "masters":
        return MixedPrecision(
            param_dtype=half,
            reduce_dtype=_F32,
            buffer_dtype=half,
            cast_root_forward_inputs=True,
            _module_classes_to_ignore=ignore,
        )
    return MixedPrecision(param_dtype=half, cast_root_forward_inputs=True, _module_classes_to_ignore=ignore)
