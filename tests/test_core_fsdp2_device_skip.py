"""Hostile attacks on FSDP2's device skip (issue 41): a fused AdamW on a ``fully_shard``-ed model skips overflowed
steps on the device by default; every attack is held to the same run with ``skip_on_device=False`` (the host read).

Two gloo processes each: the core ``Amp`` loop (tests/hostile_fsdp_script.py: an inf in rank 0's own shard at the
first step, later, in the last micro-batch of an accumulation, with a clip, after ``unscale_`` and a clip, with a
fused AdamW beside an SGD, a checkpoint right after the overflow step, rank-0-only reads, ``on_floor="raise"`` at
bfloat16) and the Trainer (tests/hostile_lightning_fsdp_script.py: a per-step StepLR with accumulation and logging
every step under ModelParallelStrategy; FSDP1 with the default and with ``skip_on_device=True``).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.launch import rank_results, run_script

pytest.importorskip("torch.distributed.fsdp")

SAME = ["step0", "step1", "accum", "clip", "unscale_clip", "two_opt"]
CORE = [*SAME, "checkpoint", "rank0_reads", "floor", "floor_reads", "floor_last"]
POISON = {"step0": 0, "step1": 1, "accum": 2, "clip": 1, "unscale_clip": 1, "two_opt": 1}
TRAINER = ["sched", "fsdp1", "fsdp1_true"]
STEPS = 5
# What the two runs of a case must agree on, bit for bit.
KEYS = ("scales", "skipped", "last", "scalers", "weights", "adam_steps", "stepped", "errors")


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """One two-process launch (Lightning's launcher) for the Trainer cases and then the core engine's (``core/``, in
    the process group the Trainer started): a launch costs seconds of start-up on two cores."""
    out = tmp_path_factory.mktemp("hostile_fsdp")
    cases = [*TRAINER, *(f"core/{case}" for case in CORE)]
    run_script("hostile_lightning_fsdp_script.py", out, timeout=480, MPX_CASES=",".join(cases))
    return {case: rank_results(out, prefix=f"{case.replace('/', '_')}_") for case in cases}


@pytest.fixture(scope="module")
def core(launch: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    return {case: launch[f"core/{case}"] for case in CORE}


@pytest.fixture(scope="module")
def trainer(launch: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    return {case: launch[case] for case in TRAINER}


@pytest.mark.parametrize("case", SAME)
def test_one_rank_overflow_on_the_device_is_the_host_read(core, case):
    """rank 0's shard alone overflows (at the first step, where fused AdamW makes its state lazily; later; in an
    accumulation's last micro-batch; with a clip; after unscale_ and torch's clip; beside an SGD that reads on the
    host): both ranks skip the same step, with the host read's scales, record, weights and Adam step counts."""
    ranks = core[case]
    for rank in ranks:
        device, host = rank["device"], rank["host"]
        assert device["on_device"] == ([True, False] if case == "two_opt" else [True])
        assert host["on_device"] == [False] * len(device["on_device"])
        for key in KEYS:
            assert device[key] == host[key], key
        skipped = [[step == POISON[case]] * len(device["on_device"]) for step in range(STEPS)]
        if case == "two_opt":  # the AdamW's inf at step 1 (only it skips), the SGD's at step 3 (only it skips)
            skipped = [[step == 1, step == 3] for step in range(STEPS)]
        assert [[not s for s in step] for step in device["stepped"]] == skipped
        assert device["last"]["ranks"] == [0]
        assert device["last"]["parameters"] == ["3.weight"]
    assert ranks[0]["device"]["weights"] == ranks[1]["device"]["weights"]
    assert ranks[0]["device"]["last"] == ranks[1]["device"]["last"]  # merged across the ranks


def test_checkpoint_right_after_the_overflow_step_resumes_as_straight_through(core):
    """amp.state_dict() on every rank right after the overflow step (nothing read, no further backward), loaded with
    the model's and the optimizer's into a fresh run that continues: the straight host run's weights and scales."""
    for resumed, straight in zip(core["checkpoint"], core["step1"]):
        for run in ("device", "host"):
            for key in ("weights", "scales", "skipped", "scalers", "adam_steps"):
                assert resumed[run][key] == straight["host"][key], (run, key)


def test_rank_zero_only_reads_do_not_hang_and_the_ranks_still_agree(core):
    """bool(outcome), metrics(), skipped_steps, state_dict() and last_overflow on rank 0 alone: local reads (the script
    would time out on a collective). The merged record arrives at the next backward (documented); the rest of what rank
    0 saw is the host read's, and both ranks end as the host read."""
    rank0, rank1 = core["rank0_reads"]
    seen_device, seen_host = rank0["device"]["rank0_reads"], rank0["host"]["rank0_reads"]
    assert [s[:4] for s in seen_device] == [s[:4] for s in seen_host]
    assert [s[4] for s in seen_device] == [False, False, True, True, True]  # merged at the next backward
    for rank in (rank0, rank1):
        for key in ("scales", "skipped", "last", "scalers", "weights", "adam_steps"):
            assert rank["device"][key] == rank["host"][key], key
    assert rank0["device"]["weights"] == rank1["device"]["weights"]


@pytest.mark.parametrize("case", ["floor", "floor_reads", "floor_last"])
def test_floor_error_is_raised_on_both_ranks_together(core, case):
    """bfloat16 (static scale 1, its floor) with on_floor="raise" and rank 0's shard overflowing: the host read raises
    in that step; the device path raises on both ranks at the next backward (documented), or at
    settle_step_outcomes() after the last step, whatever rank 0 alone read before (floor_reads). Nothing hangs, the
    ranks agree, and the record is the host read's."""
    at = STEPS - 1 if case == "floor_last" else 2
    ranks = core[case]
    for rank in ranks:
        device, host = rank["device"], rank["host"]
        assert host["errors"] == [[at, "LossScaleFloorError"]]
        assert device["errors"] == [["settle" if case == "floor_last" else at + 1, "LossScaleFloorError"]]
        assert device["skipped"] == host["skipped"] == [1]
        assert device["last"] == host["last"] and device["last"]["ranks"] == [0]
        if case == "floor_last":  # nothing after the raise: the same weights
            assert device["weights"] == host["weights"]
    assert ranks[0]["device"]["weights"] == ranks[1]["device"]["weights"]


def test_trainer_step_lr_with_accumulation_logs_what_the_host_read_logs(trainer):
    """ModelParallelStrategy, fused AdamW, a per-step StepLR, accumulate_grad_batches=2, logging every step, an inf on
    rank 0 only: the same logged loss and LR, the same plugin metrics (the LR held on the skip), weights and scales.
    Another rank's module count (rank 1's mpx/overflow/net.0) arrives one metrics() later, merged at the next
    backward (documented); over the run it is the same."""
    for rank in trainer["sched"]:
        device, host = rank["device"], rank["host"]
        assert device["on_device"] == [True] and host["on_device"] == [False]
        for key in ("skipped", "global_step", "scalers", "params"):
            assert device[key] == host[key], key
        assert device["skipped"] == [1]
        assert len(device["seen"]) == len(host["seen"]) == 8

        def plain(seen: list[dict[str, float]]) -> list[dict[str, float]]:
            return [{k: v for k, v in s.items() if not k.startswith("mpx/overflow/")} for s in seen]

        def modules(seen: list[dict[str, float]]) -> float:
            return sum(v for s in seen for k, v in s.items() if k.startswith("mpx/overflow/"))

        assert plain(device["seen"]) == plain(host["seen"])
        assert modules(device["seen"]) == modules(host["seen"]) == 1.0


def test_fsdp1_takes_the_host_path_and_refuses_skip_on_device_true(trainer):
    """FSDP1 (FSDPStrategy) with a fused AdamW: nothing set, the host path, silently, as skip_on_device=False;
    skip_on_device=True: a ValueError naming the setting and FSDP1, on every rank (no hang)."""
    for rank in trainer["fsdp1"]:
        device, host = rank["device"], rank["host"]
        assert device["on_device"] == host["on_device"] == [False]
        assert device == host
    for rank in trainer["fsdp1_true"]:
        message = rank["device"]["error"]
        assert "skip_on_device=True" in message and "FSDP1" in message
