"""What the benchmarks record about the machine they ran on, and how they write it (shared by the scripts here)."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """The CPU's model name as ``/proc/cpuinfo`` gives it, else what :mod:`platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_json(path: Path, result: Any, **dumps_kwargs: Any) -> None:
    """Write ``result`` as indented JSON to ``path`` (creating its folder) and say where it went."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, **dumps_kwargs) + "\n")
    print(f"wrote {path}")
