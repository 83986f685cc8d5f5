"""Hostile habits against stop 54's FP32 masters in a model's state dict at O2 (bfloat16): EMA swaps through the
state dict mid-fit, partial loads, a submodule's own ``state_dict(prefix=...)``, checkpoint entries mixed across runs,
a layer unfrozen with a re-created optimizer, and Fabric DDP's save/resume with the rank-0 ``torch.save`` habit; each
against an uninterrupted run or Lightning's own ``"bf16-mixed"``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin
from tests.launch import rank_results, run_script
from tests.lightning_helpers import classification_data, loader, make_trainer


def _setup(seed: int = 0) -> tuple[Fabric, Any, Any, FabricMixedPrecisionPlugin]:
    mpx = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16", loss_scale="dynamic", init_scale=2.0**8)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[mpx])
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    mpx.setup_optimizers(optimizer)
    return fabric, model, optimizer, mpx


def _train(fabric: Fabric, model: Any, optimizer: Any, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        fabric.backward(F.cross_entropy(model(x).float(), y))
        optimizer.step()
        optimizer.zero_grad()


def _weights(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]


@pytest.fixture(scope="module")
def uninterrupted() -> dict[str, torch.Tensor]:
    fabric, model, optimizer, _ = _setup()
    _train(fabric, model, optimizer, range(4))
    return _weights(model)


def test_ema_swaps_through_the_state_dict_resume_exactly(uninterrupted: dict[str, torch.Tensor]) -> None:
    """Mid-fit EMA habits: ``load_state_dict`` of averaged weights for a validation forward and back, an in-place swap
    through ``state_dict()`` values, and a ``strict=False`` load of a subset: training continues from exactly the
    weights it had (an uninterrupted run), as in FP32 where the state dict aliases the parameters."""
    fabric, model, optimizer, _ = _setup()
    _train(fabric, model, optimizer, range(2))
    backup = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict({k: v * 0.5 for k, v in backup.items()})
    with torch.no_grad():
        averaged = model(torch.ones(1, 8))
    model.load_state_dict(backup)
    with torch.no_grad():
        assert not torch.equal(model(torch.ones(1, 8)), averaged)  # the swap reached the model
    state = model.state_dict()
    for value in state.values():
        value.mul_(0.5)  # the in-place habit: written through the handed-out values
    with torch.no_grad():
        assert torch.equal(model(torch.ones(1, 8)), averaged)  # reached the model at this forward
    for key, value in model.state_dict().items():
        value.copy_(backup[key])
    missing = model.load_state_dict({"0.weight": backup["0.weight"]}, strict=False).missing_keys
    assert missing == ["0.bias", "2.weight", "2.bias"]
    _train(fabric, model, optimizer, range(2, 4))
    _assert_equal(_weights(model), uninterrupted)


def test_submodule_state_dict_with_own_prefix_gives_masters() -> None:
    """A checkpoint assembled by hand from parts (``self.backbone.state_dict(prefix="backbone.")``) holds the FP32
    masters, as the submodule's plain ``state_dict()`` and the root's do (and as ``"bf16-mixed"``'s FP32 model gives
    them); before, a prefix of the user's on a submodule gave its bfloat16 rounding."""
    fabric, model, optimizer, _ = _setup()
    _train(fabric, model, optimizer, range(2))
    root = model.state_dict()
    part = model.module[0].state_dict(prefix="backbone.")
    assert {k: v.dtype for k, v in part.items()} == {"backbone.weight": torch.float32, "backbone.bias": torch.float32}
    assert torch.equal(part["backbone.weight"], root["0.weight"]) and torch.equal(part["backbone.bias"], root["0.bias"])
    assert all(torch.equal(a, b) for a, b in zip(model.module[0].state_dict().values(), part.values()))


def test_mpx_entry_of_another_run_after_the_weights_trains_on_from_the_weights(
    tmp_path: Path, uninterrupted: dict[str, torch.Tensor]
) -> None:
    """Checkpoint entries mixed by hand: the model's and optimizer's from run A, then the plugin's from run B (same
    shapes, same scale). The weights a load wrote since the last step, before the plugin's entry, are the user's
    (stop 65: this was refused, as a checkpoint whose weight was edited by hand was): training goes on from A's
    weights, not B's, and ends as the uninterrupted run A. (The plugin's entry loaded with no model entry is still
    refused: tests/test_lightning_rank_zero_reads.py.)"""
    for seed, name in ((0, "a.ckpt"), (1, "b.ckpt")):
        fabric, model, optimizer, mpx = _setup(seed)
        _train(fabric, model, optimizer, range(2))
        fabric.save(tmp_path / name, {"model": model, "optimizer": optimizer, "mpx": mpx})
    fabric, model, optimizer, mpx = _setup(seed=2)
    fabric.load(tmp_path / "a.ckpt", {"model": model, "optimizer": optimizer})
    fabric.load(tmp_path / "b.ckpt", {"mpx": mpx})
    _train(fabric, model, optimizer, range(2, 4))
    _assert_equal(_weights(model), uninterrupted)


def test_assign_true_load_of_the_state_dict_is_refused_naming_it() -> None:
    """``model.load_state_dict(sd, assign=True)`` at O2 would put the FP32 masters the state dict holds in place of the
    bfloat16 parameters (outside the masters and the optimizer): refused at the load, naming ``assign=True`` and the
    fix; the model and its training are untouched, and the load without ``assign`` works."""
    fabric, model, optimizer, _ = _setup()
    _train(fabric, model, optimizer, range(1))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params = list(model.parameters())
    with pytest.raises(ValueError, match=r"assign=True.*'.*weight'.*assign=False"):
        model.load_state_dict(state, assign=True)
    assert [p is q for p, q in zip(params, model.parameters())] == [True] * len(params)
    model.load_state_dict(state)
    _train(fabric, model, optimizer, range(1, 2))
    assert all(torch.isfinite(p).all() for p in model.parameters())


class _Unfreezes(pl.LightningModule):
    """The first layer frozen for epoch 0, unfrozen at epoch 1 with a re-created optimizer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.net[0].requires_grad_(False)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    def on_train_epoch_start(self) -> None:
        if self.current_epoch == 1:
            self.net[0].requires_grad_(True)
            self.trainer.strategy.setup_optimizers(self.trainer)


def test_unfrozen_layer_with_recreated_optimizer_trains_as_bf16_mixed() -> None:
    """A layer unfrozen mid-fit with a new optimizer over a different parameter set: at O2 it trains from its FP32
    value (its master made then) and ends where Lightning's "bf16-mixed" ends, to bfloat16's rounding."""
    start = _Unfreezes().net[0].weight.detach().clone()
    runs = {}
    for name, plugin, kwargs in (
        ("bf16", None, {"precision": "bf16-mixed"}),
        ("O2", MixedPrecisionPlugin("O2", half_dtype="bfloat16"), {}),
    ):
        module = _Unfreezes()
        make_trainer(plugin, max_epochs=2, **kwargs).fit(module, loader(classification_data()))
        runs[name] = _weights(module)
    moved = (runs["bf16"]["net.0.weight"] - start).abs().max()
    assert moved > 0.02  # the unfrozen layer trained in epoch 1
    for key, want in runs["bf16"].items():
        assert runs["O2"][key].dtype == torch.float32
        torch.testing.assert_close(runs["O2"][key], want, atol=5e-3, rtol=0), key


def test_fabric_ddp_checkpoint_habits(tmp_path: Path) -> None:
    """Fabric DDP, 2 ranks, O2: ``fabric.save``/``fabric.load`` of {"model", "optimizer", "mpx"} resumes exactly as
    the uninterrupted run, the ranks' state dicts stay identical (FP32), and a rank-0-only ``torch.save(
    model.state_dict())`` gives the FP32 masters, which a fresh "bf16-mixed" run (the checkpoint's AdamW state
    loaded) continues to within bfloat16's rounding of the uninterrupted run."""
    run_script("fabric_state_dict_habits_script.py", tmp_path, timeout=150)
    ranks = rank_results(tmp_path)
    for key in ("uninterrupted", "saved", "resumed", "habit_loaded", "habit_trained"):
        assert ranks[0][key] == ranks[1][key], key
        assert {v["dtype"] for v in ranks[0][key].values()} == {"torch.float32"}, key
    seen = ranks[0]
    assert seen["resumed"] == seen["uninterrupted"]
    assert seen["habit_loaded"] == seen["saved"]
    assert seen["scale"] == 256.0

    def gap(a: dict[str, Any], b: dict[str, Any]) -> float:
        return max(abs(x - y) for k in a for x, y in zip(a[k]["values"], b[k]["values"]))

    assert gap(seen["habit_trained"], seen["uninterrupted"]) < 1e-3  # bfloat16's rounding of the same steps
    assert gap(seen["habit_trained"], seen["saved"]) > 1e-2  # the steps moved the weights
