"""A write through an O2 model's state dict during the fit reaches the model, as in FP32.

At O2 the Trainer and Fabric plugins' models give their FP32 masters from ``state_dict()`` (as ``"bf16-mixed"``'s FP32
model gives its weights), and torch's state dict aliases what it holds: ``model.state_dict()[k].copy_(v)`` (an EMA
swap before validation done that way) writes the master. Under ``"bf16-mixed"`` the next forward sees the write; the
plugins' next forward does too (the values the state dict handed out that were written since go to the half model).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin


def _data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
    return torch.utils.data.DataLoader(list(zip(x, y)), batch_size=8)


class _Net(pl.LightningModule):
    """Validation sees the first layer's weight its forward uses, after a callback wrote it through the state dict."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        self.before: torch.Tensor | None = None
        self.used: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, i: int) -> Any:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def validation_step(self, batch: Any, i: int) -> None:
        x, _ = batch
        self.used.append(self(x[:1] * 0).float().detach().clone())  # the bias path: net(0) reads the weights used

    def on_validation_epoch_start(self) -> None:
        self.before = self(torch.zeros(1, 8)).float().detach().clone()
        state = self.state_dict()  # the EMA-swap habit: write the weights through the state dict
        state["net.2.bias"].add_(1.0)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("precision", ["bf16-mixed", "O2"])
def test_a_write_through_the_state_dict_before_validation_reaches_its_forward(precision: str) -> None:
    model = _Net()
    plugins = [MixedPrecisionPlugin("O2", half_dtype="bfloat16")] if precision == "O2" else []
    pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, precision=None if plugins else precision, plugins=plugins,
    ).fit(model, _data(), _data())  # fmt: skip
    assert model.used and model.before is not None
    # net(0) = tanh(b0) @ W2 + b2: the bias written by 1.0 moves every output by 1.0 (bfloat16's step near 1: 2**-7)
    torch.testing.assert_close(model.used[0], model.before + 1.0, atol=2e-2, rtol=0)


def test_fabric_a_write_through_the_state_dict_reaches_the_next_forward_and_the_masters_keep_it() -> None:
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 8)
    fabric.backward(model(x).float().pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
    before = model(torch.zeros(1, 8)).float()
    value = model.state_dict()["2.bias"]
    assert value.dtype == torch.float32
    value.add_(1.0)
    after = model(torch.zeros(1, 8)).float()
    torch.testing.assert_close(after, before + 1.0, atol=2e-2, rtol=0)
    # the master keeps the exact FP32 value written (the half model holds its rounding), and trains on from it
    written = model.state_dict()["2.bias"].clone()
    assert torch.equal(written, value)
    fabric.backward(model(x).float().pow(2).mean())
    grad = model.module[2].bias.grad.float().clone()  # O2: the half gradient, scaled by bfloat16's static 1.0
    optimizer.step()
    torch.testing.assert_close(model.state_dict()["2.bias"], written - 0.1 * grad)  # stepped from the written value
