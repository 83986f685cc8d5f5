"""The settings given that a run ignores, and the one warning that names them (:func:`warn_ignored_settings`): the
scaler settings a static loss scale never reads (:func:`ignored_scaler_settings`), the settings an opt level never
reads (:func:`ignored_level_settings`), each with its remedy, said once per settings object on rank zero. Re-exported by
:mod:`lightning_mpx.settings` (their home before, where callers import them from); called by the engine once the half
dtype is known (:mod:`lightning_mpx.engine.amp_parts`), :func:`written_settings` by the front doors' ``from_settings``
and checkpoints.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lightning_mpx.settings import MixedPrecisionSettings

__all__ = [
    "DYNAMIC_ONLY",
    "ignored_level_settings",
    "ignored_scaler_settings",
    "warn_ignored_settings",
    "written_settings",
]


#: The scaler settings only a dynamic loss scale reads (a static scale never moves; ``on_floor`` acts on both).
DYNAMIC_ONLY: tuple[str, ...] = (
    "init_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "consecutive_hysteresis",
    "min_loss_scale",
    "max_loss_scale",
)


def _library_class(settings: Any) -> type:
    """The library's own settings class of ``settings`` (its class, or the first base defined in
    :mod:`lightning_mpx.settings`), whose class attributes are the library's defaults: a subclass's own defaults are
    values its author gave, warned about as given. Found without importing that module (it imports this one)."""
    for cls in type(settings).__mro__:
        if cls.__module__ == "lightning_mpx.settings":
            return cls
    return type(settings)


def ignored_scaler_settings(settings: MixedPrecisionSettings) -> dict[str, Any]:
    """The scaler settings of ``settings`` given other than their defaults that its loss scale ignores: those of
    :data:`DYNAMIC_ONLY` when the scale is static (bfloat16's default 1.0, O0's and O3's, or a number given as
    ``loss_scale``); ``{}`` with a dynamic scale, which reads them all."""
    if settings.properties.dynamic_loss_scale:
        return {}
    library = _library_class(settings.scaler)
    # the library's defaults: a subclass's own defaults are values its author gave (warned as before house69's split)
    return {
        name: getattr(settings.scaler, name)
        for name in DYNAMIC_ONLY
        if getattr(settings.scaler, name) != getattr(library, name)
    }


def _rank_zero() -> bool:
    """Whether this process is rank zero (or alone): ``torch.distributed``'s rank once initialized, before that the
    launchers' environment (``torchrun``'s ``RANK``, Lightning's ``LOCAL_RANK`` and ``NODE_RANK``)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return all(os.environ.get(name, "0") == "0" for name in ("RANK", "LOCAL_RANK", "NODE_RANK"))


def ignored_level_settings(settings: MixedPrecisionSettings) -> dict[str, str]:
    """The settings of ``settings`` given other than their defaults that its opt level (with its overrides) never
    reads, each with what to do instead: ``model_writes`` without FP32 master weights (only O2 has them),
    ``allow_banned`` without the cast table (only O1 bans ops: O2 runs losses in FP32 anyway), ``fp32_modules`` where
    nothing runs in half (O0). ``{}`` when every setting given is read. (The other settings are read at every level:
    at O0 the gradients are checked, unscaled by ``unscale_backend``, diagnosed, logged and measured against the half
    dtype's range too; the scaler's settings are :func:`ignored_scaler_settings`'.)"""
    props = settings.properties
    level = f"opt_level={props.opt_level!r}"
    defaults = _library_class(settings)

    # the library's defaults (class attributes), not a subclass's: its own defaults are values its author gave
    out: dict[str, str] = {}
    if not props.master_weights and settings.model_writes != defaults.model_writes:
        out["model_writes"] = (
            f"model_writes={settings.model_writes!r} is ignored: {level} keeps no FP32 master weights, and "
            "model_writes only applies to O2's masters. Leave it out, or use opt_level='O2'."
        )
    if not props.patch_torch_functions and settings.allow_banned != defaults.allow_banned:
        out["allow_banned"] = (
            f"allow_banned={settings.allow_banned!r} is ignored: {level} runs no cast table, and only O1's cast "
            "table bans ops"
            + (" (O2 runs losses in FP32 anyway)" if props.master_weights else "")
            + ". Leave it out, or use opt_level='O1'."
        )
    if not props.has_cast_policy and tuple(settings.fp32_modules) != tuple(defaults.fp32_modules):
        out["fp32_modules"] = (
            f"fp32_modules={list(settings.fp32_modules)!r} is ignored: {level} runs the whole model in FP32 already. "
            "Leave it out, or use opt_level='O1', 'O2' or 'O3'."
        )
    return out


def written_settings(settings: MixedPrecisionSettings) -> MixedPrecisionSettings:
    """The settings object the user wrote: ``settings`` itself, or the one :meth:`~MixedPrecisionSettings.on_device`
    picked it from (an engine's picked copy warns for the object it was picked from, once)."""
    return settings.__dict__.get("_picked_from", settings)


def warn_ignored_settings(settings: MixedPrecisionSettings) -> None:
    """Warn once per settings object (one ``UserWarning``, rank zero only) naming every setting given that
    ``settings`` ignore, with the remedy: the scaler settings its static loss scale ignores
    (:func:`ignored_scaler_settings`; remedy ``loss_scale="dynamic"``) and the settings its opt level never reads
    (:func:`ignored_level_settings`). The engine calls it once the half dtype is known: when built with one, or when
    :meth:`~lightning_mpx.engine.amp.Amp.pick_half_dtype` picks it. A setting given at its default is not given."""
    written = written_settings(settings)  # an engine's picked copy warns for the object it was picked from
    if getattr(written, "_ignored_warned", False) or not _rank_zero():
        return
    parts = []
    ignored = ignored_scaler_settings(settings)
    if ignored:
        props = settings.properties
        named = ", ".join(f"{name}={value!r}" for name, value in ignored.items())
        why = "" if "loss_scale" in settings.overrides else f" ({props.opt_level}'s default)"
        if why and props.half_dtype == torch.bfloat16 and props.opt_level in ("O1", "O2"):
            why = " (bfloat16's default: it has FP32's range)"
        parts.append(
            f"{named} {'is' if len(ignored) == 1 else 'are'} ignored: opt_level={props.opt_level!r} with "
            f"half_dtype {str(props.half_dtype).replace('torch.', '')} uses the static loss scale "
            f"{float(props.loss_scale)}{why}, and only a dynamic loss scale reads them. Pass loss_scale='dynamic' "
            "for a dynamic scale that uses them, or leave them out."
        )
    parts += ignored_level_settings(settings).values()
    if not parts:
        return
    # Once per settings object (a frozen dataclass); kept by pickling, and by from_settings, which hands it over whole.
    object.__setattr__(written, "_ignored_warned", True)
    warnings.warn("lightning_mpx: " + " ".join(parts), UserWarning, stacklevel=2)


#: The name the engine calls (the warning began with the scaler's settings).
warn_ignored_scaler_settings = warn_ignored_settings
