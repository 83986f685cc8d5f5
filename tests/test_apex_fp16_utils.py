"""lightning_mpx.apex.fp16_utils: FP16_Optimizer over Amp and the manual master helpers, on CPU."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from lightning_mpx.apex.fp16_utils import (
    BN_convert_float,
    FP16_Optimizer,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
)


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)


def _loss(model, x, y):
    return ((model(x).float() - y) ** 2).mean() * 0.01


def test_network_to_half_keeps_batchnorm_fp32():
    model = network_to_half(_net())
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes["1.1.weight"] == torch.float32 and dtypes["1.0.weight"] == torch.float16
    assert model(torch.randn(3, 4)).dtype == torch.float16
    assert BN_convert_float(nn.BatchNorm1d(2).half()).weight.dtype == torch.float32


def test_dynamic_scale_backs_off_on_overflow_then_trains(caplog):
    model = network_to_half(_net())
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                         dynamic_loss_args={"init_scale": 2.0**20, "scale_window": 2})
    x, y = _data()
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    with caplog.at_level(logging.INFO, logger="lightning_mpx.apex"):
        opt.backward(_loss(model, x, y) * float("inf"))
        opt.step()
    assert opt.overflow and opt.loss_scale == 2.0**19
    assert "OVERFLOW! Skipping step. Attempted loss scale: 524288.0" not in caplog.text
    assert "OVERFLOW! Skipping step. Attempted loss scale: 1048576.0, reducing to 524288.0" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    for _ in range(2):
        opt.zero_grad()
        opt.backward(_loss(model, x, y))
        opt.step()
        assert not opt.overflow
    assert opt.loss_scale == 2.0**20  # grew after scale_window clean steps
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_training_follows_fp32_and_masters_are_fp32():
    reference = _net()
    model = network_to_half(copy.deepcopy(reference))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=128.0)
    for i in range(3):
        x, y = _data(i)
        ref_opt.zero_grad()
        _loss(reference, x, y).backward()
        ref_opt.step()
        opt.zero_grad()
        opt.backward(_loss(model, x, y))
        norm = opt.clip_master_grads(1e6)
        assert norm > 0
        opt.step()
    masters = opt.amp.master_params(opt.optimizer)
    assert all(m.dtype == torch.float32 for m in masters)
    for m, r in zip(masters, reference.parameters()):
        torch.testing.assert_close(m, r, atol=5e-3, rtol=5e-2)


def test_two_backwards_accumulate():
    model = network_to_half(_net())
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=64.0)
    x, y = _data()
    opt.zero_grad()
    opt.backward(_loss(model, x, y))
    once = [m.grad.clone() for m in opt.amp.master_params(opt.optimizer)]
    opt.backward(_loss(model, x, y))
    twice = [m.grad for m in opt.amp.master_params(opt.optimizer)]
    for a, b in zip(once, twice):
        torch.testing.assert_close(b, 2 * a, atol=1e-3, rtol=1e-2)


def test_state_dict_round_trip_is_exact():
    def make():
        model = network_to_half(_net())
        return model, FP16_Optimizer(torch.optim.Adam(model.parameters(), lr=1e-2), dynamic_loss_scale=True,
                                     dynamic_loss_args={"init_scale": 2.0**10})

    def train(model, opt, seeds):
        for s in seeds:
            x, y = _data(s)
            opt.zero_grad()
            opt.backward(_loss(model, x, y))
            opt.step()

    model, opt = make()
    train(model, opt, range(3))
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    assert set(ckpt["opt"]) >= {"loss_scaler", "dynamic_loss_scale", "overflow", "optimizer_state_dict"}
    train(model, opt, range(3, 6))
    expected = [m.detach().clone() for m in opt.amp.master_params(opt.optimizer)]
    model, opt = make()
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    train(model, opt, range(3, 6))
    assert all(torch.equal(a, b) for a, b in zip(expected, opt.amp.master_params(opt.optimizer)))
    with pytest.raises(ValueError, match="lightning_mpx"):
        opt.load_state_dict({"optimizer_state_dict": {}})


def test_arguments_are_validated():
    model = network_to_half(_net())
    with pytest.raises(TypeError, match="unknown key"):
        FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True,
                       dynamic_loss_args={"bogus": 1})
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(NotImplementedError, match="closure"):
        opt.step(closure=lambda: 0)
    with pytest.raises(ValueError, match="norm_type='l2'"):  # any positive norm works (test_apex_scaler_settings)
        opt.clip_master_grads(1.0, norm_type="l2")


@pytest.mark.parametrize("flat", [False, True])
def test_manual_master_helpers(flat):
    model = _net().half()
    model_params, master_params = prep_param_lists(model, flat_master=flat)
    assert all(m.dtype == torch.float32 for m in master_params)
    x, y = _data()
    _loss(model, x.half(), y).backward()
    model_grads_to_master_grads(model_params, master_params, flat_master=flat)
    grads = torch.cat([p.grad.float().reshape(-1) for p in model_params])
    torch.testing.assert_close(torch.cat([m.grad.reshape(-1) for m in master_params]), grads)
    with torch.no_grad():
        for m in master_params:
            m.add_(1.0)
    master_params_to_model_params(model_params, master_params, flat_master=flat)
    torch.testing.assert_close(torch.cat([p.float().reshape(-1) for p in model_params]),
                               torch.cat([m.reshape(-1) for m in master_params]).half().float())
    assert to_python_float(torch.tensor(2.5)) == 2.5 and to_python_float([3.0]) == 3.0


def test_an_all_fp32_optimizer_gets_loss_scaling_only():
    model = _net()
    opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=8.0)
    x, y = _data()
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    opt.backward(_loss(model, x, y))
    opt.step()
    assert not opt.overflow and opt.loss_scale == 8.0
    assert not torch.equal(before[0], next(model.parameters()))
