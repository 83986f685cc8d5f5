"""Kept import path: the code lives in :mod:`lightning_mpx.casting.policy`."""

from lightning_mpx.casting.policy import (  # noqa: F401
    autocast_differences,
    BannedOpError,
    CastPolicy,
    checkpoint_contexts,
    Fp32State,
    enter_fp32,
    exit_fp32,
    casts_off_if_on,
    fp32_scope,
    disable_casts,
    HandOffHandle,
)

__all__ = ['autocast_differences', 'BannedOpError', 'CastPolicy', 'checkpoint_contexts', 'Fp32State', 'enter_fp32', 'exit_fp32', 'casts_off_if_on', 'fp32_scope', 'disable_casts', 'HandOffHandle']
