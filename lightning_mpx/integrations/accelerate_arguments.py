"""The checks of :class:`~lightning_mpx.integrations.accelerate.Accelerator`'s constructor arguments, before anything is
built: the ``mixed_precision`` value (an opt level, or Accelerate's own: :data:`NATIVE_MIXED_PRECISION`), the
``kwargs_handlers`` (one :class:`~lightning_mpx.integrations.accelerate_kwargs.MixedPrecisionKwargs` at most, and
Accelerate's ``GradScalerKwargs``/``AutocastKwargs`` refused with an opt level, naming what takes their place),
Accelerate's positional arguments bound by name, and an unknown keyword named with the closest valid one. Used by
``Accelerator.__init__`` only; :mod:`lightning_mpx.integrations.accelerate` re-exports :data:`NATIVE_MIXED_PRECISION`.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
from typing import Any

from lightning_mpx.common.imports import require
from lightning_mpx.common.keywords import check_keywords
from lightning_mpx.opt_levels import OPT_LEVELS

require("accelerate", feature="lightning_mpx.accelerate")
from accelerate import Accelerator as _BaseAccelerator  # type: ignore[import-untyped]  # noqa: E402
from accelerate.utils import GradScalerKwargs, KwargsHandler  # type: ignore[import-untyped]  # noqa: E402

from lightning_mpx.integrations.accelerate_kwargs import MixedPrecisionKwargs  # noqa: E402

__all__ = ["NATIVE_MIXED_PRECISION"]

#: Accelerate's own ``mixed_precision`` values, passed through unchanged.
NATIVE_MIXED_PRECISION: tuple[str, ...] = ("no", "fp16", "bf16", "fp8")


def _split_handlers(kwargs_handlers: object) -> tuple[list[MixedPrecisionKwargs], list[KwargsHandler]]:
    """``kwargs_handlers`` checked, as (the :class:`MixedPrecisionKwargs`, Accelerate's handlers); anything else is
    refused naming it (Accelerate's own ``AssertionError`` before)."""
    if kwargs_handlers is not None and not isinstance(kwargs_handlers, (list, tuple)):
        raise TypeError(
            f"kwargs_handlers={type(kwargs_handlers).__name__} must be a list of handlers, such as "
            f"[MixedPrecisionKwargs(...)]; for one, pass [handler]."
        )
    handlers = list(kwargs_handlers or [])
    for handler in handlers:
        if not isinstance(handler, KwargsHandler):
            hint = " (for a dict d of settings: MixedPrecisionKwargs(**d))" if isinstance(handler, dict) else ""
            raise TypeError(
                f"kwargs_handlers holds {handler!r} ({type(handler).__name__}); valid choices: "
                "lightning_mpx's MixedPrecisionKwargs(...) or one of Accelerate's handlers (a subclass of "
                f"accelerate.utils.KwargsHandler, such as DistributedDataParallelKwargs){hint}."
            )
    ours = [h for h in handlers if isinstance(h, MixedPrecisionKwargs)]
    if len(ours) > 1:
        raise ValueError(f"kwargs_handlers holds {len(ours)} MixedPrecisionKwargs; pass at most one.")
    return ours, [h for h in handlers if not isinstance(h, MixedPrecisionKwargs)]


def _check_keywords(kwargs: dict[str, Any]) -> None:
    """Refuse a keyword ``accelerate.Accelerator`` does not take before anything is built (its own ``TypeError`` named
    no valid keyword): an opt level's setting (``half_dtype=``, or a name close to one) is sent to
    ``MixedPrecisionKwargs``; anything else gets Accelerate's keywords and the closest of them."""
    parameters = inspect.signature(_BaseAccelerator.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return  # an Accelerate that takes any keyword: it names its own
    accepted = [name for name in parameters if name != "self"]
    settings = [f.name for f in dataclasses.fields(MixedPrecisionKwargs)]
    for name in (n for n in kwargs if n not in accepted):
        ours = [name] if name in settings else difflib.get_close_matches(name, settings, n=1)
        if ours and not difflib.get_close_matches(name, accepted, n=1, cutoff=0.8):
            raise TypeError(
                f"Accelerator() got an unexpected keyword argument {name!r}: "
                + (f"{name!r} is" if ours[0] == name else f"did you mean {ours[0]!r}? It is")
                + f" a setting of the opt level; pass it as kwargs_handlers=[MixedPrecisionKwargs({ours[0]}=...)] "
                f"with mixed_precision='O0' to 'O3'."
            )
        check_keywords("Accelerator()", {name: kwargs[name]}, accepted)


def _by_name(
    args: tuple[Any, ...], kwargs: dict[str, Any], mixed_precision: Any, kwargs_handlers: Any
) -> tuple[tuple[()], Any, Any, dict[str, Any]]:
    """``Accelerator(*args, ...)``'s positional ``args`` bound to ``accelerate.Accelerator``'s parameters in its order:
    ``((), mixed_precision, kwargs_handlers, kwargs)`` (a third positional argument is its ``mixed_precision``, which
    this class takes by name: Python reported it given twice). A value given both ways is refused naming it."""
    if isinstance(args[0], str):  # Accelerator("O2") ran with no mixed precision, silently
        raise TypeError(
            f"Accelerator({args[0]!r}): the first positional argument is Accelerate's device_placement (a bool); "
            f"pass the precision by name: Accelerator(mixed_precision={args[0]!r})."
        )
    names = [
        name for name, p in inspect.signature(_BaseAccelerator.__init__).parameters.items()
        if name != "self" and p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]  # fmt: skip
    if len(args) > len(names):
        raise TypeError(f"Accelerator() takes {len(names)} positional arguments but {len(args)} were given.")
    given = {"mixed_precision": mixed_precision, "kwargs_handlers": kwargs_handlers}
    bound = dict(kwargs)
    for name, value in zip(names, args):
        if name in kwargs or given.get(name) is not None:
            raise TypeError(
                f"Accelerator() got multiple values for argument {name!r}: positional argument "
                f"{names.index(name) + 1} is Accelerate's {name}, and {name}= was given too."
            )
        bound[name] = value
    return (), bound.pop("mixed_precision", mixed_precision), bound.pop("kwargs_handlers", kwargs_handlers), bound


def _native_handler_refusal(handler: KwargsHandler, opt_level: str) -> str:
    """Why Accelerate's ``GradScalerKwargs``/``AutocastKwargs`` ``handler`` is refused with ``opt_level``, and what
    takes its place."""
    if isinstance(handler, GradScalerKwargs):
        return (
            f"kwargs_handlers=[{handler!r}]: GradScalerKwargs configure torch's GradScaler, which "
            f"mixed_precision={opt_level!r} does not use; pass the loss-scaler settings (init_scale, growth_factor, "
            "backoff_factor, growth_interval) in MixedPrecisionKwargs instead."
        )
    return (
        f"kwargs_handlers=[{handler!r}]: AutocastKwargs configure torch.autocast, which mixed_precision={opt_level!r} "
        "does not use: the opt level casts by its cast table. Set what is cast with "
        "MixedPrecisionKwargs(cast_table=..., fp32_modules=[...]) instead, and run part of a forward pass in FP32 "
        "inside lightning_mpx.disable_casts()."
    )


def _opt_level_of(mixed_precision: object) -> str | None:
    """The opt level that ``mixed_precision`` (or ``ACCELERATE_MIXED_PRECISION`` when it is ``None``) names, or
    ``None`` for Accelerate's own values."""
    value, name = mixed_precision, "mixed_precision"
    if value is None:  # Accelerate passes an unknown value of it on unchecked ("o2": no mixed precision, silently)
        value, name = os.environ.get("ACCELERATE_MIXED_PRECISION") or "no", "ACCELERATE_MIXED_PRECISION"
    text = str(value)  # PrecisionType members are str enums
    if text in OPT_LEVELS:
        return text
    if text in NATIVE_MIXED_PRECISION:
        return None
    hint = ""
    if len(text) == 2 and text[1] in "0123" and text[0] in "0o":
        hint = (
            f" The opt level starts with the capital letter O, not "
            f"{'the digit zero' if text[0] == '0' else 'a lower-case o'}: did you mean 'O{text[1]}'?"
        )
    elif (near := text.strip().lower()) in NATIVE_MIXED_PRECISION or near.upper() in OPT_LEVELS:
        near = near if near in NATIVE_MIXED_PRECISION else near.upper()
        hint = f" Values are matched exactly (case, spaces): did you mean {near!r}?"
    raise ValueError(
        f"{name}={value!r} is not valid; valid choices: Accelerate's "
        f"{', '.join(map(repr, NATIVE_MIXED_PRECISION))} or lightning_mpx's opt levels "
        f"{', '.join(map(repr, OPT_LEVELS))}.{hint}"
    )
