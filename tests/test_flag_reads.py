"""``Amp.overflowed``: a host read of the overflow flag that the step then takes instead of reading the flag again,
and never a stale answer: a check made since (another backward, another unscale) or a reduction across processes
decides the step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mpx import Amp
from tests.test_hostile_apex import _HostReads


def _setup(opt_level: str):
    torch.manual_seed(0)
    amp = Amp(opt_level, half_dtype="bfloat16", loss_scale="dynamic", skip_on_device=False)
    model = amp.prepare_model(nn.Linear(4, 2))
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    return amp, model, optimizer


def _loss(amp, model, poison: float = 1.0):
    with amp.forward_context():
        return amp.cast_outputs(model(amp.cast_inputs(torch.randn(8, 4)))).float().pow(2).mean() * poison


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_the_step_takes_the_read_of_overflowed(opt_level):
    amp, model, optimizer = _setup(opt_level)
    for iteration in range(3):
        optimizer.zero_grad()
        amp.backward(_loss(amp, model))
        amp.unscale_(optimizer)
        reads = _HostReads()
        with reads:
            assert amp.overflowed(optimizer) is False
            assert amp.step(optimizer) is True
        amp.update()
        # O2's first step after an unscale also reads once whether user code wrote the half gradients through
        # .data (engine/data_writes.py: one look per optimizer, found clean, never again)
        assert reads.count == (2 if iteration == 0 and opt_level == "O2" else 1)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_check_made_after_the_read_decides_the_step(opt_level):
    """Read clean, then a second backward whose gradients overflow: the step reads the new flag and skips."""
    amp, model, optimizer = _setup(opt_level)
    before = [p.detach().clone() for p in model.parameters()]
    amp.backward(_loss(amp, model))
    amp.unscale_(optimizer)
    assert amp.overflowed(optimizer) is False
    amp.backward(_loss(amp, model, poison=float("inf")))  # brings the unscaled gradients over: checked again
    assert amp.step(optimizer) is False
    assert amp.overflowed(optimizer) is False  # nothing checked since the (skipped) step
    for param, old in zip(model.parameters(), before):
        torch.testing.assert_close(param, old, rtol=0, atol=0)
    assert amp.skipped_steps == [1]


def test_a_reduction_across_processes_decides_the_step_after_a_clean_read():
    """Under a process group another rank's overflow reaches this rank's flag in the reduction, made in place: a
    local read before it said clean, and the step must not take it."""
    amp, model, optimizer = _setup("O1")

    def other_rank_overflowed(flags: torch.Tensor) -> None:
        flags.fill_(1.0)

    amp.found_inf_reducer = other_rank_overflowed
    amp.backward(_loss(amp, model))
    amp.unscale_(optimizer)
    assert amp.overflowed(optimizer) is False  # this rank's own gradients are finite
    assert amp.step(optimizer) is False
    assert amp.skipped_steps == [1]


def test_overflowed_before_any_check_and_with_several_losses():
    torch.manual_seed(0)
    amp = Amp("O1", half_dtype="bfloat16", loss_scale="dynamic", num_losses=2, skip_on_device=False)
    model = amp.prepare_model(nn.Linear(4, 2))
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert amp.overflowed(optimizer) is False
    amp.backward(_loss(amp, model), loss_id=0)
    amp.backward(_loss(amp, model, poison=float("inf")), loss_id=1)
    amp.unscale_(optimizer)
    assert amp.overflowed(optimizer) is True
    assert amp.step(optimizer) is False
    amp.update()
    assert amp.skipped_steps == [0, 1]  # charged to the loss whose gradients overflowed


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_read_before_the_steps_own_check_does_not_decide_it(opt_level):
    """Gradients pending across an update (the optimizer did not step in that iteration) are checked by the next
    backward; ``overflowed()`` then reads that check. The backward's own inf is found by the step's check, a new
    flag of the same loss: the step skips, and the weights stay as they were."""
    torch.manual_seed(0)
    amp = Amp(opt_level, half_dtype="bfloat16", loss_scale="dynamic", skip_on_device=False)
    model = amp.prepare_model(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    first = amp.prepare_optimizer(torch.optim.SGD(model[0].parameters(), lr=0.1))
    second = amp.prepare_optimizer(torch.optim.SGD(model[1].parameters(), lr=0.1))
    amp.backward(_loss(amp, model))
    assert amp.step(first) is True
    amp.update()  # `second` did not step: its gradients wait, at the scale they were made with
    before = [p.detach().clone() for p in model[1].parameters()]
    amp.backward(_loss(amp, model, poison=float("inf")))
    assert amp.overflowed(second) is False  # the check of what was pending: finite
    assert amp.step(second) is False  # the step's own check finds the new inf
    for param, old in zip(model[1].parameters(), before):
        torch.testing.assert_close(param, old, rtol=0, atol=0)


def _fabric_clip_step_reads(**fabric_kwargs) -> list[int]:
    """Host reads of ``fabric.clip_gradients`` + ``optimizer.step()``, per iteration."""
    from lightning.fabric import Fabric

    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1, **fabric_kwargs)
    model = nn.Linear(4, 2)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    counts = []
    for _ in range(3):
        optimizer.zero_grad()
        fabric.backward(model(torch.randn(8, 4)).float().pow(2).mean())
        reads = _HostReads()
        with reads:
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
        counts.append(reads.count)
    return counts


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_fabric_clip_and_step_read_the_flag_once(opt_level):
    """Fabric's clip reads the flag (to hand an overflow step nothing to clip) and the step takes that read: one
    read more than Fabric's own bf16-mixed, which has no flag (torch's clip reads its norm in both)."""
    from lightning_mpx import FabricMixedPrecisionPlugin

    own = _fabric_clip_step_reads(precision="bf16-mixed")
    ours = _fabric_clip_step_reads(plugins=[FabricMixedPrecisionPlugin(opt_level, half_dtype="bfloat16",
                                                                        loss_scale="dynamic")])
    # O2's first iteration also reads, at the clip and at the step, whether user code wrote the half gradients
    # through .data (engine/data_writes.py: one look per optimizer, found clean, never again)
    first = 2 if opt_level == "O2" else 0
    assert ours == [n + 1 + (first if i == 0 else 0) for i, n in enumerate(own)]
