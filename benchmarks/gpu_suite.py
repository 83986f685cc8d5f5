"""The GPU suite: every GPU claim of lightning_mpx, in parts that each fit in one command on a lent GPU.

A GPU is lent to some sessions only, for minutes, 10 at most per command. Each part runs on its own, well under
9 minutes on an H100, and writes ``suite_<part>.json`` (device, torch/triton/Lightning versions, the commands, the
results) and ``suite_<part>.md`` (its table) into ``--out DIR``, after every sub-run, so a part cut off by the
device's time limit still leaves what it measured. Every subprocess runs under a timeout.

    python benchmarks/gpu_suite.py tests    --out DIR  # pytest -k "triton or cuda or compile_o1", CUDA checks (1.5 min)
    python benchmarks/gpu_suite.py unscale  --out DIR  # benchmarks/unscale.py, one run per parameter set (~1.5 min)
    python benchmarks/gpu_suite.py step --model gpt    --out DIR   # benchmarks/step.py --device cuda (~6 min)
    python benchmarks/gpu_suite.py step --model resnet --out DIR   # (~4.5 min)
    python benchmarks/gpu_suite.py fidelity --out DIR   # benchmarks/convergence.py O0/O1/O2, seed 0 (~0.5 min)
    python benchmarks/gpu_suite.py fsdp --out DIR       # benchmarks/fsdp_step.py --device cuda, 4 groups (~6 min)
    python benchmarks/gpu_suite.py all --check          # every part's code path on CPU, tiny sizes (the test suite)
    python benchmarks/gpu_suite.py plugin --out DIR     # plugin_overhead.py --device cuda (~5 min; not in all)

Parts:

* ``tests``: ``pytest -k "triton or cuda or compile_o1" tests`` (compiled O1 too: CI runs only torch 2.13, the GPU
  machine an older torch), then this file's own CUDA checks in a child process: the fused kernels against the
  reference backend on CUDA tensors (unscale in place and into FP32 masters, with norm and clipping, the overflow
  flag, the master-to-model copy), the loss scaler's backoff and growth on the device, ``MasterWeights`` and ``Amp``
  O2 steps with the fused backend against the foreach one, a Lightning ``MixedPrecisionPlugin`` fit, and the host
  syncs of a normal (non-overflow) step counted with ``torch.cuda.set_sync_debug_mode("warn")`` for ``Amp`` O1/O2 and
  for torch's ``GradScaler`` loop. ``Amp.step`` reads the overflow flag once per step by design (as
  ``GradScaler.step`` does): the count is reported, not judged.
* ``unscale``: ``benchmarks/unscale.py`` per parameter set (GPT-2 124M, GPT 1.3B, ResNet-50 with the small-tensor
  sweep, BERT-base; FP32/FP16/BF16), each run measuring the copy bandwidth it is compared with.
* ``step``: ``benchmarks/step.py --device cuda`` at real sizes (GPT-2 small at sequence 512, a CIFAR ResNet-18):
  first the rows the targets need (:data:`GOAL_ROWS`) together in one process (``step.py --one-process
  --persistent``: each row's model, Trainer or loop built once and warmed up for 10 steps, then ``--repeats`` rounds,
  default 6, of 30 more steps each, a Trainer continuing with ``fit`` and a raised ``max_steps``, the order rotated
  every round; the rows are the medians of the rounds; ``--fresh`` builds every round afresh), then every other
  variant once, one child process each (on the GPT model two more, last: a Lightning Fabric loop with
  ``FabricMixedPrecisionPlugin("O2")`` and with Fabric's own "16-mixed"); stops starting new runs when ``--budget``
  runs out. The first after the goal rows are the ``-clip`` rows (``gradient_clip_val=1.0``), then the fused AdamW
  rows (:data:`DEVICE_SKIP_ROWS`: Lightning's "16-mixed" and "bf16-mixed" with ``AdamW(fused=True)`` against the
  plugin at O1/O2 with ``skip_on_device=True``, torch's fused autocast loops against
  ``core-O1-devskip-{fp16,bf16}``). A ``--variants`` list without a goal row is measured round by round in one
  process, as the goal rows are: ``step --variants`` with the rows of :data:`DEVICE_SKIP_ROWS` gives their targets
  per-round ratios.
* ``fidelity``: ``benchmarks/convergence.py --accelerator gpu --seeds 0 --levels O0 O1 O2`` (200 steps).
* ``fsdp``: ``benchmarks/fsdp_step.py --device cuda`` (``--budget`` 330 s): on one GPU (one rank), four comparisons,
  the rows of each in one process, round by round, the order rotated, with per-round paired ratios: the plugin at
  O1/O2 (fp16, bf16) against Lightning's FSDP2 "bf16-mixed" (``ModelParallelStrategy``) on GPT-2 small and on a 1.3B
  GPT (sequence 1024), against FSDP1 "bf16-mixed" (``FSDPStrategy``; "16-mixed" for information), and the Accelerate
  adapter at O2 against Accelerate's "bf16" under ``FullyShardedDataParallelPlugin(fsdp_version=2)``: throughput and
  each row's own peak memory (``--fsdp-groups`` picks some).
* ``plugin`` (run on its own, not part of ``all``): ``benchmarks/plugin_overhead.py --device cuda``, the plugin's
  per-step host time against Lightning's "16-mixed" and the core loop, twice: the tiny ResNet-18 topology (every
  step host-bound; with the host reads per step) and the real CIFAR ResNet-18 (width 64, batch 128, 32x32 images).

``--check`` runs the same code on CPU with tiny sizes and triton's interpreter (``TRITON_INTERPRET=1``): pytest
only collects, step runs 1 step of a few small variants, fidelity is ``--quick``. It measures nothing; its files say
so. Merge the parts' files into ``docs/benchmarks.md`` with ``python benchmarks/gpu_report.py DIR``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

if "--check" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (the kernels are decorated at import)

import _harness  # noqa: E402  (benchmarks/ is on sys.path when a script runs)
import fsdp_step  # noqa: E402
import gpu_report  # noqa: E402
from _cuda_checks import run_checks  # noqa: E402  (the tests part's child)
from _harness import write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
PARTS = ("tests", "unscale", "step", "fidelity", "fsdp")
CHECK_DEVICE = "cpu (gpu_suite --check: exercises the code, measures nothing)"

#: The rows of the fused AdamW targets: Lightning's "16-mixed" and "bf16-mixed" and torch's autocast loops with
#: ``AdamW(fused=True)`` (``GradScaler`` skips on the device at fp16), the plugin and the core O1 loop with
#: ``skip_on_device=True`` on the same fused AdamW. Given alone to ``--variants``, they are measured together round by
#: round in one process, as the goal rows are.
DEVICE_SKIP_ROWS = (
    "lightning-16-mixed-fused", "mpx-O2-fp16-fused", "mpx-O1-fp16-fused", "lightning-bf16-mixed-fused",
    "mpx-O1-bf16-fused", "torch-autocast-fused-fp16", "core-O1-devskip-fp16", "torch-autocast-fused-bf16",
    "core-O1-devskip-bf16",
)  # fmt: skip
#: step.py's variants, the ones the targets and the report's ratios need first (a part cut short keeps them).
STEP_ORDER = (
    # issue 25's O1 speed verdicts first: plugin O1/O2 against "16-mixed" and "bf16-mixed", the core O1 loop against
    # torch.autocast's (on CUDA, O1 with no table given runs CastTable.for_device("cuda"): autocast alone)
    "lightning-16-mixed", "mpx-O1-fp16", "mpx-O2-fp16", "torch-autocast-fp16", "core-O1-fp16",
    "lightning-bf16-mixed", "mpx-O1-bf16", "torch-autocast-bf16", "core-O1-bf16",
    # core O1 bf16 against the bf16 loop with the same skip guarantee (torch's check, the step skipped on a hit)
    "torch-autocast-checked-bf16",
    # gradient_clip_val=1.0, the habit of most fine-tuning recipes: the plugin's clip (its fused pass on CUDA)
    "lightning-16-mixed-clip", "mpx-O2-fp16-clip", "mpx-O1-fp16-clip",
    # AdamW(fused=True): the plugin and the core loop with skip_on_device=True (no host read of the overflow flag)
    # against GradScaler with the same optimizer ("16-mixed") and bare bf16 autocast ("bf16-mixed": no check at all)
    *DEVICE_SKIP_ROWS,
    "fp32", "mpx-O1-fp16-compiled", "lightning-16-mixed-compiled", "mpx-O2-bf16", "mpx-O3-fp16", "mpx-O3-bf16",
    "core-O2-fp16", "core-O2-bf16", "loop-fp32",
    # the explicit autocast-aligned table: on CUDA the same table as the default rows now, so late
    "mpx-O1-fp16-aligned", "core-O1-fp16-aligned", "mpx-O1-bf16-aligned", "core-O1-bf16-aligned",
    # AdamW(fused=True) with Amp reading the flag on the host (their references, torch's fused loops, are above)
    "core-O1-fused-fp16", "core-O1-fused-bf16",
    # unscale_backend="foreach": the unscale backend's share of the step
    "core-O1-foreach-fp16", "core-O1-foreach-bf16",
    # O2 on torch's kernels chosen by hand (the default since stop 34 for a step without a clip)
    "core-O2-foreach-fp16",
    "fabric-16-mixed", "fabric-mpx-O2-fp16",
)  # fmt: skip
#: The rows issue 25's verdicts compare (the first of STEP_ORDER): run for every round of ``--repeats``.
GOAL_ROWS = STEP_ORDER[:10]
#: Variants measured on the GPT model only: the Fabric plugin at O2 against Fabric's own "16-mixed".
GPT_ONLY = ("fabric-16-mixed", "fabric-mpx-O2-fp16")
#: --check: per model a plugin row or a loop measured in one process (the goal rows' path) and, on the ResNet, a loop
#: that is not a goal row in a child process of its own (the other rows' path); step.py's own tests run the other
#: variants, the report's tests the ratios.
STEP_CHECK = {"gpt": ("mpx-O2-fp16",), "resnet": ("core-O1-bf16", "loop-fp32")}
#: unscale.py runs: (sets, sweep?); the issue's sets first, the sweep with the small-tensor ResNet set.
UNSCALE_RUNS = (("gpt2-124m", False), ("gpt-1.3b", False), ("resnet50", True), ("bert-base", False))
#: fsdp_step.py's --budget on a GPU (seconds for its groups together; about 6 minutes with the process's start).
FSDP_BUDGET = 330.0


# -- environment and files ------------------------------------------------------------------------------------------
def environment(check: bool) -> dict[str, Any]:
    """What the results depend on: device, library versions, commit (the harness's record of the machine)."""
    import torch

    cuda = torch.cuda.is_available() and not check
    return _harness.machine("cuda" if cuda else "cpu", device=CHECK_DEVICE if check else None)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _shown(argv: list[str]) -> str:
    """A command as someone would type it from the repository root."""
    shown = ["python" if a == sys.executable else os.path.relpath(a, ROOT) if a.startswith(str(ROOT)) else a
             for a in argv]  # fmt: skip
    return shlex.join(shown)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kill a child started in its own session, and whatever it started."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


class Part:
    """The record of one part: its commands and results, rewritten to DIR after every change."""

    def __init__(self, name: str, out: Path, check: bool, command: str, env: dict[str, Any]) -> None:
        self.name, self.out, self.check = name, out, check
        self.started = time.perf_counter()
        self.suite: dict[str, Any] = {
            "part": name.split("_")[0],
            "name": name,
            "command": command,
            "check": check,
            "created": _now(),
            "finished": None,
            "status": "running",
            "wall_seconds": 0.0,
            "environment": env,
            "commands": [],
        }
        self.result: dict[str, Any] = {}
        self.save()  # a part cut off before its first sub-run ends still says it started

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def timeout(self, args: argparse.Namespace, default: float) -> float:
        """Seconds for the next subprocess: ``--timeout`` (else ``default``), cut to what is left of ``--budget``
        (at least 30 s), so that a hung child cannot carry the part past the device's per-command limit."""
        wanted = args.timeout or default
        return min(wanted, max(args.budget - self.elapsed, 30.0)) if args.budget else wanted

    def run(self, argv: list[str], timeout: float, log: Path) -> dict[str, Any]:
        """Run ``argv`` from the repository root under ``timeout`` (its whole process group killed at the limit),
        its output into ``log``; record and return what happened."""
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        if self.check:
            env["TRITON_INTERPRET"] = "1"
        log.parent.mkdir(parents=True, exist_ok=True)
        record: dict[str, Any] = {"command": _shown(argv), "log": os.path.relpath(log, self.out), "timeout_s": timeout}
        print(f"[{self.name}] $ {record['command']}  (timeout {timeout:.0f} s)", flush=True)
        start = time.perf_counter()
        with log.open("w") as sink:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
            try:
                record["returncode"] = proc.wait(timeout=max(timeout, 1.0))
                record["status"] = "ok" if record["returncode"] == 0 else "failed"
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                record["returncode"], record["status"] = None, "timeout"
            except BaseException:  # interrupted or terminated: its own session would outlive us otherwise
                _kill_group(proc)
                record.update(returncode=None, status="interrupted", seconds=round(time.perf_counter() - start, 2))
                self.suite["commands"].append(record)
                self.save("interrupted")
                raise
        record["seconds"] = round(time.perf_counter() - start, 2)
        tail = log.read_text(errors="replace").strip().splitlines()[-6:]
        print("\n".join(f"    {line}" for line in tail), flush=True)
        print(f"[{self.name}] {record['status']} in {record['seconds']:.0f} s", flush=True)
        self.suite["commands"].append(record)
        self.save()
        return record

    def failed(self) -> bool:
        return self.suite["status"] != "complete"

    def save(self, status: str | None = None) -> None:
        if status is not None:
            self.suite["status"] = status
            self.suite["finished"] = _now()
        self.suite["wall_seconds"] = round(self.elapsed, 1)
        write_json(self.out / f"suite_{self.name}.json", {"suite": self.suite, "result": self.result}, default=str)
        (self.out / f"suite_{self.name}.md").write_text(self.markdown())

    def markdown(self) -> str:
        """This part's table, rendered by the report's own functions (what gpu_report.py reads, shown)."""
        s = self.suite
        env = s["environment"]
        lines = [f"# GPU suite: {self.name} ({s['status']})", "",
                 f"`{s['command']}` on {env['device']}; torch {env['torch']}, triton {env['triton']}, "
                 f"Lightning {env['lightning']}; commit {env['git_commit'] or '?'}; {s['wall_seconds']:.0f} s.", ""]
        if self.check:
            lines += ["**--check: ran on CPU with tiny sizes; these numbers measure nothing.**", ""]
        lines += ["| command | status | seconds |", "|---|---|---:|"]
        lines += [f"| `{c['command']}` | {c['status']} | {c['seconds']:.0f} |" for c in s["commands"]]
        source = gpu_report.Source(self.out / f"suite_{self.name}.json", s["part"], self.result, 0.0, s["command"],
                                   self.check)  # fmt: skip
        body = ""
        if s["part"] == "unscale" and self.result.get("rows"):
            body = gpu_report.unscale_table(self.result["rows"], with_source=False)
            sweep = gpu_report.sweep_table(self.result["rows"])
            body += f"\n\nSmall-tensor sweep (unscale+clip, speed-up):\n\n{sweep}" if sweep else ""
        elif s["part"] == "step" and self.result.get("rows"):
            body = gpu_report.step_table(source, self.result["model"])
        elif s["part"] == "fidelity" and self.result.get("rows"):
            body = gpu_report.fidelity_table(source)
        elif s["part"] == "tests" and self.result:
            body = gpu_report.tests_table(source)
        elif s["part"] == "fsdp" and self.result.get("rows"):
            body = gpu_report.fsdp_table(source)
        return "\n".join(lines) + ("\n\n" + body if body else "") + "\n"


# -- tests ----------------------------------------------------------------------------------------------------------
def part_tests(args: argparse.Namespace, env: dict[str, Any]) -> Part:
    part = Part("tests", args.out, args.check, args.command, env)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", gpu_report.TESTS_SELECTION, "tests"]
    if args.check:
        # On CPU the CUDA tests skip: collecting one file of them proves the command and the selection work (the
        # whole tree took 15 s of the suite's time).
        argv[-1:] = ["--collect-only", "tests/test_unscale_triton.py"]
    record = part.run(argv, part.timeout(args, 360), args.out / "raw" / "tests_pytest.txt")
    summary = gpu_report.parse_pytest_summary((args.out / "raw" / "tests_pytest.txt").read_text(errors="replace"))
    if summary is None and args.check:
        text = (args.out / "raw" / "tests_pytest.txt").read_text(errors="replace").strip().splitlines()
        summary = {"summary": text[-1] if text else "", "counts": {}, "failed_tests": []}
    part.result["pytest"] = {**(summary or {"summary": "no summary line", "counts": {}, "failed_tests": []}),
                             "command": record["command"], "returncode": record["returncode"],
                             "log": record["log"]}  # fmt: skip
    part.save()
    checks_out = args.out / "raw" / "tests_checks.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "_checks", "--out", str(checks_out)]
    record = part.run(argv + (["--check"] if args.check else []), part.timeout(args, 300),
                      args.out / "raw" / "tests_checks.log")
    if checks_out.exists():
        checks = json.loads(checks_out.read_text())
        part.result["checks"], part.result["syncs"] = checks["checks"], checks["syncs"]
    else:
        part.result["checks"] = [{"name": "CUDA checks child", "passed": False,
                                  "detail": f"{record['status']}; see {record['log']}"}]  # fmt: skip
        part.result["syncs"] = {}
    ok = all(c["status"] == "ok" for c in part.suite["commands"]) and all(c["passed"] for c in part.result["checks"])
    part.save("complete" if ok else "failed")
    return part




# -- unscale --------------------------------------------------------------------------------------------------------
def part_unscale(args: argparse.Namespace, env: dict[str, Any]) -> Part:
    part = Part("unscale", args.out, args.check, args.command, env)
    raws: list[tuple[str, dict[str, Any]]] = []
    if args.check:
        part.run([sys.executable, str(HERE / "unscale.py"), "--check"], part.timeout(args, 240),
                 args.out / "raw" / "unscale_check.log")  # fmt: skip
        # unscale.py --check writes no JSON: produce the raw file it would write from the same functions, on CPU.
        raw_path = args.out / "raw" / "unscale_check.json"
        write_json(raw_path, _unscale_check_raw())
        raws.append((os.path.relpath(raw_path, args.out), json.loads(raw_path.read_text())))
        part.result = merge_unscale(raws)
        part.save()
    else:
        for sets, sweep in UNSCALE_RUNS:
            if args.budget and part.elapsed > args.budget:
                part.suite.setdefault("not_run", []).append(sets)
                continue
            raw_path = args.out / "raw" / f"unscale_{sets}.json"
            argv = [sys.executable, str(HERE / "unscale.py"), "--sets", sets, "--out", str(raw_path)]
            argv += [] if sweep else ["--no-sweep"]
            part.run(argv, part.timeout(args, 240), args.out / "raw" / f"unscale_{sets}.log")
            if raw_path.exists():
                raws.append((os.path.relpath(raw_path, args.out), json.loads(raw_path.read_text())))
                part.result = merge_unscale(raws)
                part.save()
    ok = raws and all(c["status"] == "ok" for c in part.suite["commands"]) and not part.suite.get("not_run")
    part.save("complete" if ok else "incomplete")
    return part


def merge_unscale(raws: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One unscale result from several unscale.py runs; each row keeps its own run's copy bandwidth."""
    rows = []
    for name, raw in raws:
        for row in raw["rows"]:
            rows.append({**row, "copy_bandwidth_GBps": raw["copy_bandwidth_GBps"], "run": name})
    first = raws[0][1] if raws else {}
    return {
        "device": first.get("device"),
        "torch": first.get("torch"),
        "triton": first.get("triton"),
        "cuda": first.get("cuda"),
        "copy_bandwidth_GBps": [raw["copy_bandwidth_GBps"] for _, raw in raws],
        "repeats": first.get("repeats"),
        "warmup": first.get("warmup"),
        "runs": [name for name, _ in raws],
        "rows": rows,
    }


def _unscale_check_raw() -> dict[str, Any]:
    """unscale.py's pipeline (run_case, copy_bandwidth) on CPU in the interpreter, tiny shapes, written in the
    layout of its GPU JSON so that the merge and the report read it as they read a GPU run."""
    import argparse as ap

    import torch
    import triton
    import unscale

    device = torch.device("cpu")
    case = ap.Namespace(warmup=0, repeats=1, workspace={"chunk_size": 64, "block_size": 16, "num_warps": 1})
    bw = unscale.copy_bandwidth(device, 0, 1, nbytes=1 << 20)
    # the set names the report judges, each with the same rows (tiny shapes, run once: they measure nothing)
    measured = [r for dtype in (torch.float32, torch.float16)
                for r in unscale.run_case([(3, 5), (7,), (130,)], dtype, device, case, bw)]  # fmt: skip
    rows = [{"set": name, **r} for name in gpu_report.TARGET_SETS for r in measured]
    rows += [{"set": "sweep 3x4", **r}
             for r in unscale.run_case([(4,)] * 3, torch.float32, device, case, bw, only="unscale+clip")]
    return {"benchmark": "unscale", **_harness.machine(device=CHECK_DEVICE), "triton": triton.__version__,
            "copy_bandwidth_GBps": bw, "repeats": 1, "warmup": 0, "rows": rows}  # fmt: skip


# -- step -----------------------------------------------------------------------------------------------------------
def step_variants(model: str, chosen: list[str] | None = None) -> list[str]:
    """The step part's variants for ``model``, in :data:`STEP_ORDER` (``chosen``: a subset)."""
    return [v for v in STEP_ORDER if v in (chosen or STEP_ORDER) and (model == "gpt" or v not in GPT_ONLY)]


def step_schedule(variants: list[str], repeats: int) -> tuple[list[str], list[str]]:
    """The step part's runs: the goal rows among ``variants`` (all of them if none is), measured together in one
    process over ``repeats`` rounds (``step.py --one-process``: the order rotated every round, so that a drift of
    the machine weighs on every row alike), then the other variants, one child process each, once. One 20-step run
    per variant moved by up to 11 % between processes on an H200 (2026-11-26), more than the 3 % goals: the
    verdicts' rows share a process."""
    goals = [v for v in variants if v in GOAL_ROWS] or list(variants)
    return goals, [v for v in variants if v not in goals]


def part_step(args: argparse.Namespace, env: dict[str, Any], model: str) -> Part:
    """step.py's variants for one model: the goal rows in one process (rounds rotated), then the other variants one
    child process each (step.py's own child); saved after each."""
    import step

    part = Part(f"step_{model}", args.out, args.check, args.command, env)
    device, size = ("cpu", "tiny") if args.check else ("cuda", "real")
    steps, warmup = (1, 0) if args.check else (args.steps, args.warmup)
    variants = list(STEP_CHECK[model]) if args.check else step_variants(model, args.variants)
    spec = step.SPECS[(model, size)]
    repeats = 1 if args.check else args.repeats
    part.result = {"benchmark": "step", "model": model, "device": env["device"], "device_type": device,
                   "size": size, "specs": {model: vars(spec)}, "steps": steps, "warmup": warmup, "repeats": repeats,
                   "method": ("the goal rows in one process, " + ("each run built afresh" if args.fresh else
                              "each built once and trained on") + ", rounds rotated; the others a child process each"),
                   "rows": [], "targets": [], "failed": {}, "not_run": []}  # fmt: skip
    goals, others = step_schedule(variants, repeats)
    rounds_file = args.out / "raw" / f"step_{model}_rounds.json"
    argv = [sys.executable, str(HERE / "step.py"), "--one-process", *([] if args.fresh else ["--persistent"]),
            "--device", device, "--model", model, "--size", size, "--steps", str(steps), "--warmup", str(warmup),
            "--repeats", str(repeats), "--threads", "1", "--out", str(rounds_file), "--variants", *goals]  # fmt: skip
    record = part.run(argv, part.timeout(args, 420), args.out / "raw" / f"step_{model}_rounds.log")
    rounds = json.loads(rounds_file.read_text()) if rounds_file.exists() else {}  # saved after every round
    goal_rows = rounds.get("rows", [])
    part.result["rounds_done"] = rounds.get("rounds_done", 0)
    measured = {r["variant"] for r in goal_rows}
    for variant in goals:
        if variant not in measured:
            if record["status"] == "failed":
                part.result["failed"][variant] = f"step.py --one-process failed; see {record['log']}"
            else:
                part.result["not_run"].append(variant)
    samples: dict[str, list[dict[str, Any]]] = {}
    durations: list[float] = []

    def publish() -> None:
        rows = goal_rows + [step.combine(runs, spec.batch) for runs in samples.values()]
        step.add_ratios(rows)
        part.result["rows"], part.result["targets"] = rows, step.check_targets(rows, device)
        part.save()

    publish()
    for variant in others:
        remaining = args.budget - part.elapsed if args.budget else 1e9
        if remaining < 1.2 * max(durations, default=0.0) or remaining < 30:
            part.result["not_run"].append(variant)  # it would not finish inside the budget: keep what is done
            continue
        child_timeout = part.timeout(args, 150)
        step_args = step.build_parser().parse_args(
            ["--device", device, "--model", model, "--size", size, "--steps", str(steps), "--warmup", str(warmup),
             "--child-timeout", str(child_timeout)])  # fmt: skip
        child = [sys.executable, str(HERE / "step.py"), "--_child", variant, "--model", model, "--size", size,
                 "--steps", str(steps), "--warmup", str(warmup), "--device", device, "--threads", "1"]  # as step.py
        record = {"command": _shown(child), "log": None, "timeout_s": child_timeout}
        print(f"[{part.name}] {variant} (timeout {child_timeout:.0f} s)", flush=True)
        start = time.perf_counter()
        try:
            samples.setdefault(variant, []).append(step._spawn(variant, model, step_args, steps))
            record.update(status="ok", returncode=0)
        except subprocess.TimeoutExpired:
            record.update(status="timeout", returncode=None)
        except RuntimeError as error:  # the child failed: step.py's message has the end of its stderr
            record.update(status="failed", returncode=1)
            part.result["failed"][variant] = str(error)[-2000:]
        except BaseException:  # interrupted or terminated (subprocess.run has killed the child): keep the rows
            record.update(status="interrupted", returncode=None, seconds=round(time.perf_counter() - start, 2))
            part.suite["commands"].append(record)
            part.save("interrupted")
            raise
        record["seconds"] = round(time.perf_counter() - start, 2)
        durations.append(record["seconds"])
        part.suite["commands"].append(record)
        print(f"[{part.name}] {variant}: {record['status']} in {record['seconds']:.0f} s"
              + (f", {samples[variant][-1]['step_ms_median']:.2f} ms/step" if record["status"] == "ok" else ""),
              flush=True)  # fmt: skip
        publish()
    ok = all(c["status"] == "ok" for c in part.suite["commands"]) and not part.result["not_run"]
    part.save("complete" if ok else "incomplete")
    return part


# -- fidelity -------------------------------------------------------------------------------------------------------
def part_fidelity(args: argparse.Namespace, env: dict[str, Any]) -> Part:
    part = Part("fidelity", args.out, args.check, args.command, env)
    raw = args.out / "raw" / ("convergence_check.json" if args.check else "convergence_cuda.json")
    argv = [sys.executable, str(HERE / "convergence.py"), "--out", str(raw)]
    if args.check:  # 4 steps of a tiny model on CPU, bfloat16 (float16 matmuls crawl on CPUs)
        argv += ["--quick", "--accelerator", "cpu", "--levels", "O0", "O2", "--dtypes", "bfloat16", "--plot", ""]
    else:
        argv += ["--accelerator", "gpu", "--seeds", "0", "--levels", "O0", "O1", "O2",
                 "--plot", str(args.out / "convergence_cuda.png")]  # fmt: skip
    part.run(argv, part.timeout(args, 420), args.out / "raw" / "fidelity.log")
    partial = raw.with_suffix(".partial.json")
    if raw.exists():
        part.result = json.loads(raw.read_text())
    elif partial.exists():  # cut off: the finished runs, not yet summarised
        import convergence

        runs = json.loads(partial.read_text())["runs"]
        part.result = {"benchmark": "convergence", "partial": True, "runs": runs,
                       "rows": convergence.summarise(runs, 0.02) if any(r["variant"] == "O0" for r in runs) else []}
    if part.result:
        part.result["device"] = env["device"]
    ok = raw.exists() and part.suite["commands"][-1]["status"] == "ok"
    part.save("complete" if ok else "incomplete")
    return part


# -- fsdp -----------------------------------------------------------------------------------------------------------
def part_fsdp(args: argparse.Namespace, env: dict[str, Any]) -> Part:
    """benchmarks/fsdp_step.py on CUDA, every group (``--fsdp-groups``: some) in one process, its own ``--budget``
    a minute under the part's; ``--check``: its code path on CPU (two rows of each group, tiny models, 2 rounds)."""
    part = Part("fsdp", args.out, args.check, args.command, env)
    raw = args.out / "raw" / ("fsdp_step_check.json" if args.check else "fsdp_step_cuda.json")
    argv = [sys.executable, str(HERE / "fsdp_step.py"), "--out", str(raw), "--groups", *args.fsdp_groups]
    argv += ["--fused"] if args.fsdp_fused else []
    if args.check:
        argv += ["--check", "--budget", "0"]
    else:  # the groups share out what is left once the process has started (imports, the process group)
        budget = max(min(FSDP_BUDGET, args.budget - 60), 120) if args.budget else FSDP_BUDGET
        argv += ["--device", "cuda", "--budget", f"{budget:.0f}"]
    part.run(argv, part.timeout(args, FSDP_BUDGET + 150), args.out / "raw" / "fsdp.log")
    if raw.exists():  # rewritten after every round: a part cut short keeps the rounds it finished
        part.result = json.loads(raw.read_text())
        part.result["device"] = env["device"]
    ok = raw.exists() and part.suite["commands"][-1]["status"] == "ok" and not part.result.get("failed")
    part.save("complete" if ok else "incomplete")
    return part


# -- plugin ---------------------------------------------------------------------------------------------------------
#: plugin_overhead.py runs: (name, arguments); on CUDA float16 against "16-mixed".
PLUGIN_RUNS = (
    ("tiny", ["--count-syncs"]),
    ("resnet18", ["--width", "64", "--batch", "128", "--image", "32", "--repeats", "5"]),
)


def part_plugin(args: argparse.Namespace, env: dict[str, Any]) -> Part:
    """benchmarks/plugin_overhead.py on CUDA (--check: its code path on CPU, a few steps of two variants)."""
    part = Part("plugin", args.out, args.check, args.command, env)
    runs = [("check", ["--steps", "3", "--warmup", "1", "--repeats", "1", "--variants", "plugin-O2", "core-O2"])] \
        if args.check else PLUGIN_RUNS  # fmt: skip
    for name, extra in runs:
        if args.budget and part.elapsed > args.budget:
            part.suite.setdefault("not_run", []).append(name)
            continue
        raw = args.out / "raw" / f"plugin_overhead_{name}.json"
        argv = [sys.executable, str(HERE / "plugin_overhead.py"), "--out", str(raw), *extra]
        argv += [] if args.check else ["--device", "cuda"]
        part.run(argv, part.timeout(args, 300), args.out / "raw" / f"plugin_{name}.log")
        if raw.exists():
            part.result[name] = json.loads(raw.read_text())
            part.save()
    ok = all(c["status"] == "ok" for c in part.suite["commands"]) and not part.suite.get("not_run")
    part.save("complete" if ok else "incomplete")
    return part


# -- main -----------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=(*PARTS, "plugin", "all"),
                        help="which part to run ('all': one after the other, all but plugin)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for the results (required on GPU; --check uses a temporary folder)")
    parser.add_argument("--check", action="store_true", help="run the code paths on CPU, tiny sizes, no GPU")
    parser.add_argument("--model", choices=("gpt", "resnet", "all"), default="all",
                        help="step: which model ('all' runs both; on a 10-minute device, one per command)")
    parser.add_argument("--variants", nargs="+", choices=STEP_ORDER, default=None, metavar="VARIANT",
                        help="step: a subset of step.py's variants")
    parser.add_argument("--steps", type=int, default=30, help="step: timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=10, help="step: warm-up steps per variant and round")
    parser.add_argument("--repeats", type=int, default=6,
                        help="step: rounds over the goal rows, in one process (the order rotated every round); saved "
                             "after every round, so a part cut short keeps the rounds it finished")
    parser.add_argument("--fresh", action="store_true",
                        help="step: build the goal rows' model, Trainer or loop afresh for every round (step.py "
                             "--one-process) instead of once, trained on round after round (--persistent, the "
                             "default); fresh runs give each row its own peak memory")
    parser.add_argument("--fsdp-groups", nargs="+", choices=tuple(fsdp_step.GROUPS), default=list(fsdp_step.GROUPS),
                        metavar="GROUP", help="fsdp: which of fsdp_step.py's comparisons (default: all, "
                        f"{', '.join(fsdp_step.GROUPS)}; ~6 min together on an H100)")
    parser.add_argument("--fsdp-fused", action="store_true",
                        help="fsdp: AdamW(fused=True) in every row (the plugin's FSDP2 rows skip on the device)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per subprocess (default: 360 pytest, 300 checks, 240 unscale run, 420 step "
                             "goal rows, 150 other step variant, 420 fidelity, 300 plugin run)")  # fmt: skip
    parser.add_argument("--budget", type=float, default=480.0,
                        help="seconds per part after which no new sub-run starts (default 480; 0: no limit)")
    return parser


def main(argv: list[str] | None = None) -> int:
    raw_argv = sys.argv[1:] if argv is None else argv
    if raw_argv[:1] == ["_checks"]:  # the tests part's child: python gpu_suite.py _checks --out FILE [--check]
        child = argparse.ArgumentParser(prog="gpu_suite.py _checks")
        child.add_argument("--out", type=Path, required=True)
        child.add_argument("--check", action="store_true")
        opts = child.parse_args(raw_argv[1:])
        return run_checks(opts.out, opts.check)
    parser = build_parser()
    args = parser.parse_args(raw_argv)
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats} must be at least 1")
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps={args.steps} must be at least 1 and --warmup={args.warmup} at least 0")
    if args.timeout is not None and args.timeout <= 0:
        parser.error(f"--timeout={args.timeout} must be a positive number of seconds")
    if args.budget < 0:
        parser.error(f"--budget={args.budget} must be 0 (no limit) or a positive number of seconds")
    if args.variants and args.part not in ("step", "all"):
        parser.error(f"--variants applies to the step part, not to {args.part!r}")
    import torch

    if not args.check and not torch.cuda.is_available():
        parser.error(f"the {args.part!r} part needs a CUDA device and none is available; "
                     "--check runs the code paths on CPU (it measures nothing)")  # fmt: skip
    if args.out is None and not args.check:
        parser.error("--out DIR is required: the folder the results go to (e.g. $OUT on the device)")
    args.command = _shown([sys.executable, str(Path(__file__).resolve()), *raw_argv])
    # A device's time limit sends SIGTERM: unwind (children killed, files already written) instead of dying mid-write.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    with contextlib.ExitStack() as stack:
        if args.out is None:
            args.out = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-suite-check-")))
        args.out.mkdir(parents=True, exist_ok=True)
        env = environment(args.check)
        parts: list[Part] = []
        for name in PARTS if args.part == "all" else (args.part,):
            if name == "tests":
                parts.append(part_tests(args, env))
            elif name == "unscale":
                parts.append(part_unscale(args, env))
            elif name == "plugin":
                parts.append(part_plugin(args, env))
            elif name == "fsdp":
                parts.append(part_fsdp(args, env))
            elif name == "step":
                for model in ("gpt", "resnet") if args.model == "all" else (args.model,):
                    parts.append(part_step(args, env, model))
            else:
                parts.append(part_fidelity(args, env))
        print()
        for p in parts:
            print(f"{p.name:<12} {p.suite['status']:<10} {p.suite['wall_seconds']:6.0f} s  "
                  f"{args.out / f'suite_{p.name}.json'}")
        bad = [p.name for p in parts if p.failed()]
        if bad:
            print(f"not complete: {', '.join(bad)} (see the logs under {args.out / 'raw'})")
        return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
