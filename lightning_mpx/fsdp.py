"""Kept import path: the code lives in :mod:`lightning_mpx.integrations.fsdp`."""

from lightning_mpx.integrations.fsdp import (  # noqa: F401
    GATHER_CHOICES,
    ROLE_CHOICES,
    check_sharded_model,
    fsdp1_mixed_precision,
    mixed_precision_policy,
    reshard_gathered,
    resolve_settings,
    shard_model,
)

__all__ = [
    'GATHER_CHOICES', 'ROLE_CHOICES', 'check_sharded_model', 'fsdp1_mixed_precision', 'mixed_precision_policy',
    'reshard_gathered', 'resolve_settings', 'shard_model',
]
