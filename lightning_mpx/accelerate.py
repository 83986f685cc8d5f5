"""Kept import path: the code lives in :mod:`lightning_mpx.integrations.accelerate` (and, for ``transformers.Trainer``,
:mod:`lightning_mpx.integrations.hf_trainer`)."""

from lightning_mpx.integrations.accelerate import (  # noqa: F401
    AMP_STATE_NAME,
    NATIVE_MIXED_PRECISION,
    Accelerator,
    MixedPrecisionKwargs,
)
from lightning_mpx.integrations.hf_trainer import MpxTrainerMixin, mpx_trainer  # noqa: F401

__all__ = ['AMP_STATE_NAME', 'NATIVE_MIXED_PRECISION', 'Accelerator', 'MixedPrecisionKwargs', 'MpxTrainerMixin',
           'mpx_trainer']
