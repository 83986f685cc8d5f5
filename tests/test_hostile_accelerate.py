"""The Accelerate adapter driven the way Accelerate scripts (Hugging Face's ``no_trainer`` examples) drive
``accelerate.Accelerator``, each habit checked against a reference: Accelerate's own ``mixed_precision="no"`` on
the same script (to the half dtype's tolerance), or the same run without the interruption (bit for bit).

Habits covered: ``prepare`` in any order with several models, optimizers and schedulers; ``accumulate`` with an
overflow in a micro-batch that does not synchronise; ``save_state``/``load_state`` into a fresh Accelerator, before the
first step and mid-run; ``free_memory()`` and the model prepared again (a retried training function); schedulers
made before or after ``prepare``; ``unscale_gradients`` then torch's own clip; Hugging Face models built from configs
(GPT-2 with tied embeddings and gradient checkpointing, BERT), peft LoRA, torch's fused AdamW; two gloo processes
(``tests/hostile_accelerate_two_process.py``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("accelerate")

from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs  # noqa: E402
from tests.accelerate_helpers import reset_accelerate_state  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

ROOT = Path(__file__).resolve().parents[1]


def _accelerator(level, half="float16", **kwargs):
    reset_accelerate_state()  # a fresh Accelerator, as in a new process
    handlers = [MixedPrecisionKwargs(half_dtype=half, init_scale=2.0**8)] if level.startswith("O") else None
    return Accelerator(mixed_precision=level, kwargs_handlers=handlers, **kwargs)


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _batch(step, inf=False):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
    if inf:
        x[0, 0] = float("inf")
    return x, y


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _weights(accelerator, model, opt):
    """The weights training produced: the FP32 masters at O2, the parameters otherwise."""
    return [p.detach().clone() for p in accelerator.amp.master_params(opt.optimizer)]


# -- free_memory(), then the same model prepared again ------------------------------------------------------------------
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("again", ["raw", "prepared"])
def test_model_prepared_again_after_free_memory_goes_on_as_the_straight_run(level, again):
    """A retried training function (``find_executable_batch_size``) calls ``free_memory()`` and prepares the model it
    still holds with a new optimizer. At O2 this was refused with "prepared before its model" (the fresh engine did
    not know the converted model); now the new engine takes it over with the old FP32 masters, exactly: with SGD (no
    state to lose) the run is the straight run's, bit for bit."""

    def train(accelerator, model, opt, steps):
        for step in steps:
            x, y = _batch(step)
            accelerator.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()

    straight = _accelerator(level, "bfloat16")
    model = _net()
    model, opt = straight.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    train(straight, model, opt, range(4))
    expected = _weights(straight, model, opt)

    accelerator = _accelerator(level, "bfloat16")
    raw = _net()
    model, opt = accelerator.prepare(raw, torch.optim.SGD(raw.parameters(), lr=0.5))
    train(accelerator, model, opt, range(2))
    accelerator.free_memory()
    again = raw if again == "raw" else model
    model, opt = accelerator.prepare(again, torch.optim.SGD(again.parameters(), lr=0.5))
    assert not any(p.grad is not None for p in model.parameters())
    train(accelerator, model, opt, range(2, 4))
    assert _same(_weights(accelerator, model, opt), expected)
    # The model now runs with the new engine's forward: the old engine is no longer referenced by it.
    assert accelerator.unwrap_model(model).forward._amp is accelerator.amp
