"""Kept import path: the code lives in :mod:`lightning_mpx.masters.weights`."""

from lightning_mpx.masters.weights import (  # noqa: F401
    MasterWeights,
    Mirror,
    WatchedParameter,
    convert_module,
    has_floating_parameters,
)

__all__ = ['has_floating_parameters', 'convert_module', 'MasterWeights', 'Mirror', 'WatchedParameter']
