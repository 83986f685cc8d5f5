"""A run given no ``half_dtype`` trains in the device's half dtype: bfloat16 on a CPU (float16 matmuls are often
emulated there, tens of times slower), float16 on CUDA, picked for the device the model trains on, with one log
line; an explicit ``half_dtype`` always wins; a checkpoint of another dtype is refused, not resumed silently."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin
from lightning_mpx.engine.amp import Amp
from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer

bf16, fp16 = torch.bfloat16, torch.float16
NOTE = "runs in bfloat16 on this CPU"


def _notes(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if NOTE in r.getMessage()]


def _fit(plugin: MixedPrecisionPlugin) -> tuple[pl.Trainer, Classifier]:
    model = Classifier()
    trainer = make_trainer(plugin, max_steps=2)
    trainer.fit(model, loader(classification_data(n=32)))
    return trainer, model


@pytest.mark.parametrize(
    "level, given, dtype, precision",
    [
        ("O1", {}, bf16, "bf16-mixed"),
        ("O2", {}, bf16, "bf16-true"),
        ("O1", {"half_dtype": "float16"}, fp16, "16-mixed"),
    ],
    ids=["O1-default", "O2-default", "O1-explicit-float16"],
)
def test_trainer_on_a_cpu_trains_in_bfloat16_unless_a_half_dtype_is_given(
    level: str, given: dict[str, Any], dtype: torch.dtype, precision: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="lightning_mpx"):
        trainer, model = _fit(MixedPrecisionPlugin(level, **given))
    assert trainer.precision == precision
    assert model.hidden_dtypes["train"] == dtype  # what the first layer computed in
    if level == "O2":
        assert model.net[0].weight.dtype == dtype and model.dtype == dtype
    amp = trainer.precision_plugin.amp
    assert amp.half_dtype == dtype
    assert amp.scalers[0].dynamic == (dtype == fp16)  # bfloat16: a static scale of 1.0, as an explicit one has
    assert len(_notes(caplog)) == int(not given)  # the one line, for the picked bfloat16 only
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_trainer_corrects_a_provisional_float16_at_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CUDA machine the plugin starts from float16; a Trainer on ``accelerator="cpu"`` trains in bfloat16: the
    dtype is picked for the strategy's device at set-up, before the model is converted."""
    with monkeypatch.context() as patched:
        patched.setattr(torch.cuda, "is_available", lambda: True)
        plugin = MixedPrecisionPlugin("O2")
        assert plugin.amp.half_dtype == fp16 and plugin.precision == "16-true"  # provisional
    trainer, model = _fit(plugin)
    assert plugin.amp.half_dtype == bf16 and trainer.precision == "bf16-true"
    assert model.net[0].weight.dtype == bf16 and not plugin.amp.scalers[0].dynamic
    assert plugin.settings.properties.half_dtype == bf16 and plugin.settings.device_type == "cpu"  # one pick
    assert plugin.settings.half_dtype is None  # what the user asked: pickled (ddp_spawn) as such, picked again


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 4)
        self.seen: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        self.seen = out.dtype
        return out


@pytest.mark.parametrize("provisional_fp16", [False, True], ids=["cpu-machine", "cuda-machine"])
def test_fabric_on_a_cpu_trains_in_bfloat16_without_a_half_dtype(
    provisional_fp16: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with monkeypatch.context() as patched:
        if provisional_fp16:
            patched.setattr(torch.cuda, "is_available", lambda: True)
        plugin = FabricMixedPrecisionPlugin("O2")
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = _Net()
    with caplog.at_level("WARNING", logger="lightning_mpx"):
        model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        for _ in range(2):
            loss = model(torch.randn(4, 8)).float().pow(2).mean()
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    assert net.fc.weight.dtype == bf16 and net.seen == bf16 and plugin.amp.half_dtype == bf16
    assert plugin.precision == "bf16-true" and not plugin.amp.scalers[0].dynamic
    assert len(_notes(caplog)) == 1


def test_fabric_explicit_float16_on_a_cpu_stays_float16_with_dynamic_scaling() -> None:
    plugin = FabricMixedPrecisionPlugin("O2", half_dtype="float16", init_scale=2.0**4)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    net = _Net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    before = net.fc.weight.detach().clone()
    fabric.backward(model(torch.randn(4, 8)).float().pow(2).mean() * float("inf"))
    optimizer.step()
    assert torch.equal(net.fc.weight, before)  # the overflowed step was skipped
    fabric.backward(model(torch.randn(4, 8)).float().pow(2).mean())
    optimizer.step()
    assert net.fc.weight.dtype == fp16 and plugin.precision == "16-true"
    assert plugin.amp.scalers[0].get_scale() == 2.0**3  # the overflow backed the dynamic scale off


def test_core_amp_loop_picks_bfloat16_for_a_cpu_model(caplog: pytest.LogCaptureFixture) -> None:
    amp = Amp("O1")
    net = _Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with caplog.at_level("WARNING", logger="lightning_mpx"):
        amp.prepare_model(net)
        amp.prepare_optimizer(optimizer)
        for _ in range(2):
            with amp.forward_context():
                loss = amp.cast_outputs(net(torch.randn(4, 8))).float().pow(2).mean()
            amp.backward(loss)
            assert amp.step(optimizer)
            amp.update()
            optimizer.zero_grad()
    assert net.seen == bf16 and amp.half_dtype == bf16 and not amp.scalers[0].dynamic
    assert amp.settings.device_type == "cpu" and len(_notes(caplog)) == 1


def test_core_amp_explicit_float16_on_a_cpu_keeps_dynamic_scaling() -> None:
    amp = Amp("O2", half_dtype=torch.float16, init_scale=2.0**4)
    net = amp.prepare_model(_Net())
    optimizer = amp.prepare_optimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    amp.backward(amp.cast_outputs(net(amp.cast_inputs(torch.randn(4, 8)))).sum() * float("inf"))
    assert not amp.step(optimizer)  # skipped on the overflow
    amp.update()
    assert net.fc.weight.dtype == fp16 and amp.scalers[0].get_scale() == 2.0**3


def test_a_float16_checkpoint_is_refused_where_bfloat16_was_picked_and_resumes_when_asked() -> None:
    """A run saved in float16 (on CUDA, no half_dtype given) resumed on a CPU: no silent switch to bfloat16."""
    saving = Amp("O2", half_dtype="float16", init_scale=2.0**5)
    net = saving.prepare_model(_Net())
    saving.prepare_optimizer(torch.optim.SGD(net.parameters(), lr=0.1))
    state = saving.state_dict()
    resumed = Amp("O2")
    net2 = resumed.prepare_model(_Net())
    resumed.prepare_optimizer(torch.optim.SGD(net2.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"trained in float16.*picked bfloat16.*half_dtype='float16'"):
        resumed.load_state_dict(state)
    chosen = Amp("O2", half_dtype="float16")  # the remedy: resumes in the checkpoint's dtype and scale
    net3 = chosen.prepare_model(_Net())
    chosen.prepare_optimizer(torch.optim.SGD(net3.parameters(), lr=0.1))
    chosen.load_state_dict(state)
    assert chosen.scalers[0].get_scale() == 2.0**5 and net3.fc.weight.dtype == fp16


def test_apex_layer_keeps_float16_on_a_cpu() -> None:
    from lightning_mpx.apex import amp as apex_amp

    net = _Net()
    model, _ = apex_amp.initialize(net, torch.optim.SGD(net.parameters(), lr=0.1), opt_level="O2", verbosity=0)
    assert model.fc.weight.dtype == fp16
