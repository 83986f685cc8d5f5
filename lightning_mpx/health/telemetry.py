"""Underflow and headroom telemetry: how much of the half dtype's range the scaled gradients use, per module.

On request (a logging step), the unscale pass that runs anyway measures every scaled gradient (the value before the
multiply by ``1 / scale``, whatever its storage dtype: FP32 at O1, half at O2) against the half dtype's limits:

* ``mpx/underflow/<group>``: the fraction, in [0, 1], of the group's gradient elements that are not zero but whose
  magnitude is below ``torch.finfo(half_dtype).tiny``, the smallest normal number: values that the half backward
  holds as subnormals (with fewer significant bits), the next to be flushed to zero;
* ``mpx/zeros/<group>``: the fraction of the group's gradient elements that are exactly zero. Most zeros are
  structural (rows of an embedding absent from the batch, units a ReLU switched off, masked positions: zero at any
  scale), but a value the half backward flushed to zero is a zero too. One measurement cannot tell them apart; a run
  can: structural zeros do not move when the scale changes, flushed ones fall as it grows (``lightning-mpx doctor``
  reads them so);
* ``mpx/headroom_doublings/<group>``: ``log2(torch.finfo(half_dtype).max / the largest gradient magnitude)``, how many
  more times the scale could double before this group overflows: ``k`` means the largest gradient is ``2**-k`` of the
  half maximum, 0 or less (``-inf``) an overflow, ``inf`` a group without a non-zero gradient. In powers of two, so
  that it stays in range in float32 (TensorBoard's) for bfloat16 too, whose maximum (3.4e38) made the ratio of small
  gradients (below about 5e-7) read 0; it replaced ``mpx/headroom/<group>`` (that ratio).

``<group>`` is the top-level module of the parameter (see :func:`module_groups`). The values are device tensors:
building them never waits for the device. Without a request nothing is measured and nothing is launched.

:class:`GradTelemetry` holds the request and the latest results; :class:`~lightning_mpx.engine.amp.Amp` owns one
(``Amp.request_telemetry()``, ``Amp.metrics()``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch

from lightning_mpx.engine.sharding import local_tensor
from lightning_mpx.health.tags import WRAPPER_SEGMENTS
from lightning_mpx.scaling.unscale import GradStats

__all__ = ["GradTelemetry", "module_groups"]


def module_groups(names: Sequence[str], all_names: Iterable[str] | None = None) -> list[str]:
    """The group of each parameter name: its top-level module.

    The group is the first component of the name (``"encoder"`` for ``"encoder.layers.0.weight"``), or the one below
    the lone wrappers when every parameter of the model sits under one (``"model.encoder"`` for a LightningModule
    whose ``self.model`` holds everything, ``"net.base_model.model.transformer.h"`` for a tied GPT-2 wrapped by peft
    in ``self.net``): one group for the whole model would say nothing. A parameter of the root module itself
    (``"scale"``) is its own group. The segments ``torch.compile``, FSDP1 and activation checkpointing insert are left
    out. A ``module`` that holds every parameter is a user's own child (``"module.encoder"``), kept: the engine gives
    the names of a model prepared inside ``nn.DataParallel`` or DDP without the wrapper's ``module``
    (:class:`~lightning_mpx.health.tags.UserNames`, told by the wrapper's type), so that a run with the wrapper and its
    resume without it log the same tags.

    Args:
        names: The parameter names to group.
        all_names: Every parameter name of the model(s), to decide whether there is a lone wrapper (default:
            ``names``).

    Raises:
        TypeError: for ``names`` or ``all_names`` given as one string.
    """
    for name, value in (("names", names), ("all_names", all_names)):
        if isinstance(value, str):  # a string is a sequence of its characters: each would be a parameter name
            raise TypeError(f"{name}={value!r} must be a list of parameter names, not a string; did you mean "
                            f"{name}=[{value!r}]?")
    every = [_parts(name) for name in (names if all_names is None else all_names)]
    depth = 1
    # Down a chain of lone wrappers (a peft model in a LightningModule: "net.base_model.model.transformer"), as long
    # as every name shares the first ``depth`` components and the groups one deeper are still modules.
    while len({tuple(parts[:depth]) for parts in every}) == 1 and all(len(p) > depth + (depth > 1) for p in every):
        depth += 1
    return [".".join(_parts(name)[:depth]) for name in names]


def _parts(name: str) -> list[str]:
    """The components of a parameter name as the user wrote the model: without the segments ``torch.compile``, FSDP1
    and activation checkpointing insert (a compiled run and its uncompiled resume log the same tags), an FSDP1 flat
    parameter's ``[flat: 0.weight, ...]`` one component (its dots are not modules')."""
    head, bracket, flat = name.partition("[")
    parts = [part for part in head.split(".") if part and part not in WRAPPER_SEGMENTS]
    return parts + [bracket + flat] if bracket else parts


@dataclass
class _Result:
    groups: list[str]
    underflow: torch.Tensor  # int64 [groups]: elements below tiny (zeros included)
    zeros: torch.Tensor  # int64 [groups]: elements exactly zero
    numel: list[int]  # elements per group
    peak: torch.Tensor  # FP32 [groups]: largest magnitude
    measurement: int  # its number in the count of measurements (a reader reports those after its previous read)


class GradTelemetry:
    """The request flag and the latest per-group results of underflow and headroom telemetry.

    Args:
        half_dtype: The half dtype whose limits the scaled gradients are measured against.
        user_names: The user's name of a parameter as the prepared models name it (the engine's
            :class:`~lightning_mpx.health.tags.UserNames`: without a data-parallel wrapper's ``module``); default:
            the name itself.

    Attributes:
        requested: Whether the unscales until the next ``Amp.update()`` measure the gradients.
        measurements: How many unscales have measured gradients (one per optimizer and logging step).
    """

    def __init__(self, half_dtype: torch.dtype, user_names: Callable[[str], str] | None = None) -> None:
        self.user_names = user_names
        info = torch.finfo(half_dtype)
        self.tiny = float(info.tiny)
        self.max = float(info.max)
        self.requested = False
        self.measurements = 0
        self._results: dict[int, _Result] = {}

    def stats(self) -> GradStats:
        """An empty :class:`~lightning_mpx.scaling.unscale.GradStats` for one unscale call."""
        return GradStats(self.tiny)

    def record(
        self,
        key: int,
        sources: Sequence[torch.Tensor],
        params: Iterable[torch.Tensor],
        names: Mapping[int, str],
        stats: GradStats,
    ) -> None:
        """Reduce one unscale's per-tensor statistics to its groups and keep them (the latest per ``key``).

        Args:
            key: The optimizer's key; a later record for the same key replaces this one.
            sources: The scaled gradients the unscale read, in the order of ``stats``.
            params: The optimizer's parameters (their ``.grad`` are the ``sources``).
            names: Parameter names by ``id(param)`` (every prepared model's).
            stats: What the unscale measured.
        """
        assert stats.underflow is not None and stats.zeros is not None and stats.peak is not None
        owner = {id(p.grad): p for p in params if p.grad is not None}
        tensor_names = []
        for index, grad in enumerate(sources):
            param = owner.get(id(grad))
            tensor_names.append(names.get(id(param), f"param{index}") if param is not None else f"param{index}")
        every = names.values() if names else None
        if self.user_names is not None:
            tensor_names = [self.user_names(name) for name in tensor_names]
            every = [self.user_names(name) for name in every] if every is not None else None
        groups = module_groups(tensor_names, every)
        order = list(dict.fromkeys(groups))
        position = {group: i for i, group in enumerate(order)}
        device = stats.underflow.device
        index = torch.tensor([position[g] for g in groups], dtype=torch.int64).to(device, non_blocking=True)
        numel = [0] * len(order)
        for group, grad in zip(groups, sources):
            # a rank's shard under FSDP; a complex gradient is measured as its real and imaginary parts
            numel[position[group]] += local_tensor(grad).numel() * (1 + grad.is_complex())
        underflow = torch.zeros(len(order), dtype=torch.int64, device=device).index_add_(0, index, stats.underflow)
        zeros = torch.zeros(len(order), dtype=torch.int64, device=device).index_add_(0, index, stats.zeros)
        peak = torch.zeros(len(order), dtype=torch.float32, device=device).scatter_reduce_(
            0, index, stats.peak, "amax"
        )
        self.measurements += 1
        self._results[key] = _Result(order, underflow, zeros, numel, peak, self.measurements)

    def metrics(self, since: int = 0) -> dict[str, torch.Tensor]:
        """``mpx/underflow/<group>``, ``mpx/zeros/<group>`` and ``mpx/headroom_doublings/<group>`` from the latest
        results of every optimizer measured after the first ``since`` :attr:`measurements` (merged by group), as 0-d
        device tensors; empty when there are none. Nothing is cleared: each reader passes the count of its previous
        read."""
        results = [result for result in self._results.values() if result.measurement > since]
        if not results:
            return {}
        order = list(dict.fromkeys(group for result in results for group in result.groups))
        if len(results) == 1:
            underflow, zeros = results[0].underflow, results[0].zeros
            peak, numel = results[0].peak, results[0].numel
        else:
            position = {group: i for i, group in enumerate(order)}
            device = results[0].underflow.device
            index = torch.tensor(
                [position[g] for result in results for g in result.groups], dtype=torch.int64
            ).to(device, non_blocking=True)
            underflow = torch.zeros(len(order), dtype=torch.int64, device=device).index_add_(
                0, index, torch.cat([result.underflow.to(device) for result in results])
            )
            zeros = torch.zeros(len(order), dtype=torch.int64, device=device).index_add_(
                0, index, torch.cat([result.zeros.to(device) for result in results])
            )
            peak = torch.zeros(len(order), dtype=torch.float32, device=device).scatter_reduce_(
                0, index, torch.cat([result.peak.to(device) for result in results]), "amax"
            )
            numel = [0] * len(order)
            for result in results:
                for group, count in zip(result.groups, result.numel):
                    numel[position[group]] += count
        totals = torch.tensor([max(n, 1) for n in numel], dtype=torch.float64).to(underflow.device, non_blocking=True)
        # Both fractions from one [2, groups] division; the metrics are views of it (device tensors: no sync).
        fractions = (torch.stack([underflow - zeros, zeros]).double() / totals).float()
        # log2(max) - log2(peak) in float32: in range for any peak (max / peak overflows below ~1 under bfloat16).
        headroom = math.log2(self.max) - torch.log2(peak)
        out: dict[str, torch.Tensor] = {}
        for group, f, z, h in zip(order, fractions[0].unbind(0), fractions[1].unbind(0), headroom.unbind(0)):
            out[f"mpx/underflow/{group}"] = f
            out[f"mpx/zeros/{group}"] = z
            out[f"mpx/headroom_doublings/{group}"] = h
        return out
