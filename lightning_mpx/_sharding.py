"""Whether FSDP shards a model (a stand-in for the lead's ``_sharding.py``: on a merge, take main's version)."""

from __future__ import annotations

from torch import nn

__all__ = ["is_sharded"]


def is_sharded(module: nn.Module) -> bool:
    """Whether FSDP (FSDP2's ``fully_shard`` or FSDP1's ``FullyShardedDataParallel``) shards ``module`` or one of its
    submodules."""
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # torch without distributed support
        return False
    return any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in module.modules())
