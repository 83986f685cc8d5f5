"""A launch that fails as tests/test_accelerate_fsdp.py's once did, for tests/test_core_misspelt_keywords.py: rank 1
raises early (its first error), then prints many lines (a teardown's noise) and fails again at its end; rank 0 prints a
little and ends cleanly. No process group: the point is what ``run_script`` quotes of each rank's stderr."""

from __future__ import annotations

import os
import sys
import traceback

rank = int(os.environ["RANK"])
print(f"rank {rank}: a warning before anything fails", file=sys.stderr)
if rank == 1:
    try:
        raise ValueError("the first error of rank 1 (cut off before)")
    except ValueError:
        traceback.print_exc()
    for line in range(int(os.environ.get("MPX_NOISE_LINES", "2000"))):
        print(f"rank 1: noise line {line} after the first error", file=sys.stderr)
    raise RuntimeError("the last error of rank 1")
print("rank 0: done", file=sys.stderr)
