"""Kept import path: the code lives in :mod:`lightning_mpx.casting.table`."""

from lightning_mpx.casting.table import (  # noqa: F401
    CastEntry,
    CastTable,
    dispatchable,
)

__all__ = ['CastEntry', 'CastTable', 'dispatchable']
