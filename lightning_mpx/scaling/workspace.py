"""The fused unscale backend's state kept across steps, in a module of its own so that
:mod:`lightning_mpx.scaling.unscale` and the Triton kernels (:mod:`lightning_mpx.scaling.triton_unscale`) both import it
and neither imports the other back."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class UnscaleWorkspace:
    """The fused backend's state across steps: chunk tables and scratch buffers, owned by the caller.

    Building a table (one row per chunk of every tensor) costs host time and a host-to-device copy, so the
    ``"triton"`` backend keeps it here and reuses it for as long as the tensors keep their element counts, dtypes,
    devices and layouts (strides where not contiguous) and the list its length: a resized, re-cast or moved
    parameter or a different parameter list gets a new table. Addresses are not in the table: each tensor's base
    address sits in a small array beside it, uploaded again (one pinned copy of 16 bytes per tensor) only when an
    address changed, which ``zero_grad(set_to_none=True)`` causes whenever the allocator hands the gradients other
    blocks. The checks that decide whether the kernels can take the tensors at all are made when a table is built
    and kept with it (a "not supported" verdict too), so a call that finds its table does no per-tensor Python work
    beyond building the key and comparing the addresses. The last ``max_plans`` tables are kept (a call with
    gradients only and one with FP32 master gradients each need their own). :class:`~lightning_mpx.engine.amp.Amp` keeps
    one per optimizer, and each :class:`~lightning_mpx.masters.weights.MasterWeights` one for its copy to the model.
    Other backends ignore it.

    Args:
        chunk_size: Elements per chunk (one program each); a power of two, a multiple of ``block_size``.
        block_size: Elements a program handles per loop step; a power of two.
        num_warps: Warps per program on the GPU.
        max_plans: How many tables to keep.

    Attributes:
        builds: How many tables this workspace has built (a step that reuses one adds nothing).

    .. warning:: A workspace's scratch buffers are reused by every call: use one workspace per CUDA stream, and do
       not share one between threads.
    """

    def __init__(self, *, chunk_size: int = 16384, block_size: int = 1024, num_warps: int = 4, max_plans: int = 4):
        for name, value in (("chunk_size", chunk_size), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"{name}={value!r} must be a positive power of two.")
        if chunk_size < block_size:
            raise ValueError(f"chunk_size={chunk_size} must be at least block_size={block_size}.")
        if isinstance(num_warps, bool) or num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"num_warps={num_warps!r} is not valid; valid choices: 1, 2, 4, 8, 16, 32.")
        if isinstance(max_plans, bool) or not isinstance(max_plans, int) or max_plans < 1:
            raise ValueError(f"max_plans={max_plans!r} must be a positive integer.")
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.num_warps = num_warps
        self.max_plans = max_plans
        self.builds = 0
        self._plans: OrderedDict[Any, Any] = OrderedDict()

    def clear(self) -> None:
        """Drop every cached table (they are rebuilt on the next call)."""
        self._plans.clear()

    def __repr__(self) -> str:
        return (
            f"UnscaleWorkspace(chunk_size={self.chunk_size}, block_size={self.block_size}, "
            f"num_warps={self.num_warps}, tables={len(self._plans)}, builds={self.builds})"
        )
