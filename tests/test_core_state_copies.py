"""Hostile review of stop 62's library changes: the O2 optimizer state's copies (``StateByMasters.__reduce__``) taken
inside a step and of a schedule-free optimizer, and Apex ``amp.load_state_dict`` of the loss-scaler entries real
scripts save (numpy and tensor scalars). Core engine and the Apex layer, bfloat16, tiny models."""

from __future__ import annotations

import copy
import io
import pickle

import numpy as np
import pytest
import torch

from lightning_mpx import Amp
from lightning_mpx.apex import amp as apex_amp
from lightning_mpx.apex._state import _amp_state
from tests.test_core_state_by_param import _core_steps, _net


def _copies(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """What users do to a whole optimizer: deepcopy, pickle, ``torch.save`` then ``torch.load(weights_only=False)``"""
    buffer = io.BytesIO()
    torch.save(optimizer, buffer)
    buffer.seek(0)
    return [copy.deepcopy(optimizer), pickle.loads(pickle.dumps(optimizer)), torch.load(buffer, weights_only=False)]


def _same_state_dict(copied: torch.optim.Optimizer, live: dict) -> None:
    got = copied.state_dict()
    assert set(got["state"]) == set(live["state"]) and len(live["state"]) == 4
    for i, entry in live["state"].items():
        for key, value in entry.items():
            assert torch.equal(got["state"][i][key], value), (i, key)


def test_o2_optimizer_copied_inside_a_step_is_keyed_as_its_groups():
    """A step post-hook (a user's EMA/snapshot habit) copies the optimizer while the masters stand in its groups: the
    copy's state is keyed by the masters too (``_items_by_groups`` leaves it while ``owner.swapped``), so its
    ``state_dict()`` matches the live one's; outside the step the copies are keyed by the half parameters."""
    amp = Amp("O2", half_dtype=torch.bfloat16)
    model = amp.prepare_model(_net())
    optimizer = amp.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    _core_steps(amp, model, optimizer, 2)
    taken: dict[str, list] = {}

    def hook(opt: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        if not taken:
            taken["copies"] = _copies(opt)
            taken["live"] = copy.deepcopy(opt.state_dict())

    optimizer.register_step_post_hook(hook)
    _core_steps(amp, model, optimizer, 1)
    for copied in taken["copies"]:
        assert copied.param_groups[0]["params"][0].dtype == torch.float32  # the masters, as the groups held then
        _same_state_dict(copied, taken["live"])
    live = optimizer.state_dict()
    for copied in _copies(optimizer):
        assert copied.param_groups[0]["params"][0].dtype == torch.bfloat16
        assert all(k.dtype == torch.bfloat16 for k in copied.state)
        _same_state_dict(copied, live)


def test_o2_schedule_free_optimizer_deepcopy_state_dict():
    """A schedule-free optimizer at O2 (its state keyed by the masters, torch's lookups) copied whole by deepcopy,
    pickle or torch.save, in train and in eval mode: the copy is keyed by its groups' half parameters and its
    ``state_dict()`` is the live one's (it raised KeyError: masters/state_keys.py ``KeyedOnCopy``)."""
    from tests.test_accelerate_schedule_free import ScheduleFreeSGD

    amp = Amp("O2", half_dtype=torch.bfloat16)
    model = amp.prepare_model(_net())
    optimizer = amp.prepare_optimizer(ScheduleFreeSGD(model.parameters()))
    _core_steps(amp, model, optimizer, 2)
    for mode in ("train", "eval"):  # eval() on the half parameters leaves an empty entry under each of them
        getattr(optimizer, mode)()
        copies = _copies(optimizer)  # before the state dict, which the engine redoes the call on the masters for
        live = optimizer.state_dict()
        for copied in copies:
            assert all(k.dtype == torch.bfloat16 for k in copied.state)
            _same_state_dict(copied, live)
            assert copied.param_groups[0]["train_mode"] is (mode == "train")


@pytest.mark.parametrize(
    "entry",
    [
        {"loss_scale": np.float32(1024.0), "unskipped": np.int64(3)},
        {"loss_scale": torch.tensor(1024.0), "unskipped": torch.tensor(3)},  # 0-d tensors, as some scripts save
    ],
    ids=["numpy", "tensor"],
)
def test_apex_load_state_dict_of_numpy_and_tensor_scalars(entry):
    _amp_state.reset()
    try:
        model = torch.nn.Linear(4, 4)
        model, optimizer = apex_amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level="O1",
                                               verbosity=0)  # fmt: skip
        apex_amp.load_state_dict({"loss_scaler0": entry})
        assert apex_amp.state_dict()["loss_scaler0"] == {"loss_scale": 1024.0, "unskipped": 3}
    finally:
        _amp_state.reset()
