"""``Tuner(trainer).lr_find(model)`` at bfloat16's defaults (a static loss scale of 1.0, ``on_floor="raise"``).

The range test raises the learning rate until the loss diverges, on purpose, then restores the run from a checkpoint
of its own. At bfloat16's static scale every overflow is at the floor, so the divergence used to end the tuner with
``LossScaleFloorError``. During the range test an overflow skips the step and nothing more; the fit after the tuner
is the fit without it, bit for bit, and its floor policy is the one configured. The floor error's advice names
bfloat16 to float16 runs only.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.tuner import Tuner  # noqa: E402

from lightning_mpx import Amp, MixedPrecisionPlugin  # noqa: E402
from lightning_mpx.scaling.scaler import LossScaleFloorError, LossScaler  # noqa: E402
from tests.lightning_helpers import classification_data, loader, make_trainer  # noqa: E402


class Diverging(pl.LightningModule):
    """SGD on a squared error with inputs scaled by 10: the range test's growing learning rate makes the loss, and
    then the gradients, infinite (``inject_at``: an inf written into a gradient at that global step instead)."""

    def __init__(self, inject_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.lr = 1e-3
        self.inject_at = inject_at
        self.losses: list[torch.Tensor] = []
        self.skipped_at_end: list[list[int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x * 10), F.one_hot(y, 4).float())
        self.losses.append(loss.detach().clone())
        return loss

    def on_after_backward(self) -> None:
        if self.trainer.global_step == self.inject_at:
            self.net[0].weight.grad.view(-1)[0] = float("inf")

    def on_train_end(self) -> None:
        self.skipped_at_end.append(list(self.trainer.precision_plugin.amp.skipped_steps))

    def train_dataloader(self) -> Any:
        return loader(classification_data(n=512, seed=2), batch_size=8)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


@pytest.mark.parametrize("divergence", ["real", "injected"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_lr_find_at_bfloat16_defaults_leaves_the_fit_as_without_it(level: str, divergence: str, tmp_path) -> None:
    """``real``: the range test diverges to infinite gradients (``early_stop_threshold=None`` lets it run there);
    ``injected``: lr_find's own defaults, with an overflow at the range test's second step."""

    def fit(tuned: bool) -> tuple[Diverging, MixedPrecisionPlugin]:
        plugin = MixedPrecisionPlugin(level, half_dtype="bfloat16")
        model = Diverging(inject_at=1 if divergence == "injected" else None)
        trainer = make_trainer(plugin, max_steps=12, default_root_dir=str(tmp_path))
        if tuned:
            if divergence == "real":
                finder = Tuner(trainer).lr_find(model, num_training=40, early_stop_threshold=None)
            else:
                finder = Tuner(trainer).lr_find(model, num_training=20)
            assert model.skipped_at_end[0][0] >= 1  # the range test overflowed and skipped steps
            assert finder is not None and finder.suggestion() is not None
            assert plugin.amp.skipped_steps == [0]  # restored with the tuner's checkpoint
            assert plugin.amp.scalers[0].on_floor == "raise"  # the configured floor policy is back
            model.losses.clear()
            model.lr = 1e-3  # as without the tuner (lr_find's update_attr is off by default: a safeguard)
            model.inject_at = None
        elif divergence == "injected":
            model.inject_at = None
        trainer.fit(model)
        return model, plugin

    plain, plain_plugin = fit(tuned=False)
    tuned, tuned_plugin = fit(tuned=True)
    assert len(plain.losses) == len(tuned.losses) == 12
    assert all(torch.equal(a, b) for a, b in zip(plain.losses, tuned.losses))
    for (name, a), b in zip(plain.named_parameters(), tuned.parameters()):
        assert torch.equal(a, b), name
        assert torch.equal(plain_plugin.amp.master_of(a), tuned_plugin.amp.master_of(b)), name
    assert plain_plugin.amp.skipped_steps == tuned_plugin.amp.skipped_steps == [0]


def test_after_the_tuner_an_overflow_at_the_floor_raises_again(tmp_path) -> None:
    """The range test's floor policy ends with it: the fit after it stops at an overflow at the floor, as
    configured, with the bfloat16 advice."""
    plugin = MixedPrecisionPlugin("O1", half_dtype="bfloat16")
    model = Diverging(inject_at=1)
    trainer = make_trainer(plugin, max_steps=6, default_root_dir=str(tmp_path))
    Tuner(trainer).lr_find(model, num_training=6)
    model.inject_at = 2
    with pytest.raises(LossScaleFloorError, match="bfloat16 has FP32's range") as raised:
        trainer.fit(model)
    assert "use bfloat16" not in str(raised.value)


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_the_floor_error_advises_bfloat16_to_float16_runs_only(half: str) -> None:
    """A Trainer run whose gradients overflow at the floor (float16 with a static scale of 1.0, bfloat16 at its
    defaults): the error advises bfloat16 in a float16 run, and never in a bfloat16 one."""
    settings = {"loss_scale": 1.0} if half == "float16" else {}
    plugin = MixedPrecisionPlugin("O1", half_dtype=half, **settings)
    model = Diverging(inject_at=1)
    with pytest.raises(LossScaleFloorError) as raised:
        make_trainer(plugin, max_steps=4).fit(model)
    message = str(raised.value)
    assert "lower the learning rate" in message
    if half == "float16":
        assert "or use bfloat16" in message
    else:
        assert "bfloat16 has FP32's range" in message and "use bfloat16" not in message


def test_a_scaler_not_told_its_dtype_advises_no_dtype() -> None:
    scaler = LossScaler(1.0)
    with pytest.raises(LossScaleFloorError) as raised:
        scaler.handle_overflow(["w"])
    assert "bfloat16" not in str(raised.value)
    with pytest.raises(ValueError, match=r"half_dtype=torch\.float32 .*valid choices: None, torch\.float16"):
        LossScaler(half_dtype=torch.float32)
    assert Amp("O2", half_dtype="bfloat16").scalers[0].half_dtype == torch.bfloat16
