"""Hostile review of stop 57's schedule-free (``eval()``/``train()`` redone on the FP32 masters) and optimizer-wrapper
support at O2, each held to FP32 or ``"bf16-mixed"`` on the same code. Tiny MLPs, CPU, bfloat16."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp, FabricMixedPrecisionPlugin
from tests.test_accelerate_schedule_free import ScheduleFreeSGD
from tests.test_lightning_optimizer_wrappers_resume import TimmLookahead

HALF = "bfloat16"
Weights = dict[str, torch.Tensor]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _xy() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g)


def _gap(got: Weights, want: Weights) -> float:
    assert got.keys() == want.keys()
    return max((got[k].float() - want[k].float()).abs().max().item() for k in got)


# --- core loop: what the model holds right after optimizer.eval(), no forward between ------------------------------


def _core_eval_read(level: str | None, read: str) -> Weights:
    """A plain loop (``Amp`` at ``level``, or FP32) trains schedule-free SGD one epoch, calls ``optimizer.eval()`` and
    reads the model at once: ``model.state_dict()`` (``torch.save`` for deployment) or its parameters (an EMA)."""
    amp = Amp(level, half_dtype=HALF) if level else None
    model = _net()
    if amp is not None:
        model = amp.prepare_model(model)
    opt = ScheduleFreeSGD(model.parameters(), lr=0.5)
    if amp is not None:
        opt = amp.prepare_optimizer(opt)
    x, y = _xy()
    opt.train()
    for i in range(0, 64, 16):
        if amp is None:
            F.cross_entropy(model(x[i : i + 16]), y[i : i + 16]).backward()
            opt.step()
        else:
            with amp.forward_context():
                loss = F.cross_entropy(amp.cast_outputs(model(amp.cast_inputs(x[i : i + 16]))).float(), y[i : i + 16])
            amp.backward(loss)
            amp.step(opt)
            amp.update()
        opt.zero_grad()
    opt.eval()
    if read == "state_dict":
        return {k: v.float().clone() for k, v in model.state_dict().items()}
    if read == "wrapped_state_dict":  # the model inside a wrapper (DDP's "module.", a user's container): a prefix
        return {k[len("module."):]: v.float().clone() for k, v in nn.ModuleDict({"module": model}).state_dict().items()}
    return {k: p.detach().float().clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("read", ["state_dict", "wrapped_state_dict"])
def test_core_o2_model_state_dict_right_after_schedule_free_eval_is_at_the_averaged_point_as_fp32(read: str) -> None:
    # Before: the core's model.state_dict() right after optimizer.eval() (no forward between) held the training
    # point's half weights: 5.9e-3 off FP32 here, silently (Fabric's and the Trainer's were right: their FP32-export
    # hook follows the modes). The bfloat16 rounding gap is 8.6e-4.
    gap = _gap(_core_eval_read("O2", read), _core_eval_read(None, "state_dict"))
    assert gap < 2e-3, gap


@pytest.mark.xfail(
    strict=True,
    reason="test_core_schedule_free_wrappers.py: at O2 optimizer.eval() on the user's optimizer (its groups hold the "
    "half parameters, its state is keyed by the masters) moves no half weight; the engine redoes it on the masters at "
    "the next forward or state dict, and reading model.parameters() (an EMA) sees nothing: no hook runs there "
    "(docs/core.md)",
)
def test_core_o2_parameters_read_right_after_schedule_free_eval_are_at_the_averaged_point_as_fp32() -> None:
    gap = _gap(_core_eval_read("O2", "parameters"), _core_eval_read(None, "parameters"))
    assert gap < 2e-3, gap


def test_core_o2_call_on_masters_of_an_unregistered_inner_optimizer_is_refused_naming_the_call() -> None:
    # Held: a wrapper registered, its inner schedule-free optimizer's groups split from it (a load), the user's
    # amp.call_on_masters(inner, inner.eval) is refused before anything moves, naming prepare_optimizer.
    amp = Amp("O2", half_dtype=HALF)
    model = amp.prepare_model(_net())
    inner = ScheduleFreeSGD(model.parameters(), lr=0.5)
    amp.prepare_optimizer(_Lookahead(inner))
    inner.param_groups = [dict(group) for group in inner.param_groups]
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="ScheduleFreeSGD was not registered; call prepare_optimizer"):
        amp.call_on_masters(inner, inner.eval)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# --- Fabric ----------------------------------------------------------------------------------------------------------


def _fabric(precision: str) -> Any:
    from lightning.fabric import Fabric

    if precision == "O2":
        return Fabric(accelerator="cpu", devices=1, plugins=[FabricMixedPrecisionPlugin("O2", half_dtype=HALF)])
    return Fabric(accelerator="cpu", devices=1, precision=precision)  # type: ignore[arg-type]


def _epoch(fabric: Any, model: nn.Module, opt: Any) -> None:
    x, y = _xy()
    for i in range(0, 64, 16):
        fabric.backward(F.cross_entropy(model(x[i : i + 16]), y[i : i + 16]))
        opt.step()
        opt.zero_grad()


def _fp32(fabric: Any, precision: str, net: nn.Module) -> Weights:
    sd = fabric._precision.amp.fp32_state_dict(net) if precision == "O2" else net.state_dict()
    return {k: v.float().clone() for k, v in sd.items()}


def _step_after_eval(precision: str) -> tuple[str, Weights]:
    """A backward, then ``optimizer.eval()`` and ``optimizer.step()`` (the user forgot ``train()``): the error; then
    ``train()`` and an epoch, ``eval()`` and a forward."""
    fabric = _fabric(precision)
    net = _net()
    model, opt = fabric.setup(net, ScheduleFreeSGD(net.parameters(), lr=0.5))
    opt.train()
    _epoch(fabric, model, opt)
    x, y = _xy()
    fabric.backward(F.cross_entropy(model(x[:16]), y[:16]))
    opt.eval()
    with pytest.raises(AssertionError, match="step\\(\\) in eval mode") as error:
        opt.step()
    opt.zero_grad()
    opt.train()
    _epoch(fabric, model, opt)
    opt.eval()
    with torch.no_grad():
        model(x)
    return str(error.value), _fp32(fabric, precision, net)


def test_fabric_o2_schedule_free_step_right_after_eval_fails_as_bf16_mixed_and_train_resumes_it() -> None:
    # Held: the step runs on the masters with the groups' flags as the user left them (eval), so the optimizer's own
    # check refuses it as under bf16-mixed, nothing written; train() then moves back and training goes on alike.
    (error, got), (ref_error, ref) = _step_after_eval("O2"), _step_after_eval("bf16-mixed")
    assert error == ref_error
    assert _gap(got, ref) < 2e-3


def test_fabric_o2_schedule_free_loaded_before_setup_optimizers_is_refused_naming_the_calls(tmp_path: Any) -> None:
    # Held: fabric.load before the plugin met the optimizer loads its state (z) onto the half parameters, rounded;
    # its first step refuses it naming setup_optimizers, before anything is stepped.
    fabric = _fabric("O2")
    net = _net()
    model, opt = fabric.setup(net, ScheduleFreeSGD(net.parameters(), lr=0.5))
    opt.train()
    _epoch(fabric, model, opt)
    opt.eval()
    fabric.save(tmp_path / "sf.ckpt", {"model": model, "optimizer": opt})
    fabric = _fabric("O2")
    net = _net()  # the optimizer set up apart: the plugin meets it at its first step (fabric.setup meets it there)
    model = fabric.setup_module(net)
    opt = fabric.setup_optimizers(ScheduleFreeSGD(net.parameters(), lr=0.5))
    fabric.load(tmp_path / "sf.ckpt", {"model": model, "optimizer": opt})
    opt.train()
    x, y = _xy()
    fabric.backward(F.cross_entropy(model(x[:16]), y[:16]))
    with pytest.raises(RuntimeError, match="setup_optimizers\\(optimizer\\) after fabric.setup\\(\\) and before"):
        opt.step()


class _Lookahead(TimmLookahead):
    """timm's ``Lookahead`` keeps its settings in ``defaults``, so that a group added later gets them."""

    def __init__(self, base_optimizer: torch.optim.Optimizer) -> None:
        super().__init__(base_optimizer)
        self.defaults.update(lookahead_alpha=0.5, lookahead_k=2, lookahead_step=0)


def _lookahead_added_group(precision: str) -> Weights:
    fabric = _fabric(precision)
    net = _net()
    net[2].requires_grad_(False)
    model, opt = fabric.setup(net, _Lookahead(torch.optim.AdamW(net[0].parameters(), lr=0.02)))
    _epoch(fabric, model, opt)
    net[2].requires_grad_(True)
    opt.add_param_group({"params": list(net[2].parameters()), "lr": 0.01})  # the wrapper's own, mid-fit
    _epoch(fabric, model, opt)
    return _fp32(fabric, precision, net)


def test_fabric_o2_lookahead_add_param_group_mid_fit_trains_the_added_group_as_bf16_mixed() -> None:
    got, ref = _lookahead_added_group("O2"), _lookahead_added_group("bf16-mixed")
    assert _gap(got, ref) < 2e-3
