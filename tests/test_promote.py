"""``on_floor="promote"``: a layer that always overflows in float16 is run in FP32 and training goes on.

The model reads raw, unnormalised features (magnitude ~1e4, which float16 holds). Its first layer (``stem``) has a
weight gradient ~1e4 times the other layers': at any loss scale down to the floor of 2**10 it exceeds float16's
range on every step, in the backward pass only (its forward output is small, and no other layer's gradient is
affected), so with the forensics record's fallback (origin "unknown") the culprit is exactly ``stem``. In FP32 the
model trains fine (Adam does not mind the gradient's size); the stem's learning rate is divided by the input scale,
as the equivalent normalised model would have it.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp, LossScaleFloorError, MixedPrecisionPlugin
from lightning_mpx.health.forensics import OverflowRecord
from lightning_mpx.health.promotion import FLOOR_OVERFLOWS_TO_PROMOTE
from tests.lightning_helpers import make_trainer

INPUT_SCALE = 1e4
FLOOR = dict(init_scale=2.0**13, min_loss_scale=2.0**10)  # three backoffs to the floor
STEPS = 60
LR = 2e-2


def raw_feature_data(n: int = 256, features: int = 8, scale: float = INPUT_SCALE) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    z = torch.randn(n, features, generator=g)
    y = torch.sin(1.5 * z[:, :1]) + 0.5 * z[:, 1:2] * z[:, 2:3]
    return z * scale, y


class RawFeatures(nn.Module):
    def __init__(self, features: int = 8, hidden: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(features, hidden)
        self.hidden = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 1)
        with torch.no_grad():
            self.stem.weight.div_(INPUT_SCALE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(torch.tanh(self.stem(x)))))


def make_optimizer(model: RawFeatures, lr: float = LR, eps: float = 1e-8) -> torch.optim.Adam:
    rest = list(model.hidden.parameters()) + list(model.head.parameters())
    groups = [{"params": list(model.stem.parameters()), "lr": lr / INPUT_SCALE}, {"params": rest}]
    return torch.optim.Adam(groups, lr=lr, eps=eps)


class RawFeaturesModule(pl.LightningModule):
    """Full-batch regression with a cosine schedule stepped per optimizer step; records every training loss."""

    def __init__(self, steps: int = STEPS) -> None:
        super().__init__()
        self.model = RawFeatures()
        self.steps = steps
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = make_optimizer(self.model)
        cosine = lambda i: 0.5 * (1 + math.cos(math.pi * min(i / self.steps, 1)))  # noqa: E731
        decay = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": decay, "interval": "step"}}


def data_loader() -> torch.utils.data.DataLoader:
    x, y = raw_feature_data()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x))


def fit(level: str, on_floor: str = "promote", steps: int = STEPS, **kwargs: Any) -> tuple[RawFeaturesModule, Any]:
    module = RawFeaturesModule(steps)
    plugin = MixedPrecisionPlugin(level, on_floor=on_floor, **FLOOR, **{"half_dtype": "float16", **kwargs})
    make_trainer(plugin, max_steps=steps, max_epochs=-1).fit(module, data_loader())
    return module, plugin


@pytest.fixture(scope="module")
def o0_final_loss() -> float:
    module, _ = fit("O0")
    return module.losses[-1]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_promote_trains_through_a_layer_that_always_overflows(level: str, o0_final_loss: float, caplog: Any) -> None:
    with caplog.at_level(logging.WARNING, logger="lightning_mpx"):
        module, plugin = fit(level)
    amp = plugin.amp
    assert amp.fp32_modules == ["model.stem"]
    evidence = amp.promoted_modules["model.stem"]
    assert evidence["parameters"] == {"model.stem.weight": "inf"}  # the backward's overflow, in that layer only
    assert evidence["scale"] == FLOOR["min_loss_scale"]
    # Three backoffs to the floor, then FLOOR_OVERFLOWS_TO_PROMOTE overflows there, then never again.
    assert amp.skipped_steps == [3 + FLOOR_OVERFLOWS_TO_PROMOTE]
    assert "running model.stem in FP32" in caplog.text and "model.stem.weight (inf)" in caplog.text
    final = module.losses[-1]
    assert abs(final - o0_final_loss) <= 0.02 * o0_final_loss, (final, o0_final_loss)
    if level == "O2":
        stem = module.model.stem
        assert stem.weight.dtype == torch.float32 and module.model.hidden.weight.dtype == torch.float16
        assert amp.master_of(stem.weight) is stem.weight  # its own master now


def test_raise_stops_at_the_floor() -> None:
    module = RawFeaturesModule()
    plugin = MixedPrecisionPlugin("O1", on_floor="raise", **{"half_dtype": "float16", **FLOOR})
    with pytest.raises(LossScaleFloorError, match=r"stem\.weight"):
        make_trainer(plugin, max_steps=STEPS, max_epochs=-1).fit(module, data_loader())
    assert len(module.losses) == 4  # the fourth step is the first at the floor


def test_continue_does_not_converge(o0_final_loss: float) -> None:
    module, plugin = fit("O1", on_floor="continue", steps=20)
    assert plugin.amp.fp32_modules == []
    assert plugin.amp.skipped_steps == [20]  # every step overflows: nothing is ever learnt
    assert module.losses[-1] > 10 * o0_final_loss


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_lightning_resume_keeps_the_promotion(level: str, tmp_path: Any) -> None:
    """Checkpoint after the promotion, resume in a fresh process-like set-up: the promotion is re-applied before
    training continues, the promoted weights load exactly, and the run equals one that was never interrupted."""
    total, first = 14, 8
    straight, _ = fit(level, steps=total)
    module = RawFeaturesModule(total)
    plugin = MixedPrecisionPlugin(level, on_floor="promote", **{"half_dtype": "float16", **FLOOR})
    trainer = make_trainer(plugin, max_steps=first, max_epochs=-1)
    trainer.fit(module, data_loader())
    path = tmp_path / "promoted.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["MixedPrecisionPlugin"]["promotion"]
    assert saved["promoted"].keys() == {"model.stem"}

    seen: dict[str, Any] = {}

    class AtStart(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            amp = trainer.precision_plugin.amp
            seen["fp32_modules"] = amp.fp32_modules
            seen["dtype"] = pl_module.model.stem.weight.dtype
            seen["stem"] = pl_module.model.stem.weight.detach().clone()

    resumed = RawFeaturesModule(total)
    plugin = MixedPrecisionPlugin(level, on_floor="promote", **{"half_dtype": "float16", **FLOOR})
    make_trainer(plugin, max_steps=total, max_epochs=-1, callbacks=[AtStart()]).fit(
        resumed, data_loader(), ckpt_path=str(path)
    )
    assert seen["fp32_modules"] == ["model.stem"]
    assert seen["dtype"] == (torch.float32 if level == "O2" else torch.float32)
    assert torch.equal(seen["stem"], module.model.stem.weight.detach().float())
    assert plugin.amp.skipped_steps == [3 + FLOOR_OVERFLOWS_TO_PROMOTE]  # no new overflow after the resume
    assert resumed.losses == straight.losses[first:]
    for a, b in zip(resumed.model.parameters(), straight.model.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b)


def _core_run(amp: Amp, model: RawFeatures, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
              steps: int) -> list[bool]:
    stepped = []
    for _ in range(steps):
        with amp.forward_context():
            loss = F.mse_loss(amp.cast_outputs(model(amp.cast_inputs(x))), y)
        amp.backward(loss)
        stepped.append(amp.step(optimizer))
        amp.update()
        optimizer.zero_grad()
    return stepped


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_amp_state_dict_resume_reapplies_the_promotion(level: str) -> None:
    x, y = raw_feature_data()
    model = RawFeatures()
    # O3: pure half, with a dynamic scale and an eps that float16 holds (the optimizer state is half there).
    settings: dict[str, Any] = dict(FLOOR, loss_scale="dynamic") if level == "O3" else dict(FLOOR)
    eps = 1e-4 if level == "O3" else 1e-8
    amp = Amp(level, on_floor="promote", **{"half_dtype": "float16", **settings})
    amp.prepare_model(model)
    optimizer = amp.prepare_optimizer(make_optimizer(model, eps=eps))
    stepped = _core_run(amp, model, optimizer, x, y, 8)
    assert stepped == [False] * 5 + [True] * 3 and amp.fp32_modules == ["stem"]
    checkpoint = copy.deepcopy(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}
    )
    if level == "O2":
        assert "stem.weight" not in checkpoint["amp"]["master_weights"][0]  # no master any more...
        assert checkpoint["amp"]["promotion"]["weights"]["stem.weight"].dtype == torch.float32  # ...its own weights

    fresh = RawFeatures()
    fresh_amp = Amp(level, on_floor="promote", **{"half_dtype": "float16", **settings})
    fresh_amp.prepare_model(fresh)
    fresh_optimizer = fresh_amp.prepare_optimizer(make_optimizer(fresh, eps=eps))
    fresh.load_state_dict(checkpoint["model"])
    fresh_amp.load_state_dict(checkpoint["amp"])
    fresh_optimizer.load_state_dict(checkpoint["optimizer"])
    assert fresh_amp.fp32_modules == ["stem"] and fresh_amp.promoted_modules == amp.promoted_modules
    assert fresh.stem.weight.dtype == model.stem.weight.dtype
    assert torch.equal(fresh.stem.weight, model.stem.weight)

    assert _core_run(fresh_amp, fresh, fresh_optimizer, x, y, 4) == [True] * 4
    assert _core_run(amp, model, optimizer, x, y, 4) == [True] * 4
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_o2_promotion_keeps_the_optimizer_state() -> None:
    """Ten clean steps on normalised inputs build Adam's FP32 state for the stem's master; then the raw inputs make
    the stem overflow and it is promoted: the very same state tensors now belong to the parameter, and the next step
    continues from them (step 10 -> 11)."""
    x, y = raw_feature_data()
    model = RawFeatures()
    amp = Amp("O2", on_floor="promote", **{"half_dtype": "float16", **FLOOR})
    amp.prepare_model(model)
    optimizer = amp.prepare_optimizer(make_optimizer(model))
    assert _core_run(amp, model, optimizer, x / INPUT_SCALE, y, 10) == [True] * 10
    weight = model.stem.weight
    master = amp.master_of(weight)
    assert master is not weight
    state = optimizer.state[master]
    before = {k: v.clone() for k, v in state.items()}
    master_value = master.detach().clone()

    assert _core_run(amp, model, optimizer, x, y, 5) == [False] * 5  # three backoffs, two overflows at the floor
    assert amp.fp32_modules == ["stem"]
    assert weight.dtype == torch.float32 and torch.equal(weight, master_value)  # the master's exact value
    assert amp.master_of(weight) is weight and weight in amp.master_params(optimizer)
    assert master not in optimizer.state and optimizer.state[weight] is state
    assert all(torch.equal(state[k], v) for k, v in before.items())
    assert state["exp_avg"].dtype == torch.float32

    assert _core_run(amp, model, optimizer, x, y, 1) == [True]
    assert float(state["step"]) == 11.0
    assert not torch.equal(weight, master_value)


def test_no_promotion_without_a_culprit_in_common() -> None:
    """Overflows at the floor from different modules: nothing can be blamed, the floor error is raised."""
    model = RawFeatures()
    amp = Amp("O1", on_floor="promote", init_scale=1.0, min_loss_scale=1.0, half_dtype="float16")
    amp.prepare_model(model)
    promotion = amp.promotion
    first = OverflowRecord(0, (0,), (1.0,), {"stem.weight": "inf"}, {"stem": "inf"})
    second = OverflowRecord(1, (0,), (1.0,), {"head.weight": "nan"}, {"head": "nan"})
    assert promotion.floor_overflow(first) is None  # waiting for evidence
    assert "different modules" in (promotion.floor_overflow(second) or "")
    everything = OverflowRecord(
        2, (0,), (1.0,), {}, {"stem": "nan", "hidden": "nan", "head": "nan"}
    )
    promotion.floor_overflow(everything)
    assert "every module with parameters" in (promotion.floor_overflow(everything) or "")
    assert amp.fp32_modules == []


def test_a_blamed_fp32_module_promotes_its_parent() -> None:
    """At O2 a promoted module's output goes back to half: if it is blamed again, its parent is promoted."""
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), nn.Linear(4, 2))
    amp = Amp("O2", on_floor="promote", fp32_modules=["0.0"], half_dtype="float16")
    amp.prepare_model(model)
    assert amp.fp32_modules == ["0.0"]
    record = OverflowRecord(0, (0,), (1.0,), {}, {}, origin="forward", first_module="0.0")
    assert amp.promotion.floor_overflow(record) is None
    assert amp.promotion.floor_overflow(record) is None
    assert amp.fp32_modules == ["0.0", "0"]
    assert all(p.dtype == torch.float32 for p in model[0].parameters()) and model[1].weight.dtype == torch.float16
    out = amp.cast_outputs(model(amp.cast_inputs(torch.randn(3, 4))))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    # The root is never promoted: the whole model in FP32 is O0.
    root_record = OverflowRecord(1, (0,), (1.0,), {}, {}, origin="forward", first_module="0")
    amp.promotion.floor_overflow(root_record)
    assert "whole model" in (amp.promotion.floor_overflow(root_record) or "")


class Blowup(nn.Linear):
    """A linear layer whose weights are used 1e5 times larger: its output exceeds float16's range on every step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * 1e5, self.bias)


class ForwardOverflow(nn.Module):
    """``block.0``'s output is inf in float16; the layer norm after it brings the values back to O(1), so in FP32
    nothing overflows. At O1 promoting ``block.0`` cures it; at O2 its output goes back to half (still inf), so it is
    blamed again and its parent ``block`` (with the norm) is promoted."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(Blowup(8, 32), nn.LayerNorm(32))
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


@pytest.mark.parametrize(("level", "promoted"), [("O1", ["block.0"]), ("O2", ["block.0", "block"])])
def test_promote_cures_a_forward_overflow(level: str, promoted: list[str]) -> None:
    x, y = raw_feature_data(scale=1.0)
    model = ForwardOverflow()
    amp = Amp(level, on_floor="promote", **{"half_dtype": "float16", **FLOOR})
    amp.prepare_model(model)
    optimizer = amp.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    stepped = _core_run(amp, model, optimizer, x, y, 12)
    assert amp.fp32_modules == promoted
    assert amp.promoted_modules[promoted[-1]]["origin"] == "forward"
    assert stepped[-5:] == [True] * 5


def test_accelerator_promotes_and_resumes(tmp_path: Any) -> None:
    """The same through the Accelerate adapter: promoted while training, and again by ``load_state``."""
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    x, y = raw_feature_data()

    def setup() -> tuple[Accelerator, RawFeatures, Any]:
        handler = MixedPrecisionKwargs(on_floor="promote", half_dtype="float16", **FLOOR)  # float16's overflows
        accelerator = Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=[handler])
        model = RawFeatures()
        model, optimizer = accelerator.prepare(model, make_optimizer(model))
        return accelerator, model, optimizer

    accelerator, model, optimizer = setup()
    for _ in range(8):
        accelerator.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    assert accelerator.amp.fp32_modules == ["stem"] and accelerator.amp.skipped_steps == [5]
    assert accelerator.mpx_metrics()["mpx/promoted/stem"] == 1.0
    accelerator.save_state(str(tmp_path))

    accelerator, fresh, optimizer = setup()
    accelerator.load_state(str(tmp_path))
    assert accelerator.amp.fp32_modules == ["stem"] and fresh.stem.weight.dtype == torch.float32
    assert torch.equal(fresh.stem.weight, model.stem.weight)
    accelerator.backward(F.mse_loss(fresh(x), y))
    optimizer.step()
    assert not optimizer.step_was_skipped
