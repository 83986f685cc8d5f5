"""Whether the Trainer is inside a manual-optimization training step, for the Trainer plugin.

In manual optimization (``self.automatic_optimization = False``) one training step may step several optimizers
(a GAN's generator and discriminator, a critic stepped five times), and the plugin ends the iteration, the one scale
update, when the next training step starts. A read made while the step runs (``plugin.metrics()`` in the step, often
under ``if trainer.is_global_zero:``, or ``trainer.save_checkpoint`` between two optimizers' steps) must not end it
early: that would update the scale twice in one iteration, and under DDP on one rank only, whose scale would then
differ from the other ranks' for the gradients they average.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Iterator

__all__ = ["ManualStep"]


class ManualStep:
    """Tracks whether a manual-optimization training step runs (:attr:`running`), through the training step's
    context (:meth:`scope`)."""

    def __init__(self) -> None:
        self.running = False

    @contextlib.contextmanager
    def scope(self, inner: ContextManager[Any]) -> Iterator[Any]:
        """``inner`` (the training step's context of a module that optimizes manually), which also marks the step as
        running. An automatic step needs none (its iteration ends inside the step, at its one optimizer step): the
        plugin returns its ``inner`` itself, without the call of this generator context."""
        self.running = True
        try:
            with inner as value:
                yield value
        finally:
            self.running = False
