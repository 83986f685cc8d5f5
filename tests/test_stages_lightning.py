"""The per-optimizer stages through a real Lightning Trainer on CPU, against the same LightningModule trained by
Lightning in FP32: a training_step that returns None with gradient clipping, a manual backward between a clip and
the step, a GAN whose overflow is charged to its own loss, numpy loss ids and consecutive hysteresis."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import MixedPrecisionPlugin
from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer

TOLERANCE = dict(rtol=1e-3, atol=5e-4)  # float16 against FP32 after a few SGD steps


def _assert_trained_alike(model: pl.LightningModule, reference: pl.LightningModule) -> None:
    # At O2 the model holds the masters rounded to half: compare in FP32 within half tolerance.
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got.float(), want, **TOLERANCE, msg=name)


class SkipsBatches(Classifier):
    """Returns ``None`` from ``training_step`` at the given batches: Lightning then skips backward and step."""

    def __init__(self, skip_at: tuple[int, ...], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.skip_at = set(skip_at)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx in self.skip_at else loss


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_training_step_returning_none_with_clipping_does_not_leak(level):
    # The clip of the skipped batch unscaled (nothing) and no step followed. Before the fix the next batch's step
    # used its still-scaled gradients, clipped to the clip value (O1: an update far larger than FP32's) or, at O2,
    # stepped nothing. (Clipping by value is not tried: Lightning's own FP32 clip_grad_value_ fails on a batch
    # without gradients, in torch's clip_grad_value_ of an empty list.)
    data = loader(classification_data(n=64), batch_size=16)  # 4 batches, the second one skipped
    model = SkipsBatches(skip_at=(1,), lr=0.05)
    plugin = MixedPrecisionPlugin(level, init_scale=2.0**10, half_dtype="float16")
    trainer = make_trainer(plugin, gradient_clip_val=10.0)
    trainer.fit(model, data)
    reference = SkipsBatches(skip_at=(1,), lr=0.05)
    make_trainer(precision="32-true", gradient_clip_val=10.0).fit(reference, data)  # 10 is above the norm: no clip
    assert trainer.global_step == reference.trainer.global_step
    _assert_trained_alike(model, reference)


class ClipsBetweenBackwards(pl.LightningModule):
    """Manual optimization: backward on half the batch, clip, backward on the other half, step."""

    def __init__(self, algorithm: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.automatic_optimization = False
        self.algorithm = algorithm

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        opt = self.optimizers()
        self.manual_backward(F.cross_entropy(self.net(x[:8]), y[:8]))
        # The torch optimizer, not the LightningOptimizer: the plugin does not unwrap the latter (reported).
        clip = 0.05 if self.algorithm == "norm" else 0.01
        self.clip_gradients(opt.optimizer, gradient_clip_val=clip, gradient_clip_algorithm=self.algorithm)
        self.manual_backward(F.cross_entropy(self.net(x[8:]), y[8:]))
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_a_manual_backward_between_clip_and_step_adds_at_the_right_scale(level, algorithm):
    # Before the fix the second backward's scaled gradients were stepped as they were: 1024x too large here.
    data = loader(classification_data(n=48), batch_size=16)
    model = ClipsBetweenBackwards(algorithm)
    make_trainer(MixedPrecisionPlugin(level, init_scale=2.0**10, half_dtype="float16")).fit(model, data)
    reference = ClipsBetweenBackwards(algorithm)
    make_trainer(precision="32-true").fit(reference, data)
    _assert_trained_alike(model, reference)


class ZeroesWithoutNone(pl.LightningModule):
    """A GAN in manual optimization without toggle_optimizer, zeroing with ``set_to_none=False``: the generator's
    loss (1) reaches the discriminator, whose gradients are zeroed before its own loss (0) runs."""

    def __init__(self, nan_at: int, id_type: type = int) -> None:
        super().__init__()
        self.id_type = id_type
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 1))
        self.automatic_optimization = False
        self.nan_at = nan_at
        self.stepped: list[tuple[bool, bool]] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        plugin = self.trainer.precision_plugin
        z = torch.randn(real.shape[0], 4)
        logits = self.discriminator(torch.cat([real, self.generator(z).detach()]))
        labels = torch.cat([torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)])
        self.manual_backward(F.binary_cross_entropy_with_logits(logits, labels), loss_id=self.id_type(0))
        if batch_idx == self.nan_at:
            self.discriminator[0].weight.grad[0, 0] = float("nan")
        opt_d.step()
        d_stepped = not plugin.step_was_skipped(opt_d.optimizer)
        opt_d.zero_grad(set_to_none=False)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self.generator(z)), torch.ones(real.shape[0], 1))
        self.manual_backward(g_loss, loss_id=self.id_type(1))
        opt_g.step()
        self.stepped.append((d_stepped, not plugin.step_was_skipped(opt_g.optimizer)))
        opt_g.zero_grad(set_to_none=False)
        opt_d.zero_grad(set_to_none=False)

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.Adam(self.generator.parameters(), lr=1e-3),
            torch.optim.Adam(self.discriminator.parameters(), lr=1e-3),
        )


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize("id_type", [int, np.int64])
def test_a_discriminator_overflow_backs_off_only_its_own_scale(id_type, level):
    # Before the fix the zeroed (set_to_none=False) gradients of the generator's loss counted as loss 1's in the
    # discriminator's step, so its overflow backed off both scales: [128, 128]. numpy loss ids were refused. At O2
    # the optimizers hold the model's own parameters, so their zero_grad clears what the next step would read.
    plugin = MixedPrecisionPlugin(level, num_losses=2, init_scale=256.0, half_dtype="float16")
    model = ZeroesWithoutNone(nan_at=1, id_type=id_type)
    data = loader(torch.utils.data.TensorDataset(torch.randn(24, 8)), batch_size=8)  # 3 iterations
    make_trainer(plugin).fit(model, data)
    assert model.stepped == [(True, True), (False, True), (True, True)]
    metrics = plugin.metrics()
    assert (metrics["mpx/loss_scale/loss0"], metrics["mpx/loss_scale/loss1"]) == (128.0, 256.0)
    assert plugin.amp.skipped_steps == [1, 0]


def test_every_amp_setting_is_a_named_typed_plugin_and_adapter_setting():
    # A setting reachable only through **overrides is neither typed nor documented where Lightning and Accelerate
    # users look (consecutive_hysteresis and model_writes were so until stop 20).
    import dataclasses
    import inspect

    from lightning_mpx import Amp
    from lightning_mpx.integrations.accelerate import MixedPrecisionKwargs

    amp = {n for n, p in inspect.signature(Amp.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY}
    plugin = inspect.signature(MixedPrecisionPlugin.__init__).parameters
    assert amp <= set(plugin), sorted(amp - set(plugin))
    assert all(plugin[name].annotation is not inspect.Parameter.empty for name in amp)
    assert amp <= {f.name for f in dataclasses.fields(MixedPrecisionKwargs)}
    plugin = MixedPrecisionPlugin("O2", model_writes="values", half_dtype="bfloat16")
    assert plugin.amp.model_writes == "values"


def test_consecutive_hysteresis_reaches_the_plugin_engine():
    plugin = MixedPrecisionPlugin("O1", hysteresis=3, consecutive_hysteresis=True, half_dtype="float16")
    assert all(scaler.consecutive_hysteresis for scaler in plugin.amp.scalers)
    with pytest.raises(TypeError, match="consecutive_hysteresis='no' must be True or False"):
        MixedPrecisionPlugin("O1", consecutive_hysteresis="no", half_dtype="bfloat16")
