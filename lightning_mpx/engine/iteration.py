"""The iteration in progress: which optimizers stepped (or skipped) since the last scale update, and with what outcome.

One :class:`Iteration` per :class:`~lightning_mpx.engine.amp.Amp` (``amp.iteration``): :meth:`Amp.step
<lightning_mpx.engine.amp.Amp.step>` records each optimizer's outcome and makes the scale update due, and
:meth:`Amp.update <lightning_mpx.engine.amp.Amp.update>` closes the iteration. The front doors (the Trainer and Fabric
plugins, the Accelerate adapter) read it here rather than keep copies of their own: each decides *when* its
framework's iteration ends (:meth:`Amp.end_iteration <lightning_mpx.engine.amp.Amp.end_iteration>`), the engine alone
records what happened in it.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from lightning_mpx.engine.outcome import StepOutcome


class Iteration:
    """Each optimizer's most recent step outcome, which optimizers stepped in the iteration in progress, whether the
    scale update is due, and how many iterations were closed. Weak references only: the engine keeps no optimizer
    alive that the user let go. An outcome of ``skip_on_device`` (a :class:`~lightning_mpx.engine.outcome.StepOutcome`)
    is kept as it is, and read only when :meth:`skipped` asks.

    Attributes:
        index: The number of :meth:`~lightning_mpx.engine.amp.Amp.update` calls so far (a step skipped on the device
            in an earlier iteration is read at the next backward or step).
        update_pending: Whether a step ran since the last update (an optimizer let go since still leaves it due).
    """

    def __init__(self) -> None:
        self.index = 0
        self.update_pending = False
        # By the optimizer's id, each with a weak reference whose callback removes its entries when it goes: plain
        # dicts and a set, not weakref's containers, whose Python methods a step would call three times.
        self._refs: dict[int, weakref.ref[torch.optim.Optimizer]] = {}
        # The most recent outcome per optimizer, kept across iterations: a door asks after the scale update too.
        self._last: dict[int, bool | StepOutcome] = {}
        self._current: set[int] = set()  # stepped since the update

    def record(self, optimizer: torch.optim.Optimizer, outcome: bool | StepOutcome) -> None:
        """``optimizer`` stepped (or skipped) with ``outcome``, which is not read here: the scale update is due."""
        key = id(optimizer)
        ref = self._refs.get(key)
        if ref is None or ref() is not optimizer:
            self._refs[key] = weakref.ref(optimizer, self._forget(key))
        self._last[key] = outcome
        self._current.add(key)
        self.update_pending = True

    def _forget(self, key: int) -> Callable[[weakref.ref[torch.optim.Optimizer]], None]:
        """The callback of an optimizer's weak reference: its entries go with it (not those of a later one that
        took its id)."""
        refs, last, current = self._refs, self._last, self._current

        def forget(ref: weakref.ref[torch.optim.Optimizer]) -> None:
            if refs.get(key) is ref:
                del refs[key]
                last.pop(key, None)
                current.discard(key)

        return forget

    def _holds(self, optimizer: torch.optim.Optimizer) -> bool:
        ref = self._refs.get(id(optimizer))
        return ref is not None and ref() is optimizer

    def skipped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s most recent step was skipped on overflow (``False`` before its first); asking reads
        a :class:`~lightning_mpx.engine.outcome.StepOutcome` (waiting for the device up to that step)."""
        return self._holds(optimizer) and not self._last.get(id(optimizer), True)

    def stepped(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` stepped (or skipped) since the last scale update."""
        return id(optimizer) in self._current and self._holds(optimizer)

    def close(self) -> None:
        """The scale update ran: the next iteration starts (the most recent outcomes stay)."""
        self.index += 1
        self._current.clear()
        self.update_pending = False
