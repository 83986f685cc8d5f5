"""The Lightning plugin, driven by a real Trainer on CPU."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_mpx import MixedPrecisionPlugin
from tests.launch import rank_results, run_script
from tests.lightning_helpers import (
    Classifier,
    RecordingClassifier,
    assert_same,
    classification_data,
    loader,
    make_trainer,
    snapshot,
    true_gradients,
)
from tests.warm_python import warm_python

HALVES = [("float16", torch.float16), ("bfloat16", torch.bfloat16)]
ROOT = Path(__file__).resolve().parent.parent


# -- opt levels -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("half_name,half", HALVES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_each_opt_level_trains_with_its_dtypes(level, half_name, half):
    plugin = MixedPrecisionPlugin(level, half_dtype=half_name)
    model = Classifier(optimizer="sgd", lr=0.1)
    trainer = make_trainer(plugin, max_epochs=4)
    prefix = "16" if half == torch.float16 else "bf16"
    expected_precision = {"O0": "32-true", "O1": f"{prefix}-mixed"}.get(level, f"{prefix}-true")
    assert trainer.precision == expected_precision and plugin.opt_level == level
    data = loader(classification_data(n=128))
    trainer.fit(model, data, data)
    trainer.test(model, data, verbose=False)
    trainer.predict(model, data)

    # The forward ran in the opt level's dtype in every kind of step.
    expected_hidden = torch.float32 if level == "O0" else half
    assert model.hidden_dtypes == {s: expected_hidden for s in ("train", "val", "test", "predict")}
    param_dtype = half if level in ("O2", "O3") else torch.float32
    assert model.net[0].weight.dtype == param_dtype
    stepped_dtypes = {p.dtype for p in plugin.amp.master_params(trainer.optimizers[0])}
    assert stepped_dtypes == ({half} if level == "O3" else {torch.float32})  # O2: FP32 masters
    # It learned: the loss went down and nothing overflowed.
    first, last = sum(model.losses[:4]) / 4, sum(model.losses[-4:]) / 4
    assert last < 0.7 * first
    assert plugin.amp.skipped_steps == [0]
    # The model's outputs reach the loss in FP32 at O2/O3 (Apex's output cast) ...
    # (at O1 the last matmul's output is half, and the table sends the loss to FP32) ...
    assert model.logits_dtype == (half if level == "O1" else torch.float32)
    # ... through casts that belong to the Trainer's run: afterwards the model is a plain module again.
    if level in ("O2", "O3"):
        with pytest.raises(RuntimeError, match="dtype"):
            model(torch.randn(2, 16))


def test_o2_evaluation_without_fit_makes_no_masters_and_a_later_fit_does():
    # predict/validate/test only need the half model: FP32 masters would triple its weight memory for nothing.
    # The stage runs in half and gives the FP32 model back when it ends (a later fit's masters start from it).
    plugin = MixedPrecisionPlugin("O2", half_dtype="bfloat16")
    model = Classifier(optimizer="sgd", lr=0.1)
    trainer = make_trainer(plugin, max_epochs=2)
    data = loader(classification_data(n=64))
    fp32 = model.net[0].weight.detach().clone()
    predictions = trainer.predict(model, data)
    trainer.validate(model, data, verbose=False)
    assert plugin.amp.master_weights == []
    assert model.hidden_dtypes == {"predict": torch.bfloat16, "val": torch.bfloat16}
    assert predictions[0].dtype == torch.float32
    assert model.net[0].weight.dtype == torch.float32 and torch.equal(model.net[0].weight, fp32)

    before = model.net[0].weight.detach().clone()
    trainer.fit(model, data)
    assert len(plugin.amp.master_weights) == 1
    assert {p.dtype for p in plugin.amp.master_params(trainer.optimizers[0])} == {torch.float32}
    assert not torch.equal(before, model.net[0].weight)
    assert torch.equal(model.net[0].weight, plugin.amp.master_weights[0].master_of(model.net[0].weight).bfloat16())


def test_o2_conv_net_keeps_batchnorm_fp32_and_trains_fp32_masters():
    class ConvNet(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Sequential(
                nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
            )
            self.head = nn.Linear(8, 2)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.head(self.body(x)), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 3, 8, 8, generator=g)
    data = loader(torch.utils.data.TensorDataset(x, (x.mean((1, 2, 3)) > 0).long()), batch_size=8)
    model = ConvNet()
    plugin = MixedPrecisionPlugin("O2", keep_batchnorm_fp32=True, half_dtype="float16")
    trainer = make_trainer(plugin, max_epochs=2)
    initial_bn = model.body[1].weight.detach().clone()
    trainer.fit(model, data)

    bn, conv = model.body[1], model.body[0]
    assert bn.weight.dtype == bn.bias.dtype == bn.running_mean.dtype == torch.float32
    assert conv.weight.dtype == model.head.weight.dtype == torch.float16
    assert not torch.equal(bn.weight, initial_bn)  # batch norm trained
    optimizer = trainer.optimizers[0]
    params = plugin.amp.master_params(optimizer)
    assert all(p.dtype == torch.float32 for p in params)
    # The optimizer steps masters in place of the half parameters; the half model is a rounding of them.
    masters = plugin.amp.master_weights[0]
    assert masters.master_of(conv.weight) is not conv.weight
    assert any(p is masters.master_of(conv.weight) for p in params)
    assert torch.equal(masters.master_of(conv.weight).half(), conv.weight)
    assert plugin.amp.skipped_steps == [0]


# -- clipping, hooks, fused optimizers ------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_clip_by_norm_acts_on_unscaled_gradients(level):
    plugin = MixedPrecisionPlugin(level, half_dtype="float16")
    model = RecordingClassifier()
    data = classification_data(n=16)
    trainer = make_trainer(plugin, max_steps=1, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
    trainer.fit(model, loader(data))

    true = true_gradients(data[:16])
    true_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in true]))
    seen = trainer.optimizers[0].seen[0]
    seen_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in seen]))
    assert true_norm > 0.05  # the clip is active
    torch.testing.assert_close(seen_norm, torch.tensor(0.05), rtol=1e-3, atol=0)
    for s, t in zip(seen, true):  # same direction as the true gradient, to half-precision accuracy
        torch.testing.assert_close(s, t * (0.05 / true_norm), rtol=2e-2, atol=2e-4)
    # The norm before clipping is reported unscaled.
    metrics = plugin.metrics()
    assert metrics["mpx/grad_norm"] == pytest.approx(true_norm.item(), rel=1e-2)


def test_clip_by_value_acts_on_unscaled_gradients():
    plugin = MixedPrecisionPlugin("O1", half_dtype="float16")
    model = RecordingClassifier()
    trainer = make_trainer(plugin, max_steps=1, gradient_clip_val=1e-3, gradient_clip_algorithm="value")
    trainer.fit(model, loader(classification_data(n=16)))
    seen = trainer.optimizers[0].seen[0]
    assert max(g.abs().max().item() for g in seen) == pytest.approx(1e-3)  # not 1e-3 / scale


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_on_before_optimizer_step_sees_unscaled_gradients(level):
    class Hooked(Classifier):
        def __init__(self) -> None:
            super().__init__()
            self.hook_grads: list[list[torch.Tensor]] = []

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.hook_grads.append([p.grad.float().clone() for p in self.parameters()])

    model = Hooked()
    data = classification_data(n=16)
    trainer = make_trainer(MixedPrecisionPlugin(level, half_dtype="float16"), max_steps=1)
    trainer.fit(model, loader(data))
    for seen, true in zip(model.hook_grads[0], true_gradients(data[:16])):
        torch.testing.assert_close(seen, true, rtol=2e-2, atol=2e-4)


def test_fused_adamw_with_clipping_works():
    # Lightning's own 16-mixed plugin refuses clipping with fused optimizers; here the plugin unscales.
    plugin = MixedPrecisionPlugin("O1", half_dtype="float16")
    model = Classifier(optimizer="adamw_fused", lr=0.01)
    trainer = make_trainer(plugin, max_epochs=4, gradient_clip_val=1.0)
    trainer.fit(model, loader(classification_data(n=128)))
    assert sum(model.losses[-4:]) < 0.7 * sum(model.losses[:4])
    assert plugin.amp.skipped_steps == [0]


# -- overflow -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_injected_overflow_skips_step_and_scheduler_and_halves_scale(level):
    plugin = MixedPrecisionPlugin(level, init_scale=1024.0, half_dtype="float16")
    model = Classifier(inject_inf_at=(2,), optimizer="adamw", lr=0.01, scheduler=True)
    trainer = make_trainer(plugin, max_steps=4)
    scales: list[float] = []

    class ScaleProbe(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            scales.append(plugin.amp.scalers[0].get_scale())

    trainer.callbacks.append(ScaleProbe())
    trainer.fit(model, loader(classification_data(n=64)))

    # Parameters (model and FP32 masters) and optimizer state exactly as before the overflowing step.
    assert_same(model.snapshots[2], model.after_injection[2])
    assert plugin.amp.skipped_steps == [1]
    assert plugin.amp.last_overflow_parameters == ["net.0.weight"]
    assert scales[1:3] == [1024.0, 512.0]
    # The per-step scheduler advanced only on the three real steps: LR 0.01 * 0.5**3.
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == 3
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.01 * 0.5**3)


def test_overflow_message_names_the_parameter(caplog):
    plugin = MixedPrecisionPlugin("O1", half_dtype="float16")
    trainer = make_trainer(plugin, max_steps=2)
    with caplog.at_level("INFO", logger="lightning_mpx"):
        trainer.fit(Classifier(inject_inf_at=(1,)), loader(classification_data(n=32)))
    assert any("net.0.weight" in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records)


# -- accumulation ---------------------------------------------------------------------------------------------------
def test_accumulation_steps_once_and_keeps_the_scale_within_a_window():
    plugin = MixedPrecisionPlugin("O1", growth_interval=1, init_scale=256.0, half_dtype="float16")
    scales_at_backward: list[float] = []

    class Probe(Classifier):
        def on_before_backward(self, loss: torch.Tensor) -> None:
            scales_at_backward.append(plugin.amp.scalers[0].get_scale())

    model = Probe(optimizer="sgd", lr=0.0)
    trainer = make_trainer(plugin, max_epochs=1, accumulate_grad_batches=4)
    trainer.fit(model, loader(classification_data(n=128), batch_size=8))  # 16 micro-batches: 4 real steps
    assert trainer.global_step == 4
    # The scale grows once per real step (growth_interval=1), never inside an accumulation window.
    assert scales_at_backward == [256.0] * 4 + [512.0] * 4 + [1024.0] * 4 + [2048.0] * 4
    assert plugin.amp.scalers[0].get_scale() == 4096.0


def test_accumulated_gradient_equals_the_full_batch_gradient():
    plugin = MixedPrecisionPlugin("O1", half_dtype="bfloat16", loss_scale="dynamic", init_scale=2.0**10)
    model = RecordingClassifier()
    data = classification_data(n=32)
    trainer = make_trainer(plugin, max_steps=1, accumulate_grad_batches=4)
    trainer.fit(model, loader(data, batch_size=8))
    seen = trainer.optimizers[0].seen[0]
    for s, t in zip(seen, true_gradients(data[:32])):
        torch.testing.assert_close(s, t, rtol=3e-2, atol=1e-3)


# -- several optimizers and losses ----------------------------------------------------------------------------------
class TinyGAN(pl.LightningModule):
    def __init__(self, inject_inf_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.inject_inf_at = inject_inf_at
        self.scales: list[tuple[float, float]] = []
        self.d_before: dict[str, torch.Tensor] | None = None
        self.d_after: dict[str, torch.Tensor] | None = None
        self.g_changed: bool | None = None

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        plugin = self.trainer.precision_plugin
        self.scales.append(tuple(s.get_scale() for s in plugin.amp.scalers))
        real = batch[0]
        z = torch.randn(real.shape[0], 4)

        g_before = [p.detach().clone() for p in self.generator.parameters()]
        self.toggle_optimizer(opt_g)
        fake = self.generator(z)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), torch.ones(real.shape[0], 1))
        self.manual_backward(g_loss, loss_id=0)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)
        if batch_idx == self.inject_inf_at:
            self.g_changed = not all(torch.equal(a, b) for a, b in zip(g_before, self.generator.parameters()))

        self.toggle_optimizer(opt_d)
        logits = self.discriminator(torch.cat([real, fake.detach()]))
        labels = torch.cat([torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)])
        d_loss = F.binary_cross_entropy_with_logits(logits, labels)
        self.manual_backward(d_loss, loss_id=1)
        if batch_idx == self.inject_inf_at:
            self.discriminator[0].weight.grad[0, 0] = float("nan")
            self.d_before = {k: v.clone() for k, v in self.discriminator.state_dict().items()}
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        if batch_idx == self.inject_inf_at:
            self.d_after = {k: v.clone() for k, v in self.discriminator.state_dict().items()}

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.Adam(self.generator.parameters(), lr=1e-3),
            torch.optim.Adam(self.discriminator.parameters(), lr=1e-3),
        )


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_gan_two_optimizers_two_losses(level):
    plugin = MixedPrecisionPlugin(level, num_losses=2, growth_interval=1, init_scale=64.0, half_dtype="float16")
    model = TinyGAN(inject_inf_at=3)
    data = loader(torch.utils.data.TensorDataset(torch.randn(48, 8)), batch_size=8)  # 6 iterations
    trainer = make_trainer(plugin, max_epochs=1)
    trainer.fit(model, data)

    # Each loss's scale is updated once per iteration (growth_interval=1 doubles it), not once per optimizer call;
    # the discriminator's overflow at iteration 3 halves only its own scale.
    g_scales = [s[0] for s in model.scales]
    d_scales = [s[1] for s in model.scales]
    assert g_scales == [64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0]
    assert d_scales == [64.0, 128.0, 256.0, 512.0, 256.0, 512.0]
    # The discriminator skipped that step and was left exactly as it was; the generator stepped.
    assert_same(model.d_before, model.d_after)
    assert model.g_changed is True
    assert plugin.amp.skipped_steps == [0, 1]
    assert plugin.step_was_skipped(trainer.optimizers[1]) is False  # the last step (iteration 5) was real
    metrics = plugin.metrics()
    assert {"mpx/loss_scale/loss0", "mpx/loss_scale/loss1", "mpx/skipped_steps/loss1"} <= set(metrics)
    assert metrics["mpx/skipped_steps/loss1"] == 1.0


def test_a_manual_steps_hooks_run_without_the_training_steps_casts():
    """A manual backward and step run inside the training step's O1 cast scope: the LightningModule's ``backward``
    and ``on_before_optimizer_step`` hooks they call run without its casts, as an automatic step's do (a matmul there
    stays FP32)."""

    class Manual(Classifier):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.seen: dict[str, list[torch.dtype]] = {"backward": [], "on_before_optimizer_step": []}

        def _matmul_dtype(self) -> torch.dtype:
            x = torch.ones(2, 2)
            return torch.mm(x, x).dtype

        def training_step(self, batch: Any, batch_idx: int) -> None:
            optimizer = self.optimizers()
            x, y = batch
            self.manual_backward(F.cross_entropy(self(x), y))
            optimizer.step()
            optimizer.zero_grad()

        def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            self.seen["backward"].append(self._matmul_dtype())
            loss.backward(*args, **kwargs)

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.seen["on_before_optimizer_step"].append(self._matmul_dtype())

    model = Manual()
    trainer = make_trainer(MixedPrecisionPlugin("O1", half_dtype="bfloat16"), max_steps=2)
    trainer.fit(model, loader(classification_data()))
    assert model.seen == {"backward": [torch.float32] * 2, "on_before_optimizer_step": [torch.float32] * 2}


# -- checkpoints ----------------------------------------------------------------------------------------------------
_RESUME_SCRIPT = """
import sys, torch
sys.path.insert(0, {root!r})
from lightning_mpx import MixedPrecisionPlugin
from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer
plugin = MixedPrecisionPlugin("O2", growth_interval=2, init_scale=2.0**12, half_dtype="float16")
model = Classifier(inject_inf_at=(5,), optimizer="adamw", lr=0.01, scheduler=False)
trainer = make_trainer(plugin, max_epochs=4)
trainer.fit(model, loader(classification_data(n=64)), ckpt_path={ckpt!r})
state = {{"model": model.state_dict(), "masters": plugin.amp.state_dict(),
          "optimizer": trainer.optimizers[0].state_dict()}}
torch.save(state, {out!r})
"""


def test_resume_from_checkpoint_in_a_new_process_is_exact(tmp_path):
    data = loader(classification_data(n=64))  # 4 steps per epoch
    settings = dict(growth_interval=2, init_scale=2.0**12)

    straight_plugin = MixedPrecisionPlugin("O2", **{"half_dtype": "float16", **settings})
    straight = Classifier(inject_inf_at=(5,), optimizer="adamw", lr=0.01)
    straight_trainer = make_trainer(straight_plugin, max_epochs=4)
    straight_trainer.fit(straight, data)

    first_plugin = MixedPrecisionPlugin("O2", **{"half_dtype": "float16", **settings})
    first = Classifier(inject_inf_at=(5,), optimizer="adamw", lr=0.01)
    first_trainer = make_trainer(first_plugin, max_epochs=2)
    first_trainer.fit(first, data)
    ckpt = tmp_path / "two_epochs.ckpt"
    first_trainer.save_checkpoint(ckpt)
    assert torch.load(ckpt, weights_only=False)["MixedPrecisionPlugin"]["scalers"]  # the plugin's state is in it

    out = tmp_path / "resumed.pt"
    script = _RESUME_SCRIPT.format(root=str(ROOT), ckpt=str(ckpt), out=str(out))
    # A process of its own, forked from the warm interpreter of tests/warm_python.py (nothing of this one's state)
    subprocess.run([warm_python(), "-c", script], check=True, cwd=tmp_path, capture_output=True, timeout=300)
    resumed = torch.load(out, weights_only=False)

    assert straight_plugin.amp.skipped_steps == [1]
    assert_same(resumed["model"], straight.state_dict())
    assert_same(resumed["masters"], straight_plugin.amp.state_dict())
    assert_same(resumed["optimizer"]["state"], straight_trainer.optimizers[0].state_dict()["state"])


def test_o2_evaluation_from_a_training_checkpoint_restores_the_scale_without_masters(tmp_path):
    data = loader(classification_data(n=64))
    trained_plugin = MixedPrecisionPlugin("O2", init_scale=2.0**12, growth_interval=2, half_dtype="float16")
    trained = Classifier(optimizer="adamw", lr=0.01)
    trainer = make_trainer(trained_plugin, max_epochs=1)
    trainer.fit(trained, data)
    ckpt = tmp_path / "trained.ckpt"
    trainer.save_checkpoint(ckpt)
    assert trained_plugin.amp.scalers[0].get_scale() == 2.0**14  # 4 steps, growth every 2

    plugin = MixedPrecisionPlugin("O2", init_scale=2.0**12, growth_interval=2, half_dtype="float16")
    model = Classifier(optimizer="adamw", lr=0.01)
    evaluator = make_trainer(plugin)
    evaluator.validate(model, data, ckpt_path=ckpt, verbose=False)
    predictions = evaluator.predict(model, data, ckpt_path=ckpt)
    assert plugin.amp.master_weights == [] and plugin.amp.scalers[0].get_scale() == 2.0**14
    # The stages ran the checkpoint's weights in half; the model they give back holds its FP32 weights exactly.
    saved = torch.load(ckpt, weights_only=True)["state_dict"]
    assert {value.dtype for value in saved.values()} == {torch.float32}
    assert_same(model.state_dict(), saved)
    assert torch.equal(torch.cat(predictions), torch.cat(make_trainer(trained_plugin).predict(trained, data)))


# -- metrics in TensorBoard -----------------------------------------------------------------------------------------
def test_tensorboard_scale_curve_halves_at_injected_overflows(tmp_path):
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    plugin = MixedPrecisionPlugin("O1", init_scale=2.0**10, growth_interval=1000, half_dtype="float16")
    logger = TensorBoardLogger(str(tmp_path), name="run", version=0)
    trainer = make_trainer(plugin, max_steps=12, logger=logger, log_every_n_steps=1)
    trainer.fit(Classifier(inject_inf_at=(4, 8)), loader(classification_data(n=192)))

    events = EventAccumulator(str(tmp_path / "run" / "version_0"))
    events.Reload()
    scale = {e.step: e.value for e in events.Scalars("mpx/loss_scale")}
    overflows = {e.step: e.value for e in events.Scalars("mpx/overflows")}
    skipped = {e.step: e.value for e in events.Scalars("mpx/skipped_steps")}
    assert sorted(scale) == list(range(12))
    assert [scale[s] for s in range(12)] == [1024.0] * 4 + [512.0] * 4 + [256.0] * 4
    assert [s for s, v in overflows.items() if v] == [4, 8]
    assert skipped[11] == 2.0


def test_metrics_follow_the_trainers_logging_cadence(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    plugin = MixedPrecisionPlugin("O1", init_scale=2.0**10, growth_interval=1000, half_dtype="float16")
    logger = CSVLogger(str(tmp_path), name="run", version=0)
    trainer = make_trainer(plugin, max_steps=12, logger=logger, log_every_n_steps=5)
    trainer.fit(Classifier(inject_inf_at=(2,)), loader(classification_data(n=192)))
    rows = (tmp_path / "run" / "version_0" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    logged = [dict(zip(header, r.split(","))) for r in rows[1:]]
    mpx_rows = [r for r in logged if r.get("mpx/loss_scale")]
    assert [int(r["step"]) for r in mpx_rows] == [4, 9]
    # "overflows" counts the events since the previous log: the overflow at step 2 shows up at step 4.
    assert [float(r["mpx/overflows"]) for r in mpx_rows] == [1.0, 0.0]


# -- distribution ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """Both runs of tests/ddp_script.py in one two-process launch (a launch costs seconds of start-up)."""
    out = tmp_path_factory.mktemp("ddp")
    run_script("ddp_script.py", out, timeout=420, MPX_SKIP_ON_DEVICE="0,1")
    return out


@pytest.mark.parametrize("on_device", [False, True], ids=["host-read", "skip_on_device"])
def test_ddp_two_processes_skip_together(ddp_runs, on_device):
    results = rank_results(ddp_runs, f"skip{int(on_device)}_")
    assert results[0]["skipped_steps"] == results[1]["skipped_steps"] == [1]
    assert results[0]["scale"] == results[1]["scale"] == 512.0
    assert results[0]["params"] == results[1]["params"]
    assert results[0]["steps_taken"] == results[1]["steps_taken"] == 5
    # The overflow record, merged across the ranks (read at the next batch with skip_on_device): rank 0's inf.
    assert results[0]["overflow_parameters"] == ["net.0.weight"] and results[1]["overflow_parameters"] == []
    assert results[0]["overflow_ranks"] == results[1]["overflow_ranks"] == [0]


# -- bad input ------------------------------------------------------------------------------------------------------
def test_lbfgs_is_refused_with_a_clear_error():
    trainer = make_trainer(MixedPrecisionPlugin("O1", half_dtype="bfloat16"), max_steps=1)
    with pytest.raises(ValueError, match="LBFGS"):
        trainer.fit(Classifier(optimizer="lbfgs"), loader(classification_data(n=16)))


def test_mixing_with_another_precision_setting_is_refused():
    with pytest.raises((ValueError, MisconfigurationException), match="Received both `precision=16-mixed`"):
        pl.Trainer(precision="16-mixed", plugins=[MixedPrecisionPlugin("O1", half_dtype="bfloat16")], accelerator="cpu")


def test_o2_on_a_module_without_floating_parameters_is_refused():
    class NoFloats(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("table", torch.arange(4))

        def training_step(self, batch: Any, batch_idx: int) -> None:
            return None

        def configure_optimizers(self) -> None:
            return None

    trainer = make_trainer(MixedPrecisionPlugin("O2", half_dtype="bfloat16"), max_steps=1)
    with pytest.raises(ValueError, match="no floating-point parameters"):
        trainer.fit(NoFloats(), loader(classification_data(n=16)))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(opt_level="01"), "letter O"),
        (dict(opt_level="O4"), "'O0', 'O1', 'O2', 'O3'"),
        (dict(opt_level="O1", half_dtype="float8"), "half_dtype"),
        (dict(opt_level="O1", master_weights=True), "master_weights"),
        (dict(opt_level="O1", num_losses=0), "num_losses"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MixedPrecisionPlugin(**{"half_dtype": "bfloat16", **kwargs})


def test_manual_backward_rejects_an_unknown_loss_id():
    class Manual(Classifier):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            self.manual_backward(self._step(batch, "train"), loss_id=3)

    trainer = make_trainer(MixedPrecisionPlugin("O1", num_losses=2, half_dtype="bfloat16"), max_steps=1)
    with pytest.raises(ValueError, match="loss_id=3"):
        trainer.fit(Manual(), loader(classification_data(n=16)))


def test_snapshot_helper_detects_a_change():
    # The overflow tests rely on snapshot/assert_same noticing the smallest change.
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model, optimizer)
    with torch.no_grad():
        model.net[0].weight[0, 0] += 1e-6
    with pytest.raises(AssertionError):
        assert_same(before, snapshot(model, optimizer))


def test_steps_that_do_not_log_read_no_metrics(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    plugin = MixedPrecisionPlugin("O1", half_dtype="bfloat16")
    calls: list[int] = []
    metrics = plugin.amp.metrics

    def counting_metrics(*args: Any) -> dict:
        calls.append(1)
        return metrics(*args)

    plugin.amp.metrics = counting_metrics  # this test's own engine only
    logger = CSVLogger(str(tmp_path), name="run", version=0)
    trainer = make_trainer(plugin, max_steps=12, logger=logger, log_every_n_steps=5)
    trainer.fit(Classifier(), loader(classification_data(n=192)))
    assert len(calls) == 2  # steps 4 and 9: the only device reads of the metrics


class _EmbeddingLM(pl.LightningModule):
    """A model whose forward calls its own direct children (embedding, norm, head), as most language models do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16)
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []  # (norm input, model output) per training step

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        self.seen.append((x.dtype, x.dtype))
        return self.head(self.norm(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self(tokens)
        self.seen[-1] = (self.seen[-1][0], logits.dtype)
        return F.cross_entropy(logits.reshape(-1, 16), tokens.reshape(-1))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_children_called_inside_the_forward_stay_half(level):
    # Only the model's boundary is cast: the embedding's output feeds the half LayerNorm in half (an FP32 output
    # there made LayerNorm fail with mixed dtypes on CPU), and the model's output reaches the loss in FP32.
    model = _EmbeddingLM()
    data = torch.utils.data.TensorDataset(torch.randint(0, 16, (8, 5), generator=torch.Generator().manual_seed(0)))
    make_trainer(MixedPrecisionPlugin(level, half_dtype="bfloat16"), max_steps=2).fit(model, loader(data, 4))
    assert model.seen == [(torch.bfloat16, torch.float32)] * 2
    assert model.embed.weight.dtype == torch.bfloat16


def test_boundary_depth_is_restored_when_the_forward_raises():
    model = _EmbeddingLM()
    plugin = MixedPrecisionPlugin("O2", half_dtype="bfloat16")
    plugin.convert_module(model)
    with pytest.raises(IndexError):
        model(torch.tensor([[99]]))  # out of the embedding's range
    assert model(torch.tensor([[1, 2]])).dtype == torch.float32  # at depth 0 again: the output is cast


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_torch_compiled_submodule_trains_exactly_as_in_eager_mode(level):
    # Dynamo traces the compiled net with the O1 cast policy active around it (or the O2 boundary hooks around the
    # LightningModule); "aot_eager" keeps torch's kernels, so any difference would come from the casts themselves.
    def train(compiled: bool) -> list[torch.Tensor]:
        torch._dynamo.reset()
        model = Classifier(optimizer="sgd", lr=0.1)
        if compiled:
            model.net = torch.compile(model.net, backend="aot_eager")
        make_trainer(MixedPrecisionPlugin(level, half_dtype="bfloat16"), max_steps=3).fit(
            model, loader(classification_data(n=48))
        )
        return [p.detach().clone() for p in model.parameters()]

    eager, compiled = train(False), train(True)
    assert all(p.dtype == (torch.bfloat16 if level == "O2" else torch.float32) for p in compiled)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
