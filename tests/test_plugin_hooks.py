"""The plugin asks which Lightning hooks a model overrides once per fit and class, and whether a step logs once per
step (per-step costs otherwise): the answers must still follow the model, its instance attributes, a class changed
between fits, and a step that stops the training."""

from __future__ import annotations

from typing import Any

import torch

from lightning_mpx import MixedPrecisionPlugin
from tests.lightning_helpers import Classifier, RecordingLogger, classification_data, loader, make_trainer


class CountingBackward(Classifier):
    """A LightningModule with its own ``backward`` (the plugin must call it rather than the policy's shortcut)."""

    def __init__(self) -> None:
        super().__init__()
        self.backward_calls = 0

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.backward_calls += 1
        loss.backward(*args, **kwargs)


def test_a_class_backward_override_is_called_every_step():
    model = CountingBackward()
    trainer = make_trainer(MixedPrecisionPlugin("O1"), max_steps=3)
    trainer.fit(model, loader(classification_data(n=48)))
    assert model.backward_calls == 3


def test_a_backward_set_on_the_instance_mid_fit_is_called_from_then_on():
    calls: list[int] = []

    class SetsBackward(Classifier):
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if batch_idx == 2:  # after two steps that used the default backward

                def backward(loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
                    calls.append(batch_idx)
                    loss.backward(*args, **kwargs)

                self.backward = backward

    model = SetsBackward()
    trainer = make_trainer(MixedPrecisionPlugin("O1"), max_steps=4)
    trainer.fit(model, loader(classification_data(n=64)))
    assert len(calls) == 2  # steps 2 and 3
    assert len(model.losses) == 4


def test_a_gradient_hook_added_to_the_class_between_fits_sees_unscaled_gradients():
    class LaterHooked(Classifier):
        pass

    seen: list[float] = []
    plugin = MixedPrecisionPlugin("O1")
    model = LaterHooked()
    data = loader(classification_data(n=32))
    make_trainer(plugin, max_steps=1).fit(model, data)

    def on_before_optimizer_step(self: Any, optimizer: Any) -> None:
        seen.append(max(p.grad.abs().max().item() for p in self.parameters()))

    LaterHooked.on_before_optimizer_step = on_before_optimizer_step  # type: ignore[method-assign]
    make_trainer(plugin, max_steps=1).fit(model, data)
    # Unscaled gradients of a small classifier are far below the initial scale (2**16); scaled ones are not.
    assert len(seen) == 1 and 0 < seen[0] < 100.0


def test_a_step_that_stops_the_training_logs_the_mpx_metrics():
    class StopsAtTwo(Classifier):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if batch_idx == 2:
                self.trainer.should_stop = True  # not a logging step by the cadence (every 50): logged as the last
            return super().training_step(batch, batch_idx)

    logger = RecordingLogger()
    trainer = make_trainer(MixedPrecisionPlugin("O1"), max_epochs=1, logger=logger, log_every_n_steps=50)
    trainer.fit(StopsAtTwo(), loader(classification_data(n=128)))
    steps = [step for step, metrics in logger.logged if "mpx/loss_scale" in metrics]
    assert steps == [2]
