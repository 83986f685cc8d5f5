"""Instructions per training step of the O1 policy and its references, counted by valgrind (callgrind).

``cast_overhead.py`` times the same variants, and on a shared 2-core CPU its ratios move by several percent from run
to run. An instruction count does not: it is the same for the same binary, inputs and environment whatever else the
machine is doing. It measures work, not time, so it shows the hook's own cost exactly (the policy's Python and the
calls it makes) while saying nothing of memory traffic or of the speed of one kernel against another (an FP32 softmax
and a bfloat16 one may run the same instructions at different speeds): read it beside ``cast_overhead.py``'s times.

Each variant runs in its own process under ``valgrind --tool=callgrind``: the model of ``cast_overhead.py``, every
variant warmed up alike, then ``--steps`` forward + backward steps of the variant measured. A base process does the
same with no measured step; a variant's instructions per step are ``(its total - base total) / steps``.
``PYTHONHASHSEED`` is fixed so that the processes run the same Python. Variants (as in ``cast_overhead.py``):
``autocast``; ``mode_floor`` (autocast and a do-nothing mode); ``O1``; ``twin`` (the O1 casts written out);
``twin_floor`` (the twin inside the do-nothing mode); ``O1_uncached`` (O1 with ``cache_casts=False``: what the
parameter-cast cache's bookkeeping costs, each parameter being used once per step here); ``O1_aligned`` (O1 with
``CastTable.autocast_aligned("cpu")``: torch.autocast alone, no mode; compare with ``autocast``, same dtypes);
``O1_mode`` (O1 on the Python policy alone, ``engine="mode"``: the engine before issue 25).

    python benchmarks/cast_instructions.py [--models tiny mid] [--steps 20] [--jobs 2] [--out PATH]

Importing torch under valgrind takes about a minute, so each process costs a minute or more (about 9 for ``mid``);
``--jobs`` runs that many at once.

Valgrind's CPU has no AVX-512, so torch runs its AVX2 kernels there (the JSON records the capability torch saw): on a
CPU with native bfloat16 the half kernels' share is not the real one. Ratios between variants that run the same
kernels in the same dtypes (O1 against ``twin_floor``: the hook's own cost) are unaffected; ratios across dtypes
(O1 against ``mode_floor``, whose softmax, GELU and layer norm run in bfloat16) are not representative of native
runs. Prints a table and writes JSON and markdown (default ``benchmarks/results/cast_instructions.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import _harness  # benchmarks/ is on sys.path when a script runs

VARIANTS = ("autocast", "mode_floor", "O1", "O1_uncached", "twin", "twin_floor", "O1_aligned", "O1_mode")
REFERENCES = ("autocast", "mode_floor", "twin", "twin_floor")
_COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")


def _child(model_name: str, variant: str, steps: int, dtype_name: str) -> None:
    """Runs in the measured process: warm every variant up, then ``steps`` steps of ``variant`` (none: the base)."""
    import torch
    from cast_overhead import MODELS, TinyLM, _autocast_and_mode, _PassThrough

    from lightning_mpx import CastPolicy, CastTable

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dtype = getattr(torch, dtype_name)
    model = TinyLM(**MODELS[model_name])
    idx = torch.randint(0, 64, (2, 32))
    data = (idx, torch.roll(idx, -1, 1))
    policy = CastPolicy(half_dtype=dtype)
    uncached = CastPolicy(half_dtype=dtype, cache_casts=False)
    aligned = CastPolicy(CastTable.autocast_aligned("cpu"), half_dtype=dtype)
    python_only = CastPolicy(half_dtype=dtype, engine="mode")

    def forward(ctx: Callable[[], Any], fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with ctx():
            return fn()

    null = contextlib.nullcontext
    steps_of: dict[str, Callable[[], None]] = {
        "autocast": lambda: forward(lambda: torch.autocast("cpu", dtype=dtype), lambda: model(*data)).backward(),
        "mode_floor": lambda: forward(lambda: _autocast_and_mode(dtype), lambda: model(*data)).backward(),
        "O1": lambda: policy.backward(forward(policy.scope, lambda: model(*data))),
        "O1_uncached": lambda: uncached.backward(forward(uncached.scope, lambda: model(*data))),
        "O1_aligned": lambda: aligned.backward(forward(aligned.scope, lambda: model(*data))),
        "O1_mode": lambda: python_only.backward(forward(python_only.scope, lambda: model(*data))),
        "twin": lambda: forward(null, lambda: model.twin(*data, dtype)).backward(),
        "twin_floor": lambda: forward(_PassThrough, lambda: model.twin(*data, dtype)).backward(),
    }

    def step(run: Callable[[], None]) -> None:
        run()
        model.zero_grad(set_to_none=True)
        policy.clear_cache()
        python_only.clear_cache()

    print(f"capability={torch.backends.cpu.get_cpu_capability()}", flush=True)
    for run in steps_of.values():
        for _ in range(3):
            step(run)
    if variant != "base":
        for _ in range(steps):
            step(steps_of[variant])


def _count(model: str, variant: str, steps: int, dtype: str, workdir: Path) -> tuple[int, str]:
    """Instructions of one child process under callgrind, and the CPU capability torch saw there."""
    out = workdir / f"{model}-{variant}.callgrind"
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)])}
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__,
         "--_child", model, variant, str(steps), dtype],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{model} {variant}: valgrind exited {done.returncode}:\n{done.stderr[-2000:]}")
    match = _COLLECTED.search(done.stderr)
    if match is None:
        raise RuntimeError(f"{model} {variant}: no instruction count in valgrind's output:\n{done.stderr[-2000:]}")
    out.unlink(missing_ok=True)
    capability = re.search(r"capability=(\S+)", done.stdout)
    return int(match.group(1)), capability.group(1) if capability else "unknown"


def rows_from_counts(counts: dict[tuple[str, str], int], steps: int) -> list[dict[str, Any]]:
    """``{(model, variant or "base"): instructions}`` -> one row per model and variant: instructions per step and
    the ratio to each reference of the same model."""
    rows = []
    for model in dict.fromkeys(m for m, _ in counts):
        base = counts[(model, "base")]
        per_step = {v: (counts[(model, v)] - base) / steps for m, v in counts if m == model and v != "base"}
        for variant, instructions in per_step.items():
            row: dict[str, Any] = {"model": model, "variant": variant, "instructions_per_step": instructions}
            for ref in REFERENCES:
                if ref in per_step and ref != variant:
                    row[f"over_{ref}"] = instructions / per_step[ref]
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=["tiny", "mid"], default=["tiny"],
                        help="mid: about 9 minutes a process on a 2-core AMD EPYC")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per variant (tiny; a quarter for mid)")
    parser.add_argument("--jobs", type=int, default=2, help="valgrind processes at once")
    parser.add_argument("--out", type=Path, default=_harness.default_out("cast_instructions"))
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        parser.error("valgrind is not on PATH (Debian: apt-get install valgrind)")
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: must be at least 1")
    steps = {m: args.steps if m == "tiny" else max(args.steps // 4, 2) for m in args.models}
    jobs = [(m, v) for m in args.models for v in ("base", *args.variants)]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max(1, args.jobs)) as pool:
        counted = pool.map(lambda job: _count(job[0], job[1], steps[job[0]], args.dtype, Path(tmp)), jobs)
        measured = dict(zip(jobs, counted))
    counts = {job: count for job, (count, _) in measured.items()}
    capabilities = sorted({capability for _, capability in measured.values()})
    rows = [row for m in args.models for row in rows_from_counts({k: c for k, c in counts.items() if k[0] == m},
                                                                  steps[m])]
    table = _harness.markdown_table(
        ["model", "variant", "instructions/step", *(f"/{r}" for r in REFERENCES)],
        [[r["model"], r["variant"], f"{r['instructions_per_step']:,.0f}",
          *(f"{r[f'over_{ref}']:.4f}x" if f"over_{ref}" in r else None for ref in REFERENCES)] for r in rows],
        align="ll" + "r" * (1 + len(REFERENCES)))  # fmt: skip
    print(table)
    note = f"torch's CPU capability under valgrind: {', '.join(capabilities)} (see the module's docstring)"
    print(note)
    result = {"benchmark": "cast_instructions", "command": _harness.command(argv), **_harness.machine(),
              "dtype": args.dtype, "steps": steps, "counter": "valgrind --tool=callgrind (instructions executed)",
              "torch_cpu_capability_under_valgrind": capabilities, "rows": rows,
              "totals": {f"{m}/{v}": c for (m, v), c in counts.items()}}  # fmt: skip
    _harness.save(args.out, result, {"instructions per measured step": f"{table}\n\n{note}."})
    return result


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--_child":
        _child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        main()
