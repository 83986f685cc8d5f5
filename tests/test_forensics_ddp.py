"""Overflow forensics under DDP: two CPU processes (gloo), a NaN in rank 1's batch only; rank 0's record names
rank 1 (tests/forensics_ddp_script.py runs the processes)."""

from __future__ import annotations

from tests.launch import rank_results, run_script


def test_ddp_rank_zero_names_rank_one(tmp_path):
    run_script("forensics_ddp_script.py", tmp_path, timeout=300)
    results = rank_results(tmp_path)
    rank0 = results[0]
    assert rank0["skipped_steps"] == results[1]["skipped_steps"] == [2]
    nan_step, explosion = rank0["records"]
    # A NaN in rank 1's batch: rank 1's forward, its first module.
    assert nan_step["step"] == 1 and nan_step["rank"] == 1 and nan_step["ranks"] == [1]
    assert nan_step["origin"] == "forward" and nan_step["first_module"] == "net.inp"
    assert nan_step["culprits"] == ["net.inp"] and set(nan_step["modules"].values()) == {"nan"}
    # A gradient explosion on rank 1: every rank's gradients hold it after DDP's averaging, but only rank 1's own
    # backward produced it.
    assert explosion["step"] == 3 and explosion["ranks"] == [1] and explosion["rank"] == 1
    assert explosion["origin"] == "backward" and explosion["backward_nonfinite"] is True
    assert explosion["modules"] == {"net.explode": "inf"} and explosion["culprits"] == ["net.explode"]
    assert results[1]["records"] == rank0["records"]  # every rank gathers the same merged records
    assert len(rank0["messages"]) == 2 and all("rank 1;" in m or m.endswith("rank 1") for m in rank0["messages"])
    assert "culprit net.inp (first non-finite output, nan)" in rank0["messages"][0]
    assert "culprit net.explode (inf); origin backward" in rank0["messages"][1]
    assert results[1]["messages"] == []  # only rank 0 logs
