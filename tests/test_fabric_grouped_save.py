"""Hostile review of stop 62's later library changes (review62b): Fabric's ``state_dict()`` through ``_begin_read``
(rankzero62) under a process group. The found-inf reducer the plugin installs for a group of two or more ranks is
installed by hand here in a gloo group of one (the read's logic, in-process), against the same run without it (one
process: the pending scale update always runs before the save)."""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin
from lightning_mpx.integrations.collectives import all_reduce_max


def _run(grouped: bool, case: str, steps: int = 3, resume_from: dict | None = None) -> tuple[list, dict, list]:
    """A float16 O1 loop (growth_interval=1: each update doubles or halves the scale) saving ``mpx.state_dict()``
    every step; ``grouped``: the reducer a multi-rank run gets."""
    torch.manual_seed(0)
    mpx = FabricMixedPrecisionPlugin("O1", half_dtype="float16", growth_interval=1)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=mpx)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    # "head": the optimizer holds the head only; the body still requires grad (a fine-tune that did not freeze it)
    opt = torch.optim.SGD(model[1].parameters() if case == "head" else model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    if resume_from is not None:
        model.load_state_dict(resume_from["model"])
        opt.load_state_dict(resume_from["opt"])
        mpx.load_state_dict(resume_from["mpx"])
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(3, 4, generator=g) for _ in range(3)]
    saved = []
    for x in batches[3 - steps :]:  # a resumed run (two steps) continues after the first batch
        loss = model(x).float().pow(2).mean()
        fabric.backward(loss)
        if grouped:
            mpx.amp.found_inf_reducer = all_reduce_max
        opt.step()
        if case == "before_zero":  # a checkpoint between the step and zero_grad
            saved.append(copy.deepcopy({"mpx": mpx.state_dict(), "model": model.state_dict(), "opt": opt.state_dict()}))
        opt.zero_grad(set_to_none=False)
        if case != "before_zero":
            saved.append(copy.deepcopy({"mpx": mpx.state_dict(), "model": model.state_dict(), "opt": opt.state_dict()}))
    return saved, mpx.state_dict(), [p.detach().clone() for p in model.parameters()]


def _scales(saved: list) -> list[float]:
    return [s["mpx"]["scalers"][0]["scale"] for s in saved]


def _check(case: str) -> None:
    plain, _, _ = _run(False, case)
    grouped, _, weights = _run(True, case)
    assert _scales(grouped) == _scales(plain)  # the pending update ran before each save, as in one process
    assert len(set(_scales(plain))) > 1  # the scale moved between the saves (the check can fail)
    # resumed from the first save, two more steps: as the uninterrupted run's
    _, _, resumed = _run(True, case, steps=2, resume_from=grouped[0])
    for a, b in zip(resumed, weights):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("case", ["before_zero", "after_zero"])
def test_grouped_save_holds_the_pending_update_and_resumes(case: str, one_rank: None) -> None:
    """One optimizer over the model: a checkpoint after ``optimizer.step()`` (before ``zero_grad()`` or after
    ``zero_grad(set_to_none=False)``) under a process group holds the scale update of the saved iteration, as one
    process's does, and a run resumed from it matches the uninterrupted one."""
    _check(case)


def test_grouped_save_with_an_unheld_trainable_body(one_rank: None) -> None:
    """A fine-tune whose optimizer takes the head only, the body left requiring grad (its gradients kept for good):
    under a process group ``state_dict()`` never ends the iteration (gradients wait for a step that may come), and
    holds the scalers as the pending update leaves them (tests/test_fabric_grouped_save_pending.py): each save holds the
    update of the saved iteration, as one process's does, and a run resumed from it matches the uninterrupted one."""
    _check("head")
