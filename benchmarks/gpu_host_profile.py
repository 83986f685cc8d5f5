"""Where a CUDA training step's time goes: host (Python, launches) against device, per variant (CUDA only).

For the GPT-2-small model of ``benchmarks/step.py`` (``--size real``) it runs a plain loop per variant and reports,
as medians over ``--steps`` steps after a warm-up:

* ``host ms``: time for the host to enqueue the whole step (forward, backward, step, update, zero_grad), measured
  with ``time.perf_counter`` from a synchronized start to the end of the Python code, without a final sync;
* ``step ms``: the same step with ``torch.cuda.synchronize()`` at the end (what the user waits for);
* ``host share``: host ms / step ms. Near 1.0 means the step is host-bound (the GPU waits for Python).

Then the top operators by self CPU time of one O1 step under ``torch.profiler`` (where the host time goes).

    python benchmarks/gpu_host_profile.py [--steps 20] [--out benchmarks/results/gpu/host_profile.json]

Without CUDA it prints why and exits: no number here is ever estimated.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from step import SPECS, _loss, build_model, make_batches  # noqa: E402

from lightning_mpx import Amp  # noqa: E402

VARIANTS = ("autocast-fp16", "core-O1-fp16", "core-O2-fp16", "core-O1-bf16", "autocast-bf16")


def make_step(variant: str, dev: torch.device, model: str = "gpt") -> Callable[[Any, Any], None]:
    torch.manual_seed(0)
    net = build_model(model, SPECS[(model, "real")]).to(dev)
    dtype = torch.float16 if variant.endswith("fp16") else torch.bfloat16
    if variant.startswith("core-"):
        level = variant.split("-")[1]
        amp = Amp(level, half_dtype=dtype, on_floor="continue")
        net = amp.prepare_model(net)
        opt = amp.prepare_optimizer(torch.optim.AdamW(net.parameters(), lr=1e-4))

        def core(x: Any, y: Any) -> None:
            with amp.forward_context():
                loss = _loss(amp.cast_outputs(net(amp.cast_inputs(x))), y)
            amp.backward(loss)
            amp.step(opt)
            amp.update()
            opt.zero_grad(set_to_none=True)

        return core
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None

    def plain(x: Any, y: Any) -> None:
        with torch.autocast("cuda", dtype=dtype):
            loss = _loss(net(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)

    return plain


def measure(step: Callable[[Any, Any], None], batches: list[Any], steps: int, warmup: int) -> dict[str, float]:
    host, full = [], []
    for i in range(warmup + steps):
        x, y = batches[i % len(batches)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(x, y)
        enqueued = time.perf_counter()
        torch.cuda.synchronize()
        end = time.perf_counter()
        if i >= warmup:
            host.append((enqueued - start) * 1e3)
            full.append((end - start) * 1e3)
    return {"host_ms": statistics.median(host), "step_ms": statistics.median(full)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--model", choices=("gpt", "resnet"), default="gpt")
    parser.add_argument("--profile", choices=VARIANTS, default="core-O1-fp16",
                        help="the variant whose one step is profiled (torch.profiler) and whose host code is "
                        "profiled with cProfile over --steps steps")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gpu" / "host_profile.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_host_profile.py measures CUDA steps and no CUDA device is present: nothing measured.")
        return 0
    dev = torch.device("cuda")
    batches = make_batches(args.model, SPECS[(args.model, "real")], 4, dev)
    rows = []
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'variant':16} {'host ms':>8} {'step ms':>8} {'host share':>10}")
    for variant in VARIANTS:
        row = {"variant": variant, **measure(make_step(variant, dev, args.model), batches, args.steps, args.warmup)}
        row["host_share"] = row["host_ms"] / row["step_ms"]
        rows.append(row)
        print(f"{variant:16} {row['host_ms']:8.2f} {row['step_ms']:8.2f} {row['host_share']:10.2f}")
        torch.cuda.empty_cache()
    step = make_step(args.profile, dev, args.model)
    for i in range(3):
        step(*batches[i % len(batches)])
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(*batches[0])
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    print(f"torch.profiler, one {args.profile} step, by self CPU time:")
    print(table)
    profiler = cProfile.Profile()
    profiler.enable()
    for i in range(args.steps):
        step(*batches[i % len(batches)])
    torch.cuda.synchronize()
    profiler.disable()
    buffer = io.StringIO()
    pstats.Stats(profiler, stream=buffer).sort_stats("tottime").print_stats(30)
    python_table = buffer.getvalue()
    print(f"cProfile, {args.steps} {args.profile} steps, by own time:")
    print(python_table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "command": " ".join(sys.argv), "model": args.model, "rows": rows, "profiled": args.profile,
                                    "op_profile": table, "python_profile": python_table}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
