"""What users do with a model right after a mixed-precision fit: TorchScript (``to_torchscript()``, scripted and
traced), ``torch.jit.trace``, ``torch.export.export``, ``trainer.predict`` and going on training, at O1 (the FP32
model: FP32 inputs, FP32 weights in every export) and O2 (the half model: its own dtype's inputs), against the same
model fitted in FP32 (the Accelerate adapter's ``save_pretrained`` without ``state_dict=``:
tests/test_accelerate_save_pretrained.py). bfloat16; tolerances, not bit equality, against FP32."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import MixedPrecisionPlugin
from tests.lightning_helpers import classification_data, loader, make_trainer

HALF = torch.bfloat16


class _Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.5)


def _fit(level: str | None, model: _Net | None = None, **kwargs: Any) -> tuple[pl.Trainer, _Net]:
    model = model if model is not None else _Net()
    trainer = make_trainer(MixedPrecisionPlugin(level, half_dtype=HALF) if level else None, **kwargs)
    trainer.fit(model, loader(classification_data(n=32, seed=1), batch_size=8))
    return trainer, model


_X = torch.randn(4, 16, generator=torch.Generator().manual_seed(5))


class _HooksSeen(pl.Callback):
    """The forward hooks on the model's block at each training batch (O2: the engine's loss-region hooks)."""

    def __init__(self) -> None:
        self.counts: set[int] = set()

    def on_train_batch_start(self, trainer: pl.Trainer, module: _Net, *args: Any) -> None:
        self.counts.add(len(module.net._forward_pre_hooks) + len(module.net._forward_hooks))


@pytest.fixture(scope="module")
def fp32_out() -> torch.Tensor:
    return _fit(None)[1](_X).detach()


def _exports(model: _Net, x: torch.Tensor) -> dict[str, tuple[torch.Tensor, set[torch.dtype]]]:
    """Each export's output on ``x`` and the dtypes of the weights it holds."""
    scripted = model.to_torchscript()
    traced = model.to_torchscript(method="trace", example_inputs=x)
    jit = torch.jit.trace(model, x)
    exported = torch.export.export(model, (x,))
    got = {}
    for name, export, state in (
        ("script", scripted, scripted.state_dict()), ("trace", traced, traced.state_dict()),
        ("jit.trace", jit, jit.state_dict()), ("export", exported.module(), exported.state_dict),
    ):
        with torch.no_grad():
            got[name] = export(x), {v.dtype for v in state.values()}
    return got


def test_an_o1_fitted_model_exports_fp32_weights_that_give_the_fp32_runs_outputs(fp32_out: torch.Tensor) -> None:
    _, model = _fit("O1")
    for name, (out, dtypes) in _exports(model.eval(), _X).items():
        assert dtypes == {torch.float32} and out.dtype == torch.float32, name
        torch.testing.assert_close(out, fp32_out, atol=2e-2, rtol=0, msg=name)


def test_an_o2_fitted_model_scripts_traces_and_exports_in_its_half_dtype_then_trains_on(
    fp32_out: torch.Tensor,
) -> None:
    """``to_torchscript()`` compiled the engine's O2 loss-region hooks the fit left on the model (``Unknown type name
    'nn.Module'`` in loss_regions.py); the Trainer's teardown now takes them off, and the next fit puts them back."""
    first = _HooksSeen()
    trainer, model = _fit("O2", callbacks=[first])
    masters = {k: v.clone() for k, v in trainer.precision_plugin.amp.fp32_state_dict(model).items()}
    assert len(first.counts) == 1 and not model.net._forward_pre_hooks and not model.net._forward_hooks
    fitting, first.counts = first.counts, set()
    model.eval()
    for name, (out, dtypes) in _exports(model, _X.to(HALF)).items():
        assert dtypes == {HALF} and out.dtype == HALF, name  # the half model, as "bf16-true" exports it
        torch.testing.assert_close(out.float(), fp32_out, atol=5e-2, rtol=0, msg=name)
    assert {k: v.dtype for k, v in model.state_dict().items()} == dict.fromkeys(masters, torch.float32)
    # The same Trainer fits on (a second epoch) from the same FP32 masters as without the exports, hooked again.
    trainer_straight, straight = _fit("O2")
    for run, net in ((trainer, model.train()), (trainer_straight, straight)):
        run.fit_loop.max_epochs = 2
        run.fit(net, loader(classification_data(n=32, seed=1), batch_size=8))
    assert first.counts == fitting  # the loss regions' hooks are back for the new fit
    want = trainer_straight.precision_plugin.amp.fp32_state_dict(straight)
    for key, value in trainer.precision_plugin.amp.fp32_state_dict(model).items():
        assert torch.equal(value, want[key]) and not torch.equal(value, masters[key]), key


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_predict_after_the_fit_gives_the_fp32_runs_outputs(level: str, fp32_out: torch.Tensor) -> None:
    trainer, model = _fit(level)
    out = torch.cat(trainer.predict(model, loader(torch.utils.data.TensorDataset(_X), batch_size=4)))
    # O1 returns autocast's half output, as Lightning's "bf16-mixed" does; O2 the boundary's FP32 output.
    assert out.dtype == (HALF if level == "O1" else torch.float32)
    torch.testing.assert_close(out.float(), fp32_out, atol=5e-2, rtol=0)
