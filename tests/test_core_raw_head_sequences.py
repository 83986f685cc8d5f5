"""What the stateful machines (tests/test_*_stateful.py) found under ``HYPOTHESIS_PROFILE=explore`` at stop 67, on stop
66's surfaces (a raw head optimizer beside the prepared one, a ``strict=False`` load, a hand write, a save mid-window),
each sequence written out as a user's script."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp

REFUSAL = "did not prepare"


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


class _LooseHead:
    """The core ``Amp`` at O2 bfloat16 over Linear-LayerNorm-Linear whose last Linear (the head) is left requiring grad
    out of the prepared SGD (a backbone's habit), and a raw SGD over the head (never prepared)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
        self.amp = Amp("O2", half_dtype="bfloat16")
        self.amp.prepare_model(self.model)
        trunk = list(self.model[0].parameters()) + list(self.model[1].parameters())
        self.opt = self.amp.prepare_optimizer(torch.optim.SGD(trunk, lr=0.05))
        self.raw = torch.optim.SGD(self.model[2].parameters(), lr=0.05)

    def backward(self, seed: int) -> None:
        x, y = _batch(seed)
        with self.amp.forward_context():
            loss = F.mse_loss(self.model(self.amp.cast_inputs(x)).float(), y)
        self.amp.backward(loss)

    def step(self) -> None:
        self.amp.step(self.opt)
        self.amp.update()

    def raw_step(self) -> None:
        self.raw.step()
        self.raw.zero_grad()

    def load_first_layer(self) -> None:
        state = {"0.weight": 0.3 * torch.randn(16, 8, generator=torch.Generator().manual_seed(1))}
        self.model.load_state_dict(state, strict=False)


@pytest.mark.filterwarnings("ignore:lightning_mpx")
def test_a_raw_head_step_after_a_partial_load_is_refused_at_once() -> None:
    """A step, a ``load_state_dict(strict=False)`` of the first layer, the raw head step: the load's writes are
    neither a raw step nor a whole-model write (engine/beside_steps.py leaves the parameters it wrote out of both), so
    the next backward refuses the raw step (it was refused one iteration later: the load forgot the notes)."""
    run = _LooseHead()
    run.backward(0)
    run.step()
    run.load_first_layer()
    run.raw_step()
    with pytest.raises(RuntimeError, match=REFUSAL):
        run.backward(1)


@pytest.mark.filterwarnings("ignore:lightning_mpx")
def test_a_head_added_to_the_optimizer_between_a_clip_and_the_step_steps_on_its_gradients() -> None:
    """A head left requiring grad out of the optimizer, a backward, ``amp.clip_grad_norm_``, then the head unfrozen
    into the optimizer (``add_param_group``) and the step: the head holds this backward's gradient, which FP32's step
    applies. Without the clip before the add, the head moves as FP32's (tests/test_core_optimizer_habits_stateful.py's
    machine)."""
    run = _LooseHead()
    run.backward(0)
    run.amp.clip_grad_norm_(run.opt, 1e9)
    head = run.model[2].weight
    grad = head.grad.float().clone()
    run.opt.add_param_group({"params": list(run.model[2].parameters())})
    before = run.amp.master_of(head).detach().clone()
    run.step()
    torch.testing.assert_close(run.amp.master_of(head).detach(), before - 0.05 * grad, rtol=0, atol=1e-6)
