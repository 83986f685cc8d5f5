"""Hostile cases against this stop's newest surfaces: the Trainer plugin's weight averaging at O2, each against
Lightning's own precision or the same run without the disturbing event."""

from __future__ import annotations

import signal
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.callbacks import EMAWeightAveraging  # noqa: E402

from lightning_mpx import MixedPrecisionPlugin  # noqa: E402
from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer  # noqa: E402


def _average(callback: Any) -> list[torch.Tensor]:
    average = callback._average_model
    return [p.detach().clone() for p in getattr(average, "module", average).parameters()]


@pytest.mark.parametrize("precision", ["O2", "32-true"])
def test_a_validation_during_the_fit_leaves_the_ema_average_as_it_was(precision: str) -> None:
    """``EMAWeightAveraging`` swaps its average into the model for every validation and back afterwards, through
    ``copy_`` into the model's tensors: at O2 the half model rounded the FP32 average to bfloat16 on the way back
    (every element, every validation: an EMA that stalls as one kept in half). The average after a fit with a
    validation per epoch is the one without any, bit for bit, as with Lightning's FP32."""

    def run(validate: bool) -> list[torch.Tensor]:
        plugin = MixedPrecisionPlugin("O2", half_dtype="bfloat16") if precision == "O2" else None
        averaging = EMAWeightAveraging(decay=0.9)
        data = loader(classification_data(n=16), batch_size=4)
        trainer = make_trainer(plugin, max_epochs=2, callbacks=[averaging], num_sanity_val_steps=1,
                               limit_val_batches=1, **({} if plugin else {"precision": precision}))  # fmt: skip
        trainer.fit(Classifier(optimizer="adamw", lr=1e-3), data, data if validate else None)
        return _average(averaging)

    with_validation, without = run(True), run(False)
    for a, b in zip(with_validation, without):
        assert a.dtype == torch.float32 and torch.equal(a, b)


class _RaisesAt(Classifier):
    """Raises in ``training_step`` at global step ``at``; keeps the FP32 masters after every finished batch."""

    def __init__(self, at: int, error: type[BaseException], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.at, self.error, self.kept = at, error, None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.trainer.global_step == self.at:
            raise self.error("stop")
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        amp = self.trainer.precision_plugin.amp
        self.kept = [amp.master_of(p).detach().clone() for p in self.parameters()]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_fit_that_raised_keeps_the_trained_masters(error: type[BaseException]) -> None:
    """A fit interrupted by an exception in ``training_step`` (or Ctrl+C) never reaches ``on_train_end``: the callback
    wrote no average in, and "bf16-mixed"'s FP32 model holds the trained weights. With a learning rate whose updates
    round away in bfloat16, the half weights still equal the average's rounding, and the plugin's teardown took that
    for an average written in: the masters became the average."""
    plugin = MixedPrecisionPlugin("O2", half_dtype="bfloat16")
    averaging = EMAWeightAveraging(decay=0.5)
    trainer = make_trainer(plugin, callbacks=[averaging])
    model = _RaisesAt(3, error, optimizer="sgd", lr=1e-6)
    handler = signal.getsignal(signal.SIGINT)  # Lightning ignores Ctrl+C from its KeyboardInterrupt on
    try:
        with pytest.raises(SystemExit if error is KeyboardInterrupt else error):
            trainer.fit(model, loader(classification_data(n=32), batch_size=4))
    finally:
        signal.signal(signal.SIGINT, handler)
    assert trainer.interrupted
    masters = [plugin.amp.master_of(p) for p in model.parameters()]
    average = _average(averaging)
    assert not all(torch.equal(m, a) for m, a in zip(model.kept, average))  # (the case: the two differ)
    for kept, master in zip(model.kept, masters):
        assert torch.equal(kept, master)

