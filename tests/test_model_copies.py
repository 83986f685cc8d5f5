"""Copies of an O2/O3 model (issue 21, item 5): an EMA model kept in FP32 (timm's ``ModelEmaV3(model,
dtype=torch.float32)``, ``copy.deepcopy(model).float()``), ``AveragedModel``, a pickled model. Each copy behaves as its
own dtype says: converted to FP32 it runs in FP32 on FP32 inputs (before, the boundary casts it carried along cast
them to half: "Input type (CPUBFloat16Type) and weight type (torch.FloatTensor) should be the same"); still half, it
takes FP32 inputs as the model did. The copy does not drag the plugin, its engine or the FP32 masters along, and the
original keeps training as if no copy had been made.

timm itself cannot be a test dependency here (it needs torchvision); the copies below are what its EMA does.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel

from lightning_mpx import Amp, MixedPrecisionPlugin
from lightning_mpx.masters.weights import MasterWeights
from tests.lightning_helpers import loader, make_trainer

LEVELS = ["O2", "O3"]


def _image_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(8, 4),
    )


def _images(n: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 6, 6, generator=g), torch.randint(0, 4, (n,), generator=g)


def _fp32_reference(copied: nn.Module, build: Any) -> nn.Module:
    """A plain FP32 model (no hooks, no adapter) with the copy's weights: what the FP32 copy must compute."""
    reference = build()
    reference.load_state_dict({k: v.float() for k, v in copied.state_dict().items()})
    return reference.eval()


def _carried(memo: dict[int, Any]) -> list[str]:
    """What a deep copy copied of the mixed-precision machinery (its memo holds every object it copied)."""
    machinery = (MixedPrecisionPlugin, Amp, MasterWeights)
    return sorted({type(v).__name__ for v in memo.values() if isinstance(v, machinery)})


# -- Lightning ------------------------------------------------------------------------------------------------------
class ImageModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _image_net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Copies(pl.Callback):
    """An FP32 EMA copy (``deepcopy(...).float()``, updated from the half model every batch) and an
    ``AveragedModel``, both made once training starts, when the plugin's boundary casts are on the model."""

    def __init__(self) -> None:
        self.x = _images(4, seed=9)[0]
        self.seen: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        memo: dict[int, Any] = {}
        self.ema = copy.deepcopy(pl_module, memo).float()
        self.seen["carried"] = _carried(memo)
        self.averaged = AveragedModel(pl_module)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        with torch.no_grad():
            for ema, param in zip(self.ema.parameters(), pl_module.parameters()):
                ema.lerp_(param.float(), 0.5)
        self.averaged.update_parameters(pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        with torch.no_grad():
            self.seen["ema"] = self.ema.eval()(self.x)
            self.seen["averaged"] = self.averaged.eval()(self.x)
            # The half copy with the model's own weights computes what the model computes (same casts).
            self.averaged.module.load_state_dict(pl_module.state_dict())
            self.seen["averaged_as_model"] = self.averaged(self.x)
            self.seen["model"] = pl_module.eval()(self.x)
            pl_module.train()


def _fit(level: str, callbacks: list[pl.Callback]) -> ImageModule:
    module = ImageModule()
    x, y = _images(16)
    trainer = make_trainer(MixedPrecisionPlugin(level, half_dtype="bfloat16"), max_steps=3, callbacks=callbacks)
    trainer.fit(module, loader(torch.utils.data.TensorDataset(x, y), batch_size=4))
    return module


@pytest.mark.parametrize("level", LEVELS)
def test_lightning_fp32_ema_copy_runs_in_fp32_and_carries_no_plugin(level: str) -> None:
    copies = Copies()
    module = _fit(level, [copies])
    seen = copies.seen
    assert seen["carried"] == []  # the copy took neither the plugin, nor its engine, nor the FP32 masters
    ema = copies.ema
    assert all(p.dtype == torch.float32 for p in ema.parameters())
    reference = _fp32_reference(ema, ImageModule)
    with torch.no_grad():
        want = reference(copies.x)
        assert seen["ema"].dtype == torch.float32 and torch.equal(seen["ema"], want)
        # After the run too: the copy's casts did not outlive it as half casts.
        assert torch.equal(ema(copies.x), want)
    # The half AveragedModel takes FP32 inputs as the model did during the run.
    assert seen["averaged"].dtype == torch.float32 and torch.isfinite(seen["averaged"]).all()
    assert torch.equal(seen["averaged_as_model"], seen["model"])
    # The original trained as if no copy had been made.
    plain = _fit(level, [])
    for a, b in zip(module.parameters(), plain.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_lightning_copy_converted_back_to_half_casts_again() -> None:
    module = ImageModule()
    module.net[1] = nn.Identity()  # no batch norm, which O2 keeps in FP32 and .to(torch.bfloat16) would not
    plugin = MixedPrecisionPlugin("O2", half_dtype="bfloat16")
    plugin.convert_module(module)
    twin = copy.deepcopy(module).float()
    x = _images(2)[0]
    with torch.no_grad():
        assert twin(x).dtype == torch.float32
        twin.to(torch.bfloat16)  # an EMA stored in half again: FP32 inputs are cast to it, outputs back to FP32
        assert torch.equal(twin(x), module(x))
        restored = pickle.loads(pickle.dumps(twin))  # torch.save(model) pickles the hooks: they follow it too
        assert torch.equal(restored(x), module(x))
        reference = ImageModule()
        reference.net[1] = nn.Identity()
        reference.load_state_dict(restored.float().state_dict())
        assert torch.equal(restored(x), reference(x))


# -- Accelerate -----------------------------------------------------------------------------------------------------
def _accelerate_run(level: str, copy_at: int | None) -> tuple[nn.Module, dict[str, Any]]:
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    accelerator = Accelerator(
        mixed_precision=level, cpu=True, kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")]
    )
    model = _image_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    seen: dict[str, Any] = {}
    for step in range(4):
        if step == copy_at:
            memo: dict[int, Any] = {}
            seen["ema"] = copy.deepcopy(model, memo).float()  # timm's ModelEmaV3(model, dtype=torch.float32)
            seen["carried"] = _carried(memo)
            seen["averaged"] = AveragedModel(model)
        x, y = _images(4, seed=step)
        accelerator.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return model, seen


@pytest.mark.parametrize("level", LEVELS)
def test_accelerate_fp32_copy_runs_in_fp32_and_the_original_keeps_training(level: str) -> None:
    model, seen = _accelerate_run(level, copy_at=2)
    ema, averaged = seen["ema"], seen["averaged"]
    assert seen["carried"] == []
    x = _images(4, seed=9)[0]
    with torch.no_grad():
        out = ema.eval()(x)
        assert out.dtype == torch.float32 and torch.equal(out, _fp32_reference(ema, _image_net)(x))
        restored = pickle.loads(pickle.dumps(ema))
        assert torch.equal(restored(x), out)
        averaged.module.load_state_dict(model.state_dict())
        assert torch.equal(averaged.eval()(x), model.eval()(x))  # the half copy: the model's casts
    plain, _ = _accelerate_run(level, copy_at=None)
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a, b)


def test_accelerate_fp32_copy_of_a_gpt2() -> None:
    transformers = pytest.importorskip("transformers")
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    config = transformers.GPT2Config(
        vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2, n_inner=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, use_cache=False,
    )
    torch.manual_seed(0)
    accelerator = Accelerator(
        mixed_precision="O2", cpu=True, kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")]
    )
    model = accelerator.prepare(transformers.GPT2LMHeadModel(config))
    ema = copy.deepcopy(model).float()
    reference = transformers.GPT2LMHeadModel(config)
    reference.load_state_dict(ema.state_dict())
    embeds = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = ema.eval()(inputs_embeds=embeds).logits
        assert got.dtype == torch.float32
        assert torch.equal(got, reference.eval()(inputs_embeds=embeds).logits)  # FP32 inputs, not rounded to half
