"""Kept import path: the code lives in :mod:`lightning_mpx.scaling.scaler`."""

from lightning_mpx.scaling.scaler import (  # noqa: F401
    LossScaleFloorError,
    LossScaler,
)

__all__ = ['LossScaleFloorError', 'LossScaler']
