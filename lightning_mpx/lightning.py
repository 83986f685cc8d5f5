"""Kept import path: the code lives in :mod:`lightning_mpx.integrations.lightning`."""

from lightning_mpx.integrations.lightning import (  # noqa: F401
    MixedPrecisionPlugin,
)

__all__ = ['MixedPrecisionPlugin']
