"""Review of stop 55's merged changes, from the user's side: a model loaded between a backward and the next (a
loss-spike rollback) is no raw step; a head added after ``prepare_model`` and prepared again loads FP32 values into
its masters exactly, as the model's first modules do."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def _loss(model: nn.Module, i: int) -> torch.Tensor:
    x, y = _batch(i)
    dtype = next(p.dtype for p in model.parameters())
    return F.mse_loss(model(x.to(dtype)).float(), y)


def _rollback(model: nn.Module, opt: torch.optim.Optimizer, backward, step, saved: dict) -> None:  # noqa: ANN001
    """Two steps, then a loss spike: the weights restored and the batch skipped (no step), then two more steps."""
    for i in range(2):
        backward(_loss(model, i))
        step()
        opt.zero_grad()
    backward(_loss(model, 2))  # the spike: this batch is not stepped
    model.load_state_dict(saved)
    opt.zero_grad()
    for i in range(3, 5):
        backward(_loss(model, i))
        step()
        opt.zero_grad()


def _build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))


@pytest.mark.parametrize(
    ("opt_level", "half_dtype"),
    [
        ("O2", "bfloat16"),
        ("O1", "float16"),
    ],
)
def test_a_rollback_load_between_backwards_is_no_raw_step_and_trains_as_fp32(opt_level: str, half_dtype: str) -> None:
    ref = _build()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    saved = {k: v.clone() for k, v in ref.state_dict().items()}
    _rollback(ref, ref_opt, lambda loss: loss.backward(), ref_opt.step, saved)

    amp = Amp(opt_level=opt_level, half_dtype=half_dtype)
    model = amp.prepare_model(_build())
    opt = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def step() -> None:
        amp.step(opt)
        amp.update()

    _rollback(model, opt, amp.backward, step, saved)  # was: RuntimeError, "a torch optimizer ... stepped them"
    got = amp.fp32_state_dict(model) if opt_level == "O2" else model.state_dict()
    for k, want in ref.state_dict().items():
        assert torch.allclose(got[k].float(), want, atol=2e-2), k


def test_a_head_added_after_prepare_loads_fp32_values_into_its_masters_exactly() -> None:
    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
    amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model.add_module("head", nn.Linear(4, 3))  # a second stage's head
    amp.prepare_optimizer(torch.optim.SGD(model.head.parameters(), lr=0.1))  # prepares the model again
    g = torch.Generator().manual_seed(1)
    checkpoint = {k: torch.randn(v.shape, generator=g) for k, v in amp.fp32_state_dict(model).items()}
    assert not torch.equal(checkpoint["head.weight"], checkpoint["head.weight"].bfloat16().float())
    model.load_state_dict(checkpoint)
    got = amp.fp32_state_dict(model)
    for k, want in checkpoint.items():
        assert torch.equal(got[k], want), f"{k}: the master took the half rounding of the loaded FP32 value"
    with pytest.raises(ValueError, match=r"assign=True.*first: 'weight'"):
        model.head.load_state_dict({"weight": checkpoint["head.weight"]}, strict=False, assign=True)


class _Tied(nn.Module):
    def __init__(self, untied: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.lm_head = nn.Linear(4, 5, bias=False)
        self.lm_head.weight = nn.Parameter(self.embed.weight.detach().clone()) if untied else self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.embed(x))


def test_an_untie_in_an_engines_second_model_resumes_into_that_model_built_untied() -> None:
    def engine(untied: bool) -> tuple[Amp, nn.Module, nn.Module]:
        torch.manual_seed(0)
        amp = Amp("O2", half_dtype="bfloat16")
        first, second = amp.prepare_model(nn.Linear(4, 4)), amp.prepare_model(_Tied(untied))
        amp.prepare_optimizer(torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.1))
        return amp, first, second

    amp, first, second = engine(untied=False)
    second.lm_head.weight = nn.Parameter(second.embed.weight.detach().clone())  # the untie, after set-up
    amp.prepare_optimizer(torch.optim.SGD(second.lm_head.parameters(), lr=0.1))
    state, weights = amp.state_dict(), (amp.fp32_state_dict(first), amp.fp32_state_dict(second))

    amp2, first2, second2 = engine(untied=True)  # the same models, built untied in a new process
    first2.load_state_dict(weights[0])
    second2.load_state_dict(weights[1])
    amp2.load_state_dict(state)  # was: KeyError, unexpected ['lm_head.weight'] (named without 'model1.')
    assert torch.equal(amp2.fp32_state_dict(second2)["lm_head.weight"], weights[1]["lm_head.weight"])
