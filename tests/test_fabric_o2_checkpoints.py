"""Fabric at O2: the plugin's checkpoint entry leaves the FP32 masters to the model's entry (a set-up model's
``state_dict()`` holds them), so the documented save holds each master once; the masters come back exactly from the
model's load in either order (``fabric.load``, ``fabric.load_raw``), an older entry that holds them loads as before,
and a plugin entry loaded without the model's weights stops the next step instead of training on this run's
masters (tests/test_fabric_masters_state_dict.py has the sizes against ``"bf16-mixed"``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin
from lightning_mpx.engine.checkpoint import MASTERS_IN_STATE_DICT


def _setup() -> tuple[Fabric, Any, Any, FabricMixedPrecisionPlugin]:
    mpx = FabricMixedPrecisionPlugin("O2", half_dtype=torch.bfloat16, loss_scale="dynamic", init_scale=2.0**8)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx])
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    mpx.setup_optimizers(optimizer)
    return fabric, model, optimizer, mpx


def _train(fabric: Fabric, model: Any, optimizer: Any, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        fabric.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()


def _assert_resumed(mpx2: Any, fresh: Any, optimizer2: Any, mpx: Any, model: Any, optimizer: Any) -> None:
    got, want = mpx2.fp32_state_dict(fresh), mpx.fp32_state_dict(model)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    a, b = optimizer.optimizer.state_dict()["state"], optimizer2.optimizer.state_dict()["state"]
    assert a.keys() == b.keys() and all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i])
    assert mpx2.metrics()["mpx/loss_scale"] == mpx.metrics()["mpx/loss_scale"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run: 2 steps, then the documented state, the plugin's and optimizer's alone with the model's weights in a
    file of their own, and an entry as the release before wrote it (the engine's state dict: masters held); then 2
    more steps (the uninterrupted run)."""
    tmp = tmp_path_factory.mktemp("ckpt")
    fabric, model, optimizer, mpx = _setup()
    _train(fabric, model, optimizer, range(2))
    fabric.save(tmp / "run.ckpt", {"model": model, "optimizer": optimizer, "mpx": mpx})
    fabric.save(tmp / "apart.ckpt", {"optimizer": optimizer, "mpx": mpx})
    torch.save(model.state_dict(), tmp / "weights.pt")
    old = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "mpx": mpx.amp.state_dict()}
    torch.save(old, tmp / "old.ckpt")
    _train(fabric, model, optimizer, range(2, 4))
    return {"tmp": tmp, "model": model, "optimizer": optimizer, "mpx": mpx}


def test_the_plugins_entry_names_the_masters_the_models_entry_holds(saved: dict[str, Any]) -> None:
    """The file's ``"mpx"`` entry holds no master of the set-up model (it names them); the ``"model"`` entry holds
    them FP32; the older entry holds them itself."""
    entry = torch.load(saved["tmp"] / "run.ckpt")["mpx"]
    assert entry["master_weights"] == [{}]
    assert sorted(entry[MASTERS_IN_STATE_DICT][0]) == ["0.bias", "0.weight", "3.bias", "3.weight"]
    assert MASTERS_IN_STATE_DICT not in torch.load(saved["tmp"] / "old.ckpt")["mpx"]


@pytest.mark.parametrize("order", ["model_first", "mpx_first"])
@pytest.mark.parametrize("how", ["load", "load_raw", "old"])
def test_a_resume_from_the_models_entry_is_the_uninterrupted_run(saved: dict[str, Any], how: str, order: str) -> None:
    """Loaded into a fresh run that moved away first, in either order: ``fabric.load`` of the documented state,
    ``fabric.load`` of the plugin and optimizer with ``fabric.load_raw`` of the model's weights, and an entry that
    holds the masters (the release before): 2 more steps give the uninterrupted run's masters, half weights,
    optimizer state and loss scale bit for bit."""
    tmp = saved["tmp"]
    fabric, fresh, optimizer, mpx = _setup()
    _train(fabric, fresh, optimizer, range(7, 8))
    state = {"model": fresh, "optimizer": optimizer, "mpx": mpx}
    keys = ["model", "optimizer", "mpx"] if order == "model_first" else ["mpx", "optimizer", "model"]
    if how == "load_raw":
        rest = {k: state[k] for k in keys if k != "model"}
        loads = [lambda: fabric.load_raw(tmp / "weights.pt", fresh), lambda: fabric.load(tmp / "apart.ckpt", rest)]
        for load in loads if order == "model_first" else loads[::-1]:
            load()
    else:
        fabric.load(tmp / ("run.ckpt" if how == "load" else "old.ckpt"), {k: state[k] for k in keys})
    _train(fabric, fresh, optimizer, range(2, 4))
    _assert_resumed(mpx, fresh, optimizer, saved["mpx"], saved["model"], saved["optimizer"])


def test_the_plugins_entry_loaded_without_the_models_weights_stops_the_next_step(saved: dict[str, Any]) -> None:
    """``fabric.load`` of the optimizer and the plugin only: the next forward raises, naming the masters and the
    documented load, at every step (never trains on this run's masters); the model's weights loaded then, the run
    resumes as the uninterrupted one."""
    fabric, fresh, optimizer, mpx = _setup()
    _train(fabric, fresh, optimizer, range(7, 8))
    fabric.load(saved["tmp"] / "run.ckpt", {"optimizer": optimizer, "mpx": mpx})
    for _ in range(2):
        with pytest.raises(RuntimeError, match=r"'0\.weight'.*fabric\.load\(path, \{\"model\": model"):
            _train(fabric, fresh, optimizer, range(2, 3))
    fabric.load_raw(saved["tmp"] / "weights.pt", fresh)
    _train(fabric, fresh, optimizer, range(2, 4))
    _assert_resumed(mpx, fresh, optimizer, saved["mpx"], saved["model"], saved["optimizer"])


def test_other_weights_loaded_after_the_plugins_entry_are_kept(saved: dict[str, Any], tmp_path: Path) -> None:
    """The plugin's entry, then other FP32 weights on purpose (another run's): the masters are those weights
    exactly, no error."""
    fabric, other, other_optimizer, _ = _setup()
    _train(fabric, other, other_optimizer, range(20, 23))
    torch.save(other.state_dict(), tmp_path / "other.pt")
    fabric, fresh, optimizer, mpx = _setup()
    fabric.load(saved["tmp"] / "run.ckpt", {"optimizer": optimizer, "mpx": mpx})
    fabric.load_raw(tmp_path / "other.pt", fresh)
    fresh(torch.randn(4, 8))
    want = torch.load(tmp_path / "other.pt")
    got = mpx.fp32_state_dict(fresh)
    assert all(torch.equal(got[k], want[k]) for k in ("0.weight", "3.weight"))


@pytest.mark.parametrize("level", ["O1", "O3"])
def test_resumed_at_another_level_the_plugins_entry_alone_stops_the_next_forward(
    saved: dict[str, Any], level: str
) -> None:
    """An O2 checkpoint resumed at another level: the FP32 weights come from the model's entry (the plugin's entry
    does not hold them); its plugin entry loaded alone stops the next forward instead of keeping this run's
    weights. At O3 the half model is checked against the entry's checksums of the masters' rounding (before stop 64
    it kept this run's weights silently: the entry's checksums were of the FP32 masters only)."""
    mpx = FabricMixedPrecisionPlugin(level, half_dtype=torch.bfloat16)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx])
    fresh = fabric.setup_module(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4)))
    fabric.load(saved["tmp"] / "run.ckpt", {"mpx": mpx})
    with pytest.raises(RuntimeError, match=r"'0\.weight'"):
        fresh(torch.randn(4, 8))
