"""Kept import path: the code lives in :mod:`lightning_mpx.health.plot`."""

from lightning_mpx.health.plot import (  # noqa: F401
    FIRST_OVERFLOW_PREFIX,
    HEADROOM_DOUBLINGS_PREFIX,
    HEADROOM_PREFIX,
    LOSS_TAGS,
    MODULE_OVERFLOW_PREFIX,
    OVERFLOW_TAG,
    SCALE_TAG,
    UNDERFLOW_PREFIX,
    ZEROS_PREFIX,
    headroom_ratios,
    plot_figure,
    plot_run,
    read_scalars,
)

__all__ = [
    'SCALE_TAG', 'OVERFLOW_TAG', 'LOSS_TAGS', 'UNDERFLOW_PREFIX', 'ZEROS_PREFIX', 'HEADROOM_PREFIX',
    'HEADROOM_DOUBLINGS_PREFIX', 'headroom_ratios',
    'MODULE_OVERFLOW_PREFIX', 'FIRST_OVERFLOW_PREFIX', 'read_scalars', 'plot_run', 'plot_figure',
]
