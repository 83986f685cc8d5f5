"""Training in stages at O2 through the Trainer and Fabric: a second stage with a new plugin, or on a deep copy of the
model, goes on from the first stage's FP32 masters (bit for bit the run that reuses the first plugin), and a
weight-averaging callback's FP32 copy on a second fit says it is FP32."""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pl = pytest.importorskip("lightning.pytorch")

from lightning.fabric import Fabric  # noqa: E402
from lightning.pytorch.callbacks import EMAWeightAveraging  # noqa: E402

from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin  # noqa: E402
from tests.lightning_helpers import Classifier, assert_same, classification_data, loader, make_trainer  # noqa: E402

HALF = "bfloat16"


def _first_stage(model: Classifier, data: Any, plugin: Any) -> None:
    """A pretraining stage whose Trainer is let go when it returns (the usual function per stage)."""
    make_trainer(plugin, max_epochs=1).fit(model, data)


def _weights(model: nn.Module, plugin: Any) -> list[torch.Tensor]:
    """The FP32 weights ``model`` trains: its masters at O2, its parameters in FP32."""
    if plugin is None:
        return [p.detach().clone() for p in model.parameters()]
    return [plugin.amp.master_of(p, refresh=False).detach().clone() for p in model.parameters()]


def _two_stages(how: str) -> list[torch.Tensor]:
    """Pretrain for an epoch, then fine-tune for two with a new Trainer (``how``: with the first plugin, a new plugin,
    a new plugin on a deep copy, or FP32 throughout); the FP32 weights after the second stage."""
    data = loader(classification_data(n=32))
    model = Classifier(optimizer="adamw", lr=1e-2)
    first = MixedPrecisionPlugin("O2", half_dtype=HALF) if how != "fp32" else None
    _first_stage(model, data, first)
    gc.collect()  # the first Trainer's engine goes: a second stage does not depend on when the collector runs
    if how == "deep copy":
        model = copy.deepcopy(model)
    second = first if how in ("same plugin", "fp32") else MixedPrecisionPlugin("O2", half_dtype=HALF)
    make_trainer(second, max_epochs=2).fit(model, data)
    return _weights(model, second)


def test_a_second_stage_with_a_new_plugin_or_on_a_deep_copy_is_the_run_that_reuses_the_first_plugin() -> None:
    """A second stage through a new ``Trainer(plugins=[MixedPrecisionPlugin("O2")])`` started its masters from the half
    weights (a bfloat16 rounding of the first stage's FP32 masters, with a warning; on a deep copy, silently). It goes
    on from the masters now: bit for bit the run that passes the first plugin again, and as close to FP32 training of
    the same two stages."""
    same = _two_stages("same plugin")
    assert_same(_two_stages("new plugin"), same)
    assert_same(_two_stages("deep copy"), same)
    fp32 = _two_stages("fp32")
    assert max((a - b).abs().max().item() for a, b in zip(same, fp32)) < 2e-2


def _fabric_stage(mpx: FabricMixedPrecisionPlugin, model: nn.Module, batches: list[Any]) -> tuple[Fabric, Any, Any]:
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx])
    module, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for x, y in batches:
        _fabric_step(fabric, module, optimizer, x, y)
    return fabric, module, optimizer


def _fabric_step(fabric: Fabric, module: Any, optimizer: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    fabric.backward(F.cross_entropy(module(x), y))
    optimizer.step()
    optimizer.zero_grad()


def test_fabric_a_second_stage_with_a_new_plugin_is_the_run_of_the_first_and_refuses_the_old_optimizer() -> None:
    """Fabric, two stages, a new ``FabricMixedPrecisionPlugin("O2")`` for the second: bit for bit the second stage
    set up with the first plugin again. The first stage's optimizer stepped by mistake afterwards raises (its engine
    handed the masters over) and leaves the second stage's run as it was."""
    batches = [(x, y) for x, y in loader(classification_data(n=48))]
    runs = []
    for how in ("same plugin", "new plugin"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        first = FabricMixedPrecisionPlugin("O2", half_dtype=HALF)
        old_fabric, old_module, old_optimizer = _fabric_stage(first, model, batches[:1])
        second = first if how == "same plugin" else FabricMixedPrecisionPlugin("O2", half_dtype=HALF)
        fabric, module, optimizer = _fabric_stage(second, model, [])
        if how == "new plugin":  # before the second stage's first step: nothing has written the weights since
            with pytest.raises(RuntimeError, match="handed to another engine"):
                _fabric_step(old_fabric, old_module, old_optimizer, *batches[0])
            optimizer.zero_grad()
        for x, y in batches[1:3]:
            _fabric_step(fabric, module, optimizer, x, y)
        runs.append([m.detach().clone() for m in second.master_params(optimizer)])
    assert_same(runs[1], runs[0])


class _MastersAtStart(pl.Callback):
    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.seen = _weights(module, trainer.precision_plugin)


def test_the_first_plugin_given_the_model_back_after_a_later_stage_takes_its_masters_back() -> None:
    """Stages alternating between two plugins (the first Trainer's plugin passed again for a third stage): the
    first plugin still thought it held the model's masters and failed at the optimizer ("belong to no model prepared
    for training"), or, at Fabric's setup, kept the model as set up. It prepares the model again and takes the
    masters back from the second stage's plugin, exactly; Fabric the same."""
    data = loader(classification_data(n=16))
    model = Classifier(optimizer="adamw", lr=1e-2)
    first, second = (MixedPrecisionPlugin("O2", half_dtype=HALF) for _ in range(2))
    make_trainer(first, max_steps=1).fit(model, data)
    make_trainer(second, max_steps=1).fit(model, data)
    trained = _weights(model, second)
    probe = _MastersAtStart()
    make_trainer(first, max_steps=1, callbacks=[probe]).fit(model, data)
    assert_same(probe.seen, trained)

    x, y = next(iter(data))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    mpx_first, mpx_second = (FabricMixedPrecisionPlugin("O2", half_dtype=HALF) for _ in range(2))
    _fabric_stage(mpx_first, net, [(x, y)])
    _, _, optimizer = _fabric_stage(mpx_second, net, [(x, y)])
    trained = [m.detach().clone() for m in mpx_second.master_params(optimizer)]
    _, _, optimizer = _fabric_stage(mpx_first, net, [])
    assert_same(mpx_first.master_params(optimizer), trained)


def test_an_ema_average_made_on_a_second_fit_is_fp32_and_says_so() -> None:
    """``EMAWeightAveraging`` copies the model at its setup: on a second fit the model is half already, and the
    plugin gives the copy the FP32 values of the masters, but the copy's ``dtype`` (``LightningModule.dtype``) still
    said bfloat16, so ``x.to(average.dtype)`` in its steps rounded FP32 inputs to half. It says float32 now, as on
    the first fit."""
    data = loader(classification_data(n=32))
    model = Classifier(optimizer="adamw", lr=1e-2)
    plugin = MixedPrecisionPlugin("O2", half_dtype=HALF)
    make_trainer(plugin).fit(model, data)
    averaging = EMAWeightAveraging(decay=0.9)
    make_trainer(plugin, callbacks=[averaging], max_steps=1).fit(model, data)
    average = averaging._average_model.module
    assert average.dtype == torch.float32 and all(p.dtype == torch.float32 for p in average.parameters())
    assert model.dtype == torch.bfloat16  # the model's own stays its weights' dtype
