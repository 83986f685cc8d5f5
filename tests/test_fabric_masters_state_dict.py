"""Fabric at O2: a set-up model's ``state_dict()`` gives the FP32 masters, as the Trainer plugin's LightningModule's
does (tests/test_lightning_o2_checkpoints.py), so that ``fabric.save(path, {"model": model})`` writes the weights
training produced, and ``fabric.save``/``fabric.load`` of the documented state resumes as an uninterrupted run."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin


def _fabric(precision: str | FabricMixedPrecisionPlugin) -> Fabric:
    if isinstance(precision, str):
        return Fabric(accelerator="cpu", devices=1, precision=precision)
    return Fabric(accelerator="cpu", devices=1, plugins=[precision])


def _net(width: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.BatchNorm1d(width), nn.Tanh(), nn.Linear(width, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)


def _setup(width: int = 16, precision: Any = None) -> tuple[Fabric, Any, Any, Any]:
    mpx = FabricMixedPrecisionPlugin("O2", half_dtype=torch.bfloat16, loss_scale="dynamic", init_scale=2.0**8)
    fabric = _fabric(mpx if precision is None else precision)
    model = fabric.setup_module(_net(width))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    if precision is None:
        mpx.setup_optimizers(optimizer)
    return fabric, model, optimizer, mpx


def _train(fabric: Fabric, model: Any, optimizer: Any, steps: range) -> None:
    for step in steps:
        x, y = _batch(step)
        fabric.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()


def _masters(mpx: FabricMixedPrecisionPlugin, model: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in mpx.fp32_state_dict(model).items()}


def test_fabric_save_of_the_model_writes_the_fp32_masters_and_load_raw_resumes_them(tmp_path: Path) -> None:
    """``fabric.save(path, {"model": model})`` holds each trained parameter's FP32 master (not its bfloat16
    rounding), the batch norm's FP32 weights and buffers; ``fabric.load_raw`` of the model's own file into a fresh
    set-up model gives its masters those values exactly."""
    fabric, model, optimizer, mpx = _setup()
    _train(fabric, model, optimizer, range(3))
    want = _masters(mpx, model)
    assert any(p.dtype == torch.bfloat16 for p in model.parameters())
    got = model.state_dict()
    for name in ("0.weight", "0.bias", "3.weight", "3.bias"):
        assert got[name].dtype == torch.float32 and torch.equal(got[name], want[name]), name
    assert not torch.equal(got["0.weight"], model.get_parameter("0.weight").float())  # not the rounding
    fabric.save(tmp_path / "model.ckpt", {"model": model})
    saved = torch.load(tmp_path / "model.ckpt")["model"]
    assert {k: v.dtype for k, v in saved.items() if v.is_floating_point()} == {
        k: torch.float32 for k, v in saved.items() if v.is_floating_point()
    }
    assert all(torch.equal(saved[k], want[k]) for k in want)
    assert model.state_dict(keep_vars=True)["0.weight"] is model.get_parameter("0.weight")  # the parameters as they are
    torch.save(saved, tmp_path / "raw.pt")
    fabric2, fresh, optimizer2, mpx2 = _setup()
    fabric2.load_raw(tmp_path / "raw.pt", fresh)
    _assert_same(_masters(mpx2, fresh), want)


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in got.items():
        assert value.dtype == want[name].dtype and torch.equal(value, want[name]), name


@pytest.mark.parametrize("order", ["model_first", "mpx_first"])
def test_fabric_save_and_load_of_the_documented_state_resume_as_the_uninterrupted_run(tmp_path: Path, order) -> None:
    """docs/fabric.md's state (model, optimizer, plugin) saved after 2 steps and loaded into fresh objects, in either
    order of the state's keys: 2 more steps give the uninterrupted run's masters, half weights, optimizer state and
    loss scale bit for bit."""
    fabric, model, optimizer, mpx = _setup()
    _train(fabric, model, optimizer, range(2))
    keys = ["model", "optimizer", "mpx"] if order == "model_first" else ["mpx", "optimizer", "model"]
    fabric.save(tmp_path / "run.ckpt", {k: {"model": model, "optimizer": optimizer, "mpx": mpx}[k] for k in keys})
    _train(fabric, model, optimizer, range(2, 4))

    fabric2, fresh, optimizer2, mpx2 = _setup()
    _train(fabric2, fresh, optimizer2, range(7, 8))  # the fresh run moved away from the checkpoint first
    state = {"model": fresh, "optimizer": optimizer2, "mpx": mpx2}
    fabric2.load(tmp_path / "run.ckpt", {k: state[k] for k in keys})
    _train(fabric2, fresh, optimizer2, range(2, 4))
    _assert_same(_masters(mpx2, fresh), _masters(mpx, model))
    _assert_same(fresh.state_dict(keep_vars=True), model.state_dict(keep_vars=True))
    a, b = optimizer.optimizer.state_dict()["state"], optimizer2.optimizer.state_dict()["state"]
    assert a.keys() == b.keys() and all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i])
    assert mpx2.metrics()["mpx/loss_scale"] == mpx.metrics()["mpx/loss_scale"]


def test_an_o2_fabric_checkpoint_holds_each_master_once(tmp_path: Path) -> None:
    """The documented state's file is about ``"bf16-mixed"``'s size (FP32 weights and optimizer state): the plugin's
    entry names the masters the model's entry holds (tests/test_fabric_o2_checkpoints.py)."""
    sizes = {}
    for name in ("bf16-mixed", "O2"):
        fabric, model, optimizer, mpx = _setup(width=512, precision=name if name != "O2" else None)
        _train(fabric, model, optimizer, range(1))
        state = {"model": model, "optimizer": optimizer} | ({"mpx": mpx} if name == "O2" else {})
        fabric.save(tmp_path / f"{name}.ckpt", state)
        sizes[name] = (tmp_path / f"{name}.ckpt").stat().st_size
    assert sizes["O2"] <= sizes["bf16-mixed"] * 1.05, sizes


def test_a_model_set_up_again_has_one_hook_and_a_deep_copy_keeps_its_half_values() -> None:
    """Set up by a second plugin (a second stage): its engine's masters, one hook; an EMA-style deep copy's
    ``state_dict()`` is the copy's own half values (the hook is inert there)."""
    fabric, model, optimizer, mpx = _setup()
    _train(fabric, model, optimizer, range(1))
    module = model.module
    twin = copy.deepcopy(module)
    assert twin.state_dict()["0.weight"].dtype == torch.bfloat16
    mpx2 = FabricMixedPrecisionPlugin("O2", half_dtype=torch.bfloat16)
    fabric2 = _fabric(mpx2)
    model2, optimizer2 = fabric2.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    _train(fabric2, model2, optimizer2, range(1, 2))
    hooks = [h for h in module._state_dict_hooks.values() if type(h).__name__ == "MastersInStateDict"]
    assert len(hooks) == 1
    got, want = model2.state_dict(), mpx2.fp32_state_dict(model2)
    for name in ("0.weight", "3.weight"):
        assert got[name].dtype == torch.float32 and torch.equal(got[name], want[name]), name
