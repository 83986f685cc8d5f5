"""The device mesh :func:`~lightning_mpx.integrations.fsdp.shard_model` is given, checked against the world.

``ModelParallelStrategy()`` with its default sizes makes every device tensor-parallel: its ``"data_parallel"`` mesh
has one rank. ``shard_model(model, precision, mesh=self.device_mesh["data_parallel"])`` then shards nothing and
reduces no gradient across the ranks, and each rank trains weights of its own that drift apart silently (Lightning's
own ``"32-true"`` too). :func:`warn_one_rank_mesh` says so, naming the sizes that make the devices data-parallel.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["warn_one_rank_mesh"]


def warn_one_rank_mesh(module: nn.Module, mesh: Any) -> bool:
    """Warn (on rank zero; every rank returns ``True``) when ``mesh`` has one rank while the process group has more
    and ``module`` holds no tensor-parallel (``DTensor``) parameter: FSDP over that mesh neither shards the model nor
    reduces its gradients. ``False`` otherwise (no mesh: FSDP's default, the whole world)."""
    dist = torch.distributed
    if mesh is None or not (dist.is_available() and dist.is_initialized()):
        return False
    world = dist.get_world_size()
    if world <= 1 or mesh.size() != 1 or any(isinstance(p, DTensor) for p in module.parameters()):
        return False
    if dist.get_rank() == 0:
        names = getattr(mesh, "mesh_dim_names", None)
        warnings.warn(
            f"shard_model: mesh={names or mesh!r} has one rank while the process group has {world}: FSDP over it "
            "shards nothing and reduces no gradient across the ranks, so each rank trains weights of its own and "
            "they drift apart. ModelParallelStrategy() with default sizes makes every device tensor-parallel (its "
            "'data_parallel' mesh has one rank); for data parallelism pass ModelParallelStrategy(data_parallel_size="
            f"{world}, tensor_parallel_size=1), or apply tensor parallelism over device_mesh['tensor_parallel'] "
            "before shard_model.",
            UserWarning,
            stacklevel=3,
        )
    return True
