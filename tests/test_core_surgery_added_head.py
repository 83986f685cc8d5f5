"""A module added after set-up at O2 (a new head for a second stage) and an untie after set-up, through every front
door: Amp, Fabric (``fabric.setup_optimizers``), the Trainer (a callback that adds the head and calls
``trainer.strategy.setup_optimizers``) and the Accelerate adapter (``accelerator.prepare(optimizer)``). Preparing an
optimizer that holds the new parameters makes the head half with FP32 masters (batch norm stays FP32), and it
trains as the same surgery does in FP32 (bfloat16; tolerances, not bit equality); a forward before that is refused,
naming the module and the fix."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp, FabricMixedPrecisionPlugin, MixedPrecisionPlugin
from tests.lightning_helpers import make_trainer

HALF = "bfloat16"
Weights = dict[str, torch.Tensor]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 8)
        self.body = nn.Linear(8, 8)
        self.lm_head = nn.Linear(8, 20, bias=False)
        self.classifier: nn.Module = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.lm_head(torch.tanh(self.body(self.embed(x)))).flatten(0, 1))


def _add_head(model: nn.Module) -> None:
    torch.manual_seed(1)
    model.classifier = nn.Sequential(nn.Linear(20, 4), nn.BatchNorm1d(4))


def _loss(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float()[:, :4], x.flatten() % 4)


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 20, (4, 6), generator=g) for _ in range(4)]


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5)


def _floats(state: dict[str, Any]) -> Weights:
    return {k: v.detach().float().clone() for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point()}


def _close(got: Weights, ref: Weights) -> None:
    assert got.keys() == ref.keys()
    assert any(k.startswith("classifier.") for k in ref)
    for name, value in ref.items():
        assert torch.allclose(got[name], value, atol=0.02, rtol=0.02), f"{name}: {(got[name] - value).abs().max()}"


# --- Amp -------------------------------------------------------------------------------------------------------------


def test_a_forward_through_a_head_added_after_prepare_model_is_refused_naming_it_and_the_fix() -> None:
    amp = Amp("O2", half_dtype=HALF)
    model = amp.prepare_model(_Net())
    amp.prepare_optimizer(_sgd(model.parameters()))
    _add_head(model)
    with pytest.raises(RuntimeError, match=r"Linear 'classifier\.0'.*after prepare_model\(\).*FP32.*optimizer") as info:
        with amp.forward_context():
            model(_batches()[0])
    assert "dtype" in str(info.value.__cause__), "not raised from torch's own error"


def test_a_model_converted_whole_after_prepare_keeps_the_engines_own_error_and_lets_its_masters_go() -> None:
    """``model.float()`` after an O2 prepare is not a module added since: the forward's error is the engine's own
    (naming the conversion), not the new-module diagnosis, and the engine's masters do not outlive the engine
    through the model's hooks (the diagnosis holds the engine weakly)."""
    import gc
    import weakref

    amp = Amp("O2", half_dtype=HALF)
    model = amp.prepare_model(_Net())
    amp.prepare_optimizer(_sgd(model.parameters()))
    model.float()
    with pytest.raises(RuntimeError, match=r"was converted to torch\.float32 after prepare_model\(\)") as info:
        with amp.forward_context():
            model(_batches()[0])
    assert "is still FP32" not in str(info.value)
    held = weakref.ref(amp.master_weights[0])
    del amp, info
    gc.collect()
    assert held() is None, "the model's hooks keep the engine's masters alive"


def test_a_head_added_after_prepare_model_is_made_half_with_fp32_masters_by_the_next_prepare_optimizer() -> None:
    amp = Amp("O2", half_dtype=HALF)
    model = amp.prepare_model(_Net())
    amp.prepare_optimizer(_sgd(model.parameters()))
    _add_head(model)
    fp32 = _floats(model.classifier.state_dict())
    opt = amp.prepare_optimizer(_sgd(model.parameters()))
    linear, norm = model.classifier
    assert linear.weight.dtype == torch.bfloat16
    assert norm.weight.dtype == torch.float32, "O2 keeps batch norm in FP32"
    masters = amp.fp32_state_dict(model)
    assert torch.equal(masters["classifier.0.weight"], fp32["0.weight"]), "the master is not the FP32 init"
    assert any(m.shape == linear.weight.shape and m.dtype == torch.float32 for m in amp.master_params(opt))


def test_an_untie_after_prepare_model_gets_the_exact_fp32_value_of_the_tied_master() -> None:
    amp = Amp("O2", half_dtype=HALF)
    model = amp.prepare_model(_Net())
    model.lm_head.weight = model.embed.weight
    amp.prepare_optimizer(_sgd(model.parameters()))
    exact = amp.fp32_state_dict(model)["embed.weight"].clone()
    assert not torch.equal(exact, exact.bfloat16().float())
    model.lm_head.weight = nn.Parameter(model.embed.weight.detach().clone())
    amp.prepare_optimizer(_sgd(model.parameters()))
    masters = amp.fp32_state_dict(model)
    assert torch.equal(masters["lm_head.weight"], exact) and torch.equal(masters["embed.weight"], exact)
    assert masters["lm_head.weight"].data_ptr() != masters["embed.weight"].data_ptr(), "still tied"


# --- Fabric ----------------------------------------------------------------------------------------------------------


def _fabric_run(precision: str) -> Weights:
    from lightning.fabric import Fabric

    plugin = FabricMixedPrecisionPlugin(precision, half_dtype=HALF) if precision == "O2" else None
    if plugin is not None:
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    else:
        fabric = Fabric(accelerator="cpu", devices=1, precision=precision)  # type: ignore[arg-type]
    model = fabric.setup(_Net())
    optimizer = fabric.setup_optimizers(_sgd(model.parameters()))
    for i, x in enumerate(_batches()):
        if i == 1:
            _add_head(model.module)
            optimizer = fabric.setup_optimizers(_sgd(model.parameters()))
            if plugin is not None:  # Fabric registers lazily, at the first step: after the forward (the fix named)
                plugin.setup_optimizers(optimizer)
        fabric.backward(_loss(model(x), x))
        optimizer.step()
        optimizer.zero_grad()
    return _floats(plugin.amp.fp32_state_dict(model.module) if plugin else model.module.state_dict())


def test_fabric_head_added_after_setup_with_a_new_optimizer_trains_as_fp32() -> None:
    _close(_fabric_run("O2"), _fabric_run("32-true"))


# --- the Trainer -----------------------------------------------------------------------------------------------------


class _LM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _Net()

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        (x,) = batch
        return _loss(self.net(x), x)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _sgd(self.parameters())

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = torch.utils.data.TensorDataset(torch.cat(_batches()[:2]))
        return torch.utils.data.DataLoader(data, batch_size=4)


class _HeadAtEpochOne(pl.Callback):
    def __init__(self, register: bool) -> None:
        self.register = register

    def on_train_epoch_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.current_epoch == 1:
            _add_head(module.net)
            trainer.strategy.setup_optimizers(trainer)  # the second stage's optimizer, with the head
            if self.register and isinstance(trainer.precision_plugin, MixedPrecisionPlugin):  # the fix named
                trainer.precision_plugin.amp.prepare_optimizer(trainer.optimizers[0])


def _trainer_run(precision: str, register: bool) -> Weights:
    plugin = MixedPrecisionPlugin(precision, half_dtype=HALF) if precision == "O2" else None
    settings = {"max_epochs": 2, "callbacks": [_HeadAtEpochOne(register)]}
    trainer = make_trainer(plugin, **settings) if plugin else make_trainer(precision=precision, **settings)
    module = _LM()
    trainer.fit(module)
    return _floats(plugin.amp.fp32_state_dict(module.net) if plugin else module.net.state_dict())


@pytest.mark.parametrize("register", [False, True], ids=["plain", "registered"])
def test_trainer_head_added_by_a_callback_between_epochs_trains_as_fp32(register: bool) -> None:
    _close(_trainer_run("O2", register), _trainer_run("32-true", register))


# --- the Accelerate adapter ------------------------------------------------------------------------------------------


def _accelerate_run(precision: str) -> Weights:
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    if precision == "O2":
        handlers = [MixedPrecisionKwargs(half_dtype=HALF)]
        accelerator = Accelerator(cpu=True, mixed_precision=precision, kwargs_handlers=handlers)
    else:
        accelerator = Accelerator(cpu=True, mixed_precision=precision)
    raw = _Net()
    model, optimizer = accelerator.prepare(raw, _sgd(raw.parameters()))
    for i, x in enumerate(_batches()):
        if i == 1:
            _add_head(accelerator.unwrap_model(model))
            optimizer = accelerator.prepare(_sgd(model.parameters()))
        accelerator.backward(_loss(model(x), x))
        optimizer.step()
        optimizer.zero_grad()
    return _floats(accelerator.get_state_dict(model))


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerate_head_added_after_prepare_with_a_new_optimizer_trains_as_fp32() -> None:
    pytest.importorskip("accelerate")
    _close(_accelerate_run("O2"), _accelerate_run("no"))
