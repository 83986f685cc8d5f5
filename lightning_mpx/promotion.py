"""Kept import path: the code lives in :mod:`lightning_mpx.health.promotion`."""

from lightning_mpx.health.promotion import (  # noqa: F401
    FLOOR_OVERFLOWS_TO_PROMOTE,
    Promotion,
    check_patterns,
    matches,
)

__all__ = ['FLOOR_OVERFLOWS_TO_PROMOTE', 'check_patterns', 'matches', 'Promotion']
