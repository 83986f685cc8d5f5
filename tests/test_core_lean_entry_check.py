"""A lean O2 engine entry (its ``masters_in_state_dict`` names the masters the model's entry holds, with their
checksums) loaded into the core ``Amp``: the engine checks at its next ``step`` that the model's entry gave them
(engine/held_masters.py ``HeldMasters``), as Fabric and the Apex layer do; a load of other weights on purpose after
the entry is kept. The entry is the Apex layer's ``amp.state_dict()`` (``ckpt['amp']['lightning_mpx']``)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from lightning_mpx import Amp

HALF = torch.bfloat16


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _x(step: int) -> torch.Tensor:
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(step))


@pytest.fixture(scope="module")
def ckpt() -> dict[str, Any]:
    """An Apex O2 run's checkpoint after 3 steps (its amp entry lean: the model entry holds the masters)."""
    from lightning_mpx.apex import _amp_state, amp

    _amp_state.reset()
    model = _net()
    model, optimizer = amp.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), opt_level="O2", cast_model_type=HALF, verbosity=0
    )
    for step in range(3):
        with amp.scale_loss(model(_x(step)).float().pow(2).mean(), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()
    out = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()})
    _amp_state.reset()
    entry = out["amp"]["lightning_mpx"]
    assert entry["masters_in_state_dict"] and not any(entry["master_weights"])
    return out


def _core(ckpt: dict[str, Any]) -> tuple[Amp, nn.Module, torch.optim.Optimizer]:
    """A fresh run with the checkpoint's optimizer state (a copy: torch's optimizers keep the loaded state's ``step``
    tensors and count them up in place, so a shared checkpoint would resume the next test from a later step)."""
    core = Amp("O2", half_dtype=HALF)
    model = core.prepare_model(_net(1))
    optimizer = core.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    optimizer.load_state_dict(copy.deepcopy(ckpt["optimizer"]))
    return core, model, optimizer


def _step(core: Amp, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    with core.forward_context():
        out = model(core.cast_inputs(_x(step)))
    core.backward(out.float().pow(2).mean())
    core.step(optimizer)
    core.update()
    optimizer.zero_grad()


def _masters(core: Amp, model: nn.Module) -> list[torch.Tensor]:
    return [core.master_of(p).clone() for p in model.parameters()]


def test_without_its_model_entry_every_step_is_refused_and_nothing_trains(ckpt: dict[str, Any]) -> None:
    core, model, optimizer = _core(ckpt)
    core.load_state_dict(ckpt["amp"]["lightning_mpx"])
    before = _masters(core, model)
    for step in (3, 4):  # a caller that catches it is told again: never a silent resume from this run's masters
        with pytest.raises(RuntimeError, match=r"4 parameter\(s\).*model\.load_state_dict\(ckpt\['model'\]\)"):
            _step(core, model, optimizer, step)
    assert all(torch.equal(a, b) for a, b in zip(before, _masters(core, model)))


def _resumed(ckpt: dict[str, Any], model_first: bool) -> tuple[Amp, nn.Module, torch.optim.Optimizer]:
    core, model, optimizer = _core(ckpt)
    if model_first:
        model.load_state_dict(ckpt["model"])
    core.load_state_dict(ckpt["amp"]["lightning_mpx"])
    if not model_first:
        model.load_state_dict(ckpt["model"])
    return core, model, optimizer


def test_the_model_entry_loaded_after_the_engine_entry_gives_the_saved_masters_and_trains(
    ckpt: dict[str, Any],
) -> None:
    core, model, optimizer = _resumed(ckpt, model_first=False)
    assert all(torch.equal(core.master_of(p), ckpt["model"][k]) for k, p in model.named_parameters())
    for step in (3, 4):
        _step(core, model, optimizer, step)


def test_either_load_order_continues_the_same(ckpt: dict[str, Any]) -> None:
    """The model entry before or after ``Amp.load_state_dict``: the same step from the same masters (AdamW's step
    count the saved 3 plus one). A strict xfail while the checkpoint was shared between resumes: torch's optimizers
    count the loaded ``step`` tensors up in place, so the second resume started from a later step."""
    runs = []
    for model_first in (True, False):
        core, model, optimizer = _resumed(ckpt, model_first)
        _step(core, model, optimizer, 3)
        runs.append(_masters(core, model))
        assert {int(v["step"]) for v in optimizer.state_dict()["state"].values()} == {4}
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_other_weights_loaded_on_purpose_after_the_engine_entry_are_trained_from(ckpt: dict[str, Any]) -> None:
    """A deliberate write since the load (the model's weights from elsewhere): the user's choice, kept."""
    core, model, optimizer = _core(ckpt)
    core.load_state_dict(ckpt["amp"]["lightning_mpx"])
    other = _net(7).state_dict()
    model.load_state_dict(other)
    assert all(torch.equal(core.master_of(p), other[k]) for k, p in model.named_parameters())
    _step(core, model, optimizer, 3)


def test_apex_loss_scales_alone_after_a_lean_load_train_from_the_users_weights(ckpt: dict[str, Any]) -> None:
    """The Apex layer's documented way to keep the loss scales only, after the whole amp entry was loaded without
    its model entry: the engine does not check the earlier load's masters either."""
    from lightning_mpx.apex import _amp_state, amp

    _amp_state.reset()
    model = _net(1)
    model, optimizer = amp.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), opt_level="O2", cast_model_type=HALF, verbosity=0
    )
    mine = {k: v.float().clone() for k, v in _net(1).state_dict().items()}
    amp.load_state_dict(ckpt["amp"])
    amp.load_state_dict({k: v for k, v in ckpt["amp"].items() if k.startswith("loss_scaler")})
    with amp.scale_loss(model(_x(3)).float().pow(2).mean(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()  # the engine's step: trains from the user's weights (AdamW's first step: about lr each)
    got = dict(zip(mine, amp.master_params(optimizer)))
    assert all(0 < (got[k] - mine[k]).abs().max() < 0.02 for k in mine)
    _amp_state.reset()
