"""Host time the ``"triton"`` unscale backend spends per call before it launches anything, by number of tensors.

On a GPU the kernels of the many-small-tensors sweep (``benchmarks/unscale.py``) take microseconds, so what a call
costs the host decides whether the fused path keeps up with torch's. This script times the planning step of
:func:`lightning_mpx.unscale.unscale_grads_` (``backend="triton"``) alone, no kernel launched, side by side in one
run:

* ``cached``: what a step does now when its workspace already holds the table: build the key (addresses, sizes,
  dtypes, devices, layouts, each mapped over the list by a C accessor) and look it up;
* ``checked``: the same lookup plus the per-tensor checks that a plan hit now makes unnecessary (device check, empty
  tensors filtered out, ``supports``), i.e. the work every call did before the checks were cached with the plan;
* ``build``: a call that finds no table (first step, or after the parameters' storage changed).

Gradients are 4-element FP32 tensors unscaled in place, as in the sweep's worst case. On CPU the tensors are CPU
tensors under ``TRITON_INTERPRET=1`` (set here when there is no GPU); host time does not depend on where the data is.

    python benchmarks/triton_host.py [--counts 10 100 1000 10000] [--repeats 7] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

if not os.environ.get("TRITON_INTERPRET"):
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: CPU tensors need the interpreter

import torch

import lightning_mpx
from lightning_mpx import _triton_unscale as kernels
from lightning_mpx import unscale
from lightning_mpx.unscale import UnscaleWorkspace

from _machine import cpu_model, write_json  # benchmarks/ is on sys.path when a script runs


def _per_call_us(fn: Callable[[], object], repeats: int) -> float:
    """Median over ``repeats`` runs of the mean time per call, in microseconds (about 20 ms per run)."""
    fn()
    start = time.perf_counter()
    fn()
    calls = max(1, int(0.02 / max(time.perf_counter() - start, 1e-7)))
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(runs)


def measure(count: int, repeats: int, device: torch.device) -> dict[str, Any]:
    grads = [torch.zeros(4, device=device) for _ in range(count)]
    workspace = UnscaleWorkspace()

    def cached() -> object:
        return unscale._triton_plan(grads, grads, workspace, "unscale_grads_")

    def checked() -> object:
        found = cached()
        unscale._check_triton_devices(kernels, [*grads, *grads])
        pairs = [(g, g) for g in grads if g.numel()]
        kernels.supports([s for s, _ in pairs], [d for _, d in pairs])
        return found

    def build() -> object:
        return unscale._triton_plan(grads, grads, UnscaleWorkspace(), "unscale_grads_")

    builds_before = workspace.builds
    row = {
        "tensors": count,
        "cached_us": _per_call_us(cached, repeats),
        "checked_us": _per_call_us(checked, repeats),
        "build_us": _per_call_us(build, max(3, repeats // 2)),
    }
    assert workspace.builds == builds_before + 1, "the cached rows must not rebuild the table"
    row["cached_us_per_tensor"] = row["cached_us"] / count
    row["checked_us_per_tensor"] = row["checked_us"] / count
    row["checked_over_cached"] = row["checked_us"] / row["cached_us"]
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[10, 100, 1000, 10000])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "triton_host.json")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not kernels.interpreting() else "cpu")
    rows = [measure(count, args.repeats, device) for count in args.counts]

    print(f"host time per unscale_grads_(backend='triton') call before any launch, {device}")
    print(f"{'tensors':>8} {'cached us':>10} {'us/tensor':>10} {'checked us':>11} {'us/tensor':>10} "
          f"{'checked/cached':>15} {'build us':>10}")
    for r in rows:
        print(f"{r['tensors']:>8} {r['cached_us']:>10.1f} {r['cached_us_per_tensor']:>10.3f} {r['checked_us']:>11.1f} "
              f"{r['checked_us_per_tensor']:>10.3f} {r['checked_over_cached']:>14.2f}x {r['build_us']:>10.1f}")
    result = {
        "benchmark": "triton_host",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else cpu_model(),
        "host_cpu": cpu_model(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "lightning_mpx": lightning_mpx.__version__,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "rows": rows,
    }
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
