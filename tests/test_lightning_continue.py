"""Continuing a finished ``fit``: ``Trainer.fit`` called again on the same Trainer and model with a raised
``max_steps`` (how users train on after looking at a run, and how ``benchmarks/step.py --persistent`` measures).

Lightning carries the model and the step count into the second ``fit`` and calls ``configure_optimizers`` again (a
fresh optimizer and scheduler) and iterates the data from its start. The plugin must carry what is its own: the FP32
masters (not new ones rounded from the half weights), the loss scale and its growth counter. The reference is the
same two fits in FP32 with Lightning's own precision."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from lightning_mpx import MixedPrecisionPlugin  # noqa: E402
from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer  # noqa: E402

FIRST, TOTAL = 4, 9


class _AtSecondFit(pl.Callback):
    """What the plugin holds when the second fit's first batch starts."""

    def __init__(self, plugin: MixedPrecisionPlugin | None) -> None:
        self.plugin, self.fits, self.seen = plugin, 0, None

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.fits += 1

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if self.fits == 2 and self.seen is None and self.plugin is not None:
            amp = self.plugin.amp
            self.seen = ([amp.master_of(p).clone() for p in module.parameters()], amp.scalers[0].get_scale())


def _two_fits(plugin: MixedPrecisionPlugin | None) -> tuple[Classifier, dict[str, Any]]:
    model = Classifier(optimizer="sgd", lr=0.1)  # SGD: a deviation stays the size of the rounding (AdamW flips signs)
    probe = _AtSecondFit(plugin)
    data = loader(classification_data(n=256), batch_size=16)
    trainer = make_trainer(plugin, max_steps=FIRST, max_epochs=-1, callbacks=[probe])
    trainer.fit(model, data)
    after_first = None
    if plugin is not None:
        after_first = ([plugin.amp.master_of(p).clone() for p in model.parameters()], plugin.amp.scalers[0].get_scale())
    trainer.fit_loop.epoch_loop.max_steps = TOTAL
    trainer.fit(model, data)
    assert trainer.global_step == TOTAL
    return model, {"after_first": after_first, "at_second": probe.seen}


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread (the tolerances below were measured so), restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_fit_continued_keeps_the_masters_and_the_scale(level, dtype):
    # float16: a scale that grows every 3 overflow-free steps and never overflows, so that the growth counter has to
    # cross from one fit to the next for the scale to grow at steps 3, 6 and 9 as in one fit.
    kwargs: dict[str, Any] = {"init_scale": 256.0, "growth_interval": 3} if dtype == "float16" else {}
    plugin = MixedPrecisionPlugin(level, half_dtype=dtype, **kwargs)
    model, seen = _two_fits(plugin)
    masters, scale = seen["after_first"]
    masters_then, scale_then = seen["at_second"]
    for a, b in zip(masters, masters_then):
        assert a.dtype == torch.float32 and torch.equal(a, b)  # the FP32 masters themselves, not re-made from half
    assert scale_then == scale
    assert plugin.amp.skipped_steps == [0]
    if dtype == "float16":
        assert plugin.amp.scalers[0].get_scale() == 256.0 * 2**3  # three growths, as in one fit of 9 steps
    # The trained weights follow Lightning's own two FP32 fits within half-precision rounding.
    reference, _ = _two_fits(None)
    atol = 2.5e-2 if dtype == "bfloat16" else 3e-3  # measured: 0.0097 and 0.001 at most (torch 2.13, CPU)
    for (name, mine), theirs in zip(model.state_dict().items(), reference.state_dict().values()):
        torch.testing.assert_close(mine.float(), theirs, atol=atol, rtol=0, msg=name)
