"""Fabric at O2: the gradients read after ``optimizer.step()`` and before ``zero_grad`` (a log of the step's gradient
norm, a habit of Fabric loops), against Fabric's own ``"bf16-mixed"``, whose parameters keep the true gradients the
step used until ``zero_grad``. Strict xfails: what the user sees, with the figures."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin


def _logged(precision: str, read: str, **settings: Any) -> list[float | None]:
    """Three steps; after each ``optimizer.step()`` the norm of the gradients of ``read``: ``"main"``
    ``mpx.main_params(optimizer)`` (the parameters under Fabric's own precisions), ``"model"`` the model's own
    (``None``: no gradient at all)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    plugin = FabricMixedPrecisionPlugin(precision, **settings) if precision.startswith("O") else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric = Fabric(accelerator="cpu", devices=1, **({"plugins": [plugin]} if plugin else {"precision": precision}))
        model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.3))
        logged: list[float | None] = []
        for step in range(3):
            generator = torch.Generator().manual_seed(100 + step)
            x, y = torch.randn(6, 8, generator=generator), torch.randint(0, 4, (6,), generator=generator)
            fabric.backward(F.cross_entropy(model(x).float(), y))
            optimizer.step()
            if read == "main" and plugin is not None:
                params = list(plugin.main_params(optimizer))
            else:
                params = list(net.parameters())
            grads = [p.grad.float() for p in params if p.grad is not None]
            logged.append(float(torch.nn.utils.get_total_norm(grads)) if grads else None)
            optimizer.zero_grad()
    return logged


@pytest.mark.xfail(
    strict=True,
    reason="integrations/fabric.py:FabricMixedPrecisionPlugin.main_params: at O2 the masters' FP32 gradients are "
    "dropped by the step, so a log of mpx.main_params(opt)'s gradients after optimizer.step() finds every one None "
    "(bf16-mixed logs the step's norm, 1.092 at step 0); a fix needs the engine (engine/, not this helper's)",
)
def test_main_params_read_after_the_step_gives_the_steps_gradients() -> None:
    ours, reference = _logged("O2", "main", half_dtype="bfloat16"), _logged("bf16-mixed", "main")
    assert None not in ours
    assert ours == pytest.approx(reference, rel=1e-2)


@pytest.mark.xfail(
    strict=True,
    reason="engine/rescale.py:after_step: at O2 float16 without a clip the step leaves the model's half gradients "
    "at the loss scale, so a log of the model's gradients' norm after optimizer.step() reads 279.6 for 1.092 at a "
    "scale of 256 (bf16-mixed: 1.092; after fabric.clip_gradients the true values are shown); bfloat16 (scale 1) "
    "is right",
)
def test_model_gradients_read_after_the_step_are_true_at_float16() -> None:
    ours, reference = _logged("O2", "model", half_dtype="float16", init_scale=2.0**8), _logged("bf16-mixed", "model")
    assert ours == pytest.approx(reference, rel=1e-2)


def test_model_gradients_read_after_the_step_are_true_at_bfloat16() -> None:
    """bfloat16 (no loss scale): the model's gradients after the step are the step's, as ``"bf16-mixed"``'s."""
    ours, reference = _logged("O2", "model", half_dtype="bfloat16"), _logged("bf16-mixed", "model")
    assert ours == pytest.approx(reference, rel=1e-2)
