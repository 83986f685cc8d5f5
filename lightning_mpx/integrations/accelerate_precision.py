"""The precision of the process, for a later :class:`~lightning_mpx.integrations.accelerate.Accelerator` of it.

Accelerate keeps one mixed precision per process, in its shared ``AcceleratorState``: the first ``Accelerator`` sets
it, a later ``Accelerator()`` without ``mixed_precision`` takes it (not ``ACCELERATE_MIXED_PRECISION``), and a later
one that names another is refused. An opt level runs Accelerate with ``"no"``, so Accelerate's state alone says "no
mixed precision": a second ``Accelerator()`` after ``Accelerator(mixed_precision="O2")`` ran in FP32, silently. The
first opt level of the process (since Accelerate's state was last reset) is kept beside Accelerate's own precision, in
that same shared state (the host framework's, emptied by its ``AcceleratorState._reset_state``), with the
:class:`~lightning_mpx.integrations.accelerate_kwargs.MixedPrecisionKwargs` it was built with: a later
``Accelerator()`` takes both (its own ``MixedPrecisionKwargs``, if given, in place of the first's, as each of
Accelerate's Accelerators takes its own handlers), and a later one naming one of Accelerate's own precisions but
``"no"`` is refused with the opt level named, as Accelerate refuses one after ``"bf16"``.
"""

from __future__ import annotations

import dataclasses

from accelerate.state import AcceleratorState  # type: ignore[import-untyped]

from lightning_mpx.integrations.accelerate_kwargs import MixedPrecisionKwargs

_HELD = "_lightning_mpx_opt_level"  # the key in Accelerate's shared state: (opt level, its MixedPrecisionKwargs)
_RESET = "reset Accelerate's state first: AcceleratorState._reset_state(True) (from accelerate.state)."


def held_opt_level() -> tuple[str, MixedPrecisionKwargs] | None:
    """The opt level an earlier :class:`Accelerator` of this process set (the first since Accelerate's state was
    reset) and a copy of the ``MixedPrecisionKwargs`` it was built with, or ``None``."""
    shared = AcceleratorState._shared_state
    held = shared.get(_HELD)
    if held is None or shared.get("_mixed_precision") != "no":  # "no": what the opt level runs Accelerate with
        return None
    return held[0], dataclasses.replace(held[1])


def hold_opt_level(opt_level: str, settings: MixedPrecisionKwargs) -> None:
    """Keep ``opt_level`` and ``settings`` (as the user gave them) as the process's, in Accelerate's shared state,
    unless an earlier opt level is kept there already (the first one is the process's, as Accelerate's own)."""
    AcceleratorState._shared_state.setdefault(_HELD, (opt_level, dataclasses.replace(settings)))


def refuse_native_after_opt_level(mixed_precision: object) -> None:
    """Refuse one of Accelerate's own precisions but ``"no"`` (``mixed_precision``, given) where an opt level is the
    process's: Accelerate would refuse it too, telling the user to "pass mixed_precision='bf16'", the value they passed
    (it holds ``"no"``, which the opt level runs it with)."""
    held = held_opt_level()
    if held is not None and mixed_precision is not None and str(mixed_precision) != "no":
        raise ValueError(
            f"mixed_precision={str(mixed_precision)!r}: an earlier Accelerator of this process runs the opt level "
            f"{held[0]!r}, which runs Accelerate with mixed precision 'no', and Accelerate keeps one mixed precision "
            "for the whole process (its state is shared). Take the opt level (Accelerator() without mixed_precision, "
            f"or mixed_precision={held[0]!r}), or build this one in a fresh process, or {_RESET}"
        )


def refuse_set_precision(opt_level: str) -> None:
    """Refuse ``opt_level`` where an earlier Accelerator of this process set Accelerate's one precision to one of its
    own: Accelerate would refuse the adapter's ``"no"``, telling the user to pass ``mixed_precision='no'``."""
    held = AcceleratorState._shared_state.get("_mixed_precision")
    if held not in (None, "no"):
        raise ValueError(
            f"mixed_precision={opt_level!r}: an earlier Accelerator of this process set Accelerate's mixed precision "
            f"to {str(held)!r}, which Accelerate keeps for the whole process (its state is shared), and an opt level "
            f"runs Accelerate with 'no'. Build the opt level's Accelerator in a fresh process, or {_RESET}"
        )
