"""The engine's step does no Python work per parameter on an unsharded model (issue 41's host-bound step).

Found in stop 52's census (``benchmarks/habit_census.py``): every row's Python calls per parameter tensor went up by
exactly 1.0, from a generator expression over the gradients in the step's bookkeeping (``engine/sharding.py``
``local_tensors``, added to tell an FSDP2 gradient's local shard). A count, not a timing: the calls inside
``amp.step`` beyond those of the optimizer's own step (torch's ``_init_group`` loops over the parameters in Python)
must not grow with the number of parameter tensors.
"""

from __future__ import annotations

import gc
import sys

import pytest
import torch
from torch import nn

from lightning_mpx import Amp


def _calls_in_step(level: str | None, layers: int) -> int:
    """Python calls in the fourth step of ``amp.step`` (``level``) or of the bare optimizer (``None``, FP32)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    amp = None if level is None else Amp(level, half_dtype=torch.bfloat16)
    if amp is not None:
        amp.prepare_model(model)
        optimizer = amp.prepare_optimizer(optimizer)
    counted = 0

    def profile(frame, event, arg):
        nonlocal counted
        counted += event == "call"

    for step in range(4):  # the last one counted, after the first steps made every lazy structure
        optimizer.zero_grad(set_to_none=True)
        loss = model(torch.randn(4, 8).to(model[0].weight.dtype)).float().pow(2).mean()
        loss.backward() if amp is None else amp.backward(loss)
        if step == 3:  # no collection while counting: a finalizer or weakref callback of another test's garbage
            gc.collect()  # (a Python call) would be counted here (seen once in the whole suite: 15 calls against 13)
            gc.disable()
            sys.setprofile(profile)
        try:
            optimizer.step() if amp is None else amp.step(optimizer)
        finally:
            sys.setprofile(None)
            gc.enable()
    return counted


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_the_step_makes_no_python_call_per_parameter(level: str) -> None:
    # 4 and 16 parameter tensors; each less the bare optimizer's step on the same model (O2 steps FP32 masters)
    few, many = (_calls_in_step(level, layers) - _calls_in_step(None, layers) for layers in (2, 8))
    assert many == few, f"{level}: {few} calls a step beyond the optimizer's with 4 parameter tensors, {many} with 16"
