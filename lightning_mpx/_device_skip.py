"""Steps skipped on the device (``skip_on_device=True``): the overflow flag goes to the optimizer's own step instead of
being read on the host first, and what the step did is read later.

``torch.amp.GradScaler`` hands the flag to optimizers that can skip on the device (``_step_supports_amp_scaling``:
torch's fused implementations) and never reads it on the host. :meth:`Amp.step <lightning_mpx.amp.Amp.step>` does the
same for :data:`DEVICE_SKIP_OPTIMIZERS` with ``fused=True`` and returns a :class:`StepOutcome`; the flags, with the
scales they were computed with, are copied to the host behind the step (a non-blocking copy and an event on CUDA),
and read when the outcome is used as a bool or, at the latest, at the engine's next backward or step
(:class:`PendingSteps`). By then the device has usually passed that point: the read does not wait.

Only Adam and AdamW: torch's fused SGD with momentum leaves its momentum buffers uninitialized (``torch.empty_like``)
when its first step is skipped on the device, so a skipped first step would put garbage into every later one
(torch 2.13, found while building this; ``GradScaler`` with a fused SGD has the same problem).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable

import torch

#: The optimizers whose ``fused=True`` step skips on the device exactly (nothing changes, their step count
#: included; their state is made on the first call, zeros, as the first real step would make it).
DEVICE_SKIP_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)


def device_skip_refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer`` cannot skip its step on the device (``None`` when it can)."""
    kind = type(optimizer)
    if kind not in DEVICE_SKIP_OPTIMIZERS:
        return f"optimizer={kind.__name__} is not one of torch.optim.Adam, torch.optim.AdamW"
    unfused = [i for i, group in enumerate(optimizer.param_groups) if not group.get("fused")]
    if unfused or not getattr(optimizer, "_step_supports_amp_scaling", False):
        return f"optimizer={kind.__name__} is not fused (param group(s) {unfused or 'all'} without fused=True)"
    return None


@dataclass
class PendingStep:
    """One step handed to the device with its flag, until the host reads what it did.

    Attributes:
        optimizer: The optimizer that stepped (weakly: a dropped optimizer's step is still counted).
        loss_ids: The losses whose gradients it held.
        values: Their flags (1.0: overflow) and then their scales at the step, FP32, on the host once ``ready``.
        ready: The CUDA event after the copy of ``values`` to the host (``None``: ``values`` is read as it is).
        step: The engine's step index (``OverflowRecord.step``).
        iteration: The engine's iteration (its ``update()`` calls so far) when it stepped.
        gather: Whether every rank reads it at the same call (the flags were reduced across ranks), so that the
            overflow records are merged.
        outcome: The :class:`StepOutcome` handed to the caller.
    """

    optimizer: weakref.ref[torch.optim.Optimizer]
    loss_ids: list[int]
    values: torch.Tensor
    ready: torch.cuda.Event | None
    step: int
    iteration: int
    gather: bool
    outcome: StepOutcome

    @classmethod
    def behind(
        cls,
        optimizer: torch.optim.Optimizer,
        loss_ids: list[int],
        flags: torch.Tensor,
        scales: list[torch.Tensor],
        *,
        step: int,
        iteration: int,
        gather: bool,
        outcome: StepOutcome,
    ) -> PendingStep:
        """The pending step of ``flags`` (one per loss) and the loss ``scales`` now, copied to the host behind the
        work queued so far (one kernel and one copy on CUDA; no wait)."""
        if flags.dim() == 0:  # one loss: its flag and its scale, one kernel
            values = torch.stack([flags, scales[0]])
        else:
            values = torch.cat([flags.reshape(-1), torch.stack(scales)])
        ready = None
        if values.device.type == "cuda":
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host.copy_(values, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
            values = host
        return cls(weakref.ref(optimizer), loss_ids, values, ready, step, iteration, gather, outcome)

    def read(self) -> tuple[list[int], dict[int, float]]:
        """The losses that overflowed and every loss's scale at the step (waits for the copy, not for later work)."""
        if self.ready is not None:
            self.ready.synchronize()
        values = self.values.tolist()
        count = len(self.loss_ids)
        flags, scales = values[:count], values[count:]
        return [i for i, flag in zip(self.loss_ids, flags) if flag > 0], dict(zip(self.loss_ids, scales))


class StepOutcome:
    """Whether a step that skipped on the device stepped: ``bool(outcome)`` (``if amp.step(optimizer): ...``) reads
    it, waiting for the device only if it has not reached the step yet; reading it also reads every earlier pending
    step of the engine, in order, which is when their overflows are counted, logged and raise (``on_floor``).

    Compares equal to the ``bool`` it reads as.
    """

    __slots__ = ("_read", "_stepped", "__weakref__")

    def __init__(self, read: Callable[[], None]) -> None:
        self._read = read
        self._stepped: bool | None = None

    @property
    def known(self) -> bool:
        """Whether the outcome has been read (reading :attr:`stepped` then does not touch the device)."""
        return self._stepped is not None

    @property
    def stepped(self) -> bool:
        """Whether the optimizer stepped (``False``: its gradients overflowed and nothing changed)."""
        if self._stepped is None:
            self._read()  # an earlier step's error (on_floor="raise") propagates; this one stays pending
        assert self._stepped is not None
        return self._stepped

    def __bool__(self) -> bool:
        return self.stepped

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (bool, StepOutcome)):
            return self.stepped == bool(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  (equal to a bool, so not hashable as one)

    def __repr__(self) -> str:
        return f"StepOutcome(stepped={self._stepped})" if self.known else "StepOutcome(not read yet)"


class PendingSteps:
    """The steps of one engine handed to the device and not read yet, oldest first.

    Args:
        settle: Called with each pending step and what it read (the overflowed losses, the scales at the step), in
            order: the engine counts, records and logs an overflow there and applies ``on_floor`` (which may raise).
    """

    def __init__(self, settle: Callable[[PendingStep, list[int], dict[int, float]], None]) -> None:
        self._settle = settle
        self._steps: list[PendingStep] = []

    def __len__(self) -> int:
        return len(self._steps)

    def add(self, step: PendingStep) -> None:
        self._steps.append(step)

    def read(self, before: int | None = None) -> None:
        """Read every pending step, oldest first; ``before``: only those of iterations before it (the steps of the
        iteration under way are left to a later read, so that a second optimizer's backward does not wait for the
        first one's step). An error from one (``on_floor="raise"``) leaves the later ones pending for the next
        read."""
        while self._steps and (before is None or self._steps[0].iteration < before):
            step = self._steps.pop(0)
            overflowed, scales = step.read()
            step.outcome._stepped = not overflowed
            self._settle(step, overflowed, scales)
