"""The GPU suite's ``plugin`` part (benchmarks/plugin_overhead.py on CUDA) runs its code path on CPU with ``--check``
and records the rows; it is not part of ``all``. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.warm_python import warm_python

ROOT = Path(__file__).resolve().parents[1]


def test_plugin_part_check_writes_its_suite_file(tmp_path):
    # From the warm interpreter of tests/warm_python.py, as test_gpu_suite.py's ``all --check``: the script and its
    # plugin_overhead.py child a process of their own each, torch and Lightning already imported.
    done = subprocess.run(
        [warm_python(), str(ROOT / "benchmarks" / "gpu_suite.py"), "plugin", "--check", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "suite_plugin.json").read_text())
    assert data["suite"]["part"] == "plugin" and data["suite"]["status"] == "complete" and data["suite"]["check"]
    rows = data["result"]["check"]["rows"]
    assert [r["variant"] for r in rows] == ["bf16-mixed", "plugin-O2", "core-O2"]
    assert data["suite"]["commands"][0]["command"].startswith("python benchmarks/plugin_overhead.py --out")
    assert "measure nothing" in (tmp_path / "suite_plugin.md").read_text()
