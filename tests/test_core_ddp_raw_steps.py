"""The raw-step check (engine/raw_steps.py) under DDP, two CPU ranks (gloo), every multi-rank check in ONE launch
(tests/core_ddp_raw_steps_script.py). Under DDP an error on one rank while the other goes on into a collective is a
hang, so each refusal must happen on both ranks, and no legitimate DDP habit may be refused.

Stop 56, found and fixed: a raw SGD over a head no prepared optimizer holds, which only rank 0's forward used
(``find_unused_parameters=True``), was refused on rank 0 alone: the note of which parameters hold a gradient was taken
at the end of the backward before DDP's all-reduce gave rank 1 the head's gradient; rank 1 went on into the next
all-reduce and waited for rank 0 (until the group's timeout). The note now comes after DDP's callback.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.launch import rank_results, run_script

REFUSED = "were written and their gradients cleared after a backward of lightning_mpx"
FIX = "Step a prepared optimizer instead"
RAW_CASES = ("trainer_raw", "fabric_raw/O2", "fabric_raw/O1", "accelerate_raw")
# The bfloat16 forward and gradients of O2 (masters updated in FP32) against Fabric's "bf16-mixed" (FP32 weights,
# bfloat16 autocast) over 3 SGD steps of a tiny model: measured 3e-4 apart.
ATOL_REF = 3e-3
# Cases that raise on purpose (the checks below read their errors).
RAISING = (*RAW_CASES, "unheld_branch", "subset_no_sync", "subset_no_sync_fused", "branch_raw_no_sync")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("ddp56")
    run_script("core_ddp_raw_steps_script.py", out, timeout=90)
    got = rank_results(out)
    for rank in got:
        assert rank["world"] == 2
        for case, value in rank.items():
            if isinstance(value, dict) and case not in RAISING:
                assert "error" not in value, f"{case}: {value['error']}"
    return got


def _error(rank: dict[str, Any], case: str) -> str:
    return rank[case].get("error", "")


@pytest.mark.parametrize("case", RAW_CASES)
def test_raw_optimizer_refused_on_both_ranks(ranks: list[dict[str, Any]], case: str) -> None:
    """A raw torch optimizer under the Trainer's, Fabric's and the Accelerate adapter's DDP (O2 bfloat16; O1 float16
    with a dynamic scale): both ranks raise the named error, and it names the fix."""
    for r, rank in enumerate(ranks):
        error = _error(rank, case)
        assert "RuntimeError" in error and REFUSED in error, f"rank {r}, {case}: {error or 'not refused'}"
        assert FIX in error
    assert ranks[0]["accelerate_raw"]["wrapper"] == "DistributedDataParallel"


def test_group_still_works_after_the_refusals(ranks: list[dict[str, Any]]) -> None:
    """No rank was left in a collective by the other's error: an all-reduce after every case sums both ranks."""
    assert [rank["after"]["sum"] for rank in ranks] == [2.0, 2.0]


def test_legit_ddp_habits_not_refused_and_trained_like_bf16_mixed(ranks: list[dict[str, Any]]) -> None:
    """DDP's broadcast at wrap time (each rank its own initial weights), ``no_backward_sync`` accumulation, a branch
    only rank 0 uses (``find_unused_parameters=True``) and a rank-0-only EMA that reads the weights: no error, the
    ranks' masters equal, and within bfloat16's reach of Fabric's own "bf16-mixed" run; no hook of the engine's DDP
    watch is left on the model or on a copy made before the first backward."""
    o2 = [torch.tensor(rank["legit/O2"]["w"]) for rank in ranks]
    ref = [torch.tensor(rank["legit/ref"]["w"]) for rank in ranks]
    assert torch.equal(o2[0], o2[1]) and torch.equal(ref[0], ref[1])
    torch.testing.assert_close(o2[0], ref[0], rtol=0, atol=ATOL_REF)
    assert not torch.equal(o2[0], ref[0])  # two runs, not one read twice
    # engine/unsynced.py finds the DDP wrapper by forward pre-hooks until the first backward: none is left on the
    # model, nor on a deep copy made before it (taken off at the copy's first forward)
    assert [rank["legit/O2"]["hooks_left"] for rank in ranks] == [[0, 0], [0, 0]]
    assert all(rank["legit/O2"]["watched"] for rank in ranks)


def test_one_rank_overflow_skipped_on_both(ranks: list[dict[str, Any]]) -> None:
    """O1 float16: an inf loss on rank 1 only at step 1: both ranks skip that step (the weights unchanged by it, the
    scale halved once), equal on both ranks, and the raw-step check fires on neither."""
    for rank in ranks:
        w = [torch.tensor(x) for x in rank["overflow"]["w"]]
        assert torch.equal(w[0], w[1]) and not torch.equal(w[1], w[2]) and rank["overflow"]["scale"] == 128.0
    assert ranks[0]["overflow"]["w"] == ranks[1]["overflow"]["w"]


def test_unheld_branch_refused_on_both_ranks(ranks: list[dict[str, Any]]) -> None:
    """A raw SGD over a head no prepared optimizer holds, used by rank 0's forward only: DDP gives rank 1 its
    gradient, the raw step writes it on both ranks, and both refuse (was: rank 0 alone)."""
    for r, rank in enumerate(ranks):
        assert rank["unheld_branch"]["branch_grad"]
        error = _error(rank, "unheld_branch")
        assert "which no optimizer prepared by lightning_mpx holds" in error, f"rank {r}: {error or 'not refused'}"


def test_subset_raw_step_under_no_sync_decided_alike(ranks: list[dict[str, Any]]) -> None:
    """Under ``no_backward_sync``, a raw SGD over the trunk while the branch's gradient is kept on rank 0 only: the
    ranks must decide alike (both refuse). Was: rank 1 raised at the next backward and rank 0 went on (a hang at the
    next all-reduce); after a backward DDP did not synchronise the refusal waits for the step, where the ranks meet,
    skip it and both raise (engine/unsynced.py)."""
    outcomes = [REFUSED in _error(rank, "subset_no_sync") for rank in ranks]
    assert outcomes == [True, True], outcomes
    assert [rank["subset_no_sync"].get("step_reached") for rank in ranks] == [True, True]
    assert not any(rank["subset_no_sync"].get("stepped") for rank in ranks)
    assert "on rank 1" in _error(ranks[0], "subset_no_sync")  # rank 0 names where it was found


def test_subset_raw_step_under_no_sync_with_a_fused_optimizer_skipped_and_refused_on_both(
    ranks: list[dict[str, Any]],
) -> None:
    """The same with a fused AdamW (its step skips on the device, read later): the step is skipped on both ranks (the
    trunk as the raw step left it) and both refuse at the next backward, where the step is settled."""
    for r, rank in enumerate(ranks):
        case = rank["subset_no_sync_fused"]
        assert REFUSED in case.get("error", ""), f"rank {r}: {case.get('error') or 'not refused'}"
        assert case["trunk_after_step"] == case["trunk_before_step"]


def test_raw_step_over_a_one_rank_branch_decided_alike(ranks: list[dict[str, Any]]) -> None:
    """Under ``no_backward_sync``, a raw SGD over a branch only rank 0's forward used writes it on rank 0 alone: the
    ranks decide alike (neither refuses; rank 1 has nothing to see), and both step. Guards against fixing
    ``subset_no_sync`` by refusing each written parameter whose own gradient was cleared, which refuses here on rank 0
    alone: a hang at the next all-reduce."""
    assert [rank["branch_raw_no_sync"].get("branch_written") for rank in ranks] == [True, False]
    outcomes = [REFUSED in _error(rank, "branch_raw_no_sync") for rank in ranks]
    assert outcomes[0] == outcomes[1], outcomes
    assert [rank["branch_raw_no_sync"].get("stepped") for rank in ranks] == [True, True]
