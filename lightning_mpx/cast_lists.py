"""Kept import path: the code lives in :mod:`lightning_mpx.casting.lists`."""

from lightning_mpx.casting.lists import (  # noqa: F401
)

__all__ = []
