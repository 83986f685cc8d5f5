"""Overflow forensics under DDP: two CPU processes (gloo), a NaN in rank 1's batch only; rank 0's record names
rank 1 (tests/forensics_ddp_script.py runs the processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ddp_rank_zero_names_rank_one(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), MPX_OUT=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "forensics_ddp_script.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"exit code {proc.returncode}; stderr ends with:\n{proc.stderr[-3000:]}"
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    rank0 = results[0]
    assert rank0["skipped_steps"] == results[1]["skipped_steps"] == [1]
    record = rank0["record"]
    assert record["step"] == 1 and record["rank"] == 1 and record["ranks"] == [1]
    assert record["origin"] == "forward" and record["first_module"] == "net.inp"
    assert record["culprits"] == ["net.inp"] and set(record["modules"].values()) == {"nan"}
    assert len(rank0["messages"]) == 1 and "rank 1" in rank0["messages"][0] and "net.inp" in rank0["messages"][0]
    assert results[1]["messages"] == []  # only rank 0 logs
