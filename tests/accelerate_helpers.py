"""Set-up shared by the tests that drive Hugging Face Accelerate."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def reset_accelerate_state() -> None:
    """Empty Accelerate's process-wide singleton state (the next ``Accelerator`` starts from none)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@contextlib.contextmanager
def accelerate_state_reset() -> Iterator[None]:
    """Accelerate's singleton state, emptied on entry and on exit (also when the block raises)."""
    reset_accelerate_state()
    try:
        yield
    finally:
        reset_accelerate_state()


def prepared_gan(accelerator: Any) -> tuple[Any, Any, Any, Any]:
    """``(generator, discriminator, opt_g, opt_d)``: a small GAN (noise of 4, samples of 8) and an Adam optimizer for
    each half (lr 1e-3), seeded and prepared by ``accelerator``."""
    torch.manual_seed(0)
    gen, disc = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8)), nn.Sequential(nn.Linear(8, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    return accelerator.prepare(gen, disc, opt_g, opt_d)
