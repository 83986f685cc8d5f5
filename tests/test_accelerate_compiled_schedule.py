"""Stop 64's strict xfails made to pass (tests/test_core_compile_loss_regions.py, ...), and what their fixes also cover.

A model compiled after the Accelerate adapter's ``prepare`` traces ``Amp.forward_context`` (its new-group check and a
schedule-free optimizer's flags) into the graph: an attribute read of a torch optimizer's ``param_groups`` there made
dynamo guard on every value of every group, so a per-step learning-rate schedule recompiled the forward after the
first step, as a schedule-free group's step count did (tests/test_core_compile_loss_regions.py's xfail)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from tests.test_compile_doors import _accelerate, _no_worse


def _accelerate_scheduled(level: str | None) -> tuple[int, int, int]:
    """dynamo's counts over ``STEPS`` steps of a model compiled after ``accelerator.prepare``, its SGD's learning
    rate changed at every step by a prepared ``LambdaLR`` (``level`` None: Accelerate's own "bf16")."""
    return _accelerate(level or "bf16", "after", scheduled=True)[0]


@pytest.mark.usefixtures("fresh_dynamo")
def test_accelerate_o2_compiled_with_a_per_step_schedule_recompiles_nothing_as_bf16(monkeypatch) -> None:
    """Accelerate O2, the model compiled after ``prepare``, a ``LambdaLR`` stepped every step: one graph, no break,
    nothing compiled after the first step, as Accelerate's own "bf16" (before: a recompile at the second step, the
    forward guarded on the group's ``lr``). Two steps: the second one's is the recompile."""
    monkeypatch.setattr("tests.test_compile_doors.STEPS", 2)
    ours = _accelerate_scheduled("O2")
    assert ours[2] == 0, f"graphs compiled after the first step: {ours}"
    _no_worse(ours, _accelerate_scheduled(None))


# --- an O2 Fabric checkpoint resumed at O3 (tests/test_fabric_o2_checkpoints.py's xfail) ------------------------------


@pytest.fixture(scope="module")
def o2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, torch.Tensor]]:
    """The documented Fabric state of an O2 bfloat16 run after two steps, and its FP32 masters."""
    from tests.test_fabric_o2_checkpoints import _setup, _train

    path = tmp_path_factory.mktemp("o2") / "run.ckpt"
    fabric, model, optimizer, mpx = _setup()
    _train(fabric, model, optimizer, range(2))
    fabric.save(path, {"model": model, "optimizer": optimizer, "mpx": mpx})
    return path, {k: v.clone() for k, v in mpx.fp32_state_dict(model).items()}


def _o3(half: str) -> tuple[Any, Any, Any]:
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    mpx = FabricMixedPrecisionPlugin("O3", half_dtype=half)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx])
    torch.manual_seed(1)  # other weights than the checkpoint's
    model = fabric.setup_module(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4)))
    return fabric, model, mpx


@pytest.mark.parametrize("how", ["model_first", "mpx_first", "mpx_then_load_raw"])
def test_an_o2_checkpoint_resumed_at_o3_with_the_models_entry_runs_on_its_rounding(
    o2_checkpoint: tuple[Any, dict[str, torch.Tensor]], how: str, tmp_path: Any
) -> None:
    """The model's entry loaded before or after the plugin's (``fabric.load`` in either key order, or the plugin's
    entry then ``fabric.load_raw`` of the weights): no error at the next forward, the half model holds the masters'
    bfloat16 rounding (the check now compares it with the entry's checksums of that rounding)."""
    path, masters = o2_checkpoint
    fabric, model, mpx = _o3("bfloat16")
    if how == "mpx_then_load_raw":
        weights = tmp_path / "weights.pt"
        torch.save(torch.load(path)["model"], weights)
        fabric.load(path, {"mpx": mpx})
        fabric.load_raw(weights, model)
    else:
        fabric.load(path, {"model": model, "mpx": mpx} if how == "model_first" else {"mpx": mpx, "model": model})
    model(torch.randn(4, 8))
    params = dict(model.module.named_parameters())
    for name in ("0.weight", "0.bias", "3.weight", "3.bias"):
        assert torch.equal(params[name].detach(), masters[name].to(torch.bfloat16)), name


def test_an_o2_bfloat16_checkpoint_resumed_at_o3_float16_is_not_refused(
    o2_checkpoint: tuple[Any, dict[str, torch.Tensor]],
) -> None:
    """Resumed in the other half dtype, the model's entry loaded first: no error (the saved checksums are of the
    bfloat16 rounding, which a float16 model's values cannot be compared with: not checked), the float16 rounding."""
    path, masters = o2_checkpoint
    fabric, model, mpx = _o3("float16")
    fabric.load(path, {"model": model, "mpx": mpx})  # the model's first: the plugin's load sees its values
    model(torch.randn(4, 8))
    assert torch.equal(dict(model.module.named_parameters())["0.weight"].detach(), masters["0.weight"].half())
