"""A hostile Lightning Trainer user at stop 52: habits against the same run under Lightning's own precision.

* ``trainer.fit(torch.compile(model))`` at O2/O3: Lightning compiles the module's forward and steps; the plugin's
  boundary hook, traced inside the compiled step, read the compiled forward Lightning set on the instance, which
  Dynamo cannot (``InternalTorchDynamoError: 'method' object has no attribute '__dict__'``). It now trains, and
  predicts, as the same run in eager mode.
* An O2 checkpoint read without the plugin (``LightningModule.load_from_checkpoint``, ``fit(ckpt_path=...)`` under
  ``precision="bf16-mixed"``) gave the half rounding of the trained weights: now their FP32 masters, exactly. The
  checkpoint callback's habits around it (``save_top_k=2``, ``every_n_train_steps``, ``fit(ckpt_path="last")``
  mid-epoch, ``test(ckpt_path="best")``) follow the same run under ``bf16-mixed``; a weights-only checkpoint still
  holds the half values (strict xfail).
* Refusals a Trainer user can act on: Lightning's ``ModelPruning`` (its lottery-ticket reset writes FP32 tensors into
  the O2 model's ``param.data``) and a raw ``optimizer.step()`` at O2 (``self.optimizers(use_pl_optimizer=False)``)
  named only the core API (``prepare_model()``, ``amp.step``). The same raw step at O1 with a dynamic float16 scale,
  which applied the scaled gradients, is refused too (stop 52, evalfirst).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lightning_mpx import MixedPrecisionPlugin  # noqa: E402
from tests.lightning_helpers import classification_data, loader, make_trainer  # noqa: E402


class _Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        self.at_start: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def on_train_start(self) -> None:
        self.at_start = {k: v.detach().clone() for k, v in self.state_dict().items()}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.5)


def _data() -> torch.utils.data.DataLoader:
    return loader(classification_data(n=64, seed=1), batch_size=8)


def _trainer(precision: str, **kwargs: Any) -> pl.Trainer:
    """``precision``: an opt level (the plugin, bfloat16) or Lightning's own (``"bf16-mixed"``)."""
    if precision.startswith("O"):
        return make_trainer(MixedPrecisionPlugin(precision, half_dtype=torch.bfloat16), **kwargs)
    return make_trainer(precision=precision, **kwargs)


@pytest.mark.usefixtures("fresh_dynamo")
def test_fitting_a_torch_compiled_module_at_o2_trains_as_in_eager_mode() -> None:
    level = "O2"  # (O3 goes through the same boundary hook)
    eager = _Net()
    _trainer(level, max_steps=3).fit(eager, _data())
    module = _Net()
    trainer = _trainer(level, max_steps=3)
    trainer.fit(torch.compile(module, backend="eager"), _data())  # failed in Dynamo, tracing the boundary hook
    for (name, got), want in zip(module.named_parameters(), eager.parameters()):
        assert got.dtype == torch.bfloat16, name
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


def test_an_o2_checkpoint_read_without_the_plugin_holds_the_fp32_masters(tmp_path: Any) -> None:
    model = _Net()
    trainer = _trainer("O2")  # one epoch: a resume continues exactly where it ended
    trainer.fit(model, _data())
    path = tmp_path / "o2.ckpt"
    trainer.save_checkpoint(path)
    masters = trainer.precision_plugin.amp.fp32_state_dict(model)
    assert any(not torch.equal(v, v.bfloat16().float()) for v in masters.values())  # the masters are finer than half

    # The file holds each master once (in the state dict; the plugin's entry names them): 4 bytes a parameter, not
    # the 8 of two FP32 copies (nor stop 51's 6: half weights beside the masters).
    saved = torch.load(path, weights_only=True)
    entry = saved["MixedPrecisionPlugin"]
    assert entry["master_weights"] == [{}] and sorted(entry["masters_in_state_dict"][0]) == sorted(masters)
    loaded = _Net.load_from_checkpoint(path)  # a plain FP32 module: the trained weights are the masters
    for name, value in loaded.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, masters[name]), name

    # Resumed under Lightning's own precision: it starts from the masters.
    resumed = _Net()
    _trainer("bf16-mixed", max_steps=9).fit(resumed, _data(), ckpt_path=str(path))
    for name, value in resumed.at_start.items():
        assert torch.equal(value, masters[name]), name

    # Resumed at O2 again: the model holds the masters' rounding, the masters the checkpoint's own.
    again = _Net()
    trainer = _trainer("O2")
    trainer.fit(again, _data(), ckpt_path=str(path))
    for name, value in trainer.precision_plugin.amp.fp32_state_dict(again).items():
        assert torch.equal(value, masters[name]), name
    for name, value in again.state_dict(keep_vars=True).items():  # the parameters themselves (state_dict(): masters)
        assert torch.equal(value, masters[name].bfloat16()), name


def test_checkpoint_callback_habits_at_o2_follow_bf16_mixed(tmp_path: Any) -> None:
    """``save_top_k=2`` every 2 steps, ``fit(ckpt_path="last")`` mid-epoch, ``test(ckpt_path="best")``."""
    results = {}
    for precision in ("O2", "bf16-mixed"):
        root = tmp_path / precision

        def trainer(steps: int, root: Any = root, precision: str = precision) -> pl.Trainer:
            checkpoint = ModelCheckpoint(
                dirpath=root, save_top_k=2, every_n_train_steps=2, monitor="train_loss", save_last=True
            )
            return _trainer(precision, max_steps=steps, enable_checkpointing=True, callbacks=[checkpoint])

        trainer(5).fit(_Net(), _data())
        model = _Net()
        second = trainer(7)
        second.fit(model, _data(), ckpt_path="last")
        assert second.global_step == 7
        tested = second.test(model, _data(), ckpt_path="best", verbose=False)[0]["test_loss"]
        results[precision] = (model, tested, sorted(p.name for p in root.iterdir()))
    (ours, our_loss, our_files), (theirs, their_loss, their_files) = results["O2"], results["bf16-mixed"]
    assert our_files == their_files
    assert our_loss == pytest.approx(their_loss, rel=1e-2)
    for (name, got), want in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-3, msg=name)


def test_a_callback_replacing_the_weights_with_fp32_tensors_at_o2_is_refused_naming_the_cause_and_the_fix() -> None:
    """Lightning's ``ModelPruning`` resets the weights from FP32 copies by default (``param.data = copy``), which makes
    the O2 model FP32 (under ``"bf16-true"`` too, which fails on a dtype mismatch); the engine's refusal spoke of
    ``prepare_model()``, which a Trainer user never calls."""
    from lightning.pytorch.callbacks import ModelPruning

    pruning = ModelPruning("l1_unstructured", amount=0.3, apply_pruning=lambda epoch: epoch == 0)
    trainer = _trainer("O2", max_epochs=2, callbacks=[pruning])
    with pytest.raises(RuntimeError, match=r"param\.data = fp32_tensor.*ModelPruning.*param\.data\.copy_\(tensor\)"):
        trainer.fit(_Net(), _data())


def test_a_weights_only_o2_checkpoint_holds_the_fp32_masters(tmp_path: Any) -> None:
    model = _Net()
    trainer = _trainer("O2", max_steps=4)
    trainer.fit(model, _data())
    path = tmp_path / "weights.ckpt"
    trainer.save_checkpoint(path, weights_only=True)
    masters = trainer.precision_plugin.amp.fp32_state_dict(model)
    for name, value in _Net.load_from_checkpoint(path).state_dict().items():
        assert torch.equal(value, masters[name]), name


class _RawStep(_Net):
    """Manual optimization that steps the raw optimizer (``self.optimizers(use_pl_optimizer=False)``), bypassing the
    precision plugin's ``optimizer_step``, as with any of Lightning's own precisions."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers(use_pl_optimizer=False)
        x, y = batch
        optimizer.zero_grad()
        self.manual_backward(F.cross_entropy(self(x), y))
        optimizer.step()


def test_a_raw_optimizer_step_at_o2_is_refused_naming_the_lightning_optimizer() -> None:
    trainer = _trainer("O2", max_steps=2)
    with pytest.raises(RuntimeError, match=r"outside Amp\.step\(\).*self\.optimizers\(use_pl_optimizer=False\)"):
        trainer.fit(_RawStep(), _data())


def test_a_raw_optimizer_step_at_o1_float16_is_refused_or_trains_as_fp32() -> None:
    # At O1 with the dynamic float16 scale the raw step would apply the gradients times 65536 (Lightning's own
    # '16-mixed' does, and its weights turn NaN): refused, naming the optimizer to step, before any weight changes.
    model = _RawStep()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = make_trainer(MixedPrecisionPlugin("O1", half_dtype=torch.float16), max_steps=1)
    with pytest.raises(RuntimeError, match=r"outside Amp\.step\(\).*self\.optimizers\(use_pl_optimizer=False\)"):
        trainer.fit(model, _data())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
