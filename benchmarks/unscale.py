"""Fused Triton unscale kernels against torch's ops and against the device's copy bandwidth (CUDA).

For the parameter shapes of GPT-2 124M (148 tensors), BERT-base (199), ResNet-50 (161) and a 1.3B GPT (292), with
FP32, FP16 and BF16 gradients, it times:

* ``unscale``: unscale in place + overflow flag. torch: ``_amp_foreach_non_finite_check_and_unscale_`` (what
  ``GradScaler.unscale_`` runs);
* ``unscale+norm``: the same plus the global norm. torch: the above + ``_foreach_norm`` + ``vector_norm``;
* ``unscale+clip``: unscale, flag, norm and clip by norm. torch: the above unscale + ``clip_grad_norm_(foreach=True)``;
* ``O2 grads`` (half gradients only): half model gradients into FP32 master gradients, unscaled, checked, measured
  and clipped. torch: ``_foreach_copy_`` + unscale + ``clip_grad_norm_`` on the masters;
* ``O2 copy`` (half only): FP32 masters into the half model. torch: ``_foreach_copy_``.

Then a sweep of many small tensors (10 to 10,000 tensors of 4 to 65,536 elements, FP32, unscale+clip).

Times are medians over CUDA-event-timed repetitions after a warm-up. "GB/s" divides the bytes that the variant must
move at the floor (below) by the fused time; "% copy" compares that with the device's copy bandwidth, measured in
the same run with a large ``copy_``. Floors per element, ``e`` the gradient's element size: unscale (+norm) 2e;
unscale+clip 3e (one read-only pass, one read-write pass); O2 grads with clipping 2 + 2 + 4 bytes (half gradients
read twice, FP32 masters written once); O2 copy 4 + 2.

    python benchmarks/unscale.py [--repeats 25] [--sets gpt2-124m,gpt-1.3b] [--out benchmarks/results/unscale.json]
    python benchmarks/unscale.py --check   # no GPU needed: runs a tiny case in triton's interpreter

Without CUDA (and without ``--check``) it prints why and exits: no number here is ever estimated.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

CHECK = "--check" in sys.argv
if CHECK:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates the kernels

import torch  # noqa: E402 (after TRITON_INTERPRET is set above, as the imports below are)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lightning_mpx, without PYTHONPATH
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402

from lightning_mpx.scaling.unscale import UnscaleWorkspace, cast_copy_, foreach_check_and_unscale_, unscale_grads_  # noqa: E402

Shapes = list[tuple[int, ...]]


# -- parameter shapes -----------------------------------------------------------------------------------------------
def gpt_shapes(layers: int, dim: int, vocab: int = 50257, positions: int = 1024) -> Shapes:
    """GPT-2-style ``named_parameters()`` (tied output embedding): 12 tensors per layer + 4."""
    shapes: Shapes = [(vocab, dim), (positions, dim)]
    for _ in range(layers):
        shapes += [(dim,), (dim,), (dim, 3 * dim), (3 * dim,), (dim, dim), (dim,)]  # ln_1, c_attn, attn c_proj
        shapes += [(dim,), (dim,), (dim, 4 * dim), (4 * dim,), (4 * dim, dim), (dim,)]  # ln_2, c_fc, mlp c_proj
    return shapes + [(dim,), (dim,)]  # ln_f


def bert_base_shapes() -> Shapes:
    """``BertModel`` (bert-base-uncased, with pooler): 5 embedding tensors, 16 per layer, 2 for the pooler."""
    dim, ff = 768, 3072
    shapes: Shapes = [(30522, dim), (512, dim), (2, dim), (dim,), (dim,)]
    for _ in range(12):
        shapes += [(dim, dim), (dim,)] * 4 + [(dim,), (dim,)]  # query, key, value, attention output; its LayerNorm
        shapes += [(ff, dim), (ff,), (dim, ff), (dim,), (dim,), (dim,)]  # intermediate, output, LayerNorm
    return shapes + [(dim, dim), (dim,)]


def resnet50_shapes() -> Shapes:
    """torchvision ``resnet50``: convolutions without bias, batch-norm weight and bias, the classifier."""
    shapes: Shapes = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            width, out = planes, planes * 4
            shapes += [(width, inplanes, 1, 1), (width,), (width,)]
            shapes += [(width, width, 3, 3), (width,), (width,)]
            shapes += [(out, width, 1, 1), (out,), (out,)]
            if block == 0:
                shapes += [(out, inplanes, 1, 1), (out,), (out,)]  # downsample
            inplanes = out
    return shapes + [(1000, 2048), (1000,)]


SETS: dict[str, Callable[[], Shapes]] = {
    "gpt2-124m": lambda: gpt_shapes(12, 768),
    "bert-base": bert_base_shapes,
    "resnet50": resnet50_shapes,
    "gpt-1.3b": lambda: gpt_shapes(24, 2048, positions=2048),
}
COUNTS = {"gpt2-124m": 148, "bert-base": 199, "resnet50": 161, "gpt-1.3b": 292}
SWEEP_COUNTS = (10, 100, 1000, 10000)
SWEEP_SIZES = (4, 256, 4096, 65536)


# -- timing ---------------------------------------------------------------------------------------------------------
def timed(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds of ``fn`` (CUDA events on CUDA; wall clock in --check)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def copy_bandwidth(device: torch.device, warmup: int, repeats: int, nbytes: int) -> float:
    """GB/s of a large device-to-device ``copy_`` (bytes read + bytes written)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), device, warmup, repeats)
    return 2 * nbytes / ms / 1e6


# -- variants -------------------------------------------------------------------------------------------------------
def torch_unscale(grads: list[torch.Tensor], inv: torch.Tensor, found: torch.Tensor) -> None:
    for group in _by_dtype(grads):
        foreach_check_and_unscale_(group, found, inv)  # torch's op; bfloat16 on CUDA: mul + inf-norm (no torch op)


def torch_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    norms = [n for g in _by_dtype(grads) for n in torch._foreach_norm(g, 2.0, dtype=torch.float32)]
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


def run_case(
    shapes: Shapes,
    dtype: torch.dtype,
    device: torch.device,
    args: argparse.Namespace,
    bw: float,
    only: str | None = None,
) -> list[dict]:
    numel = sum(_numel(s) for s in shapes)
    size = torch.empty((), dtype=dtype).element_size()
    grads = [torch.randn(s, device=device).mul_(1024.0).to(dtype) for s in shapes]
    inv = torch.ones(1, device=device)  # 1.0: repeated calls leave the values as they are, for every variant alike
    found = torch.zeros(1, device=device)
    max_norm = 1e-3  # clips: both paths do the full work
    ws = UnscaleWorkspace(**args.workspace)
    fused_backend = "triton"  # explicit: "auto" would pick it too, but a missing triton must not go unnoticed
    rows = []

    def add(variant: str, fused: Callable[[], object], reference: Callable[[], object], floor_bytes: float) -> None:
        if only is not None and variant != only:
            return
        fused_ms = timed(fused, device, args.warmup, args.repeats)
        torch_ms = timed(reference, device, args.warmup, args.repeats)
        gbps = floor_bytes * numel / fused_ms / 1e6
        rows.append(
            {
                "variant": variant,
                "dtype": str(dtype).replace("torch.", ""),
                "tensors": len(shapes),
                "elements": numel,
                "fused_ms": fused_ms,
                "torch_ms": torch_ms,
                "speedup": torch_ms / fused_ms,
                "floor_bytes_per_element": floor_bytes,
                "fused_GBps": gbps,
                "pct_of_copy_bandwidth": 100.0 * gbps / bw,
            }
        )

    kw = dict(backend=fused_backend, workspace=ws)
    add("unscale", lambda: unscale_grads_(grads, inv, found, **kw), lambda: torch_unscale(grads, inv, found), 2 * size)
    add(
        "unscale+norm",
        lambda: unscale_grads_(grads, inv, found, compute_norm=True, **kw),
        lambda: (torch_unscale(grads, inv, found), torch_norm(grads)),
        2 * size,
    )
    grad_holders = _as_params(grads)

    def torch_clip() -> None:
        torch_unscale(grads, inv, found)
        torch.nn.utils.clip_grad_norm_(grad_holders, max_norm, foreach=True)

    add("unscale+clip", lambda: unscale_grads_(grads, inv, found, max_norm=max_norm, **kw), torch_clip, 3 * size)
    if dtype != torch.float32 and only in (None, "O2 grads", "O2 copy"):
        masters = [torch.empty(g.shape, dtype=torch.float32, device=device) for g in grads]
        master_holders = _as_params(masters)

        def torch_o2() -> None:
            torch._foreach_copy_(masters, grads)
            torch_unscale(masters, inv, found)
            torch.nn.utils.clip_grad_norm_(master_holders, max_norm, foreach=True)

        add("O2 grads", lambda: unscale_grads_(grads, inv, found, out=masters, max_norm=max_norm, **kw), torch_o2, 8)
        weights = [torch.empty(g.shape, dtype=torch.float32, device=device).uniform_() for g in grads]
        half = [torch.empty(g.shape, dtype=dtype, device=device) for g in grads]
        add(
            "O2 copy",
            lambda: cast_copy_(half, weights, backend=fused_backend, workspace=ws),
            lambda: torch._foreach_copy_(half, weights),
            4 + size,
        )
    return rows


def _as_params(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Stand-ins whose ``.grad`` are ``grads``, for ``clip_grad_norm_``: expanded views that own no memory."""
    holders = []
    for g in grads:
        holder = torch.zeros(1, dtype=g.dtype, device=g.device).expand(g.shape)
        holder.grad = g
        holders.append(holder)
    return holders


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# -- main -----------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--sets", default=",".join(SETS), help="comma-separated: " + ", ".join(SETS))
    parser.add_argument("--dtypes", default="float32,float16,bfloat16")
    parser.add_argument("--no-sweep", action="store_true", help="skip the many-small-tensors sweep")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: benchmarks/results/unscale.json (--check writes only where --out says)")
    parser.add_argument("--check", action="store_true", help="run a tiny case in triton's interpreter (no GPU)")
    args = parser.parse_args(argv)

    for name, make in SETS.items():  # the shape tables are data: hold them to the documented counts
        assert len(make()) == COUNTS[name], (name, len(make()), COUNTS[name])

    if args.check:
        return check(args)
    if not torch.cuda.is_available():
        print("benchmarks/unscale.py needs a CUDA device (none found); nothing was measured. "
              "Use --check to exercise the script on CPU in triton's interpreter.")
        return 0
    try:
        import triton
    except ImportError:
        print("benchmarks/unscale.py needs triton (pip install 'lightning-mpx[triton]'); nothing was measured.")
        return 0
    device = torch.device("cuda")
    args.workspace = {}
    bw = copy_bandwidth(device, args.warmup, args.repeats, nbytes=1 << 30)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    rows = []
    for name in args.sets.split(","):
        for dtype in dtypes:
            for row in run_case(SETS[name](), dtype, device, args, bw):
                rows.append({"set": name, **row})
            torch.cuda.empty_cache()
    if not args.no_sweep:
        for count in SWEEP_COUNTS:
            for size in SWEEP_SIZES:
                for row in run_case([(size,)] * count, torch.float32, device, args, bw, only="unscale+clip"):
                    rows.append({"set": f"sweep {count}x{size}", **row})
                torch.cuda.empty_cache()
    result = {
        "benchmark": "unscale",
        "command": _harness.command(argv),
        **_harness.machine("cuda"),
        "triton": triton.__version__,
        "copy_bandwidth_GBps": bw,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "rows": rows,
    }
    report(result, args.out or _harness.default_out("unscale"))
    return 0


def check(args: argparse.Namespace) -> int:
    """The whole pipeline on CPU in triton's interpreter, with tiny shapes, then a parity check."""
    device = torch.device("cpu")
    args.workspace = {"chunk_size": 64, "block_size": 16, "num_warps": 1}
    args.warmup, args.repeats = 0, 1
    shapes = [(3, 5), (7,), (130,), (1,)]
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        rows += [{"set": "check", **row} for row in run_case(shapes, dtype, device, args, bw=1.0)]
    grads = [torch.randn(s).mul_(512.0).half() for s in shapes]
    twin = [g.clone() for g in grads]
    found, twin_found = torch.zeros(()), torch.zeros(())
    inv = torch.tensor(1 / 512.0)
    ws = UnscaleWorkspace(**args.workspace)
    norm = unscale_grads_(grads, inv, found, max_norm=0.5, backend="triton", workspace=ws)
    twin_norm = unscale_grads_(twin, inv, twin_found, max_norm=0.5, backend="foreach")
    torch.testing.assert_close(norm, twin_norm, rtol=1e-5, atol=0)
    for a, b in zip(grads, twin):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=0)
    result = {"benchmark": "unscale", "command": _harness.command(),
              **_harness.machine(device="cpu (triton interpreter, --check: not a measurement)"),
              "copy_bandwidth_GBps": None, "rows": rows}  # fmt: skip
    report(result, args.out)
    print("check passed")
    return 0


def report(result: dict, out: Path | None) -> None:
    """Print the rows as a table; with ``out``, write the result there (JSON, and the table as markdown beside)."""
    bw = result["copy_bandwidth_GBps"]
    print(f"device: {result['device']}" + (f"; copy bandwidth {bw:.0f} GB/s" if bw else ""))
    table = _harness.markdown_table(
        ["set", "dtype", "variant", "tensors", "fused ms", "torch ms", "speed-up", "GB/s", "% copy"],
        [[r["set"], r["dtype"], r["variant"], r["tensors"], f"{r['fused_ms']:.3f}", f"{r['torch_ms']:.3f}",
          f"{r['speedup']:.2f}x", f"{r['fused_GBps']:.0f}" if bw else None,
          f"{r['pct_of_copy_bandwidth']:.0f}" if bw else None] for r in result["rows"]],
        align="lll" + "r" * 6)  # fmt: skip
    print(table)
    if out is not None:
        _harness.save(out, result, {f"fused against torch; copy bandwidth {bw or 0:.0f} GB/s": table})


if __name__ == "__main__":
    sys.exit(main())
