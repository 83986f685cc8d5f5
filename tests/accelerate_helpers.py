"""Set-up shared by the tests that drive Hugging Face Accelerate."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def accelerate_state_reset() -> Iterator[None]:
    """Accelerate's process-wide singleton state, emptied on entry and on exit (also when the block raises)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        yield
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
