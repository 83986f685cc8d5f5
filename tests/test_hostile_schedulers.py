"""Learning-rate schedulers around skipped steps, through the front doors, against the framework's own precision.

torch's schedulers warn ("Detected call of `lr_scheduler.step()` before `optimizer.step()`") when stepped before
any real optimizer step, which is what a skipped first step is under ``GradScaler`` and Apex; a door shows that
warning where they show it. The Trainer holds a per-step schedule on a skipped step (Lightning's "16-mixed" steps
it anyway, which is why it warns there): the logged rates are the FP32 run's, one batch late.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins import MixedPrecision
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin
from lightning_mpx.apex import _amp_state, amp
from lightning_mpx.engine.amp import Amp
from tests.lightning_helpers import Classifier, RecordingLogger, classification_data, loader, make_trainer

_BEFORE = "Detected call of `lr_scheduler.step()` before `optimizer.step()`"


def _schedule_warnings(run: Callable[[], Any]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]


def _net() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=1.0)


def _loss(model: nn.Module, overflow: bool) -> torch.Tensor:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)).to(next(model.parameters()).dtype)
    return model(x).float().sum() * (float("inf") if overflow else 1e-6)  # small: no overflow at the loss scale


def _grad_scaler_warns(overflow: bool) -> bool:
    """The reference: one step of torch's GradScaler, then the schedule's step."""
    model, optimizer = _net()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    scaler = torch.amp.GradScaler("cpu")

    def step() -> None:
        scaler.scale(_loss(model, overflow)).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()

    return any(_BEFORE in message for message in _schedule_warnings(step))


# -- the core engine and the Fabric plugin: as GradScaler and Fabric's own precision --------------------------------
@pytest.mark.parametrize("made", ["before_prepare", "after_prepare"])
@pytest.mark.parametrize("overflow", [True, False], ids=["skipped_first_step", "real_first_step"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_core_a_skipped_first_step_warns_the_scheduler_as_grad_scaler(level, overflow, made):
    model, optimizer = _net()
    engine = Amp(level, half_dtype="bfloat16", loss_scale="dynamic")
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5) if made == "before_prepare" else None
    model = engine.prepare_model(model)
    optimizer = engine.prepare_optimizer(optimizer)
    scheduler = scheduler or torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)

    def step() -> None:
        engine.scale_loss(_loss(model, overflow)).backward()
        assert bool(engine.step(optimizer)) is not overflow
        engine.update()
        scheduler.step()

    assert any(_BEFORE in message for message in _schedule_warnings(step)) == _grad_scaler_warns(overflow)


def _fabric_warns(plugin: Any, made: str) -> bool:
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model, optimizer = _net()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5) if made == "before_setup" else None
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = scheduler or torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)

    def step() -> None:
        fabric.backward(_loss(model, overflow=True))
        optimizer.step()
        scheduler.step()

    return any(_BEFORE in message for message in _schedule_warnings(step))


@pytest.mark.parametrize("made", ["before_setup", "after_setup"])
def test_fabric_a_skipped_first_step_warns_the_scheduler_as_fabric_16_mixed(made):
    # Fabric's own precision with a GradScaler: a scheduler made on the raw optimizer warns, one made on Fabric's
    # wrapper (whose step() is called, skipped or not) does not.
    own = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    plugin = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16", loss_scale="dynamic")
    assert _fabric_warns(plugin, made) == _fabric_warns(own, made) == (made == "before_setup")


# -- the Apex layer ----------------------------------------------------------------------------------------------
@pytest.fixture
def _apex_state():
    yield
    _amp_state.reset()
    _amp_state.registrations.clear()


@pytest.mark.usefixtures("_apex_state")
@pytest.mark.parametrize("made", ["before_initialize", "after_initialize"])
@pytest.mark.parametrize("overflow", [True, False], ids=["skipped_first_step", "real_first_step"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_apex_a_skipped_first_step_warns_the_scheduler_as_grad_scaler(level, overflow, made):
    # Apex's own order makes the scheduler on the optimizer initialize returns. Its step() ran even when skipped, and
    # the scheduler's mark on it said an optimizer step had been called: the warning was hidden (GradScaler and Apex,
    # whose skip replaced optimizer.step, show it).
    model, optimizer = _net()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5) if made == "before_initialize" else None
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, verbosity=0)
    scheduler = scheduler or torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)

    def step() -> None:
        with amp.scale_loss(_loss(model, overflow), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        scheduler.step()

    warned = any(_BEFORE in message for message in _schedule_warnings(step))
    assert warned == _grad_scaler_warns(overflow) == overflow
    assert optimizer.param_groups[0]["lr"] == 0.5  # Apex steps the schedule anyway: the user's scheduler.step()


# -- the Trainer plugin: a held schedule, logged as FP32's ---------------------------------------------------------
class _Sequenced(Classifier):
    """Two parameter groups with their own rates, momentum and weight decay, and a warm-up then decay as one
    SequentialLR, stepped every batch."""

    def configure_optimizers(self) -> dict[str, Any]:
        groups = [{"params": self.net[0].parameters(), "lr": 0.5}, {"params": self.net[2].parameters()}]
        optimizer = torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=0.01)
        warmup = torch.optim.lr_scheduler.LinearLR(optimizer, 0.1, 1.0, total_iters=2)
        decay = torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.5)
        schedule = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, decay], milestones=[2])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _logged_rates(plugin: Any, steps: int, inject_inf_at: tuple[int, ...] = ()) -> tuple[list[dict], list[str]]:
    logger = RecordingLogger()
    monitor = pl.callbacks.LearningRateMonitor(logging_interval="step", log_momentum=True, log_weight_decay=True)
    trainer = make_trainer(plugin, max_steps=steps, logger=logger, log_every_n_steps=1, callbacks=[monitor])
    model = _Sequenced(inject_inf_at=inject_inf_at)
    caught = _schedule_warnings(lambda: trainer.fit(model, loader(classification_data(n=96))))
    rates = [{k: round(v, 6) for k, v in metrics.items() if k.startswith("lr-")} for _, metrics in logger.logged]
    return [r for r in rates if r], caught


def test_trainer_o2_holds_a_sequential_schedule_on_a_skipped_first_step_and_logs_fp32_rates():
    plugin = MixedPrecisionPlugin("O2", half_dtype="bfloat16", loss_scale="dynamic")
    rates, caught = _logged_rates(plugin, steps=5, inject_inf_at=(0,))
    fp32, _ = _logged_rates(None, steps=4)
    assert plugin.amp.skipped_steps == [1]
    # The masters' groups carry the rates the user set (LearningRateMonitor reads the optimizer's param_groups), and
    # the skipped first step holds the schedule: FP32's rates, one batch late. The scheduler is not stepped before
    # the optimizer, so torch has nothing to warn of (Lightning's "16-mixed" steps it, and warns).
    assert rates == [rates[0], *fp32] and rates[0] == fp32[0]
    assert fp32[0]["lr-SGD/pg1"] == 0.05 and fp32[0]["lr-SGD/pg2-momentum"] == 0.9
    assert caught == []
