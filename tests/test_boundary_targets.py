"""At O2 and O3 a loss computed inside the model from a float target that the model boundary cast to half takes the
target's FP32 values (lightning_mpx/casting/targets.py), at every front door: the core ``Amp`` (``cast_inputs``),
Fabric, the Trainer plugin and the Accelerate adapter. The reference is the loss of the model's own returned
prediction against the caller's FP32 targets, which Accelerate's ``"bf16"`` and Lightning's ``"bf16-mixed"`` compute
(the half model's rounding aside): targets near 300, where bfloat16's spacing is 2, so a rounded target is off by up
to 1 and the loss by ~3e-3. The model also feeds the targets to a half layer (as SpeechT5's decoder prenet reads its
mel ``labels``): compute keeps the half tensor. Tiny models, bfloat16, CPU.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp
from lightning_mpx.casting.targets import SOURCE_ATTRIBUTE

HALF = "bfloat16"


class _Regressor(nn.Module):
    """``forward(x, labels)``: a prediction from ``x`` and a half prenet of the labels, its MSE against
    ``labels[:, 1]`` (a strided view of the cast labels) computed inside; keeps the cast labels it was given."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.prenet = nn.Linear(2, 4)
        self.head = nn.Linear(4, 1)
        self.inplace = inplace
        self.kept: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.kept = labels  # as autograd keeps an input of a half layer for the backward pass
        pred = self.head(x + self.prenet(labels)).squeeze(-1)  # labels in half compute (a prenet)
        target = labels[:, 1]
        if self.inplace:
            target.mul_(2.0)  # written in place after the cast: the loss must see the written values
        return F.mse_loss(pred.float(), target), pred


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 4, generator=g), 300 + 3 * torch.rand(8, 2, generator=g)


def _check(model: _Regressor, out: Any, labels: torch.Tensor) -> None:
    loss, pred = out
    assert pred.dtype == torch.float32 and labels.dtype == torch.float32
    assert loss.item() == pytest.approx(F.mse_loss(pred, labels[:, 1]).item(), rel=1e-6)
    assert model.kept.dtype == torch.bfloat16
    note = getattr(model.kept, SOURCE_ATTRIBUTE, None)
    assert note is None or note[0].tensor is None  # nothing of the FP32 batch kept after the forward (weakly only)


@pytest.mark.parametrize("level", ["O2", "O3"])
@pytest.mark.parametrize("whole", [True, False], ids=["tuple", "one-tensor"])
def test_core_amp_loss_inside_the_forward_takes_the_fp32_targets(level, whole):
    amp = Amp(level, half_dtype=HALF)
    model = amp.prepare_model(_Regressor())
    x, labels = _batch()
    with amp.forward_context():
        args = amp.cast_inputs((x, labels)) if whole else (amp.cast_inputs(x), amp.cast_inputs(labels))
        out = amp.cast_outputs(model(*args))
    _check(model, out, labels)
    assert not amp.policy._noted


@pytest.mark.parametrize("inference", [False, True], ids=["grad", "inference-mode"])
def test_core_amp_target_written_in_place_after_the_cast_is_the_written_half_value(inference):
    """A target written in place inside the forward is not replaced by its stale source: its version moved, or,
    under inference mode (no version counter), its half value is no longer the source's rounding."""
    amp = Amp("O2", half_dtype=HALF)
    model = amp.prepare_model(_Regressor(inplace=True))
    x, labels = _batch()
    with torch.inference_mode(inference), amp.forward_context():
        loss, pred = amp.cast_outputs(model(*amp.cast_inputs((x, labels))))
    written = labels[:, 1].to(torch.bfloat16).mul_(2.0).float()
    assert loss.item() == pytest.approx(F.mse_loss(pred, written).item(), rel=1e-6)
    assert loss.item() != pytest.approx(F.mse_loss(pred, labels[:, 1] * 2).item(), rel=1e-5)


def test_core_amp_loss_under_inference_mode_takes_the_fp32_targets():
    """Evaluation (Lightning validates under inference mode, whose tensors have no version counter)."""
    amp = Amp("O2", half_dtype=HALF)
    model = amp.prepare_model(_Regressor())
    x, labels = _batch()
    with torch.inference_mode(), amp.forward_context():
        out = amp.cast_outputs(model(*amp.cast_inputs((x, labels))))
    _check(model, out, labels)


def test_boundary_hooks_under_inference_mode_share_their_notes_with_the_scopes_policy():
    """The Trainer plugin's boundary hooks (:class:`BoundaryCast`) on a model run under inference mode: the loss's
    ``labels[:, 1]`` does not know its base there, and is found by its storage among the notes the hooks gave the
    policy of the scope they run in (dropped when the scope ends)."""
    from lightning_mpx.casting.boundary import BoundaryCast

    amp = Amp("O2", half_dtype=HALF)
    model = amp.prepare_model(_Regressor())
    (boundary,) = BoundaryCast.for_model([model], torch.bfloat16)
    model.register_forward_pre_hook(boundary.pre, with_kwargs=True)
    model.register_forward_hook(boundary.post, always_call=True)
    x, labels = _batch()
    with torch.inference_mode(), amp.forward_context():
        out = model(x, labels)
    _check(model, out, labels)
    assert not amp.policy._noted


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_fabric_loss_inside_the_forward_takes_the_fp32_targets(level):
    lightning = pytest.importorskip("lightning")
    from lightning_mpx import FabricMixedPrecisionPlugin

    plugin = FabricMixedPrecisionPlugin(level, half_dtype=HALF)
    fabric = lightning.Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    model = _Regressor()
    wrapped = fabric.setup(model)
    x, labels = _batch()
    _check(model, wrapped(x, labels=labels), labels)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_trainer_plugin_loss_inside_the_modules_forward_takes_the_fp32_targets(level):
    """A LightningModule whose ``forward(x, y)`` computes the loss (the boundary's hooks on the module itself)."""
    pl = pytest.importorskip("lightning.pytorch")
    from lightning_mpx import MixedPrecisionPlugin

    seen: list[tuple[Any, torch.Tensor]] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _Regressor()

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
            return self.net.forward(x, y)  # the module's own forward: inside the boundary

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            out = self(*batch)
            seen.append((out, batch[1]))
            return out[0]

        def validation_step(self, batch: Any, batch_idx: int) -> None:  # under inference mode: views lose _base
            seen.append((self(*batch), batch[1]))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.0)

    module = Module()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_batch()), batch_size=8)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, enable_progress_bar=False, logger=False,
                         enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=1, plugins=[MixedPrecisionPlugin(level, half_dtype=HALF)])  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader, loader)
    assert len(seen) == 2  # a training step and a validation step
    for out, labels in seen:
        _check(module.net, out, labels)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_accelerate_float_keyword_feeds_half_compute_and_its_loss_takes_the_fp32_values(level):
    """A float keyword that the model reads in a half layer (SpeechT5's mel ``labels``) and computes its loss from."""
    pytest.importorskip("accelerate")
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    try:
        handlers = [MixedPrecisionKwargs(half_dtype=HALF)]
        accelerator = Accelerator(mixed_precision=level, cpu=True, kwargs_handlers=handlers)
        model = _Regressor()
        prepared = accelerator.prepare(model)
        x, labels = _batch()
        _check(model, prepared(x, labels=labels), labels)
    finally:
        reset_accelerate_state()
