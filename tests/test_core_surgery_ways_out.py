"""Model surgery after set-up at O2, the ways out of what the engine cannot see (tests/test_core_surgery.py's strict
xfails): a head given to a registered optimizer by ``add_param_group`` (torch calls no hook there) is adopted by
preparing that optimizer again (the next ``forward_context`` now does it too:
``tests/test_lightning_surgery_pruning.py``), and ``weight_norm`` registered after set-up (torch's ``Parameter(t)``
refuses the masters' parameter class) works on the module made FP32 first, its ``original0``/``original1`` then made
half with FP32 masters from the FP32 values. Each is compared with the same surgery in FP32 (bfloat16; tolerances)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_mpx import Amp
from tests.test_core_surgery import _add_head, _run


def _add_head_and_prepare_again(model: nn.Module, opt: torch.optim.Optimizer, prepared: Any) -> torch.optim.Optimizer:
    _add_head(model, opt, prepared)
    return prepared(opt)  # registered already: only the new group's parameters are adopted


def _weight_norm_on_fp32(model: nn.Module, opt: torch.optim.Optimizer, prepared: Any) -> torch.optim.Optimizer:
    model.body.float()  # at O2: the body takes its masters' exact FP32 values (a no-op in FP32)
    nn.utils.parametrizations.weight_norm(model.body)
    return prepared(torch.optim.SGD(model.parameters(), lr=1.0))


def _close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert got.keys() == ref.keys()
    for name, value in ref.items():
        assert torch.allclose(got[name], value, atol=0.02, rtol=0.02), f"{name}: {(got[name] - value).abs().max()}"


def test_a_head_added_by_add_param_group_then_prepare_optimizer_again_trains_as_fp32() -> None:
    got = _run("O2", _add_head_and_prepare_again)
    assert "classifier.weight" in got
    _close(got, _run(None, _add_head_and_prepare_again))


def test_weight_norm_after_set_up_on_the_module_made_fp32_first_trains_as_fp32() -> None:
    got = _run("O2", _weight_norm_on_fp32)
    assert "body.parametrizations.weight.original0" in got
    _close(got, _run(None, _weight_norm_on_fp32))


def test_weight_norm_after_set_up_gets_the_fp32_norm_as_its_master() -> None:
    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)))
    amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    exact = amp.fp32_state_dict(model)["0.weight"].clone()
    model[0].float()
    nn.utils.parametrizations.weight_norm(model[0])
    amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    g, v = model[0].parametrizations.weight.original0, model[0].parametrizations.weight.original1
    assert g.dtype == v.dtype == torch.bfloat16
    masters = amp.fp32_state_dict(model)
    assert torch.equal(masters["0.parametrizations.weight.original1"], exact)
    assert torch.equal(masters["0.parametrizations.weight.original0"], torch.norm_except_dim(exact, 2, 0))
