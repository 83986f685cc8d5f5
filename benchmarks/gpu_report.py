"""Merge GPU results into ``docs/benchmarks.md``'s GPU tables and say, target by target, whether each is met.

Reads every ``*.json`` (and ``pytest*.txt``) directly inside the given folders: what ``benchmarks/gpu_suite.py``
writes (``suite_<part>.json``) and the raw JSON of ``benchmarks/unscale.py``, ``benchmarks/step.py`` and
``benchmarks/convergence.py``; anything else (host profiles, partial files) is listed as not read.

    python benchmarks/gpu_report.py benchmarks/results/gpu/2026-11-23-h100             # prints, fills the doc
    python benchmarks/gpu_report.py DIR... [--doc docs/benchmarks.md | --no-doc] [--json PATH]

When several files hold the same row (an unscale set/dtype/variant, a pytest run), the later file wins: later by the
``created`` time a suite file records, else by the time of the git commit that last touched the file, else by its
modification time; files with equal times count in the order of their names, so a re-run saved as
``<name>_<suffix>.json`` is later than ``<name>.json``. The report says which rows were superseded. Step-time ratios
are never mixed across files: each model's targets come from the latest file that holds both rows of a ratio. Rows
measured round by round in one process (``step.py --one-process``: ``step_ms_runs``) are judged on the median of the
per-round throughput ratios, which pairs each round's two rows and so leaves out the host's drift between rounds
(one variant's rounds spread by up to 46 % on the machines lent); other rows on the ratio of their medians.

The targets (issue 14): fused passes at >= 80 % of the copy bandwidth; unscale+clip >= 1.5x torch's ``unscale_`` +
``clip_grad_norm_``; the O2 master-gradient path >= 2.5x torch's ops; never slower on the small-tensor sweep; O2 >=
1.05x Lightning's "16-mixed" throughput, O1 within 3 % of it (also with ``gradient_clip_val=1.0`` on both Trainers,
the ``-clip`` rows), O2's peak memory below FP32's; issue 25: O1 bfloat16
within 3 % of "bf16-mixed", the core O1 loop >= 0.97x a plain ``torch.autocast`` (+ ``GradScaler``) loop in both
dtypes, and the same four with O1 on ``CastTable.autocast_aligned(device)`` (the ``-aligned`` rows); with
``AdamW(fused=True)`` on both sides and ``skip_on_device=True`` on ours (the ``-fused`` and ``-devskip`` rows: no host
read of the overflow flag, as ``GradScaler`` with a fused optimizer), the plugin at O1 within 3 % of "16-mixed" and of
"bf16-mixed", at O2 >= 1.05x "16-mixed", and the core O1 loop >= 0.97x torch's fused autocast loop (+ ``GradScaler``
for fp16) in both dtypes; issue 41, under FSDP on one GPU (``fsdp_step.GOALS``): the plugin at O2 >= 1.05x the
throughput of Lightning's FSDP2 "bf16-mixed" and <= 0.8x its peak memory, at O1 >= 0.97x (GPT-2 small and a 1.3B
GPT), at O2 >= 1.05x FSDP1's "bf16-mixed", the Accelerate adapter at O2 >= 1.05x Accelerate's "bf16" under the same
FSDP2 plugin; each on its per-round paired ratio, and "met" only when two runs agree. A target with no measurement is
"not measured"; no figure is ever estimated. The host syncs per normal step are stated, not judged.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

import fsdp_step  # benchmarks/ is on sys.path when a script runs

# The targets and their verdicts live in _gpu_targets; every name is re-exported here, where gpu_suite.py and
# the tests look for it (gpu_report.MET, gpu_report.step_targets, ...).
from _gpu_targets import (  # noqa: F401
    DISAGREE,
    MET,
    MODELS,
    NOT_MEASURED,
    NOT_MET,
    ONE_RUN,
    STATED,
    TARGET_SETS,
    TESTS_SELECTION,
    Verdict,
    _fsdp_figure,
    _min_row,
    _paired_rounds,
    _row,
    _sources_of,
    _sync_figure,
    _unique,
    all_targets,
    fidelity_targets,
    fsdp_targets,
    step_targets,
    tests_targets,
    unscale_targets,
)
from _harness import markdown_table

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- gpu-report:begin -->", "<!-- gpu-report:end -->"

SET_ORDER = ("gpt2-124m", "bert-base", "resnet50", "gpt-1.3b")
DTYPE_ORDER = ("float32", "float16", "bfloat16")
VARIANT_ORDER = ("unscale", "unscale+norm", "unscale+clip", "O2 grads", "O2 copy")


# -- sources --------------------------------------------------------------------------------------------------------
@dataclass
class Source:
    """One results file: what kind of result it holds, when it was made and what it says."""

    path: Path
    kind: str  # "unscale", "step", "fidelity", "tests"
    data: dict[str, Any]
    time: float
    command: str | None  # recorded by gpu_suite; None for a raw script's JSON
    check: bool = False  # made by ``gpu_suite.py --check``: exercises the code, measures nothing
    status: str = "-"  # a suite part's status ("complete", or "incomplete"/"running" when it was cut short)
    order: int = 0  # position in the chronological order (set by load_sources)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def device(self) -> str | None:
        return self.data.get("device")


@dataclass
class Skipped:
    path: Path
    reason: str


@dataclass
class Sources:
    """Everything read from the folders, in chronological order."""

    items: list[Source] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)

    def of(self, kind: str) -> list[Source]:
        return [s for s in self.items if s.kind == kind]


def classify(data: Any) -> tuple[str | None, str]:
    """The kind of result a parsed JSON file holds, or ``None`` and why it is not read."""
    if not isinstance(data, dict):
        return None, "not a JSON object"
    suite = data.get("suite")
    if isinstance(suite, dict) and "part" in suite:
        return suite["part"], ""
    if data.get("partial"):
        return None, "partial file of an interrupted run (the complete file, if any, is read instead)"
    if data.get("benchmark") == "step":
        return "step", ""
    if data.get("benchmark") == "convergence":
        return "fidelity", ""
    if data.get("benchmark") == "fsdp_step":
        return "fsdp", ""
    if "copy_bandwidth_GBps" in data and isinstance(data.get("rows"), list):
        return "unscale", ""
    return None, "not a result the report reads"


_PYTEST_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed|warnings?)")


def parse_pytest_summary(text: str) -> dict[str, Any] | None:
    """Counts from pytest's last summary line (``82 passed, 71 skipped, 697 deselected in 37.81s``), if any."""
    for line in reversed(text.strip().splitlines()):
        if re.search(r" in [\d.]+s", line) and _PYTEST_SUMMARY.search(line):
            counts = {kind.rstrip("s") if kind.startswith(("error", "warning")) else kind: int(n)
                      for n, kind in _PYTEST_SUMMARY.findall(line)}  # fmt: skip
            failed = [m.group(1) for m in re.finditer(r"^(?:FAILED|ERROR) (\S+)", text, re.MULTILINE)]
            return {"summary": line.strip("= "), "counts": counts, "failed_tests": failed}
    return None


def file_time(path: Path) -> float:
    """When ``path`` was made: the time of the git commit that last touched it when it is committed and unchanged,
    else its modification time."""
    try:
        status = subprocess.run(["git", "status", "--porcelain", "--", path.name], cwd=path.parent,
                                capture_output=True, text=True, timeout=20)  # fmt: skip
        if status.returncode == 0 and not status.stdout.strip():
            log = subprocess.run(["git", "log", "-1", "--format=%ct", "--", path.name], cwd=path.parent,
                                 capture_output=True, text=True, timeout=20)  # fmt: skip
            if log.returncode == 0 and log.stdout.strip():
                return float(log.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return path.stat().st_mtime


def load_sources(paths: Sequence[Path]) -> Sources:
    """Read the result files in ``paths`` (folders, or files) and order them from earliest to latest."""
    files: list[Path] = []
    for p in paths:
        if p.is_dir():
            files += sorted(p.glob("*.json")) + sorted(p.glob("pytest*.txt"))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such file or folder")
    sources = Sources()
    for path in files:
        if path.suffix == ".txt":
            parsed = parse_pytest_summary(path.read_text(errors="replace"))
            if parsed is None:
                sources.skipped.append(Skipped(path, "no pytest summary line"))
                continue
            data = {"pytest": {**parsed, "command": None, "log": path.name}, "checks": [], "syncs": {}}
            sources.items.append(Source(path, "tests", data, file_time(path), None))
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            sources.skipped.append(Skipped(path, f"unreadable JSON ({error})"))
            continue
        kind, why = classify(data)
        if kind is None:
            sources.skipped.append(Skipped(path, why))
            continue
        suite = data.get("suite")
        if suite is not None:
            created = suite.get("created")
            when = datetime.fromisoformat(created).timestamp() if created else file_time(path)
            result = dict(data.get("result") or {})
            result.setdefault("device", suite.get("environment", {}).get("device"))
            source = Source(path, kind, result, when, suite.get("command"), check=bool(suite.get("check")),
                            status=suite.get("status", "-"))
            source.data["environment"] = suite.get("environment", {})
        else:
            created = data.get("created")  # written by the scripts that record it (gpu_host_profile.py)
            when = datetime.fromisoformat(created).timestamp() if isinstance(created, str) else file_time(path)
            command = data.get("command")  # the scripts that record it (step.py, gpu_host_profile.py)
            source = Source(path, kind, data, when, command if isinstance(command, str) else None,
                            check=data.get("check") is True)  # fsdp_step.py --check records it
        sources.items.append(source)
    sources.items.sort(key=lambda s: (s.time, s.path.stem))
    for index, source in enumerate(sources.items):
        source.order = index
    devices = {s.device for s in sources.items if s.device}
    if len(devices) > 1:
        raise ValueError(
            f"the files come from {len(devices)} devices ({', '.join(sorted(devices))}); a report covers one device: "
            "pass the folders of one device at a time."
        )
    return sources


def environment(sources: Sources) -> dict[str, str]:
    """Device and library versions, as the files record them (several values joined when they differ)."""
    found: dict[str, set[str]] = {}
    for s in sources.items:
        env = dict(s.data.get("environment") or {})
        for key in ("device", "torch", "triton", "lightning", "cuda"):
            value = env.get(key) or s.data.get(key)
            if value:
                found.setdefault(key, set()).add(str(value))
    return {k: ", ".join(sorted(v)) for k, v in found.items()}


def reconstructed_command(source: Source) -> str:
    """The command recorded with a suite file, or the one a raw file's own settings imply."""
    if source.command:
        return source.command
    d = source.data
    if source.kind == "unscale":
        rows = d.get("rows", [])
        sets = _unique(r["set"] for r in rows if not r["set"].startswith("sweep"))
        dtypes = _unique(r["dtype"] for r in rows if not r["set"].startswith("sweep"))
        sweep = any(r["set"].startswith("sweep") for r in rows)
        return (f"python benchmarks/unscale.py --sets {','.join(sets)} --dtypes {','.join(dtypes)}"
                f"{'' if sweep else ' --no-sweep'} --repeats {d.get('repeats')} --warmup {d.get('warmup')}")
    if source.kind == "step":
        variants = _unique(r["variant"] for r in d.get("rows", []))
        models = list(d.get("specs", {})) or _unique(r["model"] for r in d.get("rows", []))
        command = (f"python benchmarks/step.py --device {d.get('device_type', 'cuda')} --model "
                   f"{models[0] if len(models) == 1 else 'all'} --steps {d.get('steps')} --warmup {d.get('warmup')}")
        if d.get("repeats", 1) != 1:
            command += f" --repeats {d['repeats']}"
        if len(variants) < 16:
            command += " --variants " + " ".join(variants)
        return command
    if source.kind == "fsdp":
        return d.get("command") or "python benchmarks/fsdp_step.py --device cuda"
    if source.kind == "fidelity":
        c = d.get("config", {})
        return (f"python benchmarks/convergence.py --accelerator {c.get('accelerator')} --steps {c.get('steps')} "
                f"--seeds {' '.join(map(str, c.get('seeds', [])))} --levels {' '.join(c.get('levels', []))} "
                f"--dtypes {' '.join(c.get('dtypes', []))}")
    return f"python -m pytest -q -k \"{TESTS_SELECTION}\" tests"


# -- merging --------------------------------------------------------------------------------------------------------
@dataclass
class Merged:
    """The latest row of each kind, with where it came from and what it replaced."""

    unscale: list[dict[str, Any]]
    superseded: dict[str, dict[str, int]]  # earlier file -> {later file: rows replaced}
    step_runs: list[Source]  # every step file, latest last
    fidelity: Source | None
    tests: Source | None
    fsdp: Source | None = None  # the latest fsdp_step.py run (its table)
    fsdp_runs: list[Source] = field(default_factory=list)  # every fsdp_step.py run, latest last (the goals)


def merge(sources: Sources) -> Merged:
    """Row by row, the latest measurement; step and fidelity files stay whole (their ratios are within one run)."""
    latest: dict[tuple[str, str, str], dict[str, Any]] = {}
    superseded: dict[str, dict[str, int]] = {}
    for s in sources.of("unscale"):  # chronological: a later file overwrites
        bw = s.data.get("copy_bandwidth_GBps")
        for row in s.data.get("rows", []):
            key = (row["set"], row["dtype"], row["variant"])
            if key in latest:
                old = latest[key]["source"]
                superseded.setdefault(old, {}).setdefault(s.name, 0)
                superseded[old][s.name] += 1
            latest[key] = {**row, "source": s.name, "copy_bandwidth_GBps": row.get("copy_bandwidth_GBps", bw)}
    rows = sorted(latest.values(), key=_unscale_order)
    tests = sources.of("tests")
    fidelity = sources.of("fidelity")
    fsdp = sources.of("fsdp")
    return Merged(rows, superseded, sources.of("step"), fidelity[-1] if fidelity else None,
                  tests[-1] if tests else None, fsdp[-1] if fsdp else None, fsdp)


def _unscale_order(row: dict[str, Any]) -> tuple[Any, ...]:
    name = row["set"]
    if name.startswith("sweep"):
        count, size = (int(x) for x in name.split()[1].split("x"))
        return (1, count, size, 0, 0)
    position = SET_ORDER.index(name) if name in SET_ORDER else len(SET_ORDER)
    return (0, position, name, _index(DTYPE_ORDER, row["dtype"]), _index(VARIANT_ORDER, row["variant"]))


def _index(order: Sequence[str], value: str) -> int:
    return order.index(value) if value in order else len(order)


# -- tables (also used by gpu_suite for each part's markdown) -----------------------------------------------------
def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:{spec}}{suffix}"


def unscale_table(rows: list[dict[str, Any]], with_source: bool = True) -> str:
    """Per parameter set, dtype and variant: fused and torch times, speed-up, bandwidth and share of copy."""
    columns = ["set", "dtype", "variant", "tensors", "fused ms", "torch ms", "speed-up", "fused GB/s", "% of copy"]
    cells = [[r["set"], r["dtype"], r["variant"], r["tensors"], f"{r['fused_ms']:.3f}", f"{r['torch_ms']:.3f}",
              f"{r['speedup']:.2f}x", _fmt(r.get("fused_GBps"), ".0f"), _fmt(r.get("pct_of_copy_bandwidth"), ".1f")]
             + ([r.get("source", "")] if with_source else []) for r in rows if not r["set"].startswith("sweep")]
    return markdown_table(columns + ["source"] * with_source, cells, align="lll" + "r" * 6 + "l" * with_source)


def sweep_table(rows: list[dict[str, Any]]) -> str:
    """The many-small-tensors sweep as a grid: speed-up of the fused path over torch's (unscale+clip, FP32)."""
    sweep = [r for r in rows if r["set"].startswith("sweep")]
    if not sweep:
        return ""
    grid: dict[int, dict[int, dict[str, Any]]] = {}
    for r in sweep:
        count, size = (int(x) for x in r["set"].split()[1].split("x"))
        grid.setdefault(count, {})[size] = r
    sizes = sorted({s for row in grid.values() for s in row})
    cells = [[f"{count:,}", *(f"{c['speedup']:.2f}x ({c['fused_ms']:.3f} / {c['torch_ms']:.3f} ms)" if c else None
                              for c in (grid[count].get(s) for s in sizes))] for count in sorted(grid)]
    return markdown_table(["tensors \\ elements each", *(f"{s:,}" for s in sizes)], cells, align="r" * (1 + len(sizes)))


def step_table(source: Source, model: str) -> str:
    """One model's rows of one step run, with the ratios computed within that run."""
    rows = [r for r in source.data.get("rows", []) if r["model"] == model]
    names = ("lightning-16-mixed", "lightning-bf16-mixed", "fp32", "fabric-16-mixed", "lightning-16-mixed-clip",
             "lightning-16-mixed-fused", "lightning-bf16-mixed-fused")
    refs = {name: _row(source, model, name) for name in names}

    def ratio(r: dict[str, Any], name: str, key: str) -> str:
        ref = refs[name]
        return f"{r[key] / ref[key]:.3f}x" if ref else "-"

    fabric = refs["fabric-16-mixed"] is not None  # a Fabric row's own reference: Fabric's "16-mixed" loop
    # The -clip and -fused rows' references: Lightning's AMP with the same clip, or with the same fused AdamW; a
    # column each when measured.
    own = [name for name in ("lightning-16-mixed-clip", "lightning-16-mixed-fused", "lightning-bf16-mixed-fused")
           if refs[name] is not None]
    return markdown_table(
        ["variant", "step ms (median)", "samples/s", "peak MiB", "throughput vs 16-mixed", "throughput vs bf16-mixed",
         *(["throughput vs Fabric 16-mixed"] if fabric else []),
         *(f"throughput vs {name.removeprefix('lightning-')}" for name in own), "peak memory vs FP32",
         "skipped steps"],
        [[r["variant"], f"{r['step_ms_median']:.2f}", f"{r['samples_per_second']:.1f}",
          f"{r['peak_memory_bytes'] / 2**20:.0f}", ratio(r, "lightning-16-mixed", "samples_per_second"),
          ratio(r, "lightning-bf16-mixed", "samples_per_second"),
          *([ratio(r, "fabric-16-mixed", "samples_per_second")] if fabric else []),
          *(ratio(r, name, "samples_per_second") for name in own),
          ratio(r, "fp32", "peak_memory_bytes"), r.get("skipped_steps", "-")] for r in rows])  # fmt: skip


def fidelity_table(source: Source) -> str:
    cells = []
    for r in source.data.get("rows", []):
        ratio = r.get("ratio_to_O0")
        cells.append([r["variant"], _fmt(r.get("val_loss_mean"), ".4f"),
                      "-" if ratio is None else f"{(ratio - 1) * 100:+.3f}%",
                      "/".join(map(str, r.get("skipped_steps", []))),
                      "/".join(f"{s:g}" for s in r.get("final_loss_scale", [])), r.get("verdict", "")])
    return markdown_table(["variant", "final val loss", "vs O0", "skipped steps", "final scale", "verdict"], cells,
                          align="lrrrrl")


def tests_table(source: Source) -> str:
    """pytest's summary, the suite's own checks and the sync counts."""
    data = source.data
    pytest = data.get("pytest") or {}
    lines = [f"`{pytest.get('command') or reconstructed_command(source)}`: **{pytest.get('summary', 'no summary')}**"]
    if pytest.get("failed_tests"):
        lines.append("Failed: " + ", ".join(f"`{t}`" for t in pytest["failed_tests"]))
    checks = data.get("checks") or []
    if checks:
        lines += ["", markdown_table(["check", "result", "detail"], [
            [c["name"], "pass" if c.get("passed") else "FAIL", c.get("detail", "")] for c in checks], align="lll")]
    syncs = data.get("syncs") or {}
    if syncs:
        lines += ["", markdown_table(["loop", "host syncs per normal step", "where"], [
            [name, None if e.get("per_step") is None else ", ".join(map(str, e["per_step"])),
             "; ".join(e.get("locations", [])) or e.get("note", "")] for name, e in syncs.items()], align="lrl")]
    return "\n".join(lines)


def fsdp_table(source: Source) -> str:
    """The rows of ``benchmarks/fsdp_step.py`` per group: time, throughput, own peak memory, the paired per-round
    throughput ratio to the group's reference and the memory ratio (``fsdp_step.table``)."""
    return fsdp_step.table(source.data.get("rows", []))


def verdict_table(verdicts: list[Verdict]) -> str:
    return markdown_table(["target", "scope", "verdict", "figure", "source"], [
        [v.target, v.scope, f"**{v.status}**" if v.status in (MET, NOT_MET) else v.status, v.figure, v.source or "-"]
        for v in verdicts], align="lllll")


# -- the report -----------------------------------------------------------------------------------------------------
def render(sources: Sources, merged: Merged, verdicts: list[Verdict], folders: Sequence[Path]) -> str:
    """The markdown that goes between the GPU markers of ``docs/benchmarks.md``."""
    env = environment(sources)
    out = ["*Generated by `python benchmarks/gpu_report.py " + " ".join(_rel(f) for f in folders) + "`; do not "
           "edit by hand between the markers.*", ""]
    if any(s.check for s in sources.items):
        out += ["**These inputs come from `gpu_suite.py --check`: they exercise the code on CPU and measure "
                "nothing.**", ""]
    out.append(f"Device: **{env.get('device', 'unknown')}**; torch {env.get('torch', '?')}, triton "
               f"{env.get('triton', '?')}, Lightning {env.get('lightning', '?')}, CUDA {env.get('cuda', '?')}.")
    out += ["", "### Targets", "", verdict_table(verdicts), ""]
    out += ["\"not measured\" means no file holds the rows the target needs. The host-sync count is stated, not "
            "judged: `Amp.step` reads the overflow flag once per step by design (as `GradScaler.step` does).", ""]
    out += ["### Sources", "", markdown_table(["file", "holds", "status", "command"], [
        *([s.name, s.kind, s.status, f"`{reconstructed_command(s)}`"
           + ("" if s.command else " (not recorded in the file: rebuilt from its settings)")] for s in sources.items),
        *([sk.path.name, f"not read: {sk.reason}", "-", "-"] for sk in sources.skipped)], align="llll")]
    if merged.superseded:
        out += ["", "Superseded (the later file's rows are used): " + "; ".join(
            f"{old}: {n} rows by {new}" for old, news in merged.superseded.items() for new, n in news.items()) + "."]
    if merged.unscale:
        bws = _unique(f"{r['copy_bandwidth_GBps']:.0f}" for r in merged.unscale if r.get("copy_bandwidth_GBps"))
        out += ["", "### Fused unscale kernels against torch (`benchmarks/unscale.py`)", "",
                f"Copy bandwidth measured in each run: {', '.join(bws)} GB/s. Speed-up = torch ms / fused ms; "
                "\"% of copy\" = the bytes the variant must move at the floor / fused time, against the copy "
                "bandwidth of the same run. bfloat16 gradients unscaled in place: torch has no CUDA check-and-unscale "
                "op for them, so their torch column is lightning_mpx's foreach twin (FP32 multiply + infinity "
                "norm).", "", unscale_table(merged.unscale)]
        sweep = sweep_table(merged.unscale)
        if sweep:
            sources_sweep = _sources_of([r for r in merged.unscale if r["set"].startswith("sweep")])
            out += ["", f"Small-tensor sweep, unscale+clip, FP32, speed-up (fused / torch ms); {sources_sweep}:", "",
                    sweep]
    for model in MODELS:  # per model, the latest run first; ratios only within a run
        runs = [s for s in reversed(merged.step_runs) if any(r["model"] == model for r in s.data.get("rows", []))]
        for rank, source in enumerate(runs):
            spec = source.data.get("specs", {}).get(model, {})
            when = "latest run" if rank == 0 else "earlier run"
            out += ["", f"### Training step, {model}: {when} (`{source.name}`)", "",
                    f"`{reconstructed_command(source)}`; {_spec_text(model, spec)}; {source.data.get('steps')} "
                    f"timed steps after {source.data.get('warmup')} warm-up; peak memory = "
                    "`torch.cuda.max_memory_allocated`.", "", step_table(source, model)]
    if merged.fidelity is not None:
        out += ["", f"### Fidelity on CUDA (`{merged.fidelity.name}`)", "",
                f"`{reconstructed_command(merged.fidelity)}`", "", fidelity_table(merged.fidelity)]
    if merged.tests is not None:
        out += ["", f"### CUDA tests (`{merged.tests.name}`)", "", tests_table(merged.tests)]
    if merged.fsdp is not None:
        out += ["", f"### Sharded training, FSDP on one GPU (`{merged.fsdp.name}`)", "",
                f"`{reconstructed_command(merged.fsdp)}`; the rows of a group in one process, rounds rotated; x "
                "throughput: the median [lowest, highest] of the per-round paired ratios to the group's reference; "
                "peak memory: each row's own (at rest + above its round's start, `torch.cuda.max_memory_allocated`).",
                "", fsdp_table(merged.fsdp)]
    return "\n".join(out).rstrip() + "\n"


def _spec_text(model: str, spec: dict[str, Any]) -> str:
    if not spec:
        return "model size not recorded"
    if model == "gpt":
        return (f"GPT-2-style, vocabulary {spec['vocab']}, sequence {spec['seq']}, width {spec['dim']}, "
                f"{spec['layers']} layers, batch {spec['batch']}")
    return (f"ResNet, width {spec['width']}, blocks {spec['blocks']}, {spec['image']}x{spec['image']} images, "
            f"batch {spec['batch']}")


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def fill_doc(doc: Path, body: str) -> None:
    """Replace what lies between the GPU markers of ``doc`` with ``body``."""
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{doc} has no '{BEGIN}' ... '{END}' markers; add them where the GPU tables belong.")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{body}{END}{tail}")


def print_verdicts(verdicts: list[Verdict]) -> None:
    width = max(len(v.target) for v in verdicts)
    for v in verdicts:
        print(f"{v.target:<{width}}  [{v.scope}]  {v.status.upper() if v.status == MET else v.status}: {v.figure}"
              + (f"  ({v.source})" if v.source else ""))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path, metavar="DIR", help="result folders (or files)")
    parser.add_argument("--doc", type=Path, default=DOC, help=f"markdown file to fill (default: {_rel(DOC)})")
    parser.add_argument("--no-doc", action="store_true", help="print only; leave the markdown file alone")
    parser.add_argument("--json", type=Path, default=None, help="also write the verdicts and merged rows here")
    args = parser.parse_args(argv)
    try:
        sources = load_sources(args.folders)
    except (FileNotFoundError, ValueError) as error:
        parser.error(str(error))
    if not sources.items:
        parser.error(f"no result files in {', '.join(map(str, args.folders))}")
    merged = merge(sources)
    verdicts = all_targets(merged)
    for s in sources.skipped:
        print(f"not read: {s.path.name} ({s.reason})")
    for old, news in merged.superseded.items():
        for new, n in news.items():
            print(f"superseded: {n} rows of {old} by {new}")
    print_verdicts(verdicts)
    body = render(sources, merged, verdicts, args.folders)
    if not args.no_doc:
        fill_doc(args.doc, body)
        print(f"wrote the GPU tables of {args.doc}")
    result = {
        "environment": environment(sources),
        "sources": [{"file": str(s.path), "kind": s.kind, "command": reconstructed_command(s),
                     "recorded_command": s.command is not None, "check": s.check, "status": s.status}
                    for s in sources.items],
        "verdicts": [vars(v) for v in verdicts],
        "unscale_rows": merged.unscale,
    }  # fmt: skip
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
