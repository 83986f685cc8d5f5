"""O1 under FSDP2 keeps the memory FSDP saves: with the default half all-gather, autograd holds no half copies of the
weights between the forward and the backward (``benchmarks/fsdp_memory.py``: exact bytes, not a timing)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.warm_python import warm_python  # a process of its own, torch and Lightning imported

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("torch.distributed.fsdp")


def test_o1_half_gather_saves_no_weight_copies_for_backward(tmp_path):
    out = tmp_path / "fsdp_memory.json"
    done = subprocess.run(
        [warm_python(), str(ROOT / "benchmarks" / "fsdp_memory.py"), "--width", "256", "--layers", "4",
         "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    half, fp32, autocast = rows["O1 gather=half"], rows["O1 gather=fp32"], rows["fsdp + autocast"]
    # An FP32 gather under a cast (O1's policy, or torch.autocast) keeps a half copy of each matmul's weight alive
    # until the backward: about half the FP32 model's bytes. The half gather keeps activations only.
    assert fp32["fraction_of_model"] > 0.35 and autocast["fraction_of_model"] > 0.35
    assert half["fraction_of_model"] < 0.1
    assert rows["O2"]["fraction_of_model"] < 0.1  # O2's half compute copies are FSDP's to free, not kept
    assert half["saved_bytes"] * 5 < fp32["saved_bytes"]
