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
@pytest.mark.parametrize("level,again", [("O1", "raw"), ("O2", "raw"), ("O2", "prepared"), ("O3", "prepared")])
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


def test_unpickled_accelerator_prepares_the_unpickled_model_again():
    """The pickling contract (docs/accelerate.md): an unpickled Accelerator starts a fresh engine and "trains what it
    prepares next". At O2 the unpickled prepared model was refused (its forward belonged to a copy's engine); now it
    trains, from its own (half) weights, as a model prepared afresh from them does."""
    import pickle

    accelerator = _accelerator("O2", "bfloat16")
    model = _net()
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    accelerator2, model2 = pickle.loads(pickle.dumps((accelerator, model)))
    model2, opt2 = accelerator2.prepare(model2, torch.optim.SGD(model2.parameters(), lr=0.5))
    x, y = _batch(0)
    accelerator2.backward(F.cross_entropy(model2(x), y))
    opt2.step()
    assert not opt2.step_was_skipped
    reference = _net()  # the same half weights, upcast: what the unpickled model holds
    with torch.no_grad():
        for p, q in zip(reference.parameters(), model.parameters()):
            p.copy_(q.float())
    reset_accelerate_state()
    fresh = _accelerator("O2", "bfloat16")
    reference, ref_opt = fresh.prepare(reference, torch.optim.SGD(reference.parameters(), lr=0.5))
    fresh.backward(F.cross_entropy(reference(x), y))
    ref_opt.step()
    assert _same(_weights(accelerator2, model2, opt2), _weights(fresh, reference, ref_opt))


# -- accumulation, overflow, schedulers, checkpoints -------------------------------------------------------------------
def _run(level, *, steps, fused=False, save_at=None, load=None, accumulation=2, inf_at=(3,), out=None):
    """A ``no_trainer``-style loop: ``accumulate``, ``backward``, clip under ``sync_gradients``, step, scheduler,
    ``zero_grad``; prepare given in a scrambled order. ``save_at``: ``save_state`` to ``out`` before that micro-batch;
    ``load``: ``load_state`` from it after ``prepare`` and start there."""
    accelerator = _accelerator(level, gradient_accumulation_steps=accumulation)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    sched, opt, model = accelerator.prepare(sched, opt, model)
    start = 0
    if load is not None:
        accelerator.load_state(str(load))
        start = save_at
    skipped = []
    for step in range(start, steps):
        if step == save_at and load is None:
            accelerator.save_state(str(out))
        x, y = _batch(step, inf=step in inf_at)
        with accelerator.accumulate(model):
            accelerator.backward(F.cross_entropy(model(x), y))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            skipped.append(opt.step_was_skipped)
    scale = accelerator.amp.scalers[0].get_scale() if accelerator.amp is not None else None
    return {"weights": _weights(accelerator, model, opt) if accelerator.amp is not None else
            [p.detach().clone() for p in model.parameters()], "skipped": skipped,
            "lr": sched.get_last_lr(), "scale": scale, "optimizer": opt.state_dict()}


@pytest.mark.parametrize("level,fused,save_at", [("O1", False, 6), ("O2", False, 0), ("O2", True, 6)])
def test_save_state_into_a_fresh_accelerator_resumes_bit_for_bit(tmp_path, level, fused, save_at):
    """``save_state`` before the first step or at the end of an accumulation window (after a skipped one), then
    ``load_state`` into a new Accelerator (Accelerate's singleton state emptied, as in a new process): the same bits
    as the uninterrupted run: weights, loss scale, optimizer state and the scheduler."""
    straight = _run(level, steps=10, fused=fused, save_at=save_at, out=tmp_path)
    resumed = _run(level, steps=10, fused=fused, save_at=save_at, load=tmp_path)
    assert _same(resumed["weights"], straight["weights"])
    assert resumed["scale"] == straight["scale"] and resumed["lr"] == straight["lr"]
    assert resumed["skipped"] == straight["skipped"][save_at // 2:]
    for key, value in straight["optimizer"]["state"].items():
        assert _same(list(value.values()), list(resumed["optimizer"]["state"][key].values()))


@pytest.mark.parametrize("level,inf_at", [("O1", 2), ("O2", 3)])
def test_an_inf_in_either_micro_batch_skips_that_window_and_holds_the_scheduler(level, inf_at):
    """An inf in the batch of the first (no ``sync``) or last micro-batch of an accumulation window: that window's step
    is skipped, and only it, the scale backs off once, and the prepared scheduler does not advance. Reference:
    Accelerate's ``"no"`` on the same script steps the scheduler on every window (5 here), so one fewer here."""
    run = _run(level, steps=10, inf_at=(inf_at,))
    assert run["skipped"] == [False, True, False, False, False]
    assert run["scale"] == 2.0**7
    native = _run("no", steps=10, inf_at=())
    assert native["lr"] == pytest.approx([1e-2 / 6]) and run["lr"] == pytest.approx([1e-2 / 5])
