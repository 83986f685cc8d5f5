"""An overflow charged to several optimizers (``Amp.share_overflow``, what Apex's ``scale_loss`` over several
optimizers does): every one of them skips, and the engine's record of the overflow still names the parameter whose
gradient held the inf, whichever optimizer steps first, with the host read and with steps skipped on the device.

Before the fix, the skip of the optimizer with finite gradients built a record naming nothing, and when it stepped
last that record replaced the one that named the parameter (``last_overflow_parameters == []``), and the log said
"no parameter (flag set by another process)" on a single process.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from lightning_mpx import Amp


def _setup(skip_on_device: bool) -> tuple[Amp, nn.Sequential, list[torch.optim.Optimizer]]:
    torch.manual_seed(0)
    amp = Amp("O1", half_dtype="float16", init_scale=2.0**8, skip_on_device=skip_on_device, overflow_log_interval=0.0)
    model = amp.prepare_model(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    fused = {"fused": True} if skip_on_device else {}
    first = torch.optim.Adam(model[0].parameters(), lr=0.1, **fused)
    second = torch.optim.Adam(model[2].parameters(), lr=0.1, **fused)
    return amp, model, [amp.prepare_optimizer(first), amp.prepare_optimizer(second)]


@pytest.mark.parametrize("skip_on_device", [False, True], ids=["host-read", "on-device"])
@pytest.mark.parametrize("finite_last", [True, False], ids=["finite-optimizer-last", "finite-optimizer-first"])
def test_a_shared_overflow_is_recorded_with_the_parameter_that_overflowed(skip_on_device, finite_last, caplog):
    amp, model, optimizers = _setup(skip_on_device)
    before = [p.detach().clone() for p in model.parameters()]
    with amp.forward_context():
        loss = model(torch.randn(3, 4)).float().sum()
    amp.backward(loss)
    model[0].weight.grad[1, 2] = float("inf")  # the first optimizer's gradient
    amp.share_overflow(optimizers)
    order = optimizers if finite_last else optimizers[::-1]
    with caplog.at_level(logging.INFO, logger="lightning_mpx"):
        outcomes = [amp.step(opt) for opt in order]
        amp.update()
        amp.read_step_outcomes()
    assert [bool(o) for o in outcomes] == [False, False]  # both skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert amp.skipped_steps == [2]  # each optimizer's skip is counted, as any overflow
    assert amp.last_overflow_parameters == ["0.weight"]
    assert list(amp.last_overflow.parameters) == ["0.weight"]
    assert "non-finite gradients in 0.weight" in caplog.text
    # The finite optimizer's skip: not logged when it comes after the named one; when it comes first, logged with
    # why it names nothing (never "another process": there is none; read later, on the device path, the log cannot
    # tell finite gradients from cleared ones and says both).
    assert "another process" not in caplog.text
    nameless = caplog.text.count("no parameter of this optimizer (skipped with the optimizers of an overflowing loss")
    assert nameless == (0 if finite_last else 1)


def test_a_later_iterations_overflow_replaces_the_record():
    """The record kept is the latest overflow's: the rule only keeps a named record over a nameless one of the same
    iteration (the next iteration's overflow, in the other optimizer, replaces it)."""
    amp, model, optimizers = _setup(False)
    for bad in ("0.weight", "2.bias"):
        with amp.forward_context():
            loss = model(torch.randn(3, 4)).float().sum()
        amp.backward(loss)
        dict(model.named_parameters())[bad].grad.view(-1)[0] = float("nan")
        amp.share_overflow(optimizers)
        for opt in optimizers:
            amp.step(opt)
        amp.update()
        assert amp.last_overflow_parameters == [bad]


def test_a_shared_overflow_of_another_loss_is_an_overflow_of_its_own():
    """The kept record is only over a nameless one of the same losses: an overflow charged to an optimizer from
    another loss (``share_overflow(..., loss_id=1)``) in the same iteration is the latest overflow, and says why it
    names nothing."""
    torch.manual_seed(0)
    amp = Amp("O1", half_dtype="float16", init_scale=2.0**8, num_losses=2, skip_on_device=False)
    model = amp.prepare_model(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    first = amp.prepare_optimizer(torch.optim.SGD(model[0].parameters(), lr=0.1))
    second = amp.prepare_optimizer(torch.optim.SGD(model[2].parameters(), lr=0.1))
    with amp.forward_context():
        loss = model(torch.randn(3, 4)).float().sum()
    amp.backward(loss, loss_id=0)
    model[0].weight.grad[0, 0] = float("inf")
    assert not amp.step(first)
    assert amp.last_overflow_parameters == ["0.weight"]
    amp.share_overflow([second], loss_id=1)
    assert not amp.step(second)
    assert list(amp.last_overflow.loss_ids) == [1] and amp.last_overflow_parameters == []
