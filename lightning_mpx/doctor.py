"""Kept import path: the code lives in :mod:`lightning_mpx.health.doctor`."""

from lightning_mpx.health.doctor import (  # noqa: F401
    CONSTANT_SCALE_SUSPECT,
    HALF_DTYPE_SPLIT,
    HEADROOM_LOW,
    HEADROOM_TARGET,
    MODULE_SHARE,
    OVERFLOW_MOST_STEPS,
    PERSISTENT_MIN_STEPS,
    PROMOTED_PREFIX,
    SKIPPED_TAG,
    SUBNORMAL_SHARE,
    TAIL_FRACTION,
    TAIL_MIN_POINTS,
    UNDERFLOW_HEAVY,
    ZEROS_CHANGES,
    ZEROS_MOVE,
    ZEROS_MOVE_MIN,
    Diagnosis,
    Finding,
    NoMixedPrecisionTagsError,
    Series,
    diagnose,
    diagnose_scalars,
    to_json,
)

__all__ = [
    'SKIPPED_TAG', 'PROMOTED_PREFIX', 'OVERFLOW_MOST_STEPS', 'PERSISTENT_MIN_STEPS', 'MODULE_SHARE', 'UNDERFLOW_HEAVY',
    'ZEROS_MOVE', 'ZEROS_MOVE_MIN', 'ZEROS_CHANGES', 'SUBNORMAL_SHARE', 'HEADROOM_LOW', 'CONSTANT_SCALE_SUSPECT',
    'HEADROOM_TARGET', 'HALF_DTYPE_SPLIT', 'TAIL_FRACTION', 'TAIL_MIN_POINTS', 'Series', 'NoMixedPrecisionTagsError',
    'Finding', 'Diagnosis', 'diagnose', 'diagnose_scalars', 'to_json',
]
