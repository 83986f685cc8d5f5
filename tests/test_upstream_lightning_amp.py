"""Lightning's own tests of its mixed-precision plugin, ported to ``MixedPrecisionPlugin`` (the Trainer's).

Upstream: ``tests/tests_pytorch/plugins/precision/test_amp.py`` (Lightning 2.6.5, the tests of the installed 2.6.6;
``test_amp_with_inference_mode`` is from Lightning's master, newer than 2.6.x). Its ``test_clip_gradients`` (clipping
through ``clip_grad_by_value``/``clip_grad_by_norm``, issue 39 item 12) is ported with that item's fix. Each test is
named after its upstream test and runs under O1/O2 x float16/bfloat16; docs/testing.md ("Ported framework tests")
lists the deliberate differences.
"""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

from lightning_mpx import MixedPrecisionPlugin
from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer

HALVES = ("float16", "bfloat16")
CASES = [pytest.param(level, half, id=f"{level}-{half}") for level in ("O1", "O2") for half in HALVES]


def _plugin(level: str, half: str) -> MixedPrecisionPlugin:
    # float16: a first scale of 1024, not 2**16, so that the few steps of a test are taken, not skipped
    return MixedPrecisionPlugin(level, half_dtype=half, init_scale=1024.0)


def _fp32_weights(plugin: MixedPrecisionPlugin, model: nn.Module) -> dict[str, torch.Tensor]:
    """The FP32 values the model trains from: the O2 masters, the model's own weights at O1."""
    return plugin.amp.fp32_state_dict(model) if plugin.opt_level == "O2" else model.state_dict()


@pytest.mark.parametrize(("level", "half"), CASES)
def test_optimizer_amp_scaling_support_in_step_method(level, half):
    """Upstream ``test_amp.py::test_optimizer_amp_scaling_support_in_step_method``: an optimizer that unscales in its
    own step (``_step_supports_amp_scaling``, a fused Adam) cannot be clipped with a GradScaler: ``clip_gradients``
    raises ``RuntimeError("The current optimizer ... does not allow for gradient clipping")``.

    Ours (a deliberate difference): the plugin, not the optimizer, unscales, so a fused AdamW is clipped like the
    unfused one: a real Trainer fit with ``gradient_clip_val`` ends with the same weights either way. Lightning's own
    "16-mixed" still refuses (checked here, so that a change upstream is noticed)."""
    fused = torch.optim.AdamW(nn.Linear(2, 2).parameters(), fused=True)
    own = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(RuntimeError, match="The current optimizer.*does not allow for gradient clipping"):
        own.clip_gradients(fused, clip_val=1.0)

    weights = {}
    for optimizer, clip in (("adamw", 0.05), ("adamw_fused", 0.05), ("adamw_fused", None)):
        plugin = _plugin(level, half)
        model = Classifier(optimizer=optimizer, lr=0.01)
        trainer = make_trainer(plugin, limit_train_batches=3, gradient_clip_val=clip)
        trainer.fit(model, loader(classification_data()))
        assert trainer.global_step == 3 and plugin.metrics()["mpx/skipped_steps"] == 0
        weights[optimizer, clip] = _fp32_weights(plugin, model)
    for name, value in weights["adamw", 0.05].items():
        torch.testing.assert_close(weights["adamw_fused", 0.05][name], value)
    # and the clip did something: without it the fused run ends elsewhere
    assert any(not torch.allclose(weights["adamw_fused", None][k], v) for k, v in weights["adamw_fused", 0.05].items())


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def _grads_after_a_grad_free_forward(level: str, half: str, grad_mode: str | None) -> list[torch.Tensor]:
    """Upstream's body: in the plugin's forward context, a forward under ``grad_mode`` (none: skipped), then one with
    gradients; the loss has a graph and its backward gives the layer gradients, which are returned."""
    plugin = _plugin(level, half)
    module = _Tiny()
    plugin.convert_module(module)
    x = torch.randn(1, 2, generator=torch.Generator().manual_seed(0))
    with plugin.forward_context():
        if grad_mode is not None:
            with getattr(torch, grad_mode)():
                _ = module(x)
        loss = module(x).float().mean()
        assert loss.grad_fn is not None
        loss.backward()
    return [p.grad.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize(("level", "half"), CASES)
def test_amp_with_no_grad(level, half):
    """Upstream ``test_amp.py::test_amp_with_no_grad``: a ``torch.no_grad()`` forward inside the plugin's forward
    context does not break gradient tracking of the next forward there (autocast's cast cache kept a weight cast
    made without a graph). Ours also checks the gradients equal those of the same forward without the ``no_grad``
    one (the O1 parameter-cast cache must not hand out the graph-less cast)."""
    expected = _grads_after_a_grad_free_forward(level, half, None)
    got = _grads_after_a_grad_free_forward(level, half, "no_grad")
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


@pytest.mark.parametrize(("level", "half"), CASES)
def test_amp_with_inference_mode(level, half):
    """Upstream (master) ``test_amp.py::test_amp_with_inference_mode``: the same with ``torch.inference_mode()``."""
    expected = _grads_after_a_grad_free_forward(level, half, None)
    got = _grads_after_a_grad_free_forward(level, half, "inference_mode")
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


class _TeacherStudent(Classifier):
    """A training step that first runs the model without gradients (a target from the model itself, as in
    self-distillation or an EMA teacher), then the forward that is trained: the Trainer-side case of upstream's
    regression."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        with torch.no_grad():
            target = self(x).float().softmax(-1)
        logits = self(x).float()
        return F.cross_entropy(logits, y) + F.cross_entropy(logits, target)


@pytest.mark.parametrize(("level", "half"), CASES)
def test_amp_with_no_grad_in_training_step(level, half):
    """Upstream ``test_amp.py::test_amp_with_no_grad``, from a real Trainer: a ``no_grad`` forward in
    ``training_step`` before the trained one; the fit trains every parameter (Lightning's FP32 "32-true" run of the
    same module is the reference, to half-precision tolerance)."""
    plugin = _plugin(level, half)
    model = _TeacherStudent(lr=0.05)
    reference = copy.deepcopy(model)
    make_trainer(plugin, limit_train_batches=2).fit(model, loader(classification_data()))
    make_trainer(limit_train_batches=2).fit(reference, loader(classification_data()))
    initial = Classifier().state_dict()
    trained = _fp32_weights(plugin, model)
    for name, value in reference.state_dict().items():
        assert not torch.equal(trained[name], initial[name]), name
        torch.testing.assert_close(trained[name], value, rtol=0.05, atol=0.01)
