"""Lightning's callbacks and Trainer habits against the Trainer plugin, each against Lightning's own precision.

Held elsewhere (not repeated here): SWA and EMA averages taken by the O2 masters, EMA resumed mid-run
(``test_o2_mirror_lightning.py``), ``BaseFinetuning`` unfreezing into FP32 masters and the tuner's restore
(``test_lightning_habits.py``, ``test_lightning_tuner_bf16.py``), a continued ``fit`` (``test_lightning_continue.py``).
Here: the averaging callbacks' copy of a model converted before the fit, the tuner's callbacks
(``LearningRateFinder``, ``BatchSizeFinder``) and a ``precision=`` passed with the plugin.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.callbacks import (  # noqa: E402
    BatchSizeFinder,
    EMAWeightAveraging,
    LearningRateFinder,
    StochasticWeightAveraging,
)

from lightning_mpx import MixedPrecisionPlugin  # noqa: E402
from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer  # noqa: E402
from tests.test_lightning_habits import _Tuned  # noqa: E402


class _AtTrainStart(pl.Callback):
    """Keeps, when training starts (after the callbacks' on_fit_start), the averaging copy's weights, the masters,
    and the plugin's scale and skipped-step count."""

    def __init__(self, averaging: Any = None) -> None:
        self.averaging, self.seen = averaging, None

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if not isinstance(trainer.precision_plugin, MixedPrecisionPlugin):
            return  # a reference run with Lightning's precision
        amp = trainer.precision_plugin.amp
        average = getattr(self.averaging, "_average_model", None)
        average = getattr(average, "module", average)
        self.seen = {
            "average": None if average is None else [p.detach().clone() for p in average.parameters()],
            "masters": [amp.master_of(p).detach().clone() for p in module.parameters()],
            "skipped": list(amp.skipped_steps),
            "scalers": amp.state_dict()["scalers"],
        }


def _average(callback: Any) -> list[torch.Tensor]:
    average = callback._average_model
    return [p.detach().float() for p in getattr(average, "module", average).parameters()]


def _make_averaging(kind: str) -> Any:
    if kind == "ema":
        return EMAWeightAveraging(decay=0.99)
    return StochasticWeightAveraging(swa_lrs=1e-3, swa_epoch_start=1, annealing_epochs=1)


@pytest.mark.parametrize("kind,before", [("ema", "fit"), ("swa", "validate")])
def test_an_average_of_a_model_converted_before_the_fit_is_kept_in_fp32(kind: str, before: str) -> None:
    """The averaging callbacks copy the model in their ``setup``: on the first ``fit`` an FP32 model, whose FP32
    average follows FP32's. A model converted already (``validate`` before ``fit``, or a second ``fit`` on the same
    Trainer) was copied in bfloat16, where an EMA's small updates round away (6x further from FP32's average than
    the first fit's). The copy now starts as the FP32 masters."""
    data = loader(classification_data(n=32), batch_size=4)

    def run(precision: str) -> tuple[Any, _AtTrainStart, Any]:
        plugin = MixedPrecisionPlugin("O2", half_dtype="bfloat16") if precision == "O2" else None
        averaging = _make_averaging(kind)
        seen = _AtTrainStart(averaging)
        trainer = make_trainer(plugin, max_epochs=2 if before == "validate" else 1, callbacks=[averaging, seen],
                               **({} if plugin else {"precision": precision}))  # fmt: skip
        model = Classifier(optimizer="adamw", lr=1e-2)
        if before == "validate":
            trainer.validate(model, data, verbose=False)
        trainer.fit(model, data)
        if before == "fit":
            trainer.fit_loop.max_epochs = 2
            trainer.fit(model, data)
        return averaging, seen, (plugin, model)

    averaging, seen, (plugin, model) = run("O2")
    # The copy the callback averages into starts as the FP32 masters, bit for bit.
    assert all(a.dtype == torch.float32 for a in seen.seen["average"])
    assert all(torch.equal(a, m) for a, m in zip(seen.seen["average"], seen.seen["masters"]))
    # At the end the callback writes its average into the model (its rounding): the masters, and so an FP32 export
    # or a checkpoint's masters, are that FP32 average, as "bf16-mixed"'s FP32 model is; not a mix of it and the
    # trained weights.
    exported = plugin.amp.fp32_state_dict(model)
    for (name, param), average in zip(model.named_parameters(), _average(averaging)):
        assert torch.equal(param, average.to(param.dtype)), name  # the callback wrote its average in
        assert torch.equal(exported[name], average), name
    if kind == "swa":
        return  # (SWA's equal average of a few steps: the exact start above is the case)
    reference, _, _ = run("32-true")
    for ours, want in zip(_average(averaging), _average(reference)):
        # bfloat16 weights averaged against FP32's: 1e-3 here (an average kept in bfloat16: 6.5e-3)
        assert (ours - want).abs().max() <= 3e-3


@pytest.mark.parametrize("finder", ["lr", "batch_size"])
def test_the_tuner_callbacks_leave_the_fit_as_they_found_it(finder: str, tmp_path) -> None:
    """``LearningRateFinder`` and ``BatchSizeFinder`` run the tuner inside ``fit`` (``on_fit_start``), after the
    plugin made the masters, through an overflow (a skipped step, the scale halved), then restore their checkpoint:
    training starts with the masters, the loss scale and the skipped-step count of the fit without them (float16,
    where the scale is dynamic as GradScaler's)."""

    def run(callbacks: list[Any]) -> tuple[_Tuned, dict[str, Any]]:
        plugin = MixedPrecisionPlugin("O2", half_dtype="float16")
        model = _Tuned()
        seen = _AtTrainStart()
        trainer = make_trainer(plugin, max_epochs=1, limit_train_batches=2, limit_val_batches=1,
                               callbacks=[*callbacks, seen], default_root_dir=str(tmp_path))  # fmt: skip
        trainer.fit(model)
        return model, seen.seen

    if finder == "lr":
        tuner = LearningRateFinder(num_training_steps=6, early_stop_threshold=None, update_attr=False)
    else:
        tuner = BatchSizeFinder(init_val=8, max_trials=1, steps_per_trial=2)
    tuned, after = run([tuner])
    _, plain = run([])
    assert tuned.skipped_at_end[0] == [1]  # the tuner's run overflowed and skipped a step
    assert after["skipped"] == plain["skipped"] == [0]
    assert after["scalers"] == plain["scalers"] and after["scalers"][0]["scale"] == 65536.0
    assert all(torch.equal(a, b) for a, b in zip(after["masters"], plain["masters"]))


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "32-true"])
def test_a_precision_passed_with_the_plugin_is_refused_naming_both(precision: str) -> None:
    """Lightning refuses the pair with the plugin's ``str``: it named the object (``<... object at 0x...>``); now it
    names the plugin's level and dtype and what to drop."""
    plugin = MixedPrecisionPlugin("O2", half_dtype="bfloat16")
    with pytest.raises(ValueError) as raised:
        pl.Trainer(precision=precision, plugins=[plugin], accelerator="cpu")
    message = str(raised.value)
    assert f"precision={precision}" in message
    assert "MixedPrecisionPlugin('O2', half_dtype='bfloat16')" in message and "pass no precision=" in message
    assert repr(plugin) == "MixedPrecisionPlugin('O2', half_dtype='bfloat16')"
