"""Fabric: the user's own reads of ``mpx.main_params(optimizer)`` (Apex's ``master_params`` habits: torch's
``clip_grad_norm_`` on them right after ``fabric.backward``, a log of the gradients' or the weights' norm), at every
opt level, against Fabric's own ``"bf16-mixed"`` or an FP32 run with ``torch.amp.GradScaler``.

* At O1/O3 with a loss scale (float16's dynamic one, a static one) torch's clip right after ``fabric.backward`` clipped
  the scaled gradients to ``max_norm``, which the step then divided by the scale (the weights 3.3e-2 off
  ``"bf16-mixed"`` in 3 steps, the norm returned 128 times too big at a scale of 128). ``main_params`` unscales first
  now, as at O2 (stop 72) and as ``fabric.clip_gradients`` does.
* On an overflow step ``main_params`` handed the user's code the one zero that stands in for the parameters in
  Fabric's clip: a gradient norm of 0.0 where GradScaler's ``unscale_`` leaves NaN, a weight norm of 0.0, one tensor
  for four. The user's code gets the parameters now (their gradients non-finite, the step skipped as before).
* An optimizer set up apart (``fabric.setup_optimizers``) is met by the plugin at its first unscale, step or
  ``main_params``: at the first step, after the backward, its gradients were taken for no loss's and not unscaled
  (torch's clip returned 0.0 at O2 and clipped nothing, 8.0e-2 off in 3 steps; at O1 it clipped the scaled ones,
  1.8e-2). They are unscaled now, as ``fabric.clip_gradients`` takes them.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin

MAX_NORM = 0.2


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(6, 8, generator=generator), torch.randint(0, 4, (6,), generator=generator)


def _norm(tensors: list[torch.Tensor]) -> float:
    return float(torch.nn.utils.get_total_norm(tensors))


def _run(precision: str, habit: str, *, inf_at: int = -1, apart: bool = False, **settings: Any) -> dict[str, Any]:
    """Three steps: ``fabric.backward`` (the loss times inf at step ``inf_at``), then ``habit``, one letter an action
    on ``main_params`` (the optimizer's parameters under Fabric's own precisions): ``r`` a log of the gradients'
    norm, ``W`` a log of the weights' norm, ``c`` torch's ``clip_grad_norm_`` (its norm logged); then the step.
    ``precision="GradScaler"``: FP32 with ``torch.amp.GradScaler`` (``unscale_`` right after the backward).
    ``apart``: the optimizer set up apart (``fabric.setup_module``, then ``fabric.setup_optimizers``)."""
    net = _net()
    plugin = None
    if precision.startswith("O"):
        plugin = FabricMixedPrecisionPlugin(precision, **settings)
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    else:
        fabric = Fabric(accelerator="cpu", devices=1, precision="32-true" if precision == "GradScaler" else precision)
    if apart:
        model = fabric.setup_module(net)
        optimizer = fabric.setup_optimizers(torch.optim.SGD(net.parameters(), lr=0.3))
    else:
        model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.3))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if precision == "GradScaler" else None
    out: dict[str, Any] = {"logged": [], "counts": []}
    for step in range(3):
        x, y = _batch(step)
        loss = F.cross_entropy(model(x).float(), y) * (math.inf if step == inf_at else 1.0)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
        else:
            fabric.backward(loss)
        for action in habit:
            params = list(plugin.main_params(optimizer) if plugin else optimizer.param_groups[0]["params"])
            out["counts"].append(len(params))
            if action == "r":
                out["logged"].append(_norm([p.grad for p in params]))
            elif action == "W":
                out["logged"].append(_norm([p.detach().float() for p in params]))
            else:
                out["logged"].append(float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM)))
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
    values = plugin.fp32_state_dict(net) if plugin else net.state_dict()
    out["final"] = torch.cat([value.float().flatten() for value in values.values()])
    return out


def _quiet(precision: str, habit: str, **kwargs: Any) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _run(precision, habit, **kwargs)


@pytest.mark.parametrize(
    ("level", "loss_scale", "habit"),
    [("O1", 128.0, "c"), ("O1", "dynamic", "rc"), ("O3", "dynamic", "c"), ("O3", 128.0, "rc")],
)
def test_torch_clip_of_main_params_with_a_loss_scale_clips_the_true_gradients(
    level: str, loss_scale: Any, habit: str
) -> None:
    atol = 2e-4 if level == "O1" else 5e-3  # O3: bfloat16 weights
    ours = _quiet(level, habit, half_dtype="bfloat16", loss_scale=loss_scale)
    reference = _quiet("bf16-mixed", habit)
    # before: the norms times the scale (139.8 for 1.09 at 128), the weights 3.3e-2 off in 3 steps
    assert ours["logged"] == pytest.approx(reference["logged"], rel=1e-2)
    torch.testing.assert_close(ours["final"], reference["final"], rtol=0, atol=atol)


@pytest.mark.parametrize("habit", ["rWc", "c"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_user_read_of_main_params_on_an_overflow_step_gets_the_parameters(habit: str, level: str) -> None:
    ours = _quiet(level, habit, inf_at=1, half_dtype="float16", init_scale=2.0**8)
    reference = _quiet("GradScaler", habit, inf_at=1)
    # before: one tensor (counts [4, 1, 4]) and a logged 0.0 on the overflow step, where GradScaler's logs NaN
    # (gradients, torch's clip) or the weights' norm (4.366)
    assert ours["counts"] == reference["counts"]
    for mine, theirs in zip(ours["logged"], reference["logged"], strict=True):
        assert mine == pytest.approx(theirs, rel=2e-3, nan_ok=True)
    torch.testing.assert_close(ours["final"], reference["final"], rtol=0, atol=2e-4)


@pytest.mark.parametrize(("level", "settings"), [("O2", {}), ("O1", {"loss_scale": "dynamic"})])
@pytest.mark.parametrize("habit", ["c", "rc"])
def test_torch_clip_of_main_params_of_an_optimizer_set_up_apart(level: str, settings: Any, habit: str) -> None:
    ours = _quiet(level, habit, apart=True, half_dtype="bfloat16", **settings)
    reference = _quiet("bf16-mixed", habit, apart=True)
    # before: at the first step 0.0 (O2) or 71571 (O1, 1.09 times 65536) for 1.09, the weights 8.0e-2 / 1.8e-2 off
    assert ours["logged"] == pytest.approx(reference["logged"], rel=1e-2)
    torch.testing.assert_close(ours["final"], reference["final"], rtol=0, atol=2e-4)
