"""Overflow steps, told to the user: the throttled log message, the gradients to examine, and the floor hint.

The record of an overflow itself is built by :class:`~lightning_mpx.forensics.OverflowForensics`; what is here is
what :meth:`~lightning_mpx.amp.Amp.step` hands it and how the result is logged.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Mapping, Sequence

import torch

from lightning_mpx._stages import optimizer_params
from lightning_mpx.forensics import OverflowRecord
from lightning_mpx.loss_scaler import LossScaler

log = logging.getLogger("lightning_mpx")

MasterOf = Callable[[torch.Tensor], torch.Tensor]


class OverflowLog:
    """The overflow messages of one engine, at most one per ``interval`` seconds (the ones in between are counted
    and reported with the next).

    Args:
        interval: Minimum seconds between two messages (``overflow_log_interval``).

    Attributes:
        enabled: Whether messages are logged (the adapters turn it off on ranks other than zero).
    """

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.enabled = True
        self._last = -float("inf")
        self._suppressed = 0

    def log(
        self, names: list[str], loss_ids: list[int], scalers: Sequence[LossScaler], record: OverflowRecord | None
    ) -> None:
        """Log one overflow step: the scales of ``loss_ids``, the parameters ``names`` and the ``record``."""
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < self.interval:
            self._suppressed += 1
            return
        suppressed = self._suppressed
        self._last, self._suppressed = now, 0
        scales = ", ".join(f"loss {i}: {scalers[i].get_scale():g}" for i in sorted(loss_ids))
        shown = ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
        log.info(
            "Gradient overflow: step skipped (scale before update %s); non-finite gradients in %s%s%s",
            scales,
            shown or "no parameter (flag set by another process)",
            f"; {record.describe()}" if record is not None else "",
            f"; {suppressed} earlier overflow message(s) suppressed" if suppressed else "",
        )


def named_grads(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], master_of: MasterOf
) -> list[tuple[str, torch.Tensor]]:
    """(name, gradient) of the optimizer's parameters that have one (the master's where the model's is gone)."""
    candidates = []
    for index, param in enumerate(optimizer_params(optimizer)):
        grad = param.grad if param.grad is not None else master_of(param).grad
        if grad is not None:
            candidates.append((names.get(id(param), f"param{index}"), grad))
    return candidates


def floor_hint(optimizer: torch.optim.Optimizer, master_of: MasterOf, opt_level: str) -> str | None:
    """The likely cause of a floor error that is not the loss: an Adam ``eps`` that the half optimizer state
    cannot hold (O3, or any half model without FP32 masters: AdamW's default 1e-8 is 0 in float16)."""
    if "adam" not in type(optimizer).__name__.lower():
        return None
    for group in optimizer.param_groups:
        eps = group.get("eps")
        stepped = [master_of(p) for p in group["params"]]  # at O2 the FP32 masters, not the half model
        half = [p.dtype for p in stepped if p.dtype in (torch.float16, torch.bfloat16)]
        if not half or not isinstance(eps, (int, float)) or isinstance(eps, bool):
            continue
        tiny = torch.finfo(half[0]).tiny  # the smallest normal number
        if eps < tiny:
            shown = "0" if torch.tensor(eps, dtype=half[0]).item() == 0 else "a subnormal"
            return (
                f"The likely cause is {type(optimizer).__name__}'s eps={eps:g}, which is {shown} in {half[0]} "
                f"(smallest normal {tiny:g}): with half parameters and no FP32 master weights (opt_level="
                f"{opt_level!r}) the optimizer state is half too, and the update divides by "
                f"sqrt(v) + eps, where both underflow to 0 for small gradients: the weights become inf/NaN. Use "
                f"opt_level='O2' (FP32 masters and optimizer state), half_dtype='bfloat16', or a larger eps such "
                f"as 1e-4"
            )
    return None
