"""SAM-style two-pass optimizers (docs/master_weights.md, "SAM and two-pass optimizers") where users scale: davda54's
raw ``second_step`` refused at the call, a checkpoint between ``first_step`` and ``second_step`` resumed in a fresh
run, ``model_writes="values"`` before the first step, and DDP (two ranks, one launch: tests/hostile_sam57_script.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.launch import rank_results, run_script
from tests.test_sam56 import SAM, DoorSAM, _batch, _net, _weights

STEPS = 4


# -- davda54's second_step: its base step refused at the call
@pytest.mark.parametrize(("opt_level", "half_dtype"), [("O2", "bfloat16"), ("O1", "float16")])
def test_davda54_base_step_refused_at_the_call_before_any_write(opt_level: str, half_dtype: str):
    """davda54's second_step restores the weights, then calls base_optimizer.step() itself: at O2 a step of the half
    weights with no master update, at float16 one with the gradients still scaled. It was refused one step late (at
    the next backward, after the raw base step wrote the weights); a step pre-hook put on the base optimizer at
    registration refuses it in the first iteration, before the base step writes anything."""
    from lightning_mpx import Amp

    amp = Amp(opt_level, half_dtype=half_dtype)
    model = amp.prepare_model(_net())
    optimizer = amp.prepare_optimizer(SAM(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9))
    before = _weights(model)
    x, y = _batch(0)
    for _ in range(2):
        with amp.forward_context():
            loss = F.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)
        amp.backward(loss)
        if _ == 0:
            optimizer.first_step(zero_grad=True)
    with pytest.raises(RuntimeError, match=r"SAM-style two-pass optimizer SAM(.|\n)*base_optimizer.step\(\) \(SGD\) "
                       r"called outside(.|\n)*docs/master_weights.md"):
        optimizer.second_step(zero_grad=True)
    after = _weights(model)
    assert all(torch.equal(after[k], before[k]) for k in before)  # restored by second_step, then nothing written
    assert not optimizer.base_optimizer.state  # no momentum buffer: the base step never ran
    if opt_level == "O2":  # the masters hold the weights before first_step
        masters = amp.master_params(optimizer)
        assert all(torch.equal(m.to(p.dtype), p) for m, p in zip(masters, model.parameters()))


def test_base_step_through_the_door_and_after_unscale_passes():
    """The recipe's step() runs the base step inside the door's step (passes the hook), and at O1 float16 a direct
    base step after amp.unscale_ (torch.amp's recipe for GradScaler users) steps true gradients: also let through."""
    from lightning_mpx import Amp

    amp = Amp("O1", half_dtype="float16")
    model = amp.prepare_model(_net())
    optimizer = amp.prepare_optimizer(DoorSAM(model.parameters(), torch.optim.SGD, lr=0.1))
    x, y = _batch(0)
    for i in range(2):
        with amp.forward_context():
            amp.backward(F.mse_loss(model(x).float(), y))
        optimizer.first_step(zero_grad=True)
        with amp.forward_context():
            amp.backward(F.mse_loss(model(x).float(), y))
        optimizer.second_step()
        if i == 0:
            assert amp.step(optimizer)
        else:
            amp.unscale_(optimizer)
            optimizer.base_optimizer.step()
        optimizer.zero_grad()
        amp.end_iteration()
    assert all(torch.isfinite(p).all() for p in model.parameters())
