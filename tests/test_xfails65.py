"""Stop 65's strict xfails turned into passes: what the fixes also cover, from the user's side.

* Gradients a step left, moved by ``model.to()`` under ``torch.__future__.set_swap_module_params_on_conversion(True)``
  (engine/rescale.py ``after_step``: the engine holds no weak reference to them any more, one to a mark in their
  ``__dict__``, which the swap takes away): the run goes on as the same run without the move.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mpx import Amp


def _kept_grads_run(move: bool, level: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three steps of a dynamic-scale bfloat16 run whose gradients are never cleared (each step adds to what the last
    one left, as in FP32); ``move``: after each step the model is moved to float64 and back by swapping tensors (its
    gradients with it). Returns the weights after and before."""
    torch.manual_seed(0)
    amp = Amp(level, half_dtype="bfloat16", loss_scale="dynamic", init_scale=2.0**4, growth_interval=1)
    model = amp.prepare_model(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)))
    initial = [p.detach().clone() for p in model.parameters()]
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(4, 4, generator=g)
        with amp.forward_context():
            loss = amp.cast_outputs(model(amp.cast_inputs(x))).float().pow(2).mean()
        amp.backward(loss)
        amp.step(optimizer)
        amp.update()  # the scale grows: the kept gradients are brought to the next backward's scale
        if move:
            torch.__future__.set_swap_module_params_on_conversion(True)
            try:
                model.to(torch.float64).to(torch.float32 if level == "O1" else torch.bfloat16)
            finally:
                torch.__future__.set_swap_module_params_on_conversion(False)
    return [p.detach().clone() for p in model.parameters()], initial


@pytest.mark.parametrize("level", ["O1", "O3"])
def test_gradients_kept_across_steps_and_moved_by_swapping_train_as_without_the_move(level: str) -> None:
    """Was: ``model.to()`` raised "Couldn't swap Linear.weight.grad". The moved gradients are brought to each new
    scale as the kept ones are (the same kernels: equal bit for bit)."""
    (moved, _), (kept, initial) = _kept_grads_run(True, level), _kept_grads_run(False, level)
    assert all(torch.equal(a, b) for a, b in zip(moved, kept))
    assert all(not torch.equal(a, b) for a, b in zip(kept, initial))  # it trained
