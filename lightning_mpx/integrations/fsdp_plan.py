"""The record of how :func:`~lightning_mpx.integrations.fsdp.shard_model` sharded a model.

FSDP cannot change a sharded model, and Lightning calls ``configure_model`` (where the model is sharded) at every
stage. The model carries its plan (what was done to it, by argument, as plain comparable values), so that a second
``shard_model`` call can tell "the same again" (nothing to do) from a conflict (an error naming what differs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_mpx.common.dtypes import dtype_name
from lightning_mpx.engine.sharding import is_sharded
from lightning_mpx.opt_levels import Properties

__all__ = ["check_same_plan", "done_plan", "record_plan", "shard_plan"]


# The attribute of a model shard_model sharded that holds its _plan (the model owns the record of its sharding).
_PLAN_ATTRIBUTE = "_lightning_mpx_shard_plan"
_MODE_WORDS = {
    "fp32": "FP32, no mixed-precision policy",
    "cast_table": "FP32 shards gathered for the cast table",
    "masters": "FP32 shards as the master weights",
    "half": "the model cast to half",
}


def shard_plan(
    props: Properties,
    mode: str,
    half: torch.dtype,
    names: dict[int, str],
    islands: list[tuple[str, nn.Module]],
    units: list[nn.Module],
    mesh: Any,
    reshard_after_forward: bool | int | None,
    gather: str,
) -> dict[str, object]:
    """What :func:`~lightning_mpx.integrations.fsdp.shard_model` does to a model with these arguments, as plain
    comparable values by argument (``mode``, ``half``: how the level shards, see ``fsdp._mode``; ``names``: the
    model's module names by ``id``, without FSDP1's wrapper segments).

    Only what changes the sharding counts: two plugins of one level and half dtype that differ in their loss scaling
    shard a model alike. The mesh is described by its value (device type, ranks, dimension names): a strategy builds
    a new ``DeviceMesh`` object at every stage.
    """
    return {
        "opt_level": f"{props.opt_level} ({_MODE_WORDS[mode]})",
        "half_dtype": None if mode == "fp32" else dtype_name(half),
        "FP32 islands (batch norm, fp32_modules)": tuple(sorted(name for name, _ in islands)),
        "blocks": tuple(sorted(names[id(unit)] for unit in units)),
        "gather": gather if mode == "cast_table" else None,
        "mesh": _mesh_value(mesh),
        # As written: True == 1 in Python, but fully_shard reads True (reshard fully) and 1 (reshard to a
        # world of one) differently.
        "reshard_after_forward": repr(reshard_after_forward),
    }


def _mesh_value(mesh: Any) -> object:
    if mesh is None:
        return None
    ranks = getattr(mesh, "mesh", None)
    return (
        getattr(mesh, "device_type", None),
        ranks.tolist() if isinstance(ranks, torch.Tensor) else ranks,
        getattr(mesh, "mesh_dim_names", None),
    )


def _shown(value: object) -> str:
    if value is None:
        return "none"
    return value if isinstance(value, str) else repr(value)


def done_plan(module: nn.Module) -> dict[str, object] | None:
    """The plan :func:`~lightning_mpx.integrations.fsdp.shard_model` sharded ``module`` with; ``None`` for an
    unsharded module; raises for a module sharded by other means (``fully_shard`` by hand, FSDP1), whose policies
    shard_model cannot know."""
    if not is_sharded(module):
        return None
    done = getattr(module, _PLAN_ATTRIBUTE, None)
    if not isinstance(done, dict):
        raise ValueError(
            f"module={type(module).__name__} is already sharded (it holds an FSDP module), and not by a shard_model "
            "call on it: shard_model shards an unsharded model with the level's policies, which FSDP cannot change "
            "afterwards. Pass the model before calling fully_shard, or shard it yourself with "
            "mixed_precision_policy(...) and check it with check_sharded_model(model, precision)."
        )
    return done


def check_same_plan(module: nn.Module, done: dict[str, object], plan: dict[str, object]) -> None:
    """Return when ``plan`` (this call's) is ``done`` (the call that sharded ``module``); raise naming what differs."""
    differ = [
        f"{key}: {_shown(done.get(key))} then, {_shown(value)} now"
        for key, value in plan.items()
        if done.get(key) != value
    ]
    if differ:
        raise ValueError(
            f"module={type(module).__name__} was sharded by an earlier shard_model call with other arguments, and "
            f"FSDP cannot change a sharded model ({'; '.join(differ)}). Call shard_model with the same arguments at "
            "every stage (Lightning calls configure_model at each of fit, validate, test, predict), or build a new "
            "model to shard it differently."
        )


def record_plan(module: nn.Module, plan: dict[str, object]) -> None:
    """Keep ``plan`` on ``module``, which was just sharded with it (the model owns the record of its sharding)."""
    setattr(module, _PLAN_ATTRIBUTE, plan)
