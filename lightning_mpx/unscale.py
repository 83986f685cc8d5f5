"""Kept import path: the code lives in :mod:`lightning_mpx.scaling.unscale`."""

from lightning_mpx.scaling.unscale import (  # noqa: F401
    BACKENDS,
    GradStats,
    Tensors,
    UnscaleWorkspace,
    auto_backend,
    cast_copy_,
    clip_coefficient,
    foreach_check_and_unscale_,
    has_complex,
    plain_unscale_,
    real_pairs,
    real_views,
    resolve_backend,
    unscale_grads_,
    unscale_real_grads_,
)

__all__ = [
    'Tensors', 'GradStats', 'UnscaleWorkspace', 'unscale_grads_', 'resolve_backend', 'auto_backend', 'cast_copy_',
    'foreach_check_and_unscale_', 'plain_unscale_', 'clip_coefficient', 'BACKENDS',
    'has_complex', 'real_views', 'real_pairs', 'unscale_real_grads_',
]
