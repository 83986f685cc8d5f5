"""One meaning per setting at every door, and no scaler setting silently ignored (stop 54)."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from torch import nn

from lightning_mpx import Amp, MixedPrecisionSettings
from lightning_mpx.integrations.fabric import FabricMixedPrecisionPlugin
from lightning_mpx.integrations.fsdp import _mode
from lightning_mpx.integrations.lightning import MixedPrecisionPlugin
from lightning_mpx.opt_levels import Properties
from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer

IGNORED = "ignored: opt_level="


class _BatchNormClassifier(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def _fit(plugin: MixedPrecisionPlugin) -> Classifier:
    model = _BatchNormClassifier()
    make_trainer(plugin, max_steps=1).fit(model, loader(classification_data(n=16)))
    return model


@pytest.mark.parametrize(("level", "bn"), [("O2", torch.float32), ("O3", torch.bfloat16)])
def test_keep_batchnorm_none_on_a_half_model_means_the_level_value_for_every_converter(level, bn):
    # Settings built directly keep an override given as None: the core engine read it as True, the FSDP policy (and the
    # Trainer plugin's O3 cast under FSDP) as False. Now it is resolved once, in the properties: the level's value.
    settings = MixedPrecisionSettings(level, half_dtype="bfloat16", overrides={"keep_batchnorm_fp32": None})
    assert settings.properties.keep_batchnorm_fp32 is (bn == torch.float32)
    model = Amp.from_settings(settings).prepare_model(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    assert model[1].weight.dtype == bn and model[0].weight.dtype == torch.bfloat16
    assert _mode(settings.properties).batchnorm_islands is (bn == torch.float32)  # FSDP1/FSDP2's policy
    built = Properties(level, torch.bfloat16, False, None, level == "O2", 1.0, torch.bfloat16)
    assert built.keep_batchnorm_fp32 is (bn == torch.float32)
    if level == "O2":  # the Trainer plugin from the same settings keeps batch norm as the engine does
        trained = _fit(MixedPrecisionPlugin.from_settings(settings))
        assert trained.net[1].weight.dtype == torch.float32 and trained.net[0].weight.dtype == torch.bfloat16


def test_settings_override_given_as_none_reaches_every_door_and_survives_pickling():
    # MixedPrecisionSettings' overrides keep resolve_properties' None (cast_model_type=None: the model as it is);
    # from_settings went through keywords, where None means the level's value, and cast the model at O2.
    settings = MixedPrecisionSettings(
        "O2", half_dtype="bfloat16",
        overrides={"cast_model_type": None, "master_weights": False, "keep_batchnorm_fp32": None},
    )
    assert settings.properties.cast_model_type is None
    trainer_plugin = MixedPrecisionPlugin.from_settings(settings)
    fabric_plugin = FabricMixedPrecisionPlugin.from_settings(settings)
    doors = {
        "Amp(**to_kwargs())": Amp(settings.opt_level, **settings.to_kwargs()),
        "Amp.from_settings": Amp.from_settings(settings),
        "MixedPrecisionPlugin.from_settings": trainer_plugin.amp,
        "FabricMixedPrecisionPlugin.from_settings": fabric_plugin.amp,
        "MixedPrecisionPlugin pickled (ddp_spawn)": pickle.loads(pickle.dumps(trainer_plugin)).amp,
        "FabricMixedPrecisionPlugin pickled (ddp_spawn)": pickle.loads(pickle.dumps(fabric_plugin)).amp,
    }
    for door, amp in doors.items():
        assert amp.properties == settings.properties, door
        assert amp.settings.overrides == settings.overrides, door
    # The keywords keep their meaning: None is the level's value.
    assert MixedPrecisionPlugin("O2", half_dtype="bfloat16", cast_model_type=None).amp.properties.casts_model
    # What a user sees: the Trainer and Fabric leave the model FP32, as the engine does.
    assert _fit(MixedPrecisionPlugin.from_settings(settings)).net[0].weight.dtype == torch.float32
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[FabricMixedPrecisionPlugin.from_settings(settings)])
    assert fabric.setup(nn.Linear(4, 4)).weight.dtype == torch.float32


def _warnings(build) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build()
    return [str(w.message) for w in caught if IGNORED in str(w.message)]


def test_scaler_settings_a_static_scale_ignores_are_named_with_the_remedy():
    # bfloat16's default loss scale is a static 1.0: init_scale and growth_interval were dropped without a word.
    (message,) = _warnings(lambda: Amp("O2", half_dtype="bfloat16", init_scale=256.0, growth_interval=500))
    assert "init_scale=256.0, growth_interval=500 are ignored" in message and "loss_scale='dynamic'" in message
    (message,) = _warnings(lambda: Amp("O3", half_dtype="float16", hysteresis=2))
    assert "hysteresis=2 is ignored" in message and "static loss scale 1.0 (O3's default)" in message
    assert _warnings(lambda: Amp("O2", half_dtype="bfloat16")) == []  # the defaults
    assert _warnings(lambda: Amp("O2", half_dtype="bfloat16", on_floor="warn")) == []  # a static scale reads it
    # With half_dtype=None the dtype (and so the scale) is known when the engine picks it: at the first model.
    built: list[Amp] = []
    assert _warnings(lambda: built.append(Amp("O2", init_scale=256.0))) == []
    assert len(_warnings(lambda: built[0].prepare_model(nn.Linear(4, 4)))) == 1  # a CPU model: bfloat16
    assert built[0].half_dtype == torch.bfloat16


def test_the_scaler_settings_act_with_a_dynamic_bfloat16_scale():
    amp = Amp("O2", half_dtype="bfloat16", loss_scale="dynamic", init_scale=256.0, growth_interval=1)
    assert _warnings(lambda: Amp("O2", half_dtype="bfloat16", loss_scale="dynamic", init_scale=256.0)) == []
    model = amp.prepare_model(nn.Linear(4, 1))
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert amp.scalers[0].get_scale() == 256.0
    amp.backward(model(torch.randn(8, 4, dtype=torch.bfloat16)).float().square().mean())
    amp.step(optimizer)
    amp.update()
    assert amp.scalers[0].get_scale() == 512.0  # grew after growth_interval=1 clean step


@pytest.mark.usefixtures("fresh_accelerate_state")  # Accelerate's singleton state: none at the start
def test_every_door_warns_once_on_rank_zero_only(monkeypatch):
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    settings = MixedPrecisionSettings.from_kwargs("O2", half_dtype="bfloat16", growth_interval=500)
    assert len(_warnings(lambda: MixedPrecisionPlugin.from_settings(settings))) == 1
    assert len(_warnings(lambda: FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16", growth_interval=500))) == 1
    handler = MixedPrecisionKwargs(half_dtype="bfloat16", growth_interval=500)
    assert len(_warnings(lambda: Accelerator(mixed_precision="O2", kwargs_handlers=[handler]))) == 1
    # The settings module's own example now shows settings that act.
    assert _warnings(lambda: Amp.from_settings(MixedPrecisionSettings.from_kwargs(
        "O2", half_dtype="float16", growth_interval=500))) == []
    monkeypatch.setenv("RANK", "1")
    assert _warnings(lambda: Amp("O2", half_dtype="bfloat16", growth_interval=500)) == []


def test_apex_layer_warns_only_for_bounds_given_with_a_static_scale():
    from lightning_mpx.apex import amp as apex_amp
    from lightning_mpx.apex.fp16_utils import FP16_Optimizer

    def initialize(**kwargs):
        model = nn.Linear(4, 4)
        apex_amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), verbosity=0, **kwargs)

    assert _warnings(lambda: initialize(opt_level="O2", cast_model_type=torch.bfloat16)) == []  # Apex's own defaults
    assert _warnings(lambda: initialize(opt_level="O3")) == []
    assert _warnings(lambda: initialize(opt_level="O1", loss_scale=128.0)) == []
    (message,) = _warnings(lambda: initialize(opt_level="O3", min_loss_scale=2.0))
    assert "min_loss_scale=2.0 is ignored" in message
    half = nn.Linear(4, 4).half()
    assert _warnings(lambda: FP16_Optimizer(torch.optim.SGD(half.parameters(), lr=0.1), static_loss_scale=128.0)) == []
