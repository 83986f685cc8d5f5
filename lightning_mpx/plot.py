"""Kept import path: the code lives in :mod:`lightning_mpx.health.plot`."""

from lightning_mpx.health.plot import (  # noqa: F401
    SCALE_TAG,
    OVERFLOW_TAG,
    LOSS_TAGS,
    UNDERFLOW_PREFIX,
    ZEROS_PREFIX,
    HEADROOM_PREFIX,
    MODULE_OVERFLOW_PREFIX,
    FIRST_OVERFLOW_PREFIX,
    read_scalars,
    plot_run,
    plot_figure,
)

__all__ = ['SCALE_TAG', 'OVERFLOW_TAG', 'LOSS_TAGS', 'UNDERFLOW_PREFIX', 'ZEROS_PREFIX', 'HEADROOM_PREFIX', 'MODULE_OVERFLOW_PREFIX', 'FIRST_OVERFLOW_PREFIX', 'read_scalars', 'plot_run', 'plot_figure']
