"""Kept import path: the code lives in :mod:`lightning_mpx.integrations.accelerate`."""

from lightning_mpx.integrations.accelerate import (  # noqa: F401
    AMP_STATE_NAME,
    NATIVE_MIXED_PRECISION,
    Accelerator,
    MixedPrecisionKwargs,
)

__all__ = ['AMP_STATE_NAME', 'NATIVE_MIXED_PRECISION', 'Accelerator', 'MixedPrecisionKwargs']
