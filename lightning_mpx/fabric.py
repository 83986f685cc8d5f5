"""Kept import path: the code lives in :mod:`lightning_mpx.integrations.fabric`."""

from lightning_mpx.integrations.fabric import (  # noqa: F401
    FabricMixedPrecisionPlugin,
)

__all__ = ['FabricMixedPrecisionPlugin']
