"""Optimizer-side habits under the raw-step check (engine/raw_steps.py) and O2's FP32 masters, each run through Fabric
and compared with Fabric's own precision ("bf16-mixed"; on a CPU "16-mixed" runs as bf16-mixed, so O1 float16 is
compared with FP32): sharpness-aware minimization (SAM, the davda54/sam pattern with the base step routed through
Fabric's optimizer) and a hand-written decoupled weight decay after the step."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin


class _SAM(torch.optim.Optimizer):
    """davda54/sam: ``first_step`` climbs to ``w + rho * g / ||g||`` (scale-free: a loss scale cancels in the ratio)
    and clears the gradients; ``step`` (second_step) restores ``w`` and steps the base optimizer, so the framework's
    optimizer step runs it."""

    def __init__(self, params: Any, rho: float = 0.05, lr: float = 0.1) -> None:
        super().__init__(params, dict(rho=rho, lr=lr))
        self.base_optimizer = torch.optim.SGD(self.param_groups, lr=lr)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self, set_to_none: bool = True) -> None:
        grads = [p.grad.float().norm() for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.stack(grads).norm()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["old_p"] = p.detach().clone()
                    p.add_(p.grad * (group["rho"] / (norm + 1e-12)).to(p))
        self.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if "old_p" in self.state[p]:
                    p.copy_(self.state[p].pop("old_p"))
        self.base_optimizer.step()


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(8, 4, generator=g)
    return x, x.sum(1, keepdim=True).tanh()


def _fit(habit: str, set_to_none: bool = True, setup: bool = False, **precision: Any) -> dict[str, torch.Tensor]:
    fabric = Fabric(accelerator="cpu", devices=1, **precision)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer: Any = _SAM(model.parameters()) if habit == "sam" else torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    if setup:  # docs/master_weights.md "SAM and two-pass optimizers": the plugin meets it before first_step
        next(p for p in precision.get("plugins", ()) if isinstance(p, FabricMixedPrecisionPlugin)).setup_optimizers(
            optimizer
        )
    for i in range(6):
        x, y = _batch(i)
        fabric.backward(F.mse_loss(model(x).float(), y))
        if habit == "sam":
            optimizer.first_step(set_to_none)
            fabric.backward(F.mse_loss(model(x).float(), y))
        optimizer.step()
        optimizer.zero_grad()
        if habit == "weight_decay":  # decoupled, by hand, after the step (lr * wd = 1e-3)
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1 - 1e-3)
    return {k: v.detach().float() for k, v in model.state_dict().items()}


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float) -> None:
    assert all(torch.allclose(got[k], want[k], atol=atol) for k in want), {
        k: (got[k] - want[k]).abs().max().item() for k in want
    }


LEVELS = [("O2", "bfloat16", "bf16-mixed"), ("O1", "float16", "32-true")]


@pytest.mark.parametrize(("opt_level", "half_dtype", "reference"), LEVELS)
def test_sam_clearing_to_none_trains_as_fabrics_precision(opt_level: str, half_dtype: str, reference: str) -> None:
    """Refused at the second backward of the first iteration ("parameters '0.weight', ... which no optimizer
    prepared by lightning_mpx holds, were written and their gradients cleared")."""
    want = _fit("sam", precision=reference)
    got = _fit("sam", plugins=[FabricMixedPrecisionPlugin(opt_level, half_dtype=half_dtype)])
    _assert_close(got, want, 3e-3)


@pytest.mark.parametrize(("opt_level", "half_dtype", "reference"), LEVELS)
def test_sam_with_the_plugin_told_trains_as_fabrics_precision(opt_level: str, half_dtype: str, reference: str) -> None:
    """SAM with first_step and a step() that restores and steps the base optimizer (no second_step), the plugin told
    of it after fabric.setup(): first_step's write, its gradients cleared to None, is its one perturbation per step."""
    want = _fit("sam", precision=reference)
    plugin = FabricMixedPrecisionPlugin(opt_level, half_dtype=half_dtype)
    got = _fit("sam", setup=True, plugins=[plugin])
    _assert_close(got, want, 3e-3)


def test_o1_float16_sam_clearing_to_zeros_trains_as_fp32() -> None:
    """The documented way out: gradients zeroed (not cleared) by first_step are no raw step's; the perturbation from
    scaled gradients is the true one (the scale cancels), and the base step runs through Fabric, unscaled."""
    want = _fit("sam", set_to_none=False, precision="32-true")
    got = _fit("sam", set_to_none=False, plugins=[FabricMixedPrecisionPlugin("O1", half_dtype="float16")])
    start = _fit("none", precision="32-true")  # plain SGD: SAM's gradient at w + e(w) differs
    assert max((want[k] - start[k]).abs().max().item() for k in want) > 1e-4
    _assert_close(got, want, 1e-3)


def test_o2_sam_clearing_to_zeros_trains_as_fabrics_bf16_mixed() -> None:
    want = _fit("sam", set_to_none=False, precision="bf16-mixed")
    got = _fit("sam", set_to_none=False, plugins=[FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")])
    _assert_close(got, want, 3e-3)


@pytest.mark.xfail(
    strict=True,
    reason="masters/weights.py: at O2 a decoupled weight decay written by hand to the half parameters after the step "
    "(p.mul_(1 - lr * wd)) mostly rounds back to the same bfloat16 value, so the FP32 masters keep their value and the "
    "decay is lost; way out: the optimizer's own weight_decay (AdamW's is decoupled) (docs/master_weights.md)",
)
def test_o2_a_hand_written_decoupled_weight_decay_trains_as_fabrics_bf16_mixed() -> None:
    want = _fit("weight_decay", precision="bf16-mixed")
    got = _fit("weight_decay", plugins=[FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")])
    plain = _fit("none", precision="bf16-mixed")
    assert max((want[k] - plain[k]).abs().max().item() for k in want) > 1e-3  # the decay moved the weights
    _assert_close(got, want, 5e-4)
