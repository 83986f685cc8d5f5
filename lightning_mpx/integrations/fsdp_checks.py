"""What an opt level needs of a model under FSDP, and the check of a model sharded by hand.

:func:`resolve_settings` reads the settings a ``precision`` stands for; ``_mode`` what the level does to the model
under FSDP; ``_islands`` its FP32 islands (batch norm, ``fp32_modules``) by the names FSDP1's wrappers leave out.
:func:`check_sharded_model` refuses a model sharded with FSDP2 or FSDP1 whose stored dtypes and gather policies do not
fit the level. The policies and :func:`~lightning_mpx.integrations.fsdp.shard_model`, built on the same reading, are in
:mod:`lightning_mpx.integrations.fsdp` (which re-exports what is public here).
"""

from __future__ import annotations

import warnings
from typing import Iterable, Literal, NamedTuple

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, MixedPrecision, MixedPrecisionPolicy
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_mpx.common.dtypes import HALF_DTYPES, dtype_name
from lightning_mpx.engine.sharding import is_sharded, reshard_gathered
from lightning_mpx.health.promotion import matches
from lightning_mpx.opt_levels import Properties
from lightning_mpx.settings import MixedPrecisionSettings

__all__ = ["check_sharded_model", "resolve_settings"]

_F32 = torch.float32
# The names FSDP1 (and activation checkpointing) insert between a module and its children.
_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")


# -- the settings ------------------------------------------------------------------------------------------------
def resolve_settings(precision: object, *, argument: str = "precision") -> MixedPrecisionSettings:
    """The :class:`~lightning_mpx.settings.MixedPrecisionSettings` that ``precision`` stands for.

    Args:
        precision: An opt-level string (the default settings of that level), a ``MixedPrecisionSettings``, or an
            object with a ``settings`` attribute holding one (``Amp``, the Lightning and Fabric plugins).
        argument: The argument's name in error messages.

    Raises:
        TypeError: for anything else; ValueError: for a string that is not an opt level.
    """
    if isinstance(precision, MixedPrecisionSettings):
        return precision
    if isinstance(precision, str):
        return MixedPrecisionSettings(opt_level=precision)
    settings = getattr(precision, "settings", None)
    if isinstance(settings, MixedPrecisionSettings):
        return settings
    raise TypeError(
        f"{argument}={precision!r} is not valid; valid choices: an opt level ('O0', 'O1', 'O2', 'O3'), a "
        "lightning_mpx.MixedPrecisionSettings, or an object with one as its `settings` (Amp, MixedPrecisionPlugin, "
        "FabricMixedPrecisionPlugin)."
    )


class _Mode(NamedTuple):
    """What the level does to the model under FSDP, read from the properties (so overrides count)."""

    name: Literal["fp32", "cast_table", "masters", "half"]
    half: torch.dtype
    batchnorm_islands: bool


def _mode(props: Properties) -> _Mode:
    if props.casts_model:
        name = "masters" if props.master_weights else "half"  # O2, O3
    elif props.patch_torch_functions:
        name = "cast_table"  # O1
    else:
        name = "fp32"  # O0
    # O1 keeps batch norm FP32 too: its parameters are the model's FP32 ones, and gathered in half they would break
    # torch's batch_norm, which needs weights and running statistics of one dtype ("expected scalar type BFloat16
    # but found Float").
    islands = bool(props.keep_batchnorm_fp32) if props.casts_model else name == "cast_table"
    return _Mode(name, props.half_dtype, islands)  # type: ignore[arg-type]


# -- FP32 islands and names ----------------------------------------------------------------------------------------
def _clean(name: str) -> str:
    """A module or parameter name without the wrapper segments FSDP1 and activation checkpointing insert."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def _inside(name: str, tops: Iterable[str]) -> bool:
    return any(name == top or name.startswith(top + ".") for top in tops)


def _islands(
    module: nn.Module, settings: MixedPrecisionSettings, mode: _Mode, *, require_match: bool = False
) -> list[tuple[str, nn.Module]]:
    """The FP32 islands of ``module``, outermost only, by clean name: batch norm at O1 and where the level keeps it
    FP32, modules matching ``fp32_modules`` (with :func:`lightning_mpx.health.promotion.matches`). None at O0."""
    if mode.name == "fp32":
        return []
    patterns = tuple(settings.fp32_modules)
    found: dict[str, nn.Module] = {}
    matched: set[str] = set()
    for raw, sub in module.named_modules():
        name = _clean(raw)
        if not name or isinstance(sub, FullyShardedDataParallel):
            continue  # the root, or an FSDP1 wrapper (the module it wraps has the same clean name)
        hits = [p for p in patterns if matches(name, p)]
        matched.update(hits)
        if (hits or (mode.batchnorm_islands and isinstance(sub, _BatchNorm))) and name not in found:
            found[name] = sub
    unmatched = [p for p in patterns if p not in matched]
    if require_match and unmatched:
        names = [n for n, _ in module.named_modules() if n]
        shown = ", ".join(map(repr, names[:12])) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
        raise ValueError(
            f"fp32_modules pattern(s) {', '.join(map(repr, unmatched))} match no module of module="
            f"{type(module).__name__}; its module names are {shown or 'none (no submodules)'}."
        )
    tops = [n for n in found if not any(n.startswith(other + ".") for other in found if other != n)]
    return [(n, found[n]) for n in tops]


# -- the check -----------------------------------------------------------------------------------------------------
class _Unit(NamedTuple):
    name: str  # clean name
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    known: bool  # whether the policy could be read


def _units(module: nn.Module) -> list[_Unit]:
    units: list[_Unit] = []
    for raw, sub in module.named_modules():
        if isinstance(sub, FSDPModule):
            policy = _fsdp2_policy(sub)
            if policy is None:
                units.append(_Unit(_clean(raw), None, None, False))
            else:
                units.append(_Unit(_clean(raw), policy.param_dtype, policy.reduce_dtype, True))
        elif isinstance(sub, FullyShardedDataParallel):
            mp = getattr(sub, "mixed_precision", None)
            known = mp is None or isinstance(mp, MixedPrecision)
            units.append(_Unit(
                _clean(raw), getattr(mp, "param_dtype", None), getattr(mp, "reduce_dtype", None), known
            ))
    return units


def _fsdp2_policy(module: FSDPModule) -> MixedPrecisionPolicy | None:
    """The policy ``fully_shard`` was given for ``module``, or ``None`` when it cannot be read.

    FSDP2 has no public getter for it (torch 2.13): it lives on the private ``FSDPState._mp_policy``. Reading it is
    the only way to tell a model sharded with the level's policies from one sharded without any; if a future torch
    moves it, the policy checks are skipped with a warning rather than failing every sharded run.
    """
    try:
        policy = module._get_fsdp_state()._mp_policy
    except AttributeError:
        return None
    return policy if isinstance(policy, MixedPrecisionPolicy) else None


def _owner(names: list[str], param: str) -> str | None:
    """The innermost of ``names`` (FSDP units) that holds parameter ``param`` (FSDP gives a parameter to the
    innermost unit that contains it, as units are made bottom-up)."""
    best: str | None = None
    for unit in names:
        if (unit == "" or param.startswith(unit + ".")) and (best is None or len(unit) > len(best)):
            best = unit
    return best


def check_sharded_model(module: nn.Module, settings: object) -> None:
    """Raise ``ValueError`` when a model sharded with FSDP2 (``fully_shard``) or FSDP1 (``FullyShardedDataParallel``)
    does not fit the opt level: what was found, what the level needs, and the helper to call.

    Refused: at O0 half parameters or a half gather; at O1 half parameters stored (any gather is fine); at O2 half
    parameters stored (FSDP's FP32 shards are the masters: do not cast before sharding) or a unit gathered in
    anything but the half dtype (sharded without the level's policy); at O3 FP32 parameters stored outside the
    islands; at O1-O3 an FP32 island (batch norm at O1 and where ``keep_batchnorm_fp32``, ``fp32_modules``)
    gathered in half (or, at O2/O3, by its parent's unit); at O2/O3
    ``on_floor="promote"`` (FSDP's policy cannot change after sharding). Warned about (``UserWarning``): gradients
    reduced in half at O1/O2 (no corruption: FSDP casts the reduced gradient back to the FP32 shard before the
    unscale, and the scaler skips a step whose sum overflowed; but the sum across ranks is rounded to half, and a
    float16 sum of N ranks has N times less headroom, which costs loss scale; some choose it to halve the
    reduce-scatter's bytes).

    Args:
        module: The sharded model (FSDP1: the wrapped model).
        settings: The opt level (anything :func:`resolve_settings` takes).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module={type(module).__name__} must be a torch.nn.Module.")
    settings = resolve_settings(settings, argument="settings")
    props = settings.properties
    mode = _mode(props)
    level, half = props.opt_level, mode.half
    reshard_gathered(module)  # an evaluation forward leaves FSDP's root gathered: check what is stored
    if not is_sharded(module):
        raise ValueError(
            f"module={type(module).__name__} is not sharded (no FSDPModule or FullyShardedDataParallel in it); "
            "check_sharded_model checks a model after fully_shard / FullyShardedDataParallel."
        )
    helper = (
        "shard the unsharded model with lightning_mpx.fsdp.shard_model(model, precision) or pass "
        "mp_policy=lightning_mpx.fsdp.mixed_precision_policy(precision, role=...) to each fully_shard "
        "(FSDP1: mixed_precision=lightning_mpx.fsdp.fsdp1_mixed_precision(precision))"
    )
    if mode.name in ("masters", "half") and settings.scaler.on_floor == "promote":
        raise ValueError(
            f"on_floor='promote' cannot work on a sharded model at opt_level={level!r}: promoting a module to FP32 "
            "changes its parameters' dtype and compute dtype, which FSDP fixes when it shards the model. Use "
            "on_floor='raise' (or 'warn'/'continue'), and name the modules to keep in FP32 up front with "
            "fp32_modules=[...] (shard_model makes them FP32 units)."
        )
    islands = [name for name, _ in _islands(module, settings, mode)]
    units = _units(module)
    unit_names = [u.name for u in units]
    by_name = {u.name: u for u in units}

    # What is stored: FSDP's sharded parameters (FSDP2 DTensors, FSDP1 flat parameters) outside the forward.
    stored_half, stored_fp32, island_half = [], [], []
    for raw, param in module.named_parameters():
        if not param.is_floating_point():
            continue
        name = _clean(raw)
        if _inside(name.rpartition(".")[0], islands):
            if param.dtype != _F32:
                island_half.append(name)
        elif param.dtype in HALF_DTYPES:
            # At O2 a frozen half parameter (a LoRA model's base loaded in half) needs no master, as without FSDP:
            # the policy gathers it in half like the rest (tests/test_accelerate_fsdp2_lora.py).
            if mode.name != "masters" or param.requires_grad:
                stored_half.append(name)
        else:
            stored_fp32.append(name)
    if stored_half and mode.name != "half":
        need = {
            "fp32": "everything in FP32 at O0",
            "cast_table": "the model in FP32 at O1 (FSDP gathers it in half; the cast table casts)",
            "masters": "FSDP's sharded FP32 parameters as the master weights at O2 (compute in half comes from "
            "the policy's param_dtype): do not cast the model to half before sharding",
        }[mode.name]
        raise ValueError(
            f"the sharded model stores half parameters ({_listed(stored_half)}) but opt_level={level!r} needs "
            f"{need}; {helper}."
        )
    if stored_fp32 and mode.name == "half":
        raise ValueError(
            f"the sharded model stores FP32 parameters ({_listed(stored_fp32)}) but opt_level={level!r} needs the "
            f"model cast to {dtype_name(half)} before sharding (batch norm and fp32_modules kept FP32 as units of "
            f"their own); {helper}."
        )
    if island_half:
        raise ValueError(
            f"the sharded model stores {_listed(island_half)} in half but at opt_level={level!r} batch norm and "
            f"fp32_modules are FP32 (FSDP units of their own, gathered in FP32); {helper}."
        )

    if not all(u.known for u in units):
        warnings.warn(
            "lightning_mpx could not read the mixed-precision policy of the FSDP modules (a torch version that "
            f"moved it); whether they fit opt_level={level!r} was not checked.",
            UserWarning,
            stacklevel=2,
        )
        return
    # Which unit gathers each parameter, and in which dtype.
    owners: dict[str, set[str]] = {}
    for raw, param in module.named_parameters():
        if param.is_floating_point():
            owner = _owner(unit_names, _clean(raw))
            if owner is not None:
                owners.setdefault(owner, set()).add(_clean(raw))
    gathers_half = {u.name for u in units if u.param_dtype in HALF_DTYPES}
    if mode.name == "fp32" and gathers_half & set(owners):
        raise ValueError(
            f"FSDP gathers {_listed(sorted(gathers_half & set(owners)))} in half but opt_level='O0' runs everything "
            f"in FP32; shard without a mixed-precision policy, or {helper}."
        )
    other_half = [u for u in units if u.name in owners and u.param_dtype in HALF_DTYPES and u.param_dtype != half]
    if mode.name != "fp32" and other_half:
        found = ", ".join(f"{u.name or '<root>'} (param_dtype={u.param_dtype})" for u in other_half[:4]) + (
            f" and {len(other_half) - 4} more" if len(other_half) > 4 else "")
        raise ValueError(
            f"FSDP gathers these units in another half dtype than opt_level={level!r} with half_dtype="
            f"{dtype_name(half)}: {found}; the level's casts and loss scale are for {dtype_name(half)} (a matmul "
            f"would meet two dtypes, or float16 would run with bfloat16's static scale). Shard with the same "
            f"precision as the engine (pass the plugin or the Amp, not an opt-level string, as shard_model's "
            f"precision), or {helper}."
        )
    if mode.name == "masters":
        plain = [u.name for u in units if u.name in owners and not _inside(u.name, islands)
                 and u.param_dtype not in HALF_DTYPES]
        if plain:
            found = ", ".join(
                f"{u or '<root>'} (param_dtype={by_name[u].param_dtype})" for u in plain[:4]
            ) + (f" and {len(plain) - 4} more" if len(plain) > 4 else "")
            raise ValueError(
                f"at opt_level='O2' FSDP must gather the model in {dtype_name(half)} (its FP32 shards are the "
                f"masters, the compute is half), but these FSDP units gather in FP32 or their own dtype: {found}. "
                f"The model was sharded without lightning_mpx's policy: {helper}."
            )
    if mode.name != "fp32":
        # An island's parameters must not be gathered in half; at O2/O3 they need a unit inside the island (FSDP
        # needs one dtype per unit, and the island's output goes back to half).
        bad = set()
        for owner, params in owners.items():
            for param in params:
                for island in islands:
                    if _inside(param.rpartition(".")[0], [island]) and (
                        by_name[owner].param_dtype in HALF_DTYPES
                        or (mode.name in ("masters", "half") and not _inside(owner, [island]))
                    ):
                        bad.add(island)
        if bad:
            raise ValueError(
                f"{_listed(sorted(bad))} must run in FP32 at opt_level={level!r} (batch norm, fp32_modules) but FSDP "
                f"gathers it in {dtype_name(half)} or with its parent's unit: an FP32 island needs an "
                f"FSDP unit of its own, mp_policy=mixed_precision_policy(precision, role='fp32'), sharded before "
                f"its parent; {helper}."
            )
    if mode.name in ("cast_table", "masters"):
        half_reduce = [
            u.name or "<root>" for u in units
            if u.name in owners and not _inside(u.name, islands)
            and (u.reduce_dtype if u.reduce_dtype is not None else u.param_dtype) in HALF_DTYPES
        ]
        if half_reduce:
            warnings.warn(
                f"FSDP reduces the gradients of {_listed(half_reduce)} in half at opt_level={level!r}: the sum "
                "across ranks is rounded to half (and a float16 sum can overflow where each rank's gradient is "
                "finite, which backs the loss scale off). lightning_mpx's policies reduce in FP32 "
                "(reduce_dtype=torch.float32); see lightning_mpx.fsdp.mixed_precision_policy.",
                UserWarning,
                stacklevel=2,
            )


def _listed(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(repr(n or "<root>") for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")

