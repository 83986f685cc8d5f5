"""Kept import path: the code lives in :mod:`lightning_mpx.scaling.unscale`."""

from lightning_mpx.scaling.unscale import (  # noqa: F401
    BACKENDS,
    GradStats,
    Tensors,
    auto_backend,
    cast_copy_,
    clip_coefficient,
    foreach_check_and_unscale_,
    plain_unscale_,
    resolve_backend,
    unscale_grads_,
)

__all__ = [
    'Tensors', 'GradStats', 'unscale_grads_', 'resolve_backend', 'auto_backend', 'cast_copy_',
    'foreach_check_and_unscale_', 'plain_unscale_', 'clip_coefficient', 'BACKENDS',
]
