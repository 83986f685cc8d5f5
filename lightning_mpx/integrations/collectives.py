"""The collective the front doors give the engine under data parallelism (DDP): the overflow flag's all-reduce."""

from __future__ import annotations

import torch

__all__ = ["all_reduce_max"]


def all_reduce_max(flag: torch.Tensor) -> None:
    """Reduce an optimizer's overflow flag in place across processes (MAX), so that every rank skips together
    (:attr:`Amp.found_inf_reducer <lightning_mpx.engine.amp.Amp>`)."""
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
