"""What users read in TensorBoard, checked step by step against a reference: real Trainer runs with a
TensorBoardLogger and overflows injected at known steps, read back from the event files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from lightning_mpx import MixedPrecisionPlugin
from lightning_mpx.health.plot import plot_figure, read_scalars
from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer
from tests.test_metric_readers import _accelerate_run, _fabric_run

INIT, GROWTH = 2.0**10, 3


def reference(overflow_steps: set[int], steps: int) -> tuple[list[float], list[int]]:
    """torch's GradScaler with the same settings on a gradient that is inf at ``overflow_steps``: the scale after
    each step's update, and the steps it skipped."""
    param = nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT, growth_interval=GROWTH)
    scales, skipped = [], []
    for step in range(steps):
        scaler.scale(param.sum()).backward()
        if step in overflow_steps:
            param.grad[0] = float("inf")
        before = param.detach().clone()
        scaler.step(optimizer)
        if torch.equal(param.detach(), before):  # the step was skipped
            skipped.append(step)
        optimizer.zero_grad()
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, skipped


class StepLogging(Classifier):
    """Logs the optimizer step each batch belongs to, to line the mpx curves up against."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("opt_step", float(self.trainer.global_step))
        return loss


class PeekingCallback(pl.Callback):
    """Reads the metrics every batch, as docs/lightning.md allows a callback to."""

    def __init__(self) -> None:
        self.overflows: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.overflows.append(trainer.precision_plugin.metrics()["mpx/overflows"])


def fp16_plugin() -> MixedPrecisionPlugin:
    return MixedPrecisionPlugin("O1", half_dtype="float16", init_scale=INIT, growth_interval=GROWTH)


def curves(run: Path) -> dict[str, dict[int, float]]:
    return {tag: dict(points) for tag, points in read_scalars(run).items()}


def plotted(run: Path) -> tuple[list[tuple[float, float]], dict[str, float]]:
    """What ``lightning-mpx plot`` draws for ``run``: the overflow markers on the scale panel ``(step, scale)``, and
    each module's overflow total at the end of its cumulative curve."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    fig = plot_figure(read_scalars(run))
    try:
        by_title = {ax.get_title(): ax for ax in fig.axes}
        markers = [tuple(xy) for c in by_title["Loss scale"].collections for xy in c.get_offsets().tolist()]
        modules = {line.get_label().split(" (")[0]: float(line.get_ydata()[-1])
                   for line in by_title.get("Overflows by module", fig.axes[0]).get_lines() if "(" in line.get_label()}
    finally:
        plt.close(fig)
    return markers, modules


@pytest.mark.parametrize(
    "accumulate,every,optimizer,peek,overflow_steps",
    [
        (1, 1, "sgd", False, {2, 3, 7}),
        # Overflows on the logging steps 4 and 9 themselves, skipped on the device (read a batch later).
        (4, 5, "adamw_fused", False, {3, 4, 9}),
        (1, 5, "sgd", True, {2, 3, 7}),
    ],
    ids=["every-step", "accumulate4-every5-skip_on_device", "callback-reads-metrics"],
)
def test_scale_curve_and_counts_match_grad_scaler_step_by_step(tmp_path, accumulate, every, optimizer, peek,
                                                               overflow_steps):
    steps = 12
    plugin = fp16_plugin()
    logger = TensorBoardLogger(str(tmp_path), name="run", version=0)
    trainer = make_trainer(
        plugin, max_steps=steps, logger=logger, log_every_n_steps=every, accumulate_grad_batches=accumulate,
        callbacks=[PeekingCallback()] if peek else [],
    )
    trainer.fit(StepLogging(inject_inf_at=tuple(overflow_steps), optimizer=optimizer),
                loader(classification_data(n=16 * steps * accumulate)))
    scales, skipped = reference(overflow_steps, steps)
    logged = curves(tmp_path / "run" / "version_0")
    at = sorted(logged["mpx/loss_scale"])
    assert at == [s for s in range(steps) if (s + 1) % every == 0]
    # Each point is the scale after the update of the optimizer step the user's own metrics name at that x.
    assert at == sorted(logged["opt_step"]) and all(logged["opt_step"][x] == x for x in at)
    assert [logged["mpx/loss_scale"][x] for x in at] == [scales[x] for x in at]
    assert [logged["mpx/skipped_steps"][x] for x in at] == [float(len([s for s in skipped if s <= x])) for x in at]
    # Every overflow is counted once, in the interval that holds it (a callback's reads take none of them).
    bounds = [-1, *at]
    expected = [float(len([s for s in skipped if lo < s <= hi])) for lo, hi in zip(bounds, bounds[1:])]
    assert [logged["mpx/overflows"][x] for x in at] == expected
    assert sum(logged["mpx/overflow/net.0"].values()) == len(skipped) == len(overflow_steps)
    # lightning-mpx plot marks the overflows at the logged steps that hold them, on the scale after their update.
    markers, modules = plotted(tmp_path / "run" / "version_0")
    assert markers == [(x, scales[x]) for x, n in zip(at, expected) if n]
    assert modules == {"net.0": 3.0}


def test_without_a_logger_each_metrics_read_counts_since_the_previous_read():
    # No logger: nothing logs, so the callback's own reads are its log (the counts are not carried to a log).
    callback = PeekingCallback()
    trainer = make_trainer(fp16_plugin(), max_steps=8, logger=False, callbacks=[callback])
    trainer.fit(Classifier(inject_inf_at=(2, 3, 6)), loader(classification_data(n=16 * 8)))
    assert callback.overflows == [0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize(
    "every,first_inf,second_inf",
    [(1, (2, 3), (7,)), (5, (2, 5), (7,))],
    ids=["every-step", "every5-overflow-not-logged-before-the-checkpoint"],
)
def test_a_resumed_run_continues_the_curve_without_an_overflow_spike(tmp_path, every, first_inf, second_inf):
    data = loader(classification_data(n=16 * 6))
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ck"), save_last=True, every_n_train_steps=6)
    first = make_trainer(
        fp16_plugin(), max_epochs=1, logger=TensorBoardLogger(str(tmp_path), name="run", version=0),
        log_every_n_steps=every, enable_checkpointing=True, callbacks=[checkpoint],
    )
    first.fit(Classifier(inject_inf_at=first_inf), data)
    second = make_trainer(
        fp16_plugin(), max_epochs=2, logger=TensorBoardLogger(str(tmp_path), name="run", version=0),
        log_every_n_steps=every,
    )
    second.fit(Classifier(inject_inf_at=second_inf), data, ckpt_path=str(tmp_path / "ck" / "last.ckpt"))

    scales, skipped = reference({*first_inf, *second_inf}, 12)
    logged = curves(tmp_path / "run" / "version_0")
    at = sorted(logged["mpx/loss_scale"])
    assert at == [s for s in range(12) if (s + 1) % every == 0]  # the step axis goes on where it stopped
    assert [logged["mpx/loss_scale"][s] for s in at] == [scales[s] for s in at]
    # Each overflow once, in its interval: none twice (the saving run's total again), none lost (one the saving run
    # had not logged yet when it saved).
    bounds = [-1, *at]
    expected = [float(len([s for s in skipped if lo < s <= hi])) for lo, hi in zip(bounds, bounds[1:])]
    assert [logged["mpx/overflows"][s] for s in at] == expected
    assert [logged["mpx/skipped_steps"][s] for s in at] == [float(len([k for k in skipped if k <= s])) for s in at]
    assert sum(logged["mpx/overflow/net.0"].values()) == 3.0
    markers, modules = plotted(tmp_path / "run" / "version_0")
    assert markers == [(s, scales[s]) for s, n in zip(at, expected) if n] and modules == {"net.0": 3.0}


class _GAN(pl.LightningModule):
    """Two optimizers, two losses (manual optimization); infs injected into chosen batches of each."""

    def __init__(self, d_inf: tuple[int, ...], g_inf: tuple[int, ...]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.g, self.d = nn.Linear(16, 16), nn.Linear(16, 1)
        self.d_inf, self.g_inf = d_inf, g_inf
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, _ = batch
        opt_g, opt_d = self.optimizers()
        opt_d.zero_grad()
        self.manual_backward(self.d(x).mean() - self.d(self.g(x).detach()).mean(), loss_id=0)
        if batch_idx in self.d_inf:
            self.d.weight.grad[0, 0] = float("inf")
        opt_d.step()
        opt_g.zero_grad()
        self.manual_backward(-self.d(self.g(x)).mean(), loss_id=1)
        if batch_idx in self.g_inf:
            self.g.weight.grad[0, 0] = float("inf")
        opt_g.step()

    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.g.parameters(), lr=0.01), torch.optim.SGD(self.d.parameters(), lr=0.01)]


def test_two_losses_each_get_their_own_curve_at_the_batch_that_overflowed(tmp_path):
    batches, d_inf, g_inf = 8, {1, 4}, {2}
    plugin = MixedPrecisionPlugin("O1", half_dtype="float16", num_losses=2, init_scale=INIT, growth_interval=GROWTH)
    logger = TensorBoardLogger(str(tmp_path), name="run", version=0)
    trainer = make_trainer(plugin, max_steps=2 * batches, logger=logger, log_every_n_steps=1)
    trainer.fit(_GAN(tuple(d_inf), tuple(g_inf)), loader(classification_data(n=16 * batches)))
    logged = curves(tmp_path / "run" / "version_0")
    for loss_id, injected in ((0, d_inf), (1, g_inf)):
        scales, skipped = reference(injected, batches)
        assert [logged[f"mpx/loss_scale/loss{loss_id}"][b] for b in range(batches)] == scales
        assert [logged[f"mpx/overflows/loss{loss_id}"][b] for b in range(batches)] == [
            float(b in skipped) for b in range(batches)
        ]
    assert sorted(s for s, v in logged["mpx/overflow/d"].items() if v) == sorted(d_inf)
    assert sorted(s for s, v in logged["mpx/overflow/g"].items() if v) == sorted(g_inf)


# -- the other doors: a resumed run's first log counts its own overflows ----------------------------------------------
def test_fabric_resumed_run_logs_no_overflow_spike():
    """``fabric.log_dict(mpx.metrics(), step=step)`` at every step (tests/test_metric_readers.py's Fabric run, read
    every step)."""
    first, state = _fabric_run(None, {1, 2}, 4, read_every=1)
    second, _ = _fabric_run(state, {2}, 4, read_every=1)
    assert first == [0.0, 1.0, 1.0, 0.0]
    assert second == [0.0, 0.0, 1.0, 0.0]  # not the 2 overflows of the first run at its first step


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerate_resumed_run_logs_no_overflow_spike(tmp_path):
    """``accelerator.log`` at every step (tests/test_metric_readers.py's Accelerate run, logging every step)."""
    from tests.accelerate_helpers import reset_accelerate_state

    _accelerate_run(tmp_path, None, {1, 2}, range(4), peek=False, log_every=1)
    reset_accelerate_state()  # a second run in this process, as in a new one
    _accelerate_run(tmp_path, tmp_path / "ckpt", {6}, range(4, 8), peek=False, log_every=1)
    scales, skipped = reference({1, 2, 6}, 8)
    logged = curves(tmp_path / "run")
    assert [logged["mpx/overflows"][s] for s in range(8)] == [float(s in skipped) for s in range(8)]
    assert [logged["mpx/loss_scale"][s] for s in range(8)] == scales
    assert [logged["mpx/skipped_steps"][s] for s in range(8)] == [
        float(len([k for k in skipped if k <= s])) for s in range(8)
    ]


# -- DDP: an overflow on rank 1 only, logged by rank 0 only -----------------------------------------------------------
def test_ddp_rank_zero_curve_shows_an_overflow_of_rank_one(tmp_path):
    from tests.launch import run_script

    run_script("hostile_telemetry_ddp_script.py", tmp_path, timeout=120)
    scales, skipped = reference({2, 3}, 8)
    logged = curves(tmp_path / "run" / "version_0")
    assert sorted(logged["mpx/loss_scale"]) == list(range(8))
    assert [logged["mpx/loss_scale"][s] for s in range(8)] == scales
    assert [logged["mpx/overflows"][s] for s in range(8)] == [float(s in skipped) for s in range(8)]
    assert logged["mpx/skipped_steps"][7] == len(skipped) == 2
    # The module that overflowed on rank 1 is named on rank 0's curve too (the records are merged across ranks).
    assert sum(logged.get("mpx/overflow/net.0", {}).values()) == 2.0


# -- lightning-mpx doctor on Trainer runs ------------------------------------------------------------------------------
@pytest.mark.parametrize("every,since", [(1, 7), (5, 5)], ids=["every-step", "every5-skip_on_device"])
def test_doctor_names_the_module_and_the_interval_where_the_scale_collapsed(tmp_path, every, since):
    from lightning_mpx.health import doctor

    plugin = MixedPrecisionPlugin("O1", half_dtype="float16", init_scale=INIT, growth_interval=GROWTH,
                                  on_floor="continue")
    trainer = make_trainer(plugin, max_steps=30, logger=TensorBoardLogger(str(tmp_path), name="run", version=0),
                           log_every_n_steps=every)
    optimizer = "sgd" if every == 1 else "adamw_fused"
    trainer.fit(Classifier(inject_inf_at=tuple(range(7, 30)), optimizer=optimizer),
                loader(classification_data(n=16 * 30)))
    (finding,) = doctor.diagnose(tmp_path / "run" / "version_0").findings
    # Since the first step of the logging interval that holds step 7, the first overflow.
    assert finding.kind == "persistent_overflow" and finding.modules == ("net.0",) and finding.since_step == since


def test_core_amp_counts_overflows_from_a_loaded_checkpoint_not_its_total_again():
    """The core loop: ``Amp.metrics()`` after ``Amp.load_state_dict`` counts this run's overflows; the checkpoint's
    total (the saving run's, reported there) is not reported again, while the scale and skipped steps carry over."""
    from lightning_mpx import Amp

    def run(amp: Amp, model: nn.Module, optimizer: torch.optim.Optimizer, infs: list[bool]) -> None:
        for inf in infs:
            x = torch.randn(4, 8)
            with amp.forward_context():
                loss = model(x).float().pow(2).mean() * (float("inf") if inf else 1.0)
            amp.backward(loss)
            amp.step(optimizer)
            amp.update()
            optimizer.zero_grad()

    def engine() -> tuple[Amp, nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        amp = Amp("O1", half_dtype="bfloat16", loss_scale="dynamic", skip_on_device=False)
        model = amp.prepare_model(nn.Linear(8, 2))
        return amp, model, amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    amp, model, optimizer = engine()
    run(amp, model, optimizer, [True, False, True])
    assert float(amp.metrics()["mpx/overflows"]) == 2
    saved = amp.state_dict()
    resumed, model2, optimizer2 = engine()
    resumed.load_state_dict(saved)
    first = resumed.metrics()
    assert float(first["mpx/overflows"]) == 0  # was 2: the saving run's total, reported twice
    assert first["mpx/skipped_steps"] == 2 and float(first["mpx/loss_scale"]) == float(amp.metrics()["mpx/loss_scale"])
    run(resumed, model2, optimizer2, [True, False])
    assert float(resumed.metrics()["mpx/overflows"]) == 1
