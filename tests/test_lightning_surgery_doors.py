"""Model surgery after set-up through the front doors (tests/test_core_surgery.py attacks it through ``Amp``): a tiny
Hugging Face GPT-2's ``resize_token_embeddings`` mid-run with the optimizer made again, then a checkpoint saved
after the resize and resumed, through the Trainer (a callback that calls ``trainer.strategy.setup_optimizers``),
Fabric (``fabric.setup_optimizers``, ``fabric.save``/``fabric.load``) and the Accelerate adapter
(``accelerator.prepare(optimizer)``, ``save_state``/``load_state``); Lightning's ``BackboneFinetuning`` at O2. Each
O1/O2 run (bfloat16) is compared with the same door's FP32 run, no closer than the framework's own bf16 mixed
precision is to it (tolerances, not bit equality)."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp, FabricMixedPrecisionPlugin, MixedPrecisionPlugin
from tests.lightning_helpers import classification_data, loader, make_trainer

HALF = "bfloat16"
NEW_ROWS = slice(40, 48)
Weights = dict[str, torch.Tensor]
# torch < 2.13's CPU normal_ draws other values into a bfloat16 tensor than into a float32 one from one seed (2.13 draws
# the same, rounded): resize_token_embeddings initialises the new rows in O2's bfloat16 (GPT-2's _init_weights), the
# FP32 reference in float32, so O2's new rows start elsewhere. O1 (FP32 weights) is checked on every torch.
OLD_RNG = torch.__version__ < (2, 13)
OLD_RNG_REASON = ("O2 part: torch < 2.13's normal_ draws other values into bfloat16 than float32 from one seed, so "
                  "resize_token_embeddings' new rows (initialised in O2's bfloat16) start off the FP32 reference's")
LEVELS = ("O1",) if OLD_RNG else ("O1", "O2")


def _gpt2(resized: bool = False) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    if resized:
        model.resize_token_embeddings(48, mean_resizing=False)
    return model


def _resize(model: nn.Module) -> None:
    torch.manual_seed(7)
    model.resize_token_embeddings(48, mean_resizing=False)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5, momentum=0.5)


def _floats(state: dict[str, Any]) -> Weights:
    return {k: v.detach().float().clone() for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point()}


def _distance(got: Weights, ref: Weights) -> float:
    assert got.keys() == ref.keys()
    return max((got[k] - ref[k]).abs().max().item() for k in ref)


def _check(runs: dict[str, tuple[Weights, ...]], fp32: str, framework: str, level: str, resized: Weights) -> None:
    """``level``'s weights at each checkpoint of the run are as close to FP32's as the framework's own bf16 mixed
    precision (with a margin), and the resize's new rows were trained."""
    key = "transformer.wte.weight"
    for got, ref, theirs in zip(runs[level], runs[fp32], runs[framework]):
        assert got[key].shape == (48, 16)
        allowed = 3 * _distance(theirs, ref) + 2e-3
        assert _distance(got, ref) <= allowed, (level, _distance(got, ref), allowed)
    final = runs[level][-1][key][NEW_ROWS]
    assert (final - resized[key][NEW_ROWS]).abs().max().item() > 0.01, "the new rows were not trained"


# --- the Trainer ----------------------------------------------------------------------------------------------------


class _LM(pl.LightningModule):
    def __init__(self, resized: bool = False) -> None:
        super().__init__()
        self.model = _gpt2(resized)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:  # made again after the resize: the new rows
        return _sgd(self.parameters())

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(1 + self.current_epoch)
        low, high = (30, 48) if self.current_epoch else (0, 40)  # the new tokens after the resize
        ids = torch.randint(low, high, (4, 8), generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)


class _ResizeAtEpochOne(pl.Callback):
    resized: Weights | None = None

    def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.current_epoch == 1:
            _resize(module.model)
            self.resized = _floats(module.model.state_dict())
            trainer.strategy.setup_optimizers(trainer)  # Lightning's way to make the optimizer again mid-fit


def _trainer(precision: str, **settings: Any) -> pl.Trainer:
    if precision in ("O1", "O2"):
        return make_trainer(MixedPrecisionPlugin(precision, half_dtype=HALF), **settings)
    return make_trainer(precision=precision, **settings)


def _export(trainer: pl.Trainer, module: _LM) -> Weights:
    plugin = trainer.precision_plugin
    if isinstance(plugin, MixedPrecisionPlugin):
        return _floats(plugin.amp.fp32_state_dict(module.model))
    return _floats(module.model.state_dict())


def test_trainer_resize_mid_fit_with_the_optimizer_made_again_then_resumed_trains_as_fp32(tmp_path) -> None:
    runs: dict[str, tuple[Weights, ...]] = {}
    resized: Weights = {}
    for precision in ("32-true", "bf16-mixed", *LEVELS):
        module, resize = _LM(), _ResizeAtEpochOne()
        trainer = _trainer(precision, max_epochs=2, reload_dataloaders_every_n_epochs=1, callbacks=[resize])
        trainer.fit(module)
        ckpt = os.path.join(tmp_path, f"{precision}.ckpt")
        trainer.save_checkpoint(ckpt)
        after = _export(trainer, module)
        if isinstance(trainer.precision_plugin, MixedPrecisionPlugin):
            assert module.model.lm_head.weight is module.model.transformer.wte.weight, "the resize untied lm_head"
        resumed, trainer = _LM(resized=True), _trainer(precision, max_epochs=3)  # resized before fit, as the user's
        trainer.fit(resumed, ckpt_path=ckpt)
        runs[precision] = (after, _export(trainer, resumed))
        assert resize.resized is not None
        resized = resize.resized
    for level in LEVELS:
        _check(runs, "32-true", "bf16-mixed", level, resized)
    if OLD_RNG:
        pytest.skip(OLD_RNG_REASON)


class _Finetuned(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Sequential(nn.Linear(16, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)
        self.backbone.requires_grad_(False)  # frozen before fit, as BackboneFinetuning leaves it until its epoch

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x)).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _sgd([p for p in self.parameters() if p.requires_grad])

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return loader(classification_data(n=32))


def test_backbone_finetuning_at_o2_trains_the_unfrozen_backbone_as_fp32() -> None:
    from lightning.pytorch.callbacks import BackboneFinetuning

    runs: dict[str, Weights] = {}
    start = _floats(_Finetuned().state_dict())
    for precision in ("32-true", "bf16-mixed", "O2"):
        module = _Finetuned()
        unfreeze = BackboneFinetuning(1, lambda epoch: 1.0, backbone_initial_ratio_lr=1.0, should_align=False)
        trainer = _trainer(precision, max_epochs=3, callbacks=[unfreeze])
        trainer.fit(module)
        state = module.state_dict()
        if precision == "O2":
            assert module.backbone[0].weight.dtype == torch.bfloat16
            state = trainer.precision_plugin.amp.fp32_state_dict(module)
        runs[precision] = _floats(state)
    moved = (runs["32-true"]["backbone.0.weight"] - start["backbone.0.weight"]).abs().max().item()
    assert moved > 0.05, "the backbone was not unfrozen"
    allowed = 3 * _distance(runs["bf16-mixed"], runs["32-true"]) + 2e-3
    assert _distance(runs["O2"], runs["32-true"]) <= allowed


# --- Fabric ---------------------------------------------------------------------------------------------------------


def _fabric_run(precision: str, path: str) -> tuple[tuple[Weights, ...], Weights]:
    from lightning.fabric import Fabric

    plugin = FabricMixedPrecisionPlugin(precision, half_dtype=HALF) if precision in ("O1", "O2") else None
    if plugin is not None:
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    else:
        fabric = Fabric(accelerator="cpu", devices=1, precision=precision)  # type: ignore[arg-type]

    def export(model: Any) -> Weights:
        return _floats(plugin.amp.fp32_state_dict(model.module) if plugin else model.module.state_dict())

    model = fabric.setup(_gpt2())
    optimizer = fabric.setup_optimizers(_sgd(model.parameters()))
    g = torch.Generator().manual_seed(1)

    def step(ids: torch.Tensor) -> None:
        fabric.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()

    step(torch.randint(0, 40, (2, 8), generator=g))
    _resize(model)  # through Fabric's wrapper, as a script calls it
    resized = _floats(model.module.state_dict())
    optimizer = fabric.setup_optimizers(_sgd(model.parameters()))
    for _ in range(2):
        step(torch.randint(30, 48, (2, 8), generator=g))
    extra = {"mpx": plugin} if plugin is not None else {}  # the O2 masters are in the plugin's state (docs/fabric.md)
    fabric.save(path, {"model": model, "optimizer": optimizer, **extra})
    after = export(model)
    model = fabric.setup(_gpt2(resized=True))
    optimizer = fabric.setup_optimizers(_sgd(model.parameters()))
    if plugin is not None:
        plugin.setup_optimizers(optimizer)  # at O2 before fabric.load (docs/fabric.md)
    fabric.load(path, {"model": model, "optimizer": optimizer, **extra})
    assert _distance(export(model), after) == 0.0, "fabric.load did not restore the resized model"
    step(torch.randint(30, 48, (2, 8), generator=g))
    return (after, export(model)), resized


def test_fabric_resize_after_setup_with_a_new_optimizer_then_save_and_load_trains_as_fp32(tmp_path) -> None:
    runs = {}
    for precision in ("32-true", "bf16-mixed", *LEVELS):
        runs[precision], resized = _fabric_run(precision, os.path.join(tmp_path, precision))
    for level in LEVELS:
        _check(runs, "32-true", "bf16-mixed", level, resized)
    if OLD_RNG:
        pytest.skip(OLD_RNG_REASON)


# --- the Accelerate adapter -----------------------------------------------------------------------------------------


def _accelerate_run(precision: str, path: str) -> tuple[tuple[Weights, ...], Weights]:
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    if precision in ("O1", "O2"):
        handlers = [MixedPrecisionKwargs(half_dtype=HALF)]
        accelerator = Accelerator(cpu=True, mixed_precision=precision, kwargs_handlers=handlers)
    else:
        accelerator = Accelerator(cpu=True, mixed_precision=precision)
    raw = _gpt2()
    model, optimizer = accelerator.prepare(raw, _sgd(raw.parameters()))
    g = torch.Generator().manual_seed(1)

    def step(ids: torch.Tensor) -> None:
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()

    def export() -> Weights:
        return _floats(accelerator.get_state_dict(model))  # at O2 the FP32 masters

    step(torch.randint(0, 40, (2, 8), generator=g))
    _resize(accelerator.unwrap_model(model))
    resized = _floats(accelerator.unwrap_model(model).state_dict())
    optimizer = accelerator.prepare(_sgd(model.parameters()))
    for _ in range(2):
        step(torch.randint(30, 48, (2, 8), generator=g))
    accelerator.save_state(path)
    after = export()
    step(torch.randint(30, 48, (2, 8), generator=g))  # moved on, then back
    accelerator.load_state(path)
    assert _distance(export(), after) == 0.0, "load_state did not restore the resized model"
    step(torch.randint(30, 48, (2, 8), generator=g))
    return (after, export()), resized


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerate_resize_after_prepare_with_a_new_optimizer_then_save_and_load_state_trains_as_fp32(
    tmp_path,
) -> None:
    pytest.importorskip("accelerate")
    runs = {}
    for precision in ("no", "bf16", *LEVELS):
        runs[precision], resized = _accelerate_run(precision, os.path.join(tmp_path, precision))
    for level in LEVELS:
        _check(runs, "no", "bf16", level, resized)
    if OLD_RNG:
        pytest.skip(OLD_RNG_REASON)


# --- a half parameter set after set-up: refused, naming the parameter and the fix ----------------------------------


class _Tied(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 8)
        self.lm_head = nn.Linear(8, 20, bias=False)
        self.lm_head.weight = self.embed.weight

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        (ids,) = batch
        return F.cross_entropy(self.lm_head(self.embed(ids)).float().flatten(0, 1), ids.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _sgd(self.parameters())

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        ids = torch.randint(0, 20, (4, 6), generator=torch.Generator().manual_seed(0))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=2)


def _untie(model: nn.Module) -> None:
    # half at O2, and not the rounding of any master (an untie's exact clone is adopted:
    # tests/test_core_surgery_added_head.py)
    model.lm_head.weight = nn.Parameter(model.embed.weight.detach().clone() * 0.5 + 0.01)


_NAMED = r"'lm_head\.weight'.*Linear 'lm_head' after prepare_model\(\).*before prepare_model\(\)"


def test_untie_after_prepare_model_at_o2_is_refused_naming_the_parameter_and_the_fix() -> None:
    amp = Amp("O2", half_dtype=HALF)
    model = amp.prepare_model(_Tied())
    amp.prepare_optimizer(_sgd(model.parameters()))
    _untie(model)
    with pytest.raises(ValueError, match=_NAMED):
        amp.prepare_optimizer(_sgd(model.parameters()))


class _UntieAtEpochOne(pl.Callback):
    def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.current_epoch == 1:
            _untie(module)
            trainer.strategy.setup_optimizers(trainer)


def test_untie_mid_fit_at_o2_is_refused_by_the_trainer_naming_the_parameter() -> None:
    trainer = _trainer("O2", max_epochs=2, callbacks=[_UntieAtEpochOne()])
    with pytest.raises(ValueError, match=_NAMED):
        trainer.fit(_Tied())
