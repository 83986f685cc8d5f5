"""Kept import path: the code lives in :mod:`lightning_mpx.casting.policy`."""

from lightning_mpx.casting.policy import (  # noqa: F401
    BannedOpError,
    CastPolicy,
    Fp32State,
    HandOffHandle,
    autocast_differences,
    casts_off_if_on,
    checkpoint_contexts,
    disable_casts,
    enter_fp32,
    exit_fp32,
    fp32_scope,
)

__all__ = [
    'autocast_differences', 'BannedOpError', 'CastPolicy', 'checkpoint_contexts', 'Fp32State', 'enter_fp32',
    'exit_fp32', 'casts_off_if_on', 'fp32_scope', 'disable_casts', 'HandOffHandle',
]
