"""Cost of the O1 cast policy against torch.autocast, on CPU, with a small op-bound transformer.

Runs forward + backward of the same model under (a) FP32, (b) ``torch.autocast("cpu", dtype)`` and (c) lightning_mpx's
O1 policy with the same dtype, interleaving the variants so that they see the same machine state. Prints a table
and writes JSON (default ``benchmarks/results/cast_overhead.json``).

    python benchmarks/cast_overhead.py [--steps 200] [--repeats 5] [--out PATH]

"added us/op" is the O1 time minus the autocast time, divided by the number of torch calls that the policy
intercepts in one forward pass. "hybrid floor" is autocast plus a do-nothing TorchFunctionMode: the least that a
design combining autocast with a mode for the table's differences could cost.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_mpx import CastPolicy

from _machine import cpu_model, write_json  # benchmarks/ is on sys.path when a script runs


class Block(nn.Module):
    """A pre-norm transformer block written with plain ops, as in small GPT-style models."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (d // self.heads) ** 0.5)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 64, heads: int = 4, layers: int = 2, seq: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class _PassThrough(TorchFunctionMode):
    """A mode that only dispatches: what any TorchFunctionMode costs before it does any work."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **kwargs) if kwargs else func(*args)


@contextlib.contextmanager
def _autocast_and_mode(dtype: torch.dtype) -> Any:
    with torch.autocast("cpu", dtype=dtype), _PassThrough():
        yield


class _Counter(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _time(model: nn.Module, data: tuple[torch.Tensor, torch.Tensor], ctx: Callable[[], ContextManager[Any]],
          steps: int, after: Callable[[], None]) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        with ctx():
            loss = model(*data)
        loss.backward()
        model.zero_grad(set_to_none=True)
        after()
    return (time.perf_counter() - start) / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cast_overhead.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = TinyLM()
    idx = torch.randint(0, 64, (args.batch, 32))
    data = (idx, torch.roll(idx, -1, 1))

    counter = _Counter()
    with counter:
        model(*data)

    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        policy = CastPolicy(half_dtype=dtype)
        variants: dict[str, tuple[Callable[[], ContextManager[Any]], Callable[[], None]]] = {
            "fp32": (contextlib.nullcontext, lambda: None),
            "autocast": (lambda: torch.autocast("cpu", dtype=dtype), lambda: None),
            # The floor of a hybrid design (autocast casting, a mode for the table's differences): autocast plus a
            # mode that dispatches and does nothing else.
            "hybrid_floor": (lambda: _autocast_and_mode(dtype), lambda: None),
            "O1": (policy.scope, policy.clear_cache),
        }
        samples: dict[str, list[float]] = {name: [] for name in variants}
        for name, (ctx, after) in variants.items():  # warm-up
            _time(model, data, ctx, 20, after)
        for _ in range(args.repeats):
            for name, (ctx, after) in variants.items():
                samples[name].append(_time(model, data, ctx, args.steps, after))
        med = {name: statistics.median(values) for name, values in samples.items()}
        rows.append(
            {
                "dtype": str(dtype).removeprefix("torch."),
                "fp32_us": med["fp32"],
                "autocast_us": med["autocast"],
                "o1_us": med["O1"],
                "hybrid_floor_us": med["hybrid_floor"],
                "hybrid_floor_over_autocast": med["hybrid_floor"] / med["autocast"],
                "o1_over_autocast": med["O1"] / med["autocast"],
                "intercepted_calls_per_forward": counter.calls,
                "added_us_per_intercepted_call": (med["O1"] - med["autocast"]) / counter.calls,
            }
        )

    header = (
        f"{'dtype':<9} {'fp32 us':>9} {'autocast us':>12} {'O1 us':>9} {'O1/autocast':>12} {'calls':>6} "
        f"{'added us/call':>14} {'hybrid floor':>13}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['dtype']:<9} {r['fp32_us']:>9.0f} {r['autocast_us']:>12.0f} {r['o1_us']:>9.0f} "
            f"{r['o1_over_autocast']:>11.2f}x {r['intercepted_calls_per_forward']:>6} "
            f"{r['added_us_per_intercepted_call']:>14.2f} {r['hybrid_floor_over_autocast']:>12.2f}x"
        )
    result = {
        "benchmark": "cast_overhead",
        "device": cpu_model(),
        "threads": args.threads,
        "torch": torch.__version__,
        "steps": args.steps,
        "repeats": args.repeats,
        "batch": args.batch,
        "rows": rows,
    }
    write_json(args.out, result)


if __name__ == "__main__":
    main()
