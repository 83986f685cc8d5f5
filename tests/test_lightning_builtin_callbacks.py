"""Lightning's built-in callbacks not attacked before, under ``MixedPrecisionPlugin`` at O1 and O2, each against the
same run under Lightning's own ``"bf16-mixed"``/``"16-mixed"`` (or against the uninterrupted state where a callback
saves and restores): GradientAccumulationScheduler, OnExceptionCheckpoint, SpikeDetection, EarlyStopping,
ModelSummary/RichModelSummary, DeviceStatsMonitor, Timer, val_check_interval inside an accumulation window,
BasePredictionWriter and a WeightAveraging with its own ``should_update``."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lightning.pytorch")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import (  # noqa: E402
    BasePredictionWriter,
    DeviceStatsMonitor,
    EarlyStopping,
    GradientAccumulationScheduler,
    ModelSummary,
    OnExceptionCheckpoint,
    Timer,
)
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from lightning_mpx import MixedPrecisionPlugin  # noqa: E402
from lightning_mpx.scaling.scaler import LossScaleFloorError  # noqa: E402
from tests.lightning_helpers import (  # noqa: E402
    Classifier,
    RecordingLogger,
    classification_data,
    loader,
    make_trainer,
)

_FP16 = dict(init_scale=2.0**10, growth_interval=2)


def _trainer(level: str | None, half: str, **kwargs: Any) -> pl.Trainer:
    """Ours at ``level`` (float16 scaled from 2**10, growth every 2 steps), or Lightning's own (``level=None``) with
    the same scaler settings."""
    if level is not None:
        plugin = MixedPrecisionPlugin(level, half_dtype=half, **(_FP16 if half == "float16" else {}))
        return make_trainer(plugin, **kwargs)
    if half == "float16":
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        return make_trainer(plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], **kwargs)
    return make_trainer(precision="bf16-mixed", **kwargs)


def _scale(trainer: pl.Trainer) -> float:
    plugin = trainer.precision_plugin
    if isinstance(plugin, MixedPrecisionPlugin):
        return plugin.amp.scalers[0].get_scale()
    scaler = getattr(plugin, "scaler", None)
    return float(scaler.get_scale()) if scaler is not None else 1.0


def _weights(trainer: pl.Trainer, module: pl.LightningModule) -> list[torch.Tensor]:
    """What the optimizer trains: the FP32 masters at O2, the FP32 parameters otherwise (cloned)."""
    plugin = trainer.precision_plugin
    if isinstance(plugin, MixedPrecisionPlugin) and plugin.amp.master_weights:
        return [plugin.amp.master_of(p).clone() for p in module.parameters()]
    return [p.detach().float().clone() for p in module.parameters()]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b, strict=True))


class _InfAt(Classifier):
    """Writes an inf into the first layer's gradient after the backward of the micro-batches ``(epoch, batch_idx)``."""

    def __init__(self, at: tuple[tuple[int, int], ...] = ()) -> None:
        super().__init__()
        self.at = set(at)

    def on_after_backward(self) -> None:
        if (self.current_epoch, self.trainer.fit_loop.epoch_loop.batch_idx) in self.at:
            self.net[0].weight.grad[0, 0] = float("inf")


class _ScalePerStep(pl.Callback):
    """The loss scale after each optimizer step."""

    def __init__(self) -> None:
        self.scales: list[float] = []
        self._step = 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step != self._step:
            self._step = trainer.global_step
            self.scales.append(_scale(trainer))


# -- 1. GradientAccumulationScheduler ------------------------------------------------------------------------------
def test_an_accumulation_schedule_with_an_overflow_after_its_change_scales_and_skips_as_16_mixed() -> None:
    """{0: 1, 1: 4}: an overflow in a micro-batch inside a 4-batch window skips that one optimizer step and halves the
    scale, as "16-mixed" does: the same scale after every optimizer step, one skipped step, the same weights."""
    runs = {}
    for which in (None, "O1", "O2"):
        model, scales = _InfAt(at=((1, 1),)), _ScalePerStep()
        schedule = GradientAccumulationScheduler({0: 1, 1: 4})
        trainer = _trainer(which, "float16", max_epochs=3, callbacks=[schedule, scales])
        trainer.fit(model, loader(classification_data(n=32), batch_size=8))
        runs[which] = (trainer, scales.scales, _weights(trainer, model))
    _, reference_scales, reference_weights = runs[None]
    assert sum(b < a for a, b in zip(reference_scales, reference_scales[1:])) == 1  # the overflow halved it once
    for level in ("O1", "O2"):
        trainer, scales, weights = runs[level]
        assert trainer.global_step == 4 + 1 + 1
        assert scales == reference_scales, level
        assert trainer.precision_plugin.metrics()["mpx/skipped_steps"] == 1
        assert _max_diff(weights, reference_weights) < 2e-3


# -- 2. OnExceptionCheckpoint ----------------------------------------------------------------------------------------
class _Boom(Exception):
    """A user's error (KeyboardInterrupt-like) raised between backward and the optimizer step."""


class _FailsAt(_InfAt):
    """At global step ``fail_at`` records the state, then raises ``_Boom`` before the step ("user") or writes an inf
    into a gradient (``on_floor="raise"`` raises from the step: "floor")."""

    def __init__(self, fail_at: int, how: str) -> None:
        super().__init__()
        self.fail_at, self.how, self.at_failure = fail_at, how, None

    def _record(self) -> None:
        plugin = self.trainer.precision_plugin
        self.at_failure = (_weights(self.trainer, self), plugin.amp.scalers[0].state_dict(), _model_state(self))

    def on_after_backward(self) -> None:
        if self.trainer.global_step == self.fail_at and self.how == "floor":
            self._record()
            self.net[0].weight.grad[0, 0] = float("inf")

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.trainer.global_step == self.fail_at and self.how == "user":
            self._record()
            raise _Boom("a user's error between backward and step")


def _model_state(module: pl.LightningModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class _StateAtStart(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        scaler = trainer.precision_plugin.amp.scalers[0].state_dict()
        self.state = (_weights(trainer, module), scaler, _model_state(module), trainer.global_step)


@pytest.mark.parametrize(
    "level, half, how", [("O1", "bfloat16", "user"), ("O2", "bfloat16", "user"), ("O2", "float16", "floor")]
)
def test_the_checkpoint_written_on_an_exception_resumes_to_the_state_at_the_exception(
    level: str, half: str, how: str, tmp_path: Any
) -> None:
    """An exception between backward and step (a user's, or our LossScaleFloorError at float16 with
    ``on_floor="raise"``): ``OnExceptionCheckpoint``'s file resumes (``ckpt_path=``) to the weights, masters, half
    model and scaler state at the exception, nothing half-updated by the failed step."""
    settings: dict[str, Any] = dict(init_scale=4.0, min_loss_scale=4.0, on_floor="raise") if how == "floor" else {}

    def trainer(callback: pl.Callback) -> pl.Trainer:
        plugin = MixedPrecisionPlugin(level, half_dtype=half, **settings)
        return make_trainer(plugin, callbacks=[callback], enable_checkpointing=True, default_root_dir=tmp_path)

    model = _FailsAt(fail_at=3, how=how)
    with pytest.raises(LossScaleFloorError if how == "floor" else _Boom):
        trainer(OnExceptionCheckpoint(tmp_path)).fit(model, loader(classification_data(n=64), batch_size=8))
    resumed = _StateAtStart()
    ckpt = os.path.join(tmp_path, "on_exception.ckpt")
    trainer(resumed).fit(Classifier(), loader(classification_data(n=64), batch_size=8), ckpt_path=ckpt)
    weights, scaler, state, step = resumed.state
    assert step == 3
    assert _max_diff(weights, model.at_failure[0]) == 0.0
    assert scaler == model.at_failure[1]
    assert state.keys() == model.at_failure[2].keys()
    assert all(state[k].dtype == v.dtype and torch.equal(state[k], v) for k, v in model.at_failure[2].items())


# -- 3. SpikeDetection, EarlyStopping ------------------------------------------------------------------------------
class _Spiky(_InfAt):
    def __init__(self, spike_at: int | None = None, at: tuple[tuple[int, int], ...] = ()) -> None:
        super().__init__(at)
        self.spike_at, self.seen = spike_at, []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * 50 if batch_idx == self.spike_at else loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(outputs["loss"])


def test_spike_detection_sees_the_loss_bf16_mixed_shows_it_and_no_spike_from_a_skipped_step(tmp_path: Any) -> None:
    """SpikeDetection reads the step's loss: a spike stops the run at the batch where "bf16-mixed" stops (the same FP32
    losses before it); an overflow's skipped steps (bfloat16, ``on_floor="continue"``) leave the weights finite and
    raise no spike, where "bf16-mixed" writes the inf into the weights and its next loss spikes."""
    from lightning.fabric.utilities.spike import TrainingSpikeException
    from lightning.pytorch.callbacks import SpikeDetection

    losses = {}
    for which in (None, "O1", "O2"):
        model, spikes = _Spiky(spike_at=6), SpikeDetection(window=3, warmup=2, exclude_batches_path=tmp_path)
        with pytest.raises(TrainingSpikeException):
            _trainer(which, "bfloat16", callbacks=[spikes]).fit(model, loader(classification_data(n=64), 8))
        assert spikes.bad_batches == [5, 6]
        losses[which] = torch.stack(model.seen)
    for level in ("O1", "O2"):
        assert losses[level].dtype == torch.float32
        torch.testing.assert_close(losses[level], losses[None], atol=2e-3, rtol=0)

        model, spikes = _Spiky(at=((0, 3), (0, 4))), SpikeDetection(window=3, warmup=2, exclude_batches_path=tmp_path)
        plugin = MixedPrecisionPlugin(level, half_dtype="bfloat16", on_floor="continue")
        trainer = make_trainer(plugin, callbacks=[spikes])
        trainer.fit(model, loader(classification_data(n=48), 8))
        assert spikes.bad_batches == [] and trainer.global_step == 6
        assert trainer.precision_plugin.metrics()["mpx/skipped_steps"] == 2
        assert all(p.isfinite().all() for p in model.parameters())


class _Overflowing(Classifier):
    """Batch 2 of the first epoch overflows float16 in the forward (an inf loss, logged as ``train_loss``)."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if batch_idx == 2 and self.current_epoch == 0:
            x = x * 1e5
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", F.cross_entropy(self(batch[0]), batch[1]))


def test_early_stopping_after_a_float16_overflow_stops_when_16_mixed_does() -> None:
    """O2 float16: an overflowing batch (inf loss, skipped step) does not stop ``EarlyStopping(monitor="val_loss")``
    ("16-mixed" does not stop either): all epochs run, the weights stay finite."""
    data = loader(classification_data(n=32), 8)
    stopped = {}
    for which in (None, "O2"):
        early = EarlyStopping(monitor="val_loss", patience=5)
        model = _Overflowing()
        trainer = _trainer(
            which, "float16", max_epochs=2, callbacks=[early], limit_val_batches=1, num_sanity_val_steps=0
        )
        trainer.fit(model, data, data)
        stopped[which] = (trainer.current_epoch, early.stopped_epoch)
        assert all(p.isfinite().all() for p in model.parameters())
    assert stopped["O2"] == stopped[None] == (2, 0)
    assert trainer.precision_plugin.metrics()["mpx/skipped_steps"] == 1


# -- 4. ModelSummary, DeviceStatsMonitor ----------------------------------------------------------------------------
class _Summarised(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(4)
        self.example_input_array = torch.randn(2, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.net(x))

    def on_fit_start(self) -> None:
        from lightning.pytorch.utilities.model_summary import ModelSummary as Summary

        summary = Summary(self, max_depth=2)
        self.summary = (summary.total_parameters, summary.trainable_parameters, summary.model_size, summary.out_sizes)


def test_model_summary_and_device_stats_report_as_under_bf16_mixed() -> None:
    """The same parameter counts and layer output sizes (the example input runs through the half model) as under
    "bf16-mixed"; the "params size" is Lightning's estimate from ``trainer.precision``: 4 bytes a parameter at O1
    ("bf16-mixed", as Lightning's own), 2 at O2 ("bf16-true": the half model; the FP32 masters, 4 bytes a trained
    parameter, are optimizer-side state it does not count, docs/lightning.md). DeviceStatsMonitor logs CPU stats."""
    summaries, logged = {}, {}
    for which in (None, "O1", "O2"):
        logger, model = RecordingLogger(), _Summarised()
        callbacks = [ModelSummary(max_depth=2), DeviceStatsMonitor(cpu_stats=True)]
        trainer = _trainer(
            which,
            "bfloat16",
            max_steps=2,
            callbacks=callbacks,
            logger=logger,
            log_every_n_steps=1,
            enable_model_summary=True,
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Precision bf16-mixed is not supported by the model summary")
            trainer.fit(model, loader(classification_data(n=32), 8))
        summaries[which] = model.summary
        logged[which] = {k.rsplit("/", 1)[-1] for _, metrics in logger.logged for k in metrics}
    for level in ("O1", "O2"):
        total, trainable, size, outputs = summaries[level]
        assert (total, trainable, outputs) == (summaries[None][0], summaries[None][1], summaries[None][3])
        assert size == pytest.approx(summaries[None][2] * (0.5 if level == "O2" else 1.0))
        assert {"cpu_percent", "cpu_vm_percent"} <= logged[level] and logged[level] >= logged[None]


# -- 5. Timer, val_check_interval inside an accumulation window, BasePredictionWriter --------------------------------
class _StopsAfter(Timer):
    """A Timer whose time runs out after ``batches`` training batches (deterministic)."""

    def __init__(self, batches: int) -> None:
        super().__init__(duration="00:01:00:00", interval="step")
        self.batches, self.seen = batches, 0

    def time_elapsed(self, stage: Any = None) -> float:
        return 3600.0 if self.seen >= self.batches else 0.0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.seen += 1
        super().on_train_batch_end(trainer, *args)


class _Writer(BasePredictionWriter):
    def __init__(self) -> None:
        super().__init__("batch")
        self.predictions: list[torch.Tensor] = []

    def write_on_batch_end(self, trainer: Any, module: Any, prediction: Any, *args: Any) -> None:
        self.predictions.append(prediction)


def _predictions(level: str | None, data: Any) -> torch.Tensor:
    """What BasePredictionWriter is handed by ``trainer.predict`` after a two-step fit."""
    model, writer = Classifier(), _Writer()
    _trainer(level, "bfloat16", max_steps=2).fit(model, data)
    _trainer(level, "bfloat16", callbacks=[writer]).predict(model, data, return_predictions=False)
    return torch.cat(writer.predictions)


@pytest.fixture(scope="module")
def bf16_mixed_predictions() -> torch.Tensor:
    return _predictions(None, loader(classification_data(n=48), 8))


class _CountsValidations(_InfAt):
    validations = 0

    def on_validation_start(self) -> None:
        self.validations += 1


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_stops_and_validations_inside_an_accumulation_window_and_a_prediction_writer_after_the_fit(
    level: str, bf16_mixed_predictions: torch.Tensor
) -> None:
    """``accumulate_grad_batches=4``: a Timer that runs out at the 5th micro-batch (float16, which overflowed) leaves
    the weights and loss scale of the one finished step (as ``max_steps=1``: the half window and its overflow are
    dropped, as "16-mixed" drops them); ``val_check_interval=3`` validates inside
    windows and trains the same weights as without validation. Afterwards BasePredictionWriter gets the predictions
    "bf16-mixed" gets (at O2 in FP32: the model's boundary casts its outputs; "bf16-mixed" and O1 hand bfloat16)."""
    data = loader(classification_data(n=48), 8)
    runs = {}
    for case in ("timer", "max_steps", "validating", "not_validating"):
        model = _CountsValidations(at=((0, 4),) if case == "timer" else ())  # an overflow in the dropped window
        if case == "timer":
            trainer = _trainer(level, "float16", max_epochs=2, accumulate_grad_batches=4, callbacks=[_StopsAfter(5)])
        elif case == "max_steps":
            trainer = _trainer(level, "float16", max_steps=1, accumulate_grad_batches=4)
        else:
            validating = case == "validating"
            trainer = _trainer(
                level,
                "bfloat16",
                accumulate_grad_batches=4,
                val_check_interval=3 if validating else 1.0,
                limit_val_batches=1 if validating else 0,
                num_sanity_val_steps=0,
            )
        trainer.fit(model, data, data if case.endswith("validating") else None)
        runs[case] = (trainer.global_step, _weights(trainer, model), model)
        if case in ("timer", "max_steps"):
            plugin = trainer.precision_plugin
            runs[case] += (plugin.amp.scalers[0].state_dict(), plugin.metrics()["mpx/skipped_steps"])
    assert runs["timer"][0] == runs["max_steps"][0] == 1
    assert _max_diff(runs["timer"][1], runs["max_steps"][1]) == 0.0
    assert runs["timer"][3:] == runs["max_steps"][3:] and runs["timer"][4] == 0  # its overflow counts nowhere
    assert runs["validating"][2].validations == 2 and runs["validating"][0] == 2
    assert _max_diff(runs["validating"][1], runs["not_validating"][1]) == 0.0

    predictions = _predictions(level, data)
    assert predictions.dtype == (torch.float32 if level == "O2" else torch.bfloat16)
    assert bf16_mixed_predictions.dtype == torch.bfloat16
    torch.testing.assert_close(predictions.float(), bf16_mixed_predictions.float(), atol=2e-2, rtol=0)


# -- 6. WeightAveraging with its own should_update -----------------------------------------------------------------
def test_a_weight_average_updated_every_other_step_at_o2_averages_the_masters_as_bf16_mixed() -> None:
    """``WeightAveraging`` whose ``should_update`` picks odd steps: at O2 the ``AveragedModel`` is FP32 and holds the
    mean of the FP32 masters at those steps; after the fit the masters are that average, as "bf16-mixed"'s FP32
    weights are, and the half model its rounding."""
    from lightning.pytorch.callbacks import WeightAveraging

    class OddSteps(WeightAveraging):
        def should_update(self, step_idx: int | None = None, epoch_idx: int | None = None) -> bool:
            return step_idx is not None and step_idx % 2 == 1

    class Seen(pl.Callback):
        def __init__(self) -> None:
            self.weights: list[list[torch.Tensor]] = []

        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
            if (trainer.global_step - 1) % 2 == 1:
                self.weights.append(_weights(trainer, module))

        def on_train_end(self, trainer: pl.Trainer, module: Any) -> None:
            self.average = [p.detach().clone() for p in averaging._average_model.module.parameters()]

    finals = {}
    for which in (None, "O2"):
        model, averaging, seen = Classifier(optimizer="adamw", lr=0.01), OddSteps(), Seen()
        trainer = _trainer(which, "bfloat16", max_epochs=2, callbacks=[averaging, seen])
        trainer.fit(model, loader(classification_data(n=32), 8))
        mean = [torch.stack(ws).mean(0) for ws in zip(*seen.weights, strict=True)]
        assert len(seen.weights) == 4 and all(p.dtype == torch.float32 for p in seen.average)
        assert _max_diff(seen.average, mean) < 1e-6
        finals[which] = _weights(trainer, model)
        assert _max_diff(finals[which], mean) < 1e-6
        if which == "O2":
            assert all(p.dtype == torch.bfloat16 for p in model.parameters())
            assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(model.parameters(), mean))
    assert _max_diff(finals["O2"], finals[None]) < 2e-3
