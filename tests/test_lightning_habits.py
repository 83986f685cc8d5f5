"""Combinations of what Lightning users do, through a real ``Trainer`` at O1 and O2, against the same run in FP32.

Each example draws a set of habits and runs the same ``fit`` twice: with ``MixedPrecisionPlugin`` and with
``precision="32-true"``. The habits: ``gradient_clip_val`` by norm or by value, ``accumulate_grad_batches``, a batch
skipped by returning ``None`` from ``training_step``, gradual unfreezing of the first layer
(``BaseFinetuning``-style: frozen at the start, unfrozen into its own param group at epoch 1), stochastic weight
averaging (Lightning's ``StochasticWeightAveraging``), a checkpoint saved mid-run and resumed in a new ``Trainer``,
and ``AdamW(fused=True)`` instead of SGD in both runs, with the plugin's ``skip_on_device=True``. The loss scale is
set so that nothing overflows, so the two runs take the same steps: the trained weights must agree within
half-precision rounding, and at O2 (without SWA, which writes its average into the model after the last step) the
model's half weights must be the FP32 masters rounded.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.callbacks import BaseFinetuning, ModelCheckpoint, StochasticWeightAveraging  # noqa: E402

from lightning_mpx import MixedPrecisionPlugin  # noqa: E402
from tests.lightning_helpers import classification_data, loader, make_trainer  # noqa: E402


class _Net(pl.LightningModule):
    def __init__(self, skip_batch: int | None, unfreeze: bool, fused: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        # Tanh, not ReLU: a unit whose sign flips between the two runs would change its gradient wholesale, and the
        # comparison would measure chaos rather than the plugin.
        self.features = nn.Sequential(nn.Linear(16, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)
        self.skip_batch = skip_batch
        self.unfreeze = unfreeze
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx == self.skip_batch:
            return None  # Lightning skips this batch's backward and step
        x, y = batch
        return F.cross_entropy(self(x).float(), y)

    def configure_optimizers(self) -> Any:
        params = self.head.parameters() if self.unfreeze else self.parameters()
        if self.fused:  # the plugin runs with skip_on_device=True then: the flag handed to the fused step
            # eps=1e-3: with the default 1e-8 Adam's first steps on near-zero gradients are lr * sign(g), and a sign
            # that half-precision rounding flips moves a weight by 2 * lr (seen at 4e-3 against FP32, with the
            # plugin bit for bit equal to its host-read path): the comparison would measure Adam, not the plugin.
            return torch.optim.AdamW(params, lr=2e-3, eps=1e-3, fused=True)
        return torch.optim.SGD(params, lr=0.05, momentum=0.5)


class _Unfreeze(BaseFinetuning):
    """The first layer frozen at the start and trained from epoch 1 in a param group of its own."""

    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        self.freeze(pl_module.features)

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: Any) -> None:
        if epoch == 1:
            lr = optimizer.param_groups[0]["lr"]  # the head's (SGD's 0.05, AdamW's 2e-3)
            self.unfreeze_and_add_param_group(pl_module.features, optimizer, lr=lr, train_bn=True)


def _fit(plugin_or_precision: Any, habits: dict[str, Any], root: Any) -> tuple[_Net, Any]:
    model = _Net(habits["skip_batch"], habits["unfreeze"], habits["fused"])
    callbacks: list[Any] = []
    if habits["unfreeze"]:
        callbacks.append(_Unfreeze())
    if habits["swa"]:
        callbacks.append(StochasticWeightAveraging(swa_lrs=0.02, swa_epoch_start=1, annealing_epochs=1))
    settings_: dict[str, Any] = dict(
        max_epochs=2, accumulate_grad_batches=habits["accumulate"], enable_checkpointing=True,
        default_root_dir=str(root),
    )
    if habits["clip"] is not None:
        settings_.update(gradient_clip_val=habits["clip"][1], gradient_clip_algorithm=habits["clip"][0])
    if isinstance(plugin_or_precision, str):
        settings_["precision"] = plugin_or_precision

    def make() -> pl.Trainer:  # a fresh plugin for each Trainer
        plugin = None if isinstance(plugin_or_precision, str) else plugin_or_precision()
        return make_trainer(plugin, **settings_, callbacks=[*callbacks, ModelCheckpoint(dirpath=str(root))])

    data = loader(classification_data(n=64, seed=1), batch_size=8)
    if habits["resume"]:
        first = make()
        first.fit_loop.max_epochs = 1
        first.fit(model, data)
        ckpt = str(root / "mid.ckpt")
        first.save_checkpoint(ckpt)
        model = _Net(habits["skip_batch"], habits["unfreeze"], habits["fused"])
        trainer = make()
        trainer.fit(model, data, ckpt_path=ckpt)
    else:
        trainer = make()
        trainer.fit(model, data)
    return model, trainer


# After 16 steps from the same start: float16's and bfloat16's rounding (O2 keeps the model's weights in half).
TOLERANCE = {"float16": dict(rtol=5e-3, atol=5e-4), "bfloat16": dict(rtol=3e-2, atol=3e-3)}

HABITS = st.fixed_dictionaries({
    "level": st.sampled_from(["O1", "O2"]),
    "half": st.sampled_from(["float16", "bfloat16"]),
    "clip": st.sampled_from([None, ("norm", 0.5), ("value", 0.05)]),
    "accumulate": st.sampled_from([1, 2]),
    # The first batch of an accumulation window: on a window's last batch Lightning's own precisions disagree
    # ("32-true" steps on the window's earlier gradients, "16-mixed" skips the step; this plugin does as "16-mixed").
    "skip_batch": st.sampled_from([None, 2]),
    "unfreeze": st.booleans(),
    "swa": st.booleans(),
    "resume": st.booleans(),
    # AdamW(fused=True) in both runs, and the plugin with skip_on_device=True (the step's outcome read later)
    "fused": st.booleans(),
})


@pytest.fixture(scope="module")
def fp32_fits() -> dict[tuple[Any, ...], dict[str, tuple[bool, torch.Tensor]]]:
    """The "32-true" fits' trained parameters (name: requires_grad, value) by the habits that make them: the level and
    the half dtype play no part in a "32-true" run, so examples that differ only in those share one reference fit."""
    return {}


def _fp32_reference(habits: dict[str, Any], root: Any, fits: dict[tuple[Any, ...], Any]) -> dict[str, Any]:
    key = tuple(value for name, value in sorted(habits.items()) if name not in ("level", "half"))
    if key not in fits:
        model, _ = _fit("32-true", habits, root / "fp32")
        fits[key] = {name: (p.requires_grad, p.detach().clone()) for name, p in model.named_parameters()}
    return fits[key]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(habits=HABITS)
def test_habits_at_o1_and_o2_train_as_fp32(habits, tmp_path_factory, fp32_fits):
    # Lightning's SWA scheduler fails on a param group added after it started (KeyError 'swa_lr'), and torch's
    # clip_grad_value_ on a step whose training_step returned None (no gradient at all), in FP32 too.
    assume(not (habits["swa"] and habits["unfreeze"]))
    assume(not (habits["clip"] and habits["clip"][0] == "value" and habits["skip_batch"] is not None))
    root = tmp_path_factory.mktemp("habits")
    level = habits["level"]
    half = habits["half"]
    plugin = lambda: MixedPrecisionPlugin(level, half_dtype=half, init_scale=2.0**8, loss_scale="dynamic",  # noqa: E731
                                          skip_on_device=habits["fused"])
    ours, trainer = _fit(plugin, habits, root / "mpx")
    reference = _fp32_reference(habits, root, fp32_fits)
    if not (habits["swa"] and habits["resume"]):  # (Lightning's SWA, resumed, averages from the fresh model's init)
        assert not torch.equal(reference["head.weight"][1], _Net(None, False).head.weight)  # the runs trained
    amp = trainer.precision_plugin.amp
    assert sum(amp.skipped_steps) == 0  # nothing overflowed: both runs took the same steps
    assert [name for name, _ in ours.named_parameters()] == list(reference)
    for name, got in ours.named_parameters():
        requires_grad, want = reference[name]
        assert got.requires_grad == requires_grad, name
        torch.testing.assert_close(got.detach().float(), want, **TOLERANCE[half], msg=name)
    if level == "O2" and not habits["swa"]:  # the model's half weights are the masters rounded
        # (SWA writes the average into the model after the last step: the masters take it at the next step, or
        # from the model's weights when a checkpoint of it is resumed.)
        for optimizer in trainer.optimizers:
            masters = amp.master_params(optimizer)
            halves = [p for group in optimizer.param_groups for p in group["params"]]
            for master, half in zip(masters, halves):
                assert torch.equal(half.detach(), master.detach().to(half.dtype))


class _Tuned(pl.LightningModule):
    """What ``Tuner`` needs: an ``lr`` attribute, a ``batch_size`` the loaders read, its own loaders; an inf written
    into a gradient at global step 1 (of the tuner's run and of the fit alike), so the loss scale backs off once."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        self.lr, self.batch_size = 0.01, 8
        self.losses: list[torch.Tensor] = []
        self.skipped_at_end: list[list[int]] = []  # the plugin's skipped-step count when each run ended

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss.detach().clone())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def on_after_backward(self) -> None:
        if self.trainer.global_step == 1:
            self.net[0].weight.grad.view(-1)[0] = float("inf")

    def on_train_end(self) -> None:
        self.skipped_at_end.append(list(self.trainer.precision_plugin.amp.skipped_steps))

    def train_dataloader(self) -> Any:
        return loader(classification_data(n=128, seed=2), batch_size=self.batch_size)

    def val_dataloader(self) -> Any:
        return loader(classification_data(n=16, seed=3), batch_size=8)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


@pytest.mark.parametrize("tune", ["lr_find", "scale_batch_size"])
def test_the_tuner_leaves_the_fit_that_follows_as_without_it(tune, tmp_path):
    """``Tuner.lr_find`` and ``Tuner.scale_batch_size`` train for a while (here through an overflow: a skipped step,
    the scale halved), then restore the run from a checkpoint of their own. The fit after them must be the fit
    without them, bit for bit: O2's FP32 masters, the loss scale and the skipped-step count come back too."""
    from lightning.pytorch.tuner import Tuner

    def fit(tuned: bool) -> tuple[_Tuned, MixedPrecisionPlugin, list[Any]]:
        plugin = MixedPrecisionPlugin("O2", half_dtype="float16")
        model = _Tuned()
        trainer = make_trainer(plugin, max_epochs=1, limit_val_batches=1, default_root_dir=str(tmp_path))
        seen: list[Any] = []
        if tuned:
            if tune == "lr_find":
                Tuner(trainer).lr_find(model, num_training=12, early_stop_threshold=None, update_attr=False)
            else:
                Tuner(trainer).scale_batch_size(model, init_val=8, max_trials=2, steps_per_trial=3)
                assert model.batch_size > 8  # it did scale (and ran steps at those sizes)
                model.batch_size = 8
            assert model.skipped_at_end[0] == [1]  # the tuner's first run overflowed and skipped a step
            seen = [list(plugin.amp.skipped_steps), plugin.amp.state_dict()["scalers"]]
            model.losses.clear()
        trainer.fit(model)
        return model, plugin, seen

    plain, plain_plugin, _ = fit(tuned=False)
    tuned, tuned_plugin, after_tuner = fit(tuned=True)
    assert after_tuner == [[0], [{"scale": 65536.0, "growth_tracker": 0, "hysteresis_tracker": 1, "overflows": 0,
                                   "dynamic": True}]]  # fmt: skip
    assert len(plain.losses) == len(tuned.losses) == 16
    assert all(torch.equal(a, b) for a, b in zip(plain.losses, tuned.losses))
    for (name, a), b in zip(plain.named_parameters(), tuned.parameters()):
        assert torch.equal(a, b), name
        assert torch.equal(plain_plugin.amp.master_of(a), tuned_plugin.amp.master_of(b)), name
    assert plain_plugin.amp.state_dict()["scalers"] == tuned_plugin.amp.state_dict()["scalers"]
    assert plain_plugin.amp.skipped_steps == tuned_plugin.amp.skipped_steps == [1]
