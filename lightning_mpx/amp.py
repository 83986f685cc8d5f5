"""Kept import path: the code lives in :mod:`lightning_mpx.engine.amp`."""

from lightning_mpx.engine.amp import (  # noqa: F401
    Amp,
)

__all__ = ['Amp']
