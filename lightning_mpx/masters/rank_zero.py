"""Rank zero's exact FP32 weights for every rank's O2 masters, when a framework sets a model up under DDP.

Under a ``torch.distributed`` process group the strategy broadcasts rank zero's *half* weights after the model was
converted, so masters taken from each rank's own FP32 values could differ between ranks, and masters taken from the half
weights start 1e-3 (bfloat16's relative rounding) off the FP32 model. :func:`agree_on_rank_zero`, called by the
framework doors (the Lightning plugin's ``convert_module`` under DDP, Fabric's ``setup``, the Accelerate adapter's
``prepare`` and its ``take_over`` of a model prepared before ``free_memory()``) at a point every rank passes together,
makes one FP32 broadcast of rank zero's values with a flag per parameter in the same tensor: every rank's masters then
start from rank zero's exact FP32 values, and its half weights are their rounding (what DDP then broadcasts). A
parameter whose FP32 value rank zero does not hold (a model made half before set-up, ``release_masters`` on rank 0 only
before a second stage) is flagged off on every rank together: its masters start from the half weights everywhere. The
core ``Amp`` makes the broadcast only when asked (``prepare_model(..., rank_zero_fp32=True)``)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from lightning_mpx.common.dtypes import HALF_DTYPES
from lightning_mpx.masters.watch import carried_value

__all__ = ["agree_on_rank_zero", "several_ranks"]


def several_ranks() -> bool:
    """Whether an initialized ``torch.distributed`` default process group holds more than one process."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _agreed_params(module: nn.Module, frozen: bool = False) -> list[nn.Parameter]:
    """The parameters whose FP32 values the ranks agree on: the trainable FP32 and half ones, with ``frozen`` the
    frozen ones too (as DDP, the same list on every rank)."""
    return [
        p for p in module.parameters()
        if (p.requires_grad or frozen) and (p.dtype == torch.float32 or p.dtype in HALF_DTYPES)
    ]  # fmt: skip


def _collective_device() -> torch.device:
    """Where the default group's broadcast runs: the current CUDA device under NCCL, else the CPU."""
    if "nccl" in str(torch.distributed.get_backend()).split(":")[-1] and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _digest(params: list[nn.Parameter]) -> int:
    """A number for the list of shapes (order included), the same on every rank that holds the same list."""
    digest = 0
    for param in params:
        for size in (param.dim(), *param.shape):
            digest = (digest * 1_000_003 + size + 1) % (2**61 - 1)
    return digest


def _same_on_every_rank(module: nn.Module, params: list[nn.Parameter]) -> None:
    """Raise ``ValueError`` on every rank when the ranks' lists of trainable parameters differ (count or shapes): a
    model built differently on one rank, a parameter frozen on one rank only. One small collective; a second, on
    every rank together, only when they differ, to name the first parameter that does."""
    dist = torch.distributed
    mine = torch.tensor([len(params), sum(p.numel() for p in params), _digest(params)], dtype=torch.int64)
    every = [torch.zeros_like(mine, device=_collective_device()) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine.to(_collective_device()))
    if all(torch.equal(other.cpu(), mine) for other in every):
        return
    names = {id(p): name for name, p in module.named_parameters()}
    shapes = [(names.get(id(p), "?"), tuple(p.shape)) for p in params]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, shapes)
    first = ""
    for index in range(max(len(shapes) for shapes in gathered)):
        found = [shapes[index] if index < len(shapes) else None for shapes in gathered]
        if len({value[1] if value else None for value in found}) > 1:  # by shape (names may differ)
            each = ", ".join(f"{value} on rank {rank}" for rank, value in enumerate(found))
            first = f"parameter {index} (name, shape): {each}"
            break
    counts = ", ".join(f"rank {r}: {len(s)}" for r, s in enumerate(gathered))
    raise ValueError(
        f"module={type(module).__name__} differs between the ranks of the process group (trainable parameters: "
        f"{counts}; {first}): DDP trains the same model on every rank. Build it the same way on every rank, with the "
        "same parameters frozen (requires_grad=False), before setting it up."
    )


def agree_on_rank_zero(
    module: nn.Module, fp32_of: Callable[[nn.Parameter], torch.Tensor | None] | None = None, *, frozen: bool = False
) -> dict[int, torch.Tensor]:
    """Broadcast rank zero's FP32 values of ``module``'s trainable parameters (one collective: call it on every rank
    together, with the same model); returns, by ``id`` of the parameter, the FP32 value its master starts from, for
    the parameters rank zero holds one for (an FP32 parameter's own value, or the FP32 value a half parameter's
    engine or deep copy keeps beyond it). On the other ranks those parameters are written with rank zero's value (a
    half one with its rounding), so every rank's model is rank zero's before the strategy wraps it. The others get
    no entry on any rank: their masters start from the half weights the strategy broadcasts.

    ``fp32_of``: rank zero's FP32 value of a parameter (``None``: it holds none) in place of the default (the
    Accelerate adapter's ``take_over``: the previous engine's masters, else the half weights, exactly). ``frozen``:
    the frozen parameters' too (``Amp.prepare_model(keep_frozen_fp32=True)``: a backbone a ``BaseFinetuning`` callback
    unfreezes later starts from rank zero's FP32 values on every rank, not from their half rounding)."""
    dist = torch.distributed
    params = _agreed_params(module, frozen)
    _same_on_every_rank(module, params)  # a clear error on every rank, not a mismatched broadcast (abort or hang)
    if not params:
        return {}
    rank_zero = dist.get_rank() == 0
    own: dict[int, torch.Tensor] = {}
    if rank_zero:
        for param in params:
            if fp32_of is not None:
                value = fp32_of(param)
            else:
                value = param.detach() if param.dtype == torch.float32 else carried_value(param)
            if value is not None and value.shape == param.shape:
                own[id(param)] = value.detach()
    sizes = [param.numel() for param in params]
    total = sum(sizes)
    flat = torch.zeros(total + len(params), dtype=torch.float32, device=_collective_device())
    with torch.no_grad():
        if rank_zero:
            offset = 0
            for index, (param, size) in enumerate(zip(params, sizes)):
                if id(param) in own:
                    flat[offset : offset + size].copy_(own[id(param)].reshape(-1))
                    flat[total + index] = 1.0
                offset += size
        dist.broadcast(flat, src=0)  # the values and their flags in one collective
        flags = flat[total:].tolist()
        agreed: dict[int, torch.Tensor] = {}
        offset = 0
        for param, size, flag in zip(params, sizes, flags):
            start, offset = offset, offset + size
            if not flag:
                continue
            if rank_zero:
                agreed[id(param)] = own[id(param)]
                continue
            value = flat[start:offset].view(param.shape)
            param.detach().copy_(value)  # FP32: rank zero's value; half: its rounding, as DDP broadcasts it
            agreed[id(param)] = param.detach() if param.dtype == torch.float32 else value.to(param.device, copy=True)
    return agreed
