"""Hostile cases against this stop's newest surfaces: the Trainer plugin's weight averaging at O2, each against
Lightning's own precision or the same run without the disturbing event."""

from __future__ import annotations

import signal
import warnings
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



# -- the Apex layer: two losses, two optimizers, their schedulers ----------------------------------------------------
_BEFORE = "Detected call of `lr_scheduler.step()` before `optimizer.step()`"


@pytest.fixture
def _apex_state():
    from lightning_mpx.apex import _amp_state

    yield
    _amp_state.reset()
    _amp_state.registrations.clear()


def _loss(model: torch.nn.Module, seed: int, poison: float) -> torch.Tensor:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed)).to(next(model.parameters()).dtype)
    return model(x).float().pow(2).mean() * poison


# Per iteration: (blocks, scheduler stepped); a block is (loss_id, which models' losses, optimizers, poison, delay).
_ITERATIONS = [
    # the first iteration: loss 1 overflows for both optimizers, loss 0 accumulated with delay_unscale before it
    ([(0, "ab", "ab", 1.0, True), (1, "ab", "ab", float("inf"), False)], "ab"),
    # an inf on loss 1 only, which names the second optimizer alone
    ([(0, "a", "a", 1.0, False), (1, "b", "b", float("inf"), False)], "ab"),
    ([(0, "ab", "ab", 1.0, False)], "ab"),  # both clean, in one block
    ([(1, "a", "ab", float("inf"), False), (0, "b", "b", 1.0, False)], "ab"),  # one block names both, overflows
    ([(0, "a", "a", 1.0, True), (0, "a", "a", 1.0, False), (1, "b", "b", 1.0, False)], "ab"),
    # read clean at the first block's end, then a second block's backward overflows for the same optimizer
    ([(0, "ab", "ab", 1.0, False), (1, "a", "a", float("inf"), False)], "ab"),
]


def _apex_run(level: str) -> dict[str, Any]:
    from lightning_mpx.apex import amp

    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in models]
    before = torch.optim.lr_scheduler.StepLR(optimizers[0], 1, 0.5)  # made on the raw optimizer, before initialize
    extra = {"cast_model_type": torch.bfloat16} if level == "O2" else {}
    models, optimizers = amp.initialize(models, optimizers, opt_level=level, num_losses=2, verbosity=0, **extra)
    schedulers = [before, torch.optim.lr_scheduler.StepLR(optimizers[1], 1, 0.5)]  # the second made on the wrapper
    pick = {"a": 0, "b": 1}
    seen: dict[str, Any] = {"weights": [], "lrs": [], "warned": []}
    for it, (blocks, stepped) in enumerate(_ITERATIONS):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for loss_id, which, named, poison, delay in blocks:
                loss = sum(_loss(models[pick[k]], it, poison) for k in which)
                opts = [optimizers[pick[k]] for k in named]
                with amp.scale_loss(loss, opts if len(opts) > 1 else opts[0], loss_id=loss_id,
                                    delay_unscale=delay) as scaled:  # fmt: skip
                    scaled.backward()
            for optimizer in optimizers:
                optimizer.step()
            for k in stepped:
                schedulers[pick[k]].step()
            for optimizer in optimizers:
                optimizer.zero_grad()
        seen["warned"].append(sum(_BEFORE in str(w.message) for w in caught))
        seen["weights"].append([p.detach().float().clone() for m in models for p in m.parameters()])
        seen["lrs"].append([o.param_groups[0]["lr"] for o in optimizers])
    seen["scales"] = [s["loss_scale"] for k, s in amp.state_dict().items() if k.startswith("loss_scaler")]
    return seen


def _no_memo(self: Any, optimizer: torch.optim.Optimizer) -> bool:
    """``StepMachine.overflowed`` without its memo: every call reads the flag, and the step reads it again."""
    state = self.state(optimizer)
    flags = state.found_by_loss
    flag = next(iter(flags.values())) if len(flags) == 1 else state.found_inf
    return flag is not None and bool(flag.item() > 0)


@pytest.mark.usefixtures("_apex_state")
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_apex_two_losses_decide_and_schedule_as_reads_never_reused_and_as_grad_scaler(level, monkeypatch):
    """Two optimizers with a scheduler each (one made before ``amp.initialize``, one after), ``num_losses=2``,
    ``delay_unscale`` accumulation, an inf on one loss only and a block naming both optimizers: the skip decisions,
    weights, rates and scales equal a run whose flag reads are never reused (``StepMachine.overflowed`` without its
    memo), and the schedulers warn where per-loss ``GradScaler``s would: once each on the first iteration, whose
    steps both overflowed, and never after a real step."""
    from lightning_mpx.engine.optimizers import StepMachine

    ours = _apex_run(level)
    from lightning_mpx.apex import _amp_state

    _amp_state.reset()
    _amp_state.registrations.clear()
    monkeypatch.setattr(StepMachine, "overflowed", _no_memo)
    reference = _apex_run(level)
    for it, (a, b) in enumerate(zip(ours["weights"], reference["weights"])):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), it
    assert ours["lrs"] == reference["lrs"] and ours["scales"] == reference["scales"]
    assert ours["warned"] == reference["warned"] == [2, 0, 0, 0, 0, 0]
    # The skipped steps: the first for both, the second's for b (its loss overflowed), the fourth's for both, the
    # sixth's for a (b steps).
    moved = [[not torch.equal(x, y) for x, y in zip(ours["weights"][i], ours["weights"][i - 1])] for i in range(1, 6)]
    assert moved[0] == [True, True, False, False] and moved[2] == [False] * 4 and all(moved[1]) and all(moved[3])
    assert moved[4] == [False, False, True, True]
