"""Hostile sweep of the public API: bad input gets an error naming the argument, the value and what is valid; calls in
the wrong order get an error naming the calls, or do what an FP32 run / ``torch.amp.GradScaler`` does; weights are
never silently corrupted."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_mpx import Amp, LossScaler, MixedPrecisionSettings

X = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _engine(level: str = "O2", half_dtype: str = "bfloat16", **settings):
    amp = Amp(level, half_dtype=half_dtype, **settings)
    model = amp.prepare_model(_net())
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    return amp, model, optimizer


def _loss(amp: Amp, model: nn.Module) -> torch.Tensor:
    with amp.forward_context():
        return amp.cast_outputs(model(amp.cast_inputs(X))).float().pow(2).mean()


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().float().clone() for p in model.parameters()]


# -- bad input ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("key", "value", "error", "words"),
    [
        ("overflow_log_interval", -1.0, ValueError, r"overflow_log_interval=-1\.0.*at least 0"),
        ("overflow_log_interval", math.nan, ValueError, r"overflow_log_interval=nan"),
        ("overflow_log_interval", "10", ValueError, r"overflow_log_interval='10'.*seconds"),
        ("overflow_log_interval", True, ValueError, r"overflow_log_interval=True"),
        ("allow_banned", 1, TypeError, r"allow_banned=1 must be True or False"),
        ("allow_banned", "yes", TypeError, r"allow_banned='yes' must be True or False"),
    ],
)
def test_unchecked_settings_are_refused(key, value, error, words):
    with pytest.raises(error, match=words):
        Amp("O2", **{key: value})


def test_overrides_that_are_not_a_mapping_name_the_valid_keys():
    with pytest.raises(TypeError, match=r"overrides=int must be a mapping.*loss_scale"):
        MixedPrecisionSettings(overrides=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("level", ["O1", "O2"])
@pytest.mark.parametrize(
    ("make", "error", "words"),
    [
        (lambda amp, model: torch.tensor(3), TypeError, r"loss=torch\.int64 must be a floating-point torch\.Tensor"),
        (lambda amp, model: 3.0, TypeError, r"loss=float must be a floating-point"),
        (lambda amp, model: None, TypeError, r"loss=NoneType must be a floating-point"),
        (lambda amp, model: _loss(amp, model).expand(3), ValueError, r"loss has shape \(3,\).*loss\.mean\(\)"),
        (lambda amp, model: _loss(amp, model).detach(), ValueError, r"loss does not require grad.*no_grad"),
    ],
)
def test_bad_losses_are_named_before_autograd(level, make, error, words):
    amp, model, optimizer = _engine(level)
    before = _weights(model)
    with pytest.raises(error, match=words):
        amp.backward(make(amp, model))
    amp.step(optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))


def test_a_loss_with_several_elements_and_a_gradient_is_a_backward_torch_allows():
    amp, model, optimizer = _engine("O1")
    amp.backward(_loss(amp, model).expand(3), gradient=torch.full((3,), 1 / 3))
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("bad", [torch.tensor(3), 3.0, None])
def test_scale_loss_and_the_scaler_refuse_what_is_no_float_loss(bad):
    amp, _, _ = _engine("O2", half_dtype="float16")
    with pytest.raises(TypeError, match=r"loss=.* must be a floating-point torch\.Tensor"):
        amp.scale_loss(bad)
    with pytest.raises(TypeError, match=r"loss=.* must be a floating-point"):
        LossScaler().scale(bad)


@pytest.mark.parametrize("call", ["clip_grad_norm_", "clip_grad_value_"])
@pytest.mark.parametrize("limit", [math.nan, -1.0, 0.0, None, "1", True])
def test_clip_limits_that_would_corrupt_the_gradients_are_refused(call, limit):
    # torch's clip accepts a NaN or negative max_norm and writes NaN or sign-flipped gradients: the step applies them.
    amp, model, optimizer = _engine("O2")
    amp.backward(_loss(amp, model))
    name = "max_norm" if call == "clip_grad_norm_" else "clip_value"
    with pytest.raises(ValueError, match=rf"{name}={limit!r}.*must be a positive number"):
        getattr(amp, call)(optimizer, limit)


def test_an_infinite_max_norm_measures_without_clipping():
    amp, model, optimizer = _engine("O1")
    amp.backward(_loss(amp, model))
    norm = amp.clip_grad_norm_(optimizer, math.inf)
    reference = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    torch.testing.assert_close(norm, reference)


@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda amp, model, opt: amp.share_overflow(opt), r"optimizers=SGD must be a list.*\[optimizer\]"),
        (lambda amp, model, opt: amp.release_optimizer(model), r"optimizer=Sequential is not a torch\.optim"),
        (lambda amp, model, opt: amp.master_of(model), r"param=Sequential must be a model parameter"),
        (lambda amp, model, opt: amp.master_of(3), r"param=int must be a model parameter"),
        (lambda amp, model, opt: amp.refresh_masters(model), r"params=Sequential must be an iterable.*parameters"),
        (lambda amp, model, opt: amp.refresh_masters(3), r"params=int must be an iterable"),
        (lambda amp, model, opt: amp.refresh_masters([model]), r"params holds Sequential"),
        (lambda amp, model, opt: amp.load_state_dict(None), r"state=NoneType must be the dict.*Amp\.state_dict"),
    ],
)
def test_a_model_where_an_optimizer_or_parameter_is_expected_is_named(call, words):
    amp, model, optimizer = _engine("O2")
    with pytest.raises(TypeError, match=words):
        call(amp, model, optimizer)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_state_dict_that_is_not_the_engines_is_refused_naming_the_right_call(level):
    amp, model, _ = _engine(level)
    with pytest.raises(ValueError, match=r"not an Amp\.state_dict\(\).*'scalers'.*model\.load_state_dict\(\)"):
        amp.load_state_dict(model.state_dict())
    with pytest.raises(ValueError, match=r"keys none.*lacks"):
        amp.load_state_dict({})


@pytest.mark.parametrize("scale", [math.nan, math.inf, -2.0, 0.0, "big", None])
def test_a_scaler_checkpoint_with_a_broken_scale_is_refused(scale):
    scaler = LossScaler()
    state = {**scaler.state_dict(), "scale": scale}
    with pytest.raises(ValueError, match=rf"loss scale {scale!r} is not a positive finite number"):
        scaler.load_state_dict(state)
    amp, _, _ = _engine("O2", half_dtype="float16")
    engine_state = amp.state_dict()
    engine_state["scalers"] = [state]
    with pytest.raises(ValueError, match="not a positive finite number"):
        amp.load_state_dict(engine_state)
    assert amp.scalers[0].get_scale() == 65536.0  # unchanged


def test_scaler_update_and_load_refuse_wrong_types():
    scaler = LossScaler()
    with pytest.raises(TypeError, match=r"found_inf=None must be a torch\.Tensor"):
        scaler.update(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"found_inf=True must be a torch\.Tensor"):
        scaler.update(True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"state=int must be a dict"):
        scaler.load_state_dict(1)  # type: ignore[arg-type]


def test_a_meta_model_at_o2_is_refused_before_its_masters_are_made():
    amp = Amp("O2", half_dtype="bfloat16")
    with torch.device("meta"):
        model = _net()
    with pytest.raises(ValueError, match=r"module=Sequential has parameters on the meta device.*'0\.weight'.*to_empty"):
        amp.prepare_model(model)


def test_a_meta_model_evaluated_at_o2_or_trained_at_o3_is_prepared():
    with torch.device("meta"):
        model = _net()
    Amp("O2", half_dtype="bfloat16").prepare_model(model, train=False)
    Amp("O3", half_dtype="bfloat16").prepare_model(model)


# -- misuse: calls in the wrong order ------------------------------------------------------------------------------
def test_a_step_after_a_new_backward_or_an_update_is_allowed():
    amp, model, optimizer = _engine("O2", half_dtype="float16")
    amp.backward(_loss(amp, model))
    assert amp.step(optimizer)
    optimizer.zero_grad()
    amp.backward(_loss(amp, model))  # two steps in one iteration, each after its own backward
    assert amp.step(optimizer)
    amp.update()
    amp.update()  # twice: a no-op, as GradScaler.update()
    amp.step(optimizer)  # after an update: the step has nothing new, as GradScaler's


@pytest.mark.parametrize("level", ["O2", "O3"])
@pytest.mark.parametrize(
    ("convert", "dtype"),
    [
        (lambda m: m.half(), "torch.float16"),
        (lambda m: m.float(), "torch.float32"),
        (lambda m: m.double(), "torch.float64"),
    ],
)
def test_changing_the_model_dtype_after_prepare_names_the_calls(level, convert, dtype):
    # Before: torch's "mat1 and mat2 must have the same dtype" from inside the forward.
    amp, model, _ = _engine(level)
    convert(model)
    with pytest.raises(RuntimeError, match=rf"module=Sequential was converted to {dtype} after prepare_model\(\)"):
        _loss(amp, model)


def test_a_module_promoted_to_fp32_is_no_dtype_change():
    amp, model, _ = _engine("O2")
    model[0].float()  # what on_floor="promote" does to one module (with its casts): the rest stays half
    with amp.forward_context():  # the check runs here, and passes
        pass
    model.float()
    with pytest.raises(RuntimeError, match="converted to torch.float32"):
        amp.forward_context()


def test_o2_masters_take_a_model_state_dict_loaded_after_prepare_exactly():
    amp, model, optimizer = _engine("O2")
    new = _net(seed=1)
    model.load_state_dict(new.state_dict())
    for param, loaded in zip(model.parameters(), new.parameters()):
        assert torch.equal(amp.master_of(param), loaded.detach())
    amp.backward(_loss(amp, model))
    amp.step(optimizer)
    reference = torch.optim.SGD(new.parameters(), lr=0.1)
    reference.zero_grad()
    for param, fp32 in zip(model.parameters(), new.parameters()):
        fp32.grad = amp.master_of(param).grad if amp.master_of(param).grad is not None else param.grad.float()
    reference.step()
    for param, fp32 in zip(model.parameters(), new.parameters()):
        torch.testing.assert_close(amp.master_of(param), fp32.detach())


def test_o2_optimizer_stepped_directly_is_refused_and_leaves_the_weights():
    amp, model, optimizer = _engine("O2", half_dtype="float16")
    before = _weights(model)
    amp.backward(_loss(amp, model))
    with pytest.raises(RuntimeError, match=r"optimizer\.step\(\).*Call amp\.step\(optimizer\)"):
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))


def test_o2_prepare_optimizer_before_prepare_model_names_both_calls():
    amp = Amp("O2", half_dtype="bfloat16")
    with pytest.raises(RuntimeError, match=r"prepare_model\(\) must run before prepare_optimizer\(\)"):
        amp.prepare_optimizer(torch.optim.SGD(_net().parameters(), lr=0.1))


def test_zero_grad_between_unscale_and_step_leaves_the_weights_as_gradscaler():
    amp, model, optimizer = _engine("O2", half_dtype="float16")
    before = _weights(model)
    amp.backward(_loss(amp, model))
    amp.unscale_(optimizer)
    optimizer.zero_grad()
    amp.step(optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(model)))


def test_release_optimizer_then_step_names_the_call():
    amp, model, optimizer = _engine("O2")
    amp.backward(_loss(amp, model))
    amp.release_optimizer(optimizer)
    with pytest.raises(RuntimeError, match=r"optimizer=SGD was not registered.*prepare_optimizer\(\)"):
        amp.step(optimizer)
