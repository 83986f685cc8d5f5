"""``MixedPrecisionPlugin.clip_gradients`` keeps Lightning's ``Precision.clip_gradients`` contract.

Lightning's contract: nothing happens when ``clip_val <= 0`` (whatever the optimizer), and a clip goes through
``clip_grad_by_value`` or ``clip_grad_by_norm``, the extension points a subclass overrides. Ported from Lightning's
``tests_pytorch/plugins/precision/test_amp.py`` (``test_clip_gradients``,
``test_optimizer_amp_scaling_support_in_step_method``) under O1/O2 x float16/bfloat16, plus a subclass whose
overrides are called in a real fit and clip the unscaled gradients the step uses.
"""

from __future__ import annotations

from typing import Any
from unittest.mock import Mock

import pytest
import torch
from torch.optim import Optimizer

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402

from lightning_mpx import MixedPrecisionPlugin  # noqa: E402
from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer  # noqa: E402

LEVELS = [("O1", "bfloat16"), ("O2", "bfloat16"), ("O1", "float16"), ("O2", "float16")]


@pytest.mark.parametrize(("level", "half"), LEVELS)
def test_clip_gradients(level: str, half: str) -> None:
    """Upstream's test: `.clip_gradients()` is a no-op when clipping is disabled (an optimizer the plugin never
    saw included), and dispatches to the one extension point of the algorithm otherwise."""
    optimizer = Mock(spec=Optimizer)
    precision = MixedPrecisionPlugin(level, half_dtype=half)
    precision.clip_grad_by_value = Mock()
    precision.clip_grad_by_norm = Mock()
    precision.clip_gradients(optimizer)
    precision.clip_grad_by_value.assert_not_called()
    precision.clip_grad_by_norm.assert_not_called()

    precision.clip_gradients(optimizer, clip_val=1.0, gradient_clip_algorithm=GradClipAlgorithmType.VALUE)
    precision.clip_grad_by_value.assert_called_once()
    precision.clip_grad_by_norm.assert_not_called()

    precision.clip_grad_by_value.reset_mock()
    precision.clip_grad_by_norm.reset_mock()

    precision.clip_gradients(optimizer, clip_val=1.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM)
    precision.clip_grad_by_value.assert_not_called()
    precision.clip_grad_by_norm.assert_called_once()


@pytest.mark.parametrize(("level", "half"), LEVELS)
def test_optimizer_amp_scaling_support_in_step_method(level: str, half: str) -> None:
    """Upstream's test, with one deliberate difference: Lightning's "16-mixed" refuses to clip for an optimizer that
    unscales inside its step (a fused one: its GradScaler cannot unscale before the clip); this plugin unscales
    itself, so the clip goes through at every dtype."""
    optimizer = Mock(_step_supports_amp_scaling=True)
    plugin = MixedPrecisionPlugin(level, half_dtype=half)
    plugin.clip_grad_by_norm = Mock()
    plugin.clip_gradients(optimizer, clip_val=1.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM)
    plugin.clip_grad_by_norm.assert_called_once()


class OwnClipping(MixedPrecisionPlugin):
    """Clips with torch's own functions on ``main_params`` (Lightning's ``Precision`` implementation), recording
    each call and the gradient norm it saw."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[tuple[str, float]] = []

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        norm = torch.nn.utils.clip_grad_norm_(list(self.main_params(optimizer)), clip_val)
        self.calls.append(("norm", float(norm)))

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        params = list(self.main_params(optimizer))
        self.calls.append(("value", max(float(p.grad.abs().max()) for p in params)))
        torch.nn.utils.clip_grad_value_(params, clip_val)


@pytest.mark.parametrize("algorithm", ["norm", "value"])
@pytest.mark.parametrize(("level", "half"), LEVELS)
def test_a_subclass_clipping_its_own_way_is_called_in_a_fit(level: str, half: str, algorithm: str) -> None:
    """A real fit with ``gradient_clip_val``: the subclass's override is called at every step with the unscaled
    gradients (the norms it sees are the FP32 run's, not times the loss scale), and the run trains as with the
    plugin's own clip."""
    clip = 0.05 if algorithm == "norm" else 0.005
    steps = 3
    data = loader(classification_data(n=48))

    def fit(plugin: MixedPrecisionPlugin) -> Classifier:
        model = Classifier(lr=0.1)
        trainer = make_trainer(plugin, max_steps=steps, gradient_clip_val=clip, gradient_clip_algorithm=algorithm)
        trainer.fit(model, data)
        return model

    own = OwnClipping(level, half_dtype=half)
    trained = fit(own)
    assert [kind for kind, _ in own.calls] == [algorithm] * steps
    reference = OwnClipping("O0")  # FP32: what the override sees without scaling
    fit(reference)
    seen = [value for _, value in own.calls]
    expected = [value for _, value in reference.calls]
    assert seen == pytest.approx(expected, rel=0.1)  # unscaled (a float16 scale would multiply them by 65536)
    assert all(value > clip for value in seen)  # the clip is active
    default = fit(MixedPrecisionPlugin(level, half_dtype=half))
    for (name, a), b in zip(trained.named_parameters(), default.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-3, msg=name)
