"""Kept import path: the code lives in :mod:`lightning_mpx.health.forensics`."""

from lightning_mpx.health.forensics import (  # noqa: F401
    FIRST_TAG,
    OVERFLOW_TAG,
    ROOT_TAG,
    CodeRegion,
    ForwardWatch,
    Kind,
    Origin,
    OverflowForensics,
    OverflowRecord,
    merge_kinds,
    merge_records,
    module_of,
    overflow_tag,
)

__all__ = [
    'Kind', 'Origin', 'OVERFLOW_TAG', 'ROOT_TAG', 'FIRST_TAG', 'CodeRegion', 'OverflowRecord', 'module_of',
    'overflow_tag', 'merge_kinds', 'merge_records', 'ForwardWatch', 'OverflowForensics',
]
