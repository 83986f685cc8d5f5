"""Fabric at O2: the masters' gradients read for a log (``mpx.main_params(optimizer)``) after
``fabric.clip_gradients``, then a write to the model's gradients before the step, as under Fabric's own
``"bf16-mixed"``: with two optimizers that share a parameter (a layer both train), each clipped, and with one optimizer
clipped twice in a step (a log after each clip).

A read of ``main_params`` is told from a clip of the masters by the gradients' version counters at the step. An
engine write between the read and the step moved them, and the read was taken for a clip whose write must be refused:
the run stopped with "a model gradient was written between clip_grad_norm_()/clip_grad_value_() and step()" where
``"bf16-mixed"`` trains. Such writes: the other optimizer's unscale or step, which writes the shared master's FP32
gradient, and the second ``fabric.clip_gradients`` of the same optimizer. A real clip of the masters (torch's
``clip_grad_norm_`` on ``main_params``) followed by a write to the model's gradients is still refused.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin

MAX_NORM = 0.2


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.shared, self.b = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.shared(torch.relu(self.a(x)))))


def _run(precision: str, habit: str, *, shared: bool = True) -> dict[str, Any]:
    """Three steps of ``habit``, one letter an action: ``1``/``2`` clip optimizer 1/2 (Fabric's), ``r``/``R`` read
    ``main_params`` of optimizer 1/2 (a log of the norms), ``c`` torch's clip of ``main_params(optimizer 1)``, ``u`` the
    precision's ``unscale_gradients(optimizer 1)``, ``v`` torch's ``clip_grad_value_`` of the model's gradients, ``w``
    halve every model gradient, ``S``/``T`` step optimizer 1/2. ``shared=False``: the first optimizer alone, over
    every parameter."""
    net = _Net()
    plugin = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16") if precision == "O2" else None
    fabric = Fabric(accelerator="cpu", devices=1, **({"plugins": [plugin]} if plugin else {"precision": precision}))
    if shared:
        first = torch.optim.SGD([*net.a.parameters(), *net.shared.parameters()], lr=0.3)
        second = torch.optim.SGD([*net.b.parameters(), *net.shared.parameters()], lr=0.3)
        model, first, second = fabric.setup(net, first, second)
    else:
        model, first = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.3))
        second = first
    optimizers = {"1": first, "2": second, "r": first, "R": second, "S": first, "T": second}
    out: dict[str, Any] = {"norms": [], "logged": []}
    for step in range(3):
        generator = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(6, 8, generator=generator), torch.randint(0, 4, (6,), generator=generator)
        fabric.backward(F.cross_entropy(model(x).float(), y))
        for action in habit:
            optimizer = optimizers.get(action)
            if action in "12":
                out["norms"].append(float(fabric.clip_gradients(model, optimizer, max_norm=MAX_NORM)))
            elif action in "rR":
                params = plugin.main_params(optimizer) if plugin else optimizer.param_groups[0]["params"]
                out["logged"].append(float(torch.nn.utils.get_total_norm([p.grad for p in params])))
            elif action == "c":
                params = plugin.main_params(first) if plugin else first.param_groups[0]["params"]
                torch.nn.utils.clip_grad_norm_(list(params), MAX_NORM / 2)
            elif action == "u":
                (plugin or fabric.strategy.precision).unscale_gradients(first)
            elif action == "v":
                torch.nn.utils.clip_grad_value_(list(net.parameters()), 0.01)
            elif action == "w":
                for param in net.parameters():
                    param.grad.mul_(0.5)
            else:
                optimizer.step()
        first.zero_grad()
        if shared:
            second.zero_grad()
    values = plugin.fp32_state_dict(net) if plugin else net.state_dict()
    out["final"] = torch.cat([value.float().flatten() for value in values.values()])
    return out


def _quiet(precision: str, habit: str, *, shared: bool = True) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _run(precision, habit, shared=shared)


@pytest.mark.parametrize(
    "habit",
    [
        "1r2wST",  # read the first's masters after its clip, then the second's clip, the write, the steps
        "1rw2ST",  # the write before the second's clip
        "12rwTS",  # read after both clips, the second stepped first
        "12RwST",  # the second's masters read, the first stepped first
        "1r2r1rwST",  # a read after each clip, the first clipped twice
    ],
)
def test_read_of_shared_masters_then_write_trains_as_bf16_mixed(habit: str) -> None:
    ours, reference = _quiet("O2", habit), _quiet("bf16-mixed", habit)
    # before: RuntimeError "a model gradient was written between clip_grad_norm_()/clip_grad_value_() and step()"
    assert ours["norms"] == pytest.approx(reference["norms"], rel=2e-3)
    assert ours["logged"] == pytest.approx(reference["logged"], rel=1e-2)
    torch.testing.assert_close(ours["final"], reference["final"], rtol=0, atol=2e-4)


@pytest.mark.parametrize(
    "habit",
    [
        "1r1rwS",  # a log after each of two clips
        "1c1rwS",  # torch's clip of the masters, then Fabric's (which shows the clipped values), a read, the write
    ],
)
def test_read_after_second_clip_then_write_trains_as_bf16_mixed(habit: str) -> None:
    ours, reference = _quiet("O2", habit, shared=False), _quiet("bf16-mixed", habit, shared=False)
    # before: RuntimeError "a model gradient was written between clip_grad_norm_()/clip_grad_value_() and step()"
    assert ours["norms"] == pytest.approx(reference["norms"], rel=2e-3)
    torch.testing.assert_close(ours["final"], reference["final"], rtol=0, atol=2e-4)


@pytest.mark.parametrize("habit", ["uv1S", "uv1rS"])
def test_unscale_then_a_write_then_fabrics_clip_trains_as_bf16_mixed(habit: str) -> None:
    """The precision's ``unscale_gradients(optimizer)``, torch's ``clip_grad_value_`` of the model's gradients, then
    ``fabric.clip_gradients`` (and a read of ``main_params``), the step. Before: refused at the step ("both the FP32
    master weights' gradients ... and the model's gradients ... were written"), where ``"bf16-mixed"`` trains: the clip
    of the masters did not take the model's write first. Now the already-unscaled optimizer's model writes are taken
    before the clip (1.4e-4 off ``"bf16-mixed"``; the write's own effect is 3.5e-2)."""
    ours, reference = _quiet("O2", habit, shared=False), _quiet("bf16-mixed", habit, shared=False)
    assert ours["norms"] == pytest.approx(reference["norms"], rel=2e-3)
    torch.testing.assert_close(ours["final"], reference["final"], rtol=0, atol=2e-4)


@pytest.mark.parametrize("habit", ["1cwS", "1r1cwS"])
def test_clip_of_masters_then_write_still_refused(habit: str) -> None:
    with pytest.raises(RuntimeError, match=r"written between clip_grad_norm_\(\)/clip_grad_value_\(\) and step\(\)"):
        _quiet("O2", habit, shared=False)


def test_clip_of_shared_masters_then_write_still_refused() -> None:
    """torch's clip of the first's masters, then a write to the model's gradients: made on the unclipped values, it
    would undo the clip, so it stays refused (at the second's clip, which takes the shared gradient)."""
    with pytest.raises(RuntimeError, match=r"written between clip_grad_norm_\(\)/clip_grad_value_\(\) and step\(\)"):
        _quiet("O2", "1cw2ST")


@pytest.mark.parametrize("habit", ["cS", "rcS"])
def test_torch_clip_of_main_params_before_any_unscale_clips(habit: str) -> None:
    """torch's ``clip_grad_norm_(mpx.main_params(opt), ...)`` right after ``fabric.backward`` (Apex's habit), with or
    without a read for a log before it. Before: the masters held no gradients yet (no unscale), the clip returned 0.0
    and clipped nothing, the weights ended 7.8e-2 off ``"bf16-mixed"`` in 3 steps, and the read found ``grad`` None.
    Now ``main_params`` unscales first, as ``fabric.clip_gradients`` does."""
    ours, reference = _quiet("O2", habit, shared=False), _quiet("bf16-mixed", habit, shared=False)
    assert ours["logged"] == pytest.approx(reference["logged"], rel=1e-2)
    torch.testing.assert_close(ours["final"], reference["final"], rtol=0, atol=2e-4)


# -- two ranks, ONE launch (tests/fabric_clip_reads_script.py) --------------------------------------------------------
@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from pathlib import Path

    from tests.launch import case_results

    return case_results("fabric_clip_reads_script.py", Path(tmp_path_factory.mktemp("clip_reads")), timeout=240)


def test_ddp_rank_zero_read_of_shared_masters_changes_nothing(ranks: list[dict[str, Any]]) -> None:
    """DDP, O2 float16, rank 1 alone overflowing at step 1, rank 0 alone reading the first optimizer's masters after
    its clip, then the second's clip, a write and the steps: no rank refuses or waits, the overflow step is skipped
    by both optimizers on both ranks, and the weights are those of the same run without the read, equal on the ranks
    (before: rank 0 refused the write, rank 1 was left in a collective until the group's timeout)."""
    for rank in ranks:
        assert rank["read"]["skipped"] == [[False, False], [True, True], [False, False]]
        assert rank["read"]["final"] == ranks[0]["read"]["final"]
        assert rank["read"]["final"] == rank["plain"]["final"]
    assert len(ranks[0]["read"]["logged"]) == 3 and not ranks[1]["read"]["logged"]


def _finals(ranks: list[dict[str, Any]], case: str) -> list[torch.Tensor]:
    return [torch.tensor(rank[case]["final"]) for rank in ranks]


@pytest.mark.parametrize("level", ["O1", "O2", "apart:O2"])
def test_ddp_rank_zero_log_of_main_params_after_backward(ranks: list[dict[str, Any]], level: str) -> None:
    """DDP float16, rank 0 alone logging the norm of ``mpx.main_params(opt)``'s gradients right after
    ``fabric.backward`` (before ``fabric.clip_gradients``), rank 1 alone overflowing at step 1. The weights are those of
    the run without the log, equal on the ranks, the overflow step skipped on both; the logged norm is the one the clip
    then returns (the reduced, true gradients'), non-finite on the overflow step. Before: at O1 the log read the scaled
    gradients (193.2 for 0.755 at a scale of 256), at O2 it read 0.0 on the overflow step (a zero stand-in).
    ``apart:O2``: the optimizer set up apart, met by the plugin at rank 0's first read (rank 1: at its clip)."""
    case = f"{level}:read" if level.startswith("apart") else f"ddp:{level}:read"
    for final, plain in zip(_finals(ranks, case), _finals(ranks, case[: -len("read")] + "plain"), strict=True):
        torch.testing.assert_close(final, plain, rtol=0, atol=0)
        torch.testing.assert_close(final, _finals(ranks, case)[0], rtol=0, atol=0)
    for rank in ranks:
        assert rank[case]["skipped"] == [False, True, False]
    logged, clipped = ranks[0][case]["logged"], ranks[0][case]["clipped"]
    assert not math.isfinite(logged[1])
    assert [logged[0], logged[2]] == pytest.approx([clipped[0], clipped[2]], rel=1e-3)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_ddp_rank_zero_log_on_a_non_final_micro_batch(ranks: list[dict[str, Any]], level: str) -> None:
    """DDP float16, two micro-batches under ``fabric.no_backward_sync``, rank 0 alone logging ``main_params`` on the
    first (which unscales its gradients there, on that rank alone), rank 1 alone overflowing on its first micro-batch
    at step 1: no rank waits, both skip step 1, and the weights are those of the run without the log, equal on the
    ranks. Before: the same weights, but at O1 the log read the scaled gradients (139.8 at a scale of 256)."""
    case = f"accumulate:{level}:read"
    for final, plain in zip(_finals(ranks, case), _finals(ranks, f"accumulate:{level}:plain"), strict=True):
        torch.testing.assert_close(final, plain, rtol=0, atol=0)
        torch.testing.assert_close(final, _finals(ranks, case)[0], rtol=0, atol=0)
    for rank in ranks:
        assert rank[case]["skipped"] == [False, True, False]
    # rank 0's own first micro-batch, unreduced: finite, of the size of the step's reduced norm (not times the scale)
    logged, clipped = ranks[0][case]["logged"], ranks[0][case]["clipped"]
    assert all(math.isfinite(norm) and norm < 4 * max(clipped[0], clipped[2]) for norm in logged)


def test_fsdp2_rank_zero_read_of_main_params_enters_no_collective(ranks: list[dict[str, Any]]) -> None:
    """``ModelParallelStrategy`` (FSDP2) at O1, ``fabric.clip_gradients`` on both ranks, then ``mpx.main_params(opt)``
    read on rank 0 alone (a log), rank 1 alone overflowing at step 1. Before: on the overflow check the read reduced
    the flag across ranks, a collective rank 1 never joined: it paired with rank 1's next one and the run died at the
    group's timeout. Now rank 0 gets its parameters (no collective) and the weights are those of the run without the
    read, equal on the ranks."""
    for final, plain in zip(_finals(ranks, "fsdp2:read"), _finals(ranks, "fsdp2:plain"), strict=True):
        torch.testing.assert_close(final, plain, rtol=0, atol=0)
    for rank in ranks:
        assert rank["fsdp2:read"]["skipped"] == [False, True, False]
    assert ranks[0]["fsdp2:read"]["logged"] == [4, 4, 4]  # the model's four parameters, the overflow step's too


def test_fsdp2_torch_clip_of_main_params_after_backward_clips_as_fabrics(ranks: list[dict[str, Any]]) -> None:
    """FSDP2 at O1 (bfloat16, dynamic scale 256), the optimizer set up apart: torch's
    ``clip_grad_norm_(mpx.main_params(opt))`` right after ``fabric.backward`` on both ranks gives the weights of the
    run clipped with ``fabric.clip_gradients``. Before: 2.2e-2 off (sharded, ``main_params`` did not unscale first,
    and the optimizer met at that read carried no loss: the scaled gradients were clipped)."""
    for final, fabric_clip in zip(_finals(ranks, "fsdp2:torch_clip"), _finals(ranks, "fsdp2:plain"), strict=True):
        torch.testing.assert_close(final, fabric_clip, rtol=0, atol=1e-4)


def test_fsdp2_rank_zero_read_right_after_backward_changes_nothing(ranks: list[dict[str, Any]]) -> None:
    """FSDP2 at O1, ``mpx.main_params(opt)`` read on rank 0 alone right after ``fabric.backward`` (it unscales there,
    on that rank alone), then ``fabric.clip_gradients`` on both, rank 1 alone overflowing at step 1: the weights are
    those of the run without the read, the overflow step skipped on both ranks."""
    for final, plain in zip(_finals(ranks, "fsdp2:early_read"), _finals(ranks, "fsdp2:plain"), strict=True):
        torch.testing.assert_close(final, plain, rtol=0, atol=0)
    for rank in ranks:
        assert rank["fsdp2:early_read"]["skipped"] == [False, True, False]
    assert ranks[0]["fsdp2:early_read"]["logged"] == [4, 4, 4]
