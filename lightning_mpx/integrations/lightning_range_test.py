"""Lightning's learning-rate range test (``Tuner.lr_find``) under the Trainer plugin.

The range test raises the learning rate until the loss diverges, on purpose, and then restores the run from the
checkpoint it saved first. An overflow there is the divergence it looks for, not a run to stop: with bfloat16's
static scale every overflow is at the floor, and ``on_floor="raise"`` would end the tuner (and ``"promote"`` would
change the model for the fit after it). :class:`RangeTest` lets overflows at the floor skip the step and nothing more
while the test runs, and gives the scalers their own ``on_floor`` back when the tuner restores its checkpoint.
"""

from __future__ import annotations

import itertools
from typing import Any

from lightning_mpx.common.imports import require
from lightning_mpx.engine.amp import Amp
from lightning_mpx.settings import OnFloor

require("lightning.pytorch", extra="lightning", feature="lightning_mpx.MixedPrecisionPlugin")

# The callback of Lightning's learning-rate range test (Tuner.lr_find), private to Lightning: the tuner replaces the
# Trainer's callbacks with it while the test runs.
try:
    from lightning.pytorch.tuner.lr_finder import _LRCallback
except ImportError:  # a release that names it otherwise: the range test is not recognised
    _LRCallback = None  # type: ignore[assignment,misc]

__all__ = ["RangeTest"]


class RangeTest:
    """The scalers' own ``on_floor`` while a range test runs with ``"continue"`` in its place."""

    def __init__(self) -> None:
        self._floors: list[OnFloor] | None = None

    def enter(self, amp: Amp, trainer: Any) -> None:
        """If ``trainer`` runs a range test (and it was not entered yet), make overflows at the floor skip the step
        and nothing more."""
        if self._floors is not None or _LRCallback is None:
            return
        # Asked at every step: isinstance over the callbacks in C (map), no call per callback.
        if not any(map(isinstance, trainer.callbacks, itertools.repeat(_LRCallback))):
            return
        self._floors = [scaler.on_floor for scaler in amp.scalers]
        for scaler in amp.scalers:
            scaler.on_floor = "continue"

    def leave(self, amp: Amp) -> None:
        """After a range test: its pending steps read under its policy, then the scalers' own ``on_floor`` back."""
        if self._floors is None:
            return
        try:
            # The range test's last steps (skip_on_device) are settled under its policy: every rank is here (the
            # tuner's restore, or teardown), so their records can be merged.
            amp.settle_step_outcomes()
        finally:
            for scaler, on_floor in zip(amp.scalers, self._floors):
                scaler.on_floor = on_floor
            self._floors = None
