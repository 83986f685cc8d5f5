"""What every benchmark script here shares: side-by-side timing, medians and spread, the machine, JSON and tables.

A script keeps its workload and its question; this module keeps the method:

* :func:`interleave` runs variants in rounds, the order rotated every round, so that a slow spell of a shared
  machine hits every variant of a round alike; :func:`paired` reads a ratio (or a difference) per round and
  summarises it, which is what the docs quote. :func:`per_call_us` times a callable, with an untimed set-up before
  each call when asked, on the clock a script picks (:data:`CLOCKS`).
* :class:`Spread` is a median with its interquartile range, and how the tables print it.
* :func:`machine` records what a figure depends on (device, CPU, versions, commit, load), so a result file says
  where it came from.
* :func:`markdown_table` renders rows for the terminal (padded) and for the docs (compact); :func:`save` writes a
  result as JSON and its tables as markdown beside it.

``benchmarks/`` is on ``sys.path`` when a script there runs, so the scripts ``import _harness``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
T = TypeVar("T")

#: Clocks a script can time with: wall time, the process's CPU time (less moved by other processes on a shared
#: machine), or this thread's CPU time (torch on one thread runs on it).
CLOCKS: dict[str, Callable[[], float]] = {
    "wall": time.perf_counter,
    "cpu": time.process_time,
    "thread": time.thread_time,
}


#: The ``peak_memory_kind`` of rows measured in one process that several variants share (``step.py --persistent``):
#: the process's peak, not the row's own, so no memory ratio or target is taken from it.
SHARED_PEAK = "process (persistent variants share it)"


def own_peak(row: Mapping[str, Any]) -> bool:
    """Whether a row's peak memory is its own (not a process's shared by several variants, :data:`SHARED_PEAK`)."""
    return row.get("peak_memory_kind") != SHARED_PEAK


# -- timing -----------------------------------------------------------------------------------------------------------
def rotation(names: Sequence[str], round_: int) -> list[str]:
    """``names`` rotated left by ``round_`` places: round r starts with the r-th variant."""
    shift = round_ % len(names) if names else 0
    return list(names[shift:]) + list(names[:shift])


def interleave(variants: Mapping[str, Callable[[], T]], rounds: int, *, rotate: bool = True,
               warmup_rounds: int = 0, after_round: Callable[[int, dict[str, list[T]]], None] | None = None,
               ) -> dict[str, list[T]]:
    """Run every variant once per round for ``rounds`` rounds and return each one's samples in round order.

    Args:
        variants: name -> a callable that runs the variant once and returns its sample (a time, or a record).
        rounds: how many samples each variant gets.
        rotate: rotate the order every round (a fixed order otherwise, for scripts whose method says so).
        warmup_rounds: rounds run first whose samples are dropped.
        after_round: called with the round's index and the samples so far after each kept round (progress lines).
    """
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be at least 1")
    names = list(variants)
    samples: dict[str, list[T]] = {name: [] for name in names}
    for index in range(warmup_rounds + rounds):
        for name in rotation(names, index) if rotate else names:
            value = variants[name]()
            if index >= warmup_rounds:
                samples[name].append(value)
        if after_round is not None and index >= warmup_rounds:
            after_round(index - warmup_rounds, samples)
    return samples


def per_call_us(fn: Callable[[], Any], calls: int, *, setup: Callable[[], Any] | None = None,
                clock: str = "wall") -> float:
    """Mean microseconds of ``fn`` over ``calls`` calls on ``clock``; ``setup`` (untimed) runs before each call."""
    if calls < 1:
        raise ValueError(f"calls={calls} must be at least 1")
    now = CLOCKS[clock]
    if setup is None:
        start = now()
        for _ in range(calls):
            fn()
        return (now() - start) / calls * 1e6
    total = 0.0
    for _ in range(calls):
        setup()
        start = now()
        fn()
        total += now() - start
    return total / calls * 1e6


# -- statistics -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spread:
    """A median and its interquartile range (``low`` and ``high``: the first and third quartiles)."""

    median: float
    low: float
    high: float

    @property
    def iqr(self) -> list[float]:
        """The interquartile range as ``[low, high]`` (the layout of the result files)."""
        return [self.low, self.high]

    def text(self, spec: str = ".3f", suffix: str = "") -> str:
        """``1.032x (1.010-1.060)`` for ``spec=".3f", suffix="x"``."""
        return f"{self.median:{spec}}{suffix} ({self.low:{spec}}-{self.high:{spec}})"


def spread(values: Iterable[float]) -> Spread:
    """Median and interquartile range of ``values`` (a single value is its own range)."""
    data = sorted(values)
    if not data:
        raise ValueError("spread() of no values")
    if len(data) == 1:
        return Spread(data[0], data[0], data[0])
    q1, _, q3 = statistics.quantiles(data, n=4)
    return Spread(statistics.median(data), q1, q3)


def iqr_width(values: Sequence[float]) -> float:
    """Third quartile minus first (0 below four values, where quartiles say little)."""
    if len(values) < 4:
        return 0.0
    s = spread(values)
    return s.high - s.low


def paired(a: Sequence[float], b: Sequence[float], *, difference: bool = False) -> Spread:
    """The spread of ``a[i] / b[i]`` (or ``a[i] - b[i]``) over the rounds: each ratio from two samples taken close
    in time, so that a change of load between rounds cancels out."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired samples must be non-empty and of one length, got {len(a)} and {len(b)}")
    return spread(x - y if difference else x / y for x, y in zip(a, b))


# -- the machine ------------------------------------------------------------------------------------------------------
def cpu_model() -> str:
    """The CPU's model name as ``/proc/cpuinfo`` gives it, else what :mod:`platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> list[float] | None:
    """The 1, 5 and 15-minute load averages, where the system has them."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def git(*args: str) -> str | None:
    """``git args`` in the repository holding this folder (stripped output), or ``None`` when git cannot say."""
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def machine(device_type: str = "cpu", *, device: str | None = None) -> dict[str, Any]:
    """What a figure depends on: the device, the CPU, the library versions, the commit and the load.

    Args:
        device_type: ``"cpu"`` or ``"cuda"`` (on CUDA, ``device`` defaults to the GPU's name).
        device: the device's name as the result should record it (default: the GPU's or the CPU's model).
    """
    import torch

    import lightning_mpx

    if device is None:
        device = torch.cuda.get_device_name() if device_type == "cuda" else cpu_model()
    commit = git("rev-parse", "HEAD")
    return {
        "device": device,
        "device_type": device_type,
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "lightning": _version("lightning"),
        "accelerate": _version("accelerate"),
        "lightning_mpx": lightning_mpx.__version__,
        # The package measured: a before/after run puts another copy on PYTHONPATH.
        "package_path": str(Path(lightning_mpx.__file__).parent),
        "git_commit": commit,
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")) if commit else None,
        "loadavg": load_average(),
    }


def command(argv: Sequence[str] | None = None) -> str:
    """The command that ran this script, as typed from the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        shown = str(script.relative_to(ROOT))
    except ValueError:
        shown = str(script)
    return " ".join(["python", shown, *(sys.argv[1:] if argv is None else argv)])


# -- tables and files -------------------------------------------------------------------------------------------------
def cell(value: Any, spec: str = "") -> str:
    """A table cell: ``-`` for a missing value, numbers by ``spec``, anything else as text."""
    if value is None:
        return "-"
    if spec and isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:{spec}}"
    return str(value)


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[Any]], *, align: str | None = None,
                   pad: bool = False) -> str:
    """A markdown table of ``rows`` (cells already formatted, or ``None`` for ``-``).

    Args:
        columns: the header.
        rows: one sequence of cells per row, as long as ``columns``.
        align: one letter per column, ``l`` or ``r`` (default: every column but the first right-aligned).
        pad: pad the cells to their column's width (for a terminal); the docs' tables are compact.
    """
    align = align or "l" + "r" * (len(columns) - 1)
    if len(align) != len(columns):
        raise ValueError(f"align={align!r} has {len(align)} letters for {len(columns)} columns")
    body = [[cell(c) for c in row] for row in rows]
    for row in body:
        if len(row) != len(columns):
            raise ValueError(f"a row of {len(row)} cells for {len(columns)} columns: {row}")
    if not pad:
        rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
        return "\n".join(["| " + " | ".join(columns) + " |", rule, *("| " + " | ".join(r) + " |" for r in body)])
    widths = [max(3, *(len(x) for x in col)) for col in zip(columns, *body)]  # a rule needs three characters
    rules = [("-" * (w - 1) + ":") if a == "r" else "-" * w for a, w in zip(align, widths)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if a == "r" else c.ljust(w) for c, a, w in zip(cells, align, widths)) + " |"

    return "\n".join([line(columns), "| " + " | ".join(rules) + " |", *(line(r) for r in body)])


def run_child(cmd: Sequence[str], what: str, timeout: float) -> dict[str, Any]:
    """Run a script's child process (``cmd``: the interpreter, the script, its arguments) with the repository on
    ``PYTHONPATH`` and warnings off, and return the last JSON object it printed. Raises ``RuntimeError`` naming
    ``what`` with the end of its stderr when it fails or prints none, ``subprocess.TimeoutExpired`` past ``timeout``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONWARNINGS", "ignore")
    done = subprocess.run(list(cmd), capture_output=True, text=True, env=env, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"{what} failed (exit {done.returncode}):\n{tail}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def write_json(path: Path, result: Any, **dumps_kwargs: Any) -> None:
    """Write ``result`` as indented JSON to ``path`` (creating its folder) and say where it went."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, **dumps_kwargs) + "\n")
    print(f"wrote {path}")


def save(path: Path, result: dict[str, Any], tables: Mapping[str, str] | None = None, **dumps_kwargs: Any) -> None:
    """Write ``result`` as JSON to ``path`` and, when there are ``tables`` (title -> markdown), them to the same
    name with ``.md``: the run's tables ready for the docs, with the command and the machine they came from."""
    write_json(path, result, **dumps_kwargs)
    if not tables:
        return
    where = result.get("device") or cpu_model()
    lines = [f"# {result.get('benchmark', path.stem)}", "", f"`{result.get('command') or command()}` on {where}; "
             f"torch {result.get('torch', '?')}; commit {result.get('git_commit') or '?'}.", ""]
    for title, table in tables.items():
        lines += [f"## {title}", "", table, ""] if title else [table, ""]
    md = path.with_suffix(".md")
    md.write_text("\n".join(lines))
    print(f"wrote {md}")


def default_out(name: str) -> Path:
    """``benchmarks/results/<name>.json``: where a script's real run goes unless ``--out`` says otherwise."""
    return RESULTS / f"{name}.json"
