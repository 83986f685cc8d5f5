"""Kept import path: the code lives in :mod:`lightning_mpx.health.forensics`."""

from lightning_mpx.health.forensics import (  # noqa: F401
    Kind,
    Origin,
    OVERFLOW_TAG,
    ROOT_TAG,
    FIRST_TAG,
    CodeRegion,
    OverflowRecord,
    module_of,
    overflow_tag,
    merge_kinds,
    merge_records,
    ForwardWatch,
    OverflowForensics,
)

__all__ = ['Kind', 'Origin', 'OVERFLOW_TAG', 'ROOT_TAG', 'FIRST_TAG', 'CodeRegion', 'OverflowRecord', 'module_of', 'overflow_tag', 'merge_kinds', 'merge_records', 'ForwardWatch', 'OverflowForensics']
