"""Lightning Trainer flags the rest of the suite never sets, run with `MixedPrecisionPlugin` against the same Trainer
with Lightning's own precision at the same seed: `fast_dev_run`, `overfit_batches`, `detect_anomaly`, `barebones`,
`max_time`, `check_val_every_n_epoch`, `num_sanity_val_steps=-1`, `limit_val_batches=0`, `max_steps=0` (then more
steps), a second `fit` (a new Trainer, or the same one with a larger limit), `validate`/`test`/`predict` before `fit`,
`precision=` with the plugin, a partial accumulation window at the epoch's end, `log_every_n_steps=1` with the
progress bar, and `profiler="simple"`. O1's bfloat16 runs take `"bf16-mixed"`'s kernels, so they match it to float
rounding; O2's bfloat16 model computes what `"bf16-mixed"` computes from its FP32 masters, so it matches too, within
a bound far under the distance to a `"32-true"` run."""

from __future__ import annotations

import datetime
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_mpx import MixedPrecisionPlugin
from tests.lightning_helpers import Classifier, RecordingLogger, classification_data, loader, make_trainer

DATA = loader(classification_data())  # 4 batches of 16
CLOSE = dict(rtol=0.0, atol=1e-5)  # kernel rounding; a "32-true" run is 1e-4 to 2e-3 away after these few steps


def plugin(level: str, half_dtype: str = "bfloat16") -> MixedPrecisionPlugin:
    return MixedPrecisionPlugin(level, half_dtype=half_dtype)


def trainers(level: str) -> dict[str, Callable[..., pl.Trainer]]:
    """The plugin's Trainer and the reference Trainer (Lightning's "bf16-mixed"), both built by make_trainer."""
    return {
        "mpx": lambda **kw: make_trainer(plugin(level), **kw),
        "ref": lambda **kw: make_trainer(None, precision="bf16-mixed", **kw),
    }


def fp32_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict in FP32 (the FP32 masters at O2)."""
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def assert_weights_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol: Any) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], **(tol or CLOSE), msg=lambda m: f"{key}: {m}")


def max_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


class Counting(Classifier):
    """Counts validation batches and logs its loss to the progress bar."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.val_batches = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_batches += 1
        super().validation_step(batch, batch_idx)


def test_dev_runs_and_validation_flags_match_bf16_mixed() -> None:
    """fast_dev_run (True at O1, 3 at O2) and overfit_batches with check_val_every_n_epoch and
    num_sanity_val_steps=-1 (O2): the same steps, the same validation batches and the same weights as
    "bf16-mixed"."""
    cases: list[tuple[str, dict[str, Any], int, int]] = [  # level, flags, steps, validation batches
        ("O1", dict(fast_dev_run=True), 1, 1),
        ("O2", dict(fast_dev_run=3), 3, 3),
        # overfit: 2 training batches, validated on them; sanity (all 2) + epoch 1's 2 (every 2nd epoch).
        ("O2", dict(overfit_batches=2, max_epochs=2, check_val_every_n_epoch=2, num_sanity_val_steps=-1), 4, 4),
    ]
    for level, kw, steps, val_batches in cases:
        seen = {}
        for name, make in trainers(level).items():
            model = Counting()
            trainer = make(**kw)
            trainer.fit(model, DATA, DATA)
            seen[name] = (trainer.global_step, model.val_batches, model.hidden_dtypes, fp32_weights(model))
        mpx, ref = seen["mpx"], seen["ref"]
        assert mpx[:3] == ref[:3] == (steps, val_batches, {"train": torch.bfloat16, "val": torch.bfloat16}), kw
        assert_weights_close(mpx[3], ref[3])


def float16_reference() -> MixedPrecision:
    """Lightning's own "16-mixed" with a CPU GradScaler (a CPU Trainer's precision="16-mixed" falls back to bf16)."""
    return MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))


class Overflows(Classifier):
    """An inf written into a gradient after step 0's backward (a skipped step, no anomaly: autograd made it), then
    at global step 2 a loss multiplied by 1e30: the scaled float16 backward overflows, inf then NaN."""

    def __init__(self) -> None:
        super().__init__(inject_inf_at=(0,))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * 1e30 if self.trainer.global_step == 2 else loss


@pytest.mark.filterwarnings("ignore:Error detected in:UserWarning")
def test_detect_anomaly_as_lightning_16_mixed() -> None:
    """detect_anomaly=True under float16 (O2): an inf written into a gradient after backward is a skipped step with
    a halved scale, no anomaly, as under Lightning's "16-mixed"; an overflow inside backward makes anomaly mode raise
    at the same step under both, leaving the same finite weights, which a new Trainer trains on. bfloat16 with no
    overflow (O1) trains as "bf16-mixed" does."""
    outcomes, models = {}, {}
    for name, make in {"mpx": lambda: plugin("O2", "float16"), "ref": float16_reference}.items():
        model = models[name] = Overflows()
        trainer = make_trainer(make(), detect_anomaly=True)
        with pytest.raises(RuntimeError, match="returned nan values"):
            trainer.fit(model, DATA)
        outcomes[name] = (trainer.global_step, len(model.losses), trainer.precision_plugin.scaler.get_scale())
        weights = fp32_weights(model)
        assert all(torch.isfinite(v).all() for v in weights.values())
        outcomes[name + " weights"] = weights
    assert outcomes["mpx"] == outcomes["ref"] == (2, 3, 2.0**15)
    assert_weights_close(outcomes["mpx weights"], outcomes["ref weights"], rtol=0.0, atol=1e-4)
    again = make_trainer(plugin("O2", "float16"), max_steps=2)
    again.fit(models["mpx"], DATA)  # the model the plugin's raise left trains on
    assert again.global_step == 2 and all(torch.isfinite(v).all() for v in fp32_weights(models["mpx"]).values())

    runs = {}
    for name, make in trainers("O1").items():
        model = Classifier()
        make(detect_anomaly=True).fit(model, DATA)
        runs[name] = fp32_weights(model)
    assert_weights_close(runs["mpx"], runs["ref"])


def test_barebones_needs_no_logger() -> None:
    """barebones=True (no logger, no callbacks, self.log disabled): the plugin needs no logger and its metrics()
    still reads; the weights at O1 and at O2 are "bf16-mixed"'s."""
    settings: dict[str, Any] = dict(accelerator="cpu", devices=1, max_epochs=1, barebones=True)
    runs = {}
    for name in ("O1", "O2", "bf16-mixed"):
        model = Counting()
        if name == "bf16-mixed":
            trainer = pl.Trainer(precision=name, **settings)
        else:
            trainer = pl.Trainer(plugins=[plugin(name)], **settings)
        trainer.fit(model, DATA)
        assert trainer.loggers == [] and trainer.global_step == 4
        if name != "bf16-mixed":
            assert trainer.precision_plugin.metrics() == {
                "mpx/loss_scale": 1.0, "mpx/overflows": 0.0, "mpx/skipped_steps": 0.0}
        runs[name] = fp32_weights(model)
    assert_weights_close(runs["O1"], runs["bf16-mixed"])
    assert_weights_close(runs["O2"], runs["bf16-mixed"])


class TimesOut(Classifier):
    """Runs the Trainer's max_time out after batch 1 (the Timer sees it at batch 2's end): a stop mid-epoch."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1:
            timer = next(cb for cb in self.trainer.callbacks if isinstance(cb, pl.callbacks.Timer))
            timer._duration = 0.0


class StartWeights(pl.Callback):
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.weights = fp32_weights(pl_module)


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_max_time_stop_mid_epoch_saves_and_resumes(tmp_path: Any) -> None:
    """max_time stops mid-epoch at the step "bf16-mixed" stops at (O2); trainer.save_checkpoint after the stop
    resumes the saved FP32 masters exactly, and the resumed run ends where "bf16-mixed"'s resumed run ends."""
    ends = {}
    for name, make in trainers("O2").items():
        model = TimesOut()
        trainer = make(max_time=datetime.timedelta(hours=1))
        trainer.fit(model, DATA)
        stopped = fp32_weights(model)
        path = tmp_path / f"{name}.ckpt"
        trainer.save_checkpoint(path)
        start = StartWeights()
        resumed = Classifier()
        again = make(max_epochs=2, callbacks=[start])
        again.fit(resumed, DATA, ckpt_path=path)
        assert max_gap(start.weights, stopped) == 0.0
        ends[name] = (trainer.global_step, again.global_step, stopped, fp32_weights(resumed))
    assert ends["mpx"][:2] == ends["ref"][:2] == (3, 7)
    assert_weights_close(ends["mpx"][2], ends["ref"][2])
    assert_weights_close(ends["mpx"][3], ends["ref"][3])


def test_o2_masters_from_fp32_weights_across_fits() -> None:
    """At O2 the masters come from the FP32 weights exactly, not their bfloat16 rounding: after max_steps=0 (the
    state dict is the initial weights, and the same Trainer continued to 3 steps ends as "bf16-mixed"'s does), after
    a first fit (a second fit with a new Trainer is a fresh fit from the first's FP32 weights: 1e-3 away from one
    from their rounding), and after validate/test/predict before the fit (the fit is a fresh fit)."""
    initial = fp32_weights(Classifier())
    ends = {}
    for name, make in trainers("O2").items():
        model = Classifier()
        trainer = make(max_steps=0)
        trainer.fit(model, DATA)
        assert max_gap(fp32_weights(model), initial) == 0.0
        trainer.fit_loop.epoch_loop.max_steps = 3
        trainer.fit(model, DATA)
        ends[name] = (trainer.global_step, fp32_weights(model))
    assert ends["mpx"][0] == ends["ref"][0] == 3
    assert_weights_close(ends["mpx"][1], ends["ref"][1])

    twice = Classifier()
    make_trainer(plugin("O2")).fit(twice, DATA)
    once = fp32_weights(twice)
    make_trainer(plugin("O2")).fit(twice, DATA)
    from_fp32 = Classifier()
    from_fp32.load_state_dict(once)
    make_trainer(plugin("O2")).fit(from_fp32, DATA)
    assert max_gap(fp32_weights(twice), fp32_weights(from_fp32)) == 0.0

    evaluated = Classifier()
    trainer = make_trainer(plugin("O2"))
    trainer.validate(evaluated, DATA)
    trainer.test(evaluated, DATA)
    trainer.predict(evaluated, DATA)
    assert max_gap(fp32_weights(evaluated), initial) == 0.0
    trainer.fit(evaluated, DATA)
    assert max_gap(fp32_weights(evaluated), once) == 0.0


def test_precision_with_the_plugin_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match=r"precision=bf16-mixed.*MixedPrecisionPlugin\('O2'.*pass no precision="):
        make_trainer(plugin("O2"), precision="bf16-mixed")


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_partial_accumulation_window_steps_at_epoch_end(level: str) -> None:
    """accumulate_grad_batches=3 over 4 batches (with limit_val_batches=0): the last window (1 batch) steps at the
    epoch's end, as under "bf16-mixed"; at O2 the half gradients add up in bfloat16 (Apex's O2), hence the bound."""
    runs = {}
    for name, make in trainers(level).items():
        model = Counting()
        trainer = make(accumulate_grad_batches=3, limit_val_batches=0)
        trainer.fit(model, DATA, DATA)
        runs[name] = (trainer.global_step, model.val_batches, fp32_weights(model))
    assert runs["mpx"][:2] == runs["ref"][:2] == (2, 0)
    assert_weights_close(runs["mpx"][2], runs["ref"][2], rtol=0.0, atol=3e-4 if level == "O2" else 1e-5)


def test_log_every_step_with_progress_bar_and_simple_profiler() -> None:
    """log_every_n_steps=1 with the progress bar on: the logger gets the plugin's metrics at every step; the bar
    shows the user's prog_bar metrics, not the plugin's (they are not callback metrics: docs/lightning.md).
    profiler="simple" profiles the run without changing it."""
    logger = RecordingLogger()
    model = Counting()
    trainer = make_trainer(plugin("O2", "float16"), logger=logger, log_every_n_steps=1, enable_progress_bar=True,
                           profiler="simple")
    trainer.fit(model, DATA)
    scales = [(step, m["mpx/loss_scale"]) for step, m in logger.logged if "mpx/loss_scale" in m]
    assert scales == [(step, 2.0**16) for step in range(4)]
    bar = trainer.progress_bar_callback.get_metrics(trainer, model)
    assert "loss" in bar and not any(key.startswith("mpx/") for key in bar)
    assert "run_training_batch" in trainer.profiler.summary()
    plain = Counting()
    make_trainer(plugin("O2", "float16")).fit(plain, DATA)
    assert max_gap(fp32_weights(model), fp32_weights(plain)) == 0.0
