"""Review of stop 56 from a hostile user's side: SAM-style optimizers at O2 combined with the user's own writes to the
weights (a max-norm clamp after each step, a layer re-initialised after set-up), against the framework's own precision
(FP32, Fabric's ``"bf16-mixed"``)."""

from __future__ import annotations

import functools
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.test_core_sam import DoorSAM, _assert_close, _batch, _iteration, _net, _weights

STEPS = 3


def _clamp(model: nn.Module) -> None:
    """A weight constraint after each step (WGAN-style clipping, a max-norm habit)."""
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.2, 0.2)


def _reinit(model: nn.Module) -> None:
    """The head re-initialised after set-up (before the first step)."""
    with torch.no_grad():
        model[2].weight.fill_(0.25)
        model[2].bias.zero_()


def _run(amp: Any, habit: str) -> dict[str, torch.Tensor]:
    model = _net()
    if amp is not None:
        model = amp.prepare_model(model)
    optimizer = DoorSAM(model.parameters(), torch.optim.SGD, lr=0.1)
    if amp is not None:
        optimizer = amp.prepare_optimizer(optimizer)
    if habit == "reinit":
        _reinit(model)
    for i in range(STEPS):
        x, y = _batch(i)

        def backward() -> None:
            if amp is None:
                F.mse_loss(model(x), y).backward()
                return
            with amp.forward_context():
                loss = F.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)
            amp.backward(loss)

        _iteration(backward, optimizer, functools.partial(amp.step, optimizer) if amp else optimizer.step)
        if habit == "clamp":
            _clamp(model)
    return _weights(model)


@pytest.mark.parametrize("habit", ["clamp", "reinit"])
def test_o2_sam_takes_the_users_writes_between_steps(habit: str) -> None:
    """Core Amp, O2 bfloat16, the recipe's DoorSAM: a write of the user's to the half weights before the first pass
    (a clamp after the step, a head re-initialised after set-up) reaches the FP32 masters, as at FP32 (was: the SAM
    step overlooked every write since the last step, so the clamp or the init was silently undone by the next step)."""
    from lightning_mpx import Amp

    got = _run(Amp("O2", half_dtype="bfloat16"), habit)
    _assert_close(got, _run(None, habit), atol=1e-2)


def _fabric(plugin: Any, precision: str) -> dict[str, torch.Tensor]:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, **({"plugins": [plugin]} if plugin else {"precision": precision}))
    model = _net()
    model, optimizer = fabric.setup(model, DoorSAM(model.parameters(), torch.optim.SGD, lr=0.1))
    if plugin is not None:
        plugin.setup_optimizers(optimizer)  # docs/master_weights.md: the plugin meets SAM before first_step
    step: Callable[[], Any] = optimizer.step
    for i in range(STEPS):
        x, y = _batch(i)
        _iteration(lambda: fabric.backward(F.mse_loss(model(x).float(), y)), optimizer, step)
        _clamp(model.module)
    return _weights(model.module)


def test_fabric_o2_sam_with_a_clamp_after_each_step_trains_as_bf16_mixed() -> None:
    """Fabric O2 bfloat16, SAM with a weight clamp after each step: as Fabric's own "bf16-mixed"."""
    from lightning_mpx import FabricMixedPrecisionPlugin

    got = _fabric(FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16"), "")
    _assert_close(got, _fabric(None, "bf16-mixed"), atol=1e-2)


def _restore_in_step(amp: Any) -> dict[str, torch.Tensor]:
    """fpa56's SAM (the restore of ``old_p`` inside ``step()``, no ``second_step``), an overflow in the first pass of
    the second iteration: the step is skipped (``amp`` ``None``: FP32, that iteration's step and restore left out
    but for the restore, which a skipped step owes the weights)."""
    from tests.test_fabric_raw_step_optimizer_habits import _SAM

    model = _net()
    if amp is not None:
        model = amp.prepare_model(model)
    optimizer = _SAM(model.parameters())
    if amp is not None:
        optimizer = amp.prepare_optimizer(optimizer)
    for i in range(STEPS):
        x, y = _batch(i)
        for second in (False, True):
            if amp is None:
                F.mse_loss(model(x), y).backward()
            else:
                with amp.forward_context():
                    loss = F.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)
                amp.backward(loss * (1e30 if i == 1 and not second else 1.0))  # overflows at float16
            if not second:
                optimizer.first_step()
        if amp is not None:
            amp.step(optimizer)
        elif i != 1:
            optimizer.step()
        else:  # the skipped step: the weights before first_step
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(optimizer.state[p].pop("old_p"))
        optimizer.zero_grad()
    return _weights(model)


def test_o2_float16_sam_restoring_in_step_survives_an_overflowed_first_pass() -> None:
    """Core Amp, O2 float16, SAM whose step() restores and steps: an overflow in the first pass skips the step, so its
    restore never runs; the perturbation (NaN from the overflowed gradients) was left in the half weights and every
    later step overflowed and skipped (a dead run). The skipped step now copies the masters (the weights before
    first_step) into the model, and training goes on as FP32 with that step skipped."""
    from lightning_mpx import Amp

    amp = Amp("O2", half_dtype="float16")
    got = _restore_in_step(amp)
    assert len(amp.skipped_steps) == 1, amp.skipped_steps
    _assert_close(got, _restore_in_step(None), atol=1e-2)
