"""Every public entry point, given bad input or called in the wrong order, answers with an error that names the
argument (or the calls), the value and what is valid: never a bare AttributeError/KeyError from deep inside (stop 54).

Each case is one call a user makes, the exception type and a pattern of its message. ``FIXED`` were answered by a
bare error (or accepted) before this stop; ``GOOD`` were already right and are held so.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch
from torch import nn

import lightning_mpx as mpx
from lightning_mpx import Amp, CastPolicy, LossScaler, MasterWeights
from lightning_mpx.apex import amp as apex_amp
from lightning_mpx.apex import fp16_utils
from lightning_mpx.fsdp import check_sharded_model
from tests.error_tables import Row, cases, fresh_apex_state, refused  # noqa: F401 (fresh_apex_state: autouse)

BF16 = {"half_dtype": "bfloat16"}


def _linear() -> nn.Module:
    return nn.Linear(4, 4)


def _sgd(module: nn.Module | None = None) -> torch.optim.Optimizer:
    return torch.optim.SGD((module or _linear()).parameters(), lr=0.1)


def _prepared(level: str = "O2") -> tuple[Amp, nn.Module, torch.optim.Optimizer]:
    amp = Amp(level, **BF16)
    model = amp.prepare_model(_linear())
    return amp, model, amp.prepare_optimizer(_sgd(model))


def _load_before_prepare(level: str) -> None:
    amp, _, _ = _prepared("O2")
    Amp(level, **BF16).load_state_dict(amp.state_dict())  # the masters have no model to go into yet


def _unscale_twice() -> None:
    amp, model, opt = _prepared("O1")
    amp.backward(model(torch.randn(2, 4)).float().sum())
    amp.unscale_(opt)
    amp.unscale_(opt)


def _apex_load(state: Any) -> None:
    model, _ = apex_amp.initialize(_linear(), _sgd(), opt_level="O2", cast_model_type=torch.bfloat16, verbosity=0)
    apex_amp.load_state_dict(state)


def _fabric_clip_before_setup() -> None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx.FabricMixedPrecisionPlugin("O2", **BF16)])
    model = _linear()
    fabric.clip_gradients(model, _sgd(model), max_norm=1.0)  # before fabric.setup(model, optimizer)


def _accelerator(**kwargs: Any) -> Any:
    from lightning_mpx.accelerate import Accelerator

    return Accelerator(**kwargs)  # refused before Accelerate's process-wide state is touched


def _mpk() -> Any:
    from lightning_mpx.integrations.accelerate import MixedPrecisionKwargs

    return MixedPrecisionKwargs(**BF16)


_LIGHTNING_CKPT = {"state_dict": {}, "optimizer_states": [], "epoch": 1, "MixedPrecisionPlugin": {}}

FIXED: list[Row] = [
    ("Amp(cast_table=dict)", lambda: Amp("O1", cast_table={}, **BF16), TypeError,
     r"cast_table=dict must be a lightning_mpx\.CastTable or None"),
    ("Trainer plugin(cast_table=str)", lambda: mpx.MixedPrecisionPlugin("O1", cast_table="default", **BF16),
     TypeError, r"cast_table=str must be a lightning_mpx\.CastTable"),
    ("CastPolicy(table=str)", lambda: CastPolicy(table="default"), TypeError, r"table=str must be a lightning_mpx"),
    ("Amp(init_scaler=) typo", lambda: Amp("O2", init_scaler=1024.0, **BF16), TypeError,
     r"'init_scaler'; valid choices: cast_model_type.*or a setting: half_dtype.*init_scale.*"
     r"Did you mean init_scale=\?"),
    ("Fabric plugin(grow_interval=) typo", lambda: mpx.FabricMixedPrecisionPlugin("O2", grow_interval=5, **BF16),
     TypeError, r"Did you mean growth_interval=\?"),
    ("Trainer plugin.load_state_dict(list)", lambda: mpx.MixedPrecisionPlugin("O2", **BF16).load_state_dict([]),
     TypeError, r"state=list must be the dict that Amp\.state_dict\(\) returned"),
    ("Fabric plugin.load_state_dict(list)", lambda: mpx.FabricMixedPrecisionPlugin("O2", **BF16).load_state_dict([]),
     TypeError, r"state=list must be the dict"),
    ("Amp.load_state_dict(GradScaler state)",
     lambda: _prepared()[0].load_state_dict(torch.amp.GradScaler("cpu").state_dict()), ValueError,
     r"not an Amp\.state_dict\(\).*This is a torch\.amp\.GradScaler state dict"),
    ("Amp.load_state_dict(whole Lightning checkpoint)", lambda: _prepared()[0].load_state_dict(_LIGHTNING_CKPT),
     ValueError, r"whole Lightning checkpoint.*ckpt_path=.*checkpoint\['MixedPrecisionPlugin'\]"),
    ("LossScaler.load_state_dict(GradScaler state)",
     lambda: LossScaler().load_state_dict(torch.amp.GradScaler("cpu").state_dict()), KeyError,
     r"It is a torch\.amp\.GradScaler state dict: pass init_scale=state\['scale'\]"),
    ("Amp.load_state_dict before prepare_model (O2)", lambda: _load_before_prepare("O2"), RuntimeError,
     r"load_state_dict\(\) was called before prepare_model\(\).*Call prepare_model\(model\) first"),
    ("Amp.load_state_dict before prepare_model (O1 from O2)", lambda: _load_before_prepare("O1"), RuntimeError,
     r"load_state_dict\(\) was called before prepare_model\(\)"),
    ("convert_module(list)", lambda: mpx.convert_module([_linear()], torch.bfloat16), TypeError,
     r"module=list is not a torch\.nn\.Module"),
    ("convert_module(dtype='fp16')", lambda: mpx.convert_module(_linear(), "fp16"), TypeError,
     r"dtype='fp16' must be a floating-point torch\.dtype; valid choices: torch\.float16"),
    ("MasterWeights(module)", lambda: MasterWeights(_linear()), TypeError,
     r"named_parameters=Linear must be \(name, parameter\) pairs, such as model\.named_parameters\(\)"),
    ("MasterWeights([module])", lambda: MasterWeights([_linear()]), TypeError,
     r"named_parameters holds Linear; it must be \(name, parameter\) pairs"),
    ("release_masters(list)", lambda: mpx.release_masters([_linear()]), TypeError,
     r"module=list is not a torch\.nn\.Module"),
    ("dispatchable(3)", lambda: mpx.dispatchable(3), TypeError, r"function=3 is not callable"),
    ("apex half_function(3)", lambda: apex_amp.half_function(3), TypeError, r"function=3 is not callable"),
    ("apex master_params(model)", lambda: list(apex_amp.master_params(_linear())), TypeError,
     r"optimizer=Linear is not an optimizer"),
    ("apex load_state_dict(list)", lambda: _apex_load([]), TypeError,
     r"state_dict=list must be the dict that amp\.state_dict\(\) returned"),
    ("check_sharded_model(list)", lambda: check_sharded_model([_linear()], "O2"), TypeError,
     r"module=list must be a torch\.nn\.Module"),
    ("Accelerator(kwargs_handlers=handler)", lambda: _accelerator(mixed_precision="O2", kwargs_handlers=_mpk()),
     TypeError, r"kwargs_handlers=MixedPrecisionKwargs must be a list of handlers.*pass \[handler\]"),
    ("fabric.clip_gradients before fabric.setup", _fabric_clip_before_setup, RuntimeError,
     r"prepare_model\(\) must run before prepare_optimizer\(\).*fabric\.setup\(model, optimizer\) before"),
    ("FP16_Optimizer(dynamic_loss_scale='False')",
     lambda: fp16_utils.FP16_Optimizer(_sgd(_linear().half()), dynamic_loss_scale="False"), TypeError,
     r"dynamic_loss_scale='False' must be True or False"),
    ("fp16_utils.convert_network(dtype='half')", lambda: fp16_utils.convert_network(_linear(), "half"), TypeError,
     r"dtype='half' must be a floating-point torch\.dtype"),
]

GOOD: list[Row] = [
    ("Amp('o2')", lambda: Amp("o2"), ValueError, r"opt_level='o2' is not an opt level; valid choices: 'O0'.*'O2'\?"),
    ("Amp('O4')", lambda: Amp("O4"), ValueError, r"opt_level='O4' is not an opt level; valid choices"),
    ("Amp(2)", lambda: Amp(2), ValueError, r"opt_level=2 is not an opt level"),
    ("Amp(half_dtype=float64)", lambda: Amp("O2", half_dtype=torch.float64), ValueError,
     r"half_dtype=torch\.float64 is not a half-precision dtype; valid choices: 'float16'"),
    ("Amp(growth_interval=-1)", lambda: Amp("O2", half_dtype="float16", growth_interval=-1), ValueError,
     r"growth_interval=-1 must be a positive integer"),
    ("LossScaler(init_scale=nan)", lambda: LossScaler(init_scale=math.nan), ValueError,
     r"init_scale=nan must be a positive finite number"),
    ("LossScaler(backoff_factor=1.5)", lambda: LossScaler(backoff_factor=1.5), ValueError,
     r"backoff_factor=1\.5 must be between 0 and 1"),
    ("LossScaler(growth_factor=0.5)", lambda: LossScaler(growth_factor=0.5), ValueError,
     r"growth_factor=0\.5 must be a finite number of at least 1\.0"),
    ("LossScaler(init_scaler=)", lambda: LossScaler(init_scaler=2.0), TypeError,
     r"LossScaler\(\) got an unexpected keyword argument 'init_scaler'; valid choices: init_scale"),
    ("Amp(on_floor='Raise')", lambda: Amp("O2", on_floor="Raise", **BF16), ValueError,
     r"on_floor='Raise' is not valid; valid choices: raise, warn"),
    ("Amp(loss_scale=0)", lambda: Amp("O2", loss_scale=0, **BF16), ValueError,
     r"loss_scale=0 must be a positive finite number; valid choices: 'dynamic'"),
    ("Amp(allow_banned=tensor)", lambda: Amp("O1", allow_banned=torch.tensor(True), **BF16), TypeError,
     r"allow_banned=tensor\(True\) must be True or False"),
    ("Amp(fp32_modules='lm_head')", lambda: Amp("O2", fp32_modules="lm_head", **BF16), TypeError,
     r"did you mean fp32_modules=\['lm_head'\]"),
    ("Accelerator(mixed_precision='o2')", lambda: _accelerator(mixed_precision="o2"), ValueError,
     r"mixed_precision='o2' is not valid; valid choices: Accelerate's 'no'"),
    ("Amp.step before prepare_optimizer", lambda: Amp("O1", **BF16).step(_sgd()), RuntimeError,
     r"optimizer=SGD was not registered; call prepare_optimizer\(\) on it first"),
    ("Amp.unscale_ twice", _unscale_twice, RuntimeError, r"unscale_\(\) has already been called on this optimizer"),
    ("Amp.backward(loss_id=3)", lambda: Amp("O1", **BF16).backward(torch.ones((), requires_grad=True), loss_id=3),
     ValueError, r"loss_id=3 is out of range; valid choices: 0 to 0"),
    ("Amp.load_state_dict(Apex amp.state_dict())",
     lambda: _prepared()[0].load_state_dict({"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 0}}), ValueError,
     r"is an Apex amp\.state_dict\(\) with loss scales only"),
    ("apex initialize(['x'])", lambda: apex_amp.initialize(["x"], opt_level="O2"), TypeError,
     r"models=\['x'\] must be a Module or a non-empty list of them"),
    ("apex state_dict before initialize", apex_amp.state_dict, RuntimeError,
     r"amp\.initialize\(\) has not been called"),
]


@cases(FIXED)
def test_bad_input_fixed_this_stop_is_named(call: Callable[[], Any], error: type[Exception], pattern: str) -> None:
    refused(call, error, pattern)


@cases(GOOD)
def test_bad_input_already_named_stays_so(call: Callable[[], Any], error: type[Exception], pattern: str) -> None:
    refused(call, error, pattern)


@pytest.mark.parametrize("alias", ["fp16", "half", "FP16", "float16", torch.float16])
def test_common_half_dtype_spellings_are_accepted(alias: object) -> None:
    assert Amp("O2", half_dtype=alias).properties.half_dtype == torch.float16


def test_a_refused_load_before_prepare_changes_nothing() -> None:
    """The wrong-order load is refused before anything is loaded: the scale the engine starts from is its own."""
    saved = Amp("O2", half_dtype="float16", init_scale=1024.0)
    trained = saved.prepare_model(_linear())
    saved.prepare_optimizer(_sgd(trained))
    fresh = Amp("O2", half_dtype="float16")
    with pytest.raises(RuntimeError, match="before prepare_model"):
        fresh.load_state_dict(saved.state_dict())
    assert fresh.scalers[0].get_scale() == 2.0**16
    model = fresh.prepare_model(_linear())
    fresh.prepare_optimizer(_sgd(model))
    fresh.load_state_dict(saved.state_dict())  # in the right order it loads
    assert fresh.scalers[0].get_scale() == 1024.0
