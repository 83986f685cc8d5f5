"""Left items of gradients kept after a step (issue 49), each against an FP32 twin (the loop helpers of
``tests/test_leftover_grads.py``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_mpx import Amp
from tests.test_leftover_grads import LR, Loop, assert_close, make_net, run


def _late_group(level: str | None, then: list[str]) -> list[torch.Tensor]:
    # The first layer trains only from the second iteration's step on (add_param_group, a fine-tuning habit); the
    # model's own zero_grad clears every gradient each iteration, so the layer's come from the last backward only:
    # scaled (at O1 in place, at O2 in the half model), as no step unscaled them. Then a second step (no backward
    # since) applies them with the other layers' kept ones, or a backward adds to them, as FP32 does; the scale
    # grows at every update.
    net = make_net()
    opt = torch.optim.SGD([p for m in (net[1], net[3]) for p in m.parameters()], lr=LR)
    loop = Loop(None)
    if level is not None:
        loop.amp = Amp(level, half_dtype="bfloat16", loss_scale="dynamic", growth_interval=1)
        net, opt = loop.amp.prepare_model(net), loop.amp.prepare_optimizer(opt)
    loop.net, loop.opts = net, [opt]
    for i, actions in enumerate((["bw", "step", "update"], ["bw", "step", "update"], ["bw", "step", "update"])):
        net.zero_grad()
        run(loop, actions)
        if i == 1:
            opt.add_param_group({"params": list(net[0].parameters())})
            run(loop, then)
    return loop.weights()


@pytest.mark.parametrize("then", [["step", "update"], ["bw", "step", "update"]], ids=["second_step", "backward"])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_group_added_after_a_step_brings_the_scale_of_its_backward(level, then):
    # Before: at O1 a second step took the new group's gradients as true values (1.6e3 off FP32); after a backward
    # (O1 and O2) they kept the scale before the update, the backward's added at the new one.
    assert_close(_late_group(level, then), _late_group(None, then), atol=1e-3)  # 3e-4 now, 5.7e-3 before


# -- metric readers: a saved position above a total ----------------------------------------------------------------
def _overflowing_engine(half_dtype: str = "bfloat16", steps: int = 2, **settings: Any) -> tuple[Amp, dict[str, Any]]:
    """An O1 engine after ``steps`` overflow steps, read by its default reader; its state dict."""
    torch.manual_seed(0)
    amp = Amp("O1", half_dtype=half_dtype, skip_on_device=False, **settings)
    model = amp.prepare_model(nn.Linear(8, 2))
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(steps):
        with amp.forward_context():
            loss = model(torch.randn(4, 8)).float().pow(2).mean() * float("inf")
        amp.backward(loss)
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()
    amp.metrics()
    return amp, amp.state_dict()


@pytest.mark.parametrize("count", ["mpx/overflows", "mpx/overflow/_root", "mpx/overflow/other"])
def test_a_reader_position_above_the_checkpoints_total_is_refused_before_anything_is_loaded(count):
    # Before: accepted, and the reader's next read reported -1 overflows (positions pasted from another checkpoint).
    _, state = _overflowing_engine(loss_scale="dynamic")
    readers = {**state["metric_readers"], "log": {count: 3}}
    fresh, before = _overflowing_engine(steps=0, loss_scale="dynamic")
    total = 2 if count != "mpx/overflow/other" else 0
    with pytest.raises(ValueError, match=rf"reader 'log' holds {count}=3, above the checkpoint's total {total}"):
        fresh.load_state_dict({**state, "metric_readers": readers})
    assert fresh.state_dict() == before  # nothing was taken


def test_a_count_the_load_does_not_carry_over_is_read_from_zero_not_below():
    # float16's dynamic scale into bfloat16's static one: the scale is this run's setting, its overflow count starts
    # afresh, and the saved positions (2) are above it. Before: the first read reported -2 overflows.
    _, state = _overflowing_engine("float16", loss_scale="dynamic")
    fresh, _ = _overflowing_engine("bfloat16", steps=0)
    fresh.load_state_dict(state)
    assert int(fresh.metrics()["mpx/overflows"]) == 0
    fresh_reader = fresh.metrics(reader="monitor")  # not in the checkpoint: counts from the start (the docs say so)
    assert int(fresh_reader["mpx/overflows"]) == 0 and fresh_reader["mpx/overflow/_root"] == 2.0
