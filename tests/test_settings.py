"""The settings object: one place that defines, documents and checks every setting; each front door agrees with it."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
import typing

import pytest
import torch
from torch import nn

from lightning_mpx import Amp, LossScaler, MixedPrecisionSettings, ScalerSettings
from lightning_mpx.settings import (
    DEFAULTS,
    OPT_LEVEL_OVERRIDES,
    SCALER_FIELDS,
    ScalerKeywords,
    SettingsKeywords,
)

ENGINE_FIELDS = [f.name for f in dataclasses.fields(MixedPrecisionSettings) if f.init]
KEYWORDS = [n for n in ENGINE_FIELDS if n not in ("opt_level", "overrides", "scaler")] + list(SCALER_FIELDS)


def _keyword_defaults(function) -> dict:
    params = inspect.signature(function).parameters
    return {n: p.default for n, p in params.items() if p.kind is p.KEYWORD_ONLY}


def _default(name: str):
    return getattr(DEFAULTS.scaler if name in SCALER_FIELDS else DEFAULTS, name)


def test_every_front_door_has_each_setting_typed_with_the_settings_default():
    # Adding a field to the settings without its typed keyword (or with another default) fails here.
    from lightning_mpx.integrations.accelerate import MixedPrecisionKwargs
    from lightning_mpx.integrations.fabric import FabricMixedPrecisionPlugin
    from lightning_mpx.integrations.lightning import MixedPrecisionPlugin

    kwargs_fields = {f.name: f.default for f in dataclasses.fields(MixedPrecisionKwargs)}
    for front in (Amp.__init__, MixedPrecisionPlugin.__init__, FabricMixedPrecisionPlugin.__init__):
        defaults = _keyword_defaults(front)
        # then each opt-level override, typed, default None: the level's value (a LightningCLI config sets them)
        expected = [*KEYWORDS, *OPT_LEVEL_OVERRIDES]
        assert list(defaults) == expected, (front, sorted(set(defaults) ^ set(expected)))
        assert all(defaults[name] == _default(name) for name in KEYWORDS), front
        assert all(defaults[name] is None for name in OPT_LEVEL_OVERRIDES), front
        params = inspect.signature(front).parameters
        assert all(params[name].annotation is not inspect.Parameter.empty for name in expected), front
    assert set(KEYWORDS) | set(OPT_LEVEL_OVERRIDES) <= set(kwargs_fields)
    # but half_dtype: None, the device's (bfloat16 on a CPU, else the settings' float16; docs/accelerate.md)
    assert all(kwargs_fields[name] == (None if name == "half_dtype" else _default(name)) for name in KEYWORDS)
    # LossScaler's keywords are the scaler settings and the run's half dtype (which words its floor error's advice).
    scaler_keywords = _keyword_defaults(LossScaler.__init__)
    assert scaler_keywords.pop("half_dtype") is None
    assert scaler_keywords == {name: getattr(DEFAULTS.scaler, name) for name in SCALER_FIELDS}


def _typed(annotations: dict) -> dict:
    return {name: getattr(kind, "__forward_arg__", kind) for name, kind in annotations.items()}


def test_the_typed_keywords_are_the_settings_fields():
    # What type checkers and IDEs read (the TypedDicts of **settings) is what the settings hold: the same names and
    # the same types, so that a field added without its typed keyword (or with another type) fails here.
    from lightning_mpx.integrations.accelerate_kwargs import MixedPrecisionKwargs, MixedPrecisionKwargsKeywords

    scaler = {f.name: f.type for f in dataclasses.fields(ScalerSettings)}
    assert _typed(ScalerKeywords.__annotations__) == scaler
    engine = {f.name: f.type for f in dataclasses.fields(MixedPrecisionSettings) if f.name in KEYWORDS}
    overrides = set(OPT_LEVEL_OVERRIDES)
    typed = _typed(SettingsKeywords.__annotations__)
    assert {k: v for k, v in typed.items() if k not in overrides} == {**engine, **scaler}
    assert set(typed) - set(KEYWORDS) == overrides
    fields = {f.name: f.type for f in dataclasses.fields(MixedPrecisionKwargs)}
    assert set(_typed(MixedPrecisionKwargsKeywords.__annotations__)) == set(fields)
    # LossScaler shows the scaler's keywords, typed as the fields (evaluated: jsonargparse reads them).
    params = inspect.signature(LossScaler).parameters
    assert {name: params[name].annotation for name in SCALER_FIELDS} == typing.get_type_hints(ScalerSettings)


def test_a_misspelt_keyword_is_named():
    with pytest.raises(TypeError, match=r"unknown opt-level override\(s\) 'grow_interval'; valid choices: cast_model"):
        Amp("O1", grow_interval=5)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"LossScaler\(\) got an unexpected keyword argument 'grow_interval'; valid"):
        LossScaler(grow_interval=5)  # type: ignore[call-arg]
    from lightning_mpx.integrations.accelerate import MixedPrecisionKwargs

    with pytest.raises(TypeError, match="unexpected keyword argument 'grow_interval'"):
        MixedPrecisionKwargs(grow_interval=5)  # type: ignore[call-arg]


def test_keywords_and_settings_build_the_same_engine():
    from lightning_mpx.integrations.accelerate import MixedPrecisionKwargs
    from lightning_mpx.integrations.lightning import MixedPrecisionPlugin

    kw = dict(half_dtype="bfloat16", num_losses=2, growth_interval=7, hysteresis=2, model_writes="values",
              fp32_modules=["0"], keep_batchnorm_fp32=False, loss_scale="dynamic")
    settings = MixedPrecisionSettings.from_kwargs("O2", **kw)
    by_keywords, by_settings = Amp("O2", **kw), Amp.from_settings(settings)
    assert by_keywords.settings == settings == by_settings.settings
    assert by_settings.properties == by_keywords.properties and by_settings.properties.keep_batchnorm_fp32 is False
    assert [s.growth_interval for s in by_settings.scalers] == [7, 7] and by_settings.model_writes == "values"
    assert Amp(settings.opt_level, **settings.to_kwargs()).settings == settings
    assert MixedPrecisionPlugin.from_settings(settings).amp.settings == settings
    from lightning_mpx.integrations.fabric import FabricMixedPrecisionPlugin

    fabric_plugin = FabricMixedPrecisionPlugin.from_settings(settings)
    assert fabric_plugin.amp.settings == settings == FabricMixedPrecisionPlugin("O2", **kw).amp.settings
    assert pickle.loads(pickle.dumps(fabric_plugin)).amp.settings == settings
    assert MixedPrecisionKwargs(**{k: v for k, v in kw.items() if k != "fp32_modules"}, fp32_modules=["0"]).settings(
        "O2") == settings
    assert pickle.loads(pickle.dumps(settings)) == settings
    # The engine runs from the settings object alone.
    model = by_settings.prepare_model(nn.Sequential(nn.Linear(4, 4)))
    opt = by_settings.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    by_settings.backward(by_settings.cast_outputs(model(by_settings.cast_inputs(torch.randn(2, 4)))).float().sum())
    assert by_settings.step(opt)


def test_settings_are_frozen_and_checked_when_built():
    settings = MixedPrecisionSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.num_losses = 2  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"growth_factor=0\.5 must be a finite number of at least 1\.0"):
        ScalerSettings(growth_factor=0.5)
    with pytest.raises(ValueError, match=r"on_floor='ignore' is not valid; valid choices: raise, warn"):
        ScalerSettings(on_floor="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"opt_level='02' is not an opt level.*letter O"):
        MixedPrecisionSettings("02")
    with pytest.raises(TypeError, match=r"unknown opt-level override\(s\) 'keep_bn'"):
        MixedPrecisionSettings.from_kwargs("O2", keep_bn=True)
    with pytest.raises(ValueError, match=r"init_scale=0\.5 lies outside \[min_loss_scale=1\.0"):
        MixedPrecisionSettings(half_dtype="float16", scaler=ScalerSettings(init_scale=0.5))  # dynamic at O1
    # A static scale ignores init_scale, as before: bfloat16's default is a static 1.0.
    assert (
        MixedPrecisionSettings(half_dtype="bfloat16", scaler=ScalerSettings(init_scale=0.5)).properties.loss_scale
        == 1.0
    )
    with pytest.raises(TypeError, match="settings=dict must be a lightning_mpx.MixedPrecisionSettings"):
        Amp.from_settings({})  # type: ignore[arg-type]
