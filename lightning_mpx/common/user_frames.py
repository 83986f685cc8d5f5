"""Where a one-time warning of the library points: the user's line, not a line inside the library or the framework
that called it (the user's ``trainer.fit(model)``, ``fabric.backward(loss)``, ``optimizer.step()``)."""

from __future__ import annotations

import sys

__all__ = ["LIBRARIES", "user_stacklevel"]

# The packages whose frames a warning skips to point at the user's line (a Trainer's: the ``trainer.fit`` call;
# contextlib's: the exit of Apex's ``with amp.scale_loss(...)``, a generator context manager).
LIBRARIES = frozenset(
    {"lightning_mpx", "torch", "lightning", "pytorch_lightning", "accelerate", "transformers", "peft", "contextlib"}
)


def user_stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by this function's caller that points at the first frame
    outside :data:`LIBRARIES`: filters by module then match the user's code, and the warning is not deduplicated by a
    line inside the library."""
    frame, level = sys._getframe(2), 2  # the caller's caller (stacklevel 2)
    while frame.f_back is not None and frame.f_globals.get("__name__", "").split(".")[0] in LIBRARIES:
        frame, level = frame.f_back, level + 1
    return level
