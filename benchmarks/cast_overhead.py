"""Cost of the O1 cast policy against torch.autocast, on CPU, eager and under ``torch.compile``.

Two models: ``tiny`` (2 layers, d=64) and ``mid`` (4 layers, d=256), forward + backward, one thread by default;
``micro`` (1 layer, d=16) is the test suite's: every row's code path at the least compute.

Eager rows, interleaved so that they see the same machine state: FP32; ``torch.autocast("cpu", dtype)``; autocast
plus a do-nothing ``TorchFunctionMode`` (``mode_floor``: what any mode costs before it does work); the O1 policy; the
explicit-cast twin (the same model with the table's casts written out by hand, no mode at all); and the twin run
inside the do-nothing mode (``twin_floor``: O1's own casts plus any mode's dispatch, without the policy's hook).

The three references answer different questions. ``/floor`` (O1 over ``mode_floor``) mixes two costs: the hook's,
and the table's semantics, since the table runs softmax, GELU and layer norm in FP32 where CPU autocast runs them in
the half dtype (the twin over autocast shows that part alone). ``/twin`` is what the casts cost written by hand
without a mode. ``/twin_floor`` is the hook's own cost: the same casts and the same kind of dispatch, the policy's
lookups and argument handling being the only difference.

Compiled rows (inductor, unless ``--backend``): ``torch.autocast`` outside the compiled model; the O1 policy entered
outside the compiled model (``O1_outside``: ``Amp.forward_context()`` around a model compiled by hand); the same with
the compiled model handed off (``O1_handoff``: ``CastPolicy.hand_off_compiled``, what the Lightning plugin does with a
compiled model); and the O1 policy entered inside the compiled function (``O1_inside``: the Accelerate adapter's
prepared forward). Each compiled row starts from ``torch._dynamo.reset()`` and reports dynamo's graph breaks, the
graphs compiled (the backend's calls), the recompiles (compilations after the first step, over ``--count-steps``)
and the calls into the policy's hook in one steady-state step (counted with ``sys.setprofile``).

    python benchmarks/cast_overhead.py [--models tiny mid] [--steps 100] [--repeats 5] [--no-compile] [--split]
                                       [--out PATH]

``--split`` adds the eager variants with forward and backward timed apart (40 rotated rounds): what each variant
adds to ``mode_floor``'s step and to autocast's, in microseconds, beside the tiny goal's budget (2% of
``mode_floor``'s step); ``twin`` - ``autocast`` is the table's semantics alone.

The variants are timed side by side in rotated order (``4 * repeats`` rounds of a quarter of ``--steps``); each
ratio is the median over rounds of the ratio within a round, with its interquartile range (``/floor``: O1 over
``mode_floor``; ``/twin``: O1 over the explicit-cast twin; ``/twin_floor``: O1 over the twin inside the do-nothing
mode).

Prints the tables and writes JSON and markdown (default ``benchmarks/results/cast_overhead.json`` and ``.md``). The
single-call timings (``--per-call``, stop 20) are retired: their table is in ``docs/benchmarks_history.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, ContextManager

import _harness  # benchmarks/ is on sys.path when a script runs
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch.overrides import TorchFunctionMode

import lightning_mpx.casting.policy
from lightning_mpx import CastPolicy


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


def _twin_block(block: Block, x: torch.Tensor, half: torch.dtype) -> torch.Tensor:
    """``Block.forward`` with the default table's casts written out: linear and matmul in half; layer norm and softmax
    in FP32; GELU on what it gets (the table leaves it alone: its half kernels compute in FP32 and round once); the
    residual additions promote to FP32."""
    b, t, d = x.shape
    f32 = torch.float32

    def linear(mod: nn.Linear, h: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(h.to(half), mod.weight.to(half), mod.bias.to(half))

    def norm(mod: nn.LayerNorm, h: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(h.to(f32), mod.normalized_shape, mod.weight, mod.bias, mod.eps)

    q, k, v = linear(block.qkv, norm(block.ln1, x)).view(b, t, 3, block.heads, d // block.heads).unbind(2)
    q, k, v = (z.transpose(1, 2) for z in (q, k, v))
    att = (q @ k.transpose(-2, -1)) * (1.0 / (d // block.heads) ** 0.5)
    att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).to(f32).softmax(-1)
    y = (att.to(half) @ v).transpose(1, 2).reshape(b, t, d)
    x = x + linear(block.proj, y).to(f32)
    return x + linear(block.fc2, nn.functional.gelu(linear(block.fc1, norm(block.ln2, x)))).to(f32)


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

    def twin(self, idx: torch.Tensor, targets: torch.Tensor, half: torch.dtype) -> torch.Tensor:
        """The forward pass with the casts of O1 written out (the explicit-cast twin)."""
        f32 = torch.float32
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = _twin_block(block, x, half)
        h = nn.functional.layer_norm(x, self.ln.normalized_shape, self.ln.weight, self.ln.bias, self.ln.eps)
        logits = nn.functional.linear(h.to(half), self.head.weight.to(half), self.head.bias.to(half)).to(f32)
        return nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


MODELS = {"tiny": {"dim": 64, "heads": 4, "layers": 2}, "mid": {"dim": 256, "heads": 4, "layers": 4},
          "micro": {"dim": 16, "heads": 2, "layers": 1}}


class _PassThrough(TorchFunctionMode):
    """A mode that only dispatches: what any TorchFunctionMode costs before it does any work."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **kwargs) if kwargs else func(*args)


@contextlib.contextmanager
def _autocast_and_mode(dtype: torch.dtype) -> Any:
    with torch.autocast("cpu", dtype=dtype), _PassThrough():
        yield


Step = Callable[[], torch.Tensor]


def _time(model: nn.Module, step: Step, steps: int, after: Callable[[], None]) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        step()
        model.zero_grad(set_to_none=True)
        after()
    return (time.perf_counter() - start) / steps * 1e6


def _in(ctx: Callable[[], ContextManager[Any]], fn: Step,
        backward: Callable[[torch.Tensor], None] = torch.Tensor.backward) -> Step:
    """One step: ``fn()`` (the forward pass) inside ``ctx()``, then ``backward(loss)``."""

    def step() -> torch.Tensor:
        with ctx():
            loss = fn()
        backward(loss)
        return loss

    return step


def _hook_calls(model: nn.Module, step: Step, after: Callable[[], None]) -> int:
    """Calls into the policy's ``__torch_function__`` during one step (forward and backward)."""
    code = lightning_mpx.casting.policy._CastMode.__torch_function__.__code__
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call" and frame.f_code is code:
            calls += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    model.zero_grad(set_to_none=True)
    after()
    return calls


def _variants(model: TinyLM, data: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype, policy: CastPolicy,
              compile_backend: str | None) -> dict[str, tuple[Step, Callable[[], None]]]:
    """name -> (step, what to run after each step), eager or compiled."""
    clear = policy.clear_cache
    null = contextlib.nullcontext
    # The O1 rows run the backward pass in the policy's recompute scope (policy.backward), as Amp.backward does.
    if compile_backend is None:
        return {
            "fp32": (_in(null, lambda: model(*data)), lambda: None),
            "autocast": (_in(lambda: torch.autocast("cpu", dtype=dtype), lambda: model(*data)), lambda: None),
            "mode_floor": (_in(lambda: _autocast_and_mode(dtype), lambda: model(*data)), lambda: None),
            "O1": (_in(policy.scope, lambda: model(*data), policy.backward), clear),
            "twin": (_in(null, lambda: model.twin(*data, dtype)), lambda: None),
            "twin_floor": (_in(_PassThrough, lambda: model.twin(*data, dtype)), lambda: None),
        }
    compiled = torch.compile(model, backend=compile_backend)
    handed_off = torch.compile(model, backend=compile_backend)
    policy.hand_off_compiled(handed_off)  # as the Lightning plugin does with a compiled model

    @torch.compile(backend=compile_backend)
    def inside(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with policy.scope():
            return model(idx, targets)

    return {
        "autocast": (_in(lambda: torch.autocast("cpu", dtype=dtype), lambda: compiled(*data)), lambda: None),
        "O1_outside": (_in(policy.scope, lambda: compiled(*data), policy.backward), clear),
        "O1_handoff": (_in(policy.scope, lambda: handed_off(*data), policy.backward), clear),
        "O1_inside": (_in(null, lambda: inside(*data), policy.backward), clear),
    }


def _counting(backend: str) -> tuple[Any, list[int]]:
    """A backend that counts the graphs it is given before handing them to ``backend``."""
    graphs = [0]
    inner = torch._dynamo.lookup_backend(backend)

    def count(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs[0] += 1
        return inner(gm, example_inputs)

    return count, graphs


def _alternate(model: nn.Module, variants: dict[str, tuple[Step, Callable[[], None]]], steps: int, repeats: int
               ) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """Time the variants side by side: ``4 * repeats`` rounds of ``steps // 4`` steps each, the order rotated every
    round, so that a slow spell of a shared machine hits every variant of the round alike.

    Returns the median microseconds per step of each variant, and its ratios to the references of the same round
    (``autocast``; for O1 also ``mode_floor``, ``twin`` and ``twin_floor`` when present): the median and the
    interquartile range.
    """
    per_round = max(steps // 4, 2)
    samples = _harness.interleave(
        {v: (lambda step=step, after=after: _time(model, step, per_round, after)) for v, (step, after) in
         variants.items()}, 4 * repeats)  # fmt: skip
    times = {v: statistics.median(s) for v, s in samples.items()}
    ratios: dict[str, dict[str, Any]] = {}
    for v in variants:
        ratios[v] = {}
        for ref in ("autocast", "mode_floor", "twin", "twin_floor"):
            if ref in variants and (ref == "autocast" or v == "O1"):
                ratio = _harness.paired(samples[v], samples[ref])
                ratios[v][f"over_{ref}"], ratios[v][f"over_{ref}_iqr"] = ratio.median, ratio.iqr
    return times, ratios


def run_model(name: str, dtype: torch.dtype, args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = TinyLM(**MODELS[name])
    idx = torch.randint(0, 64, (args.batch, 32))
    data = (idx, torch.roll(idx, -1, 1))
    policy = CastPolicy(half_dtype=dtype)
    steps = max(args.steps // 4, 10) if name == "mid" else args.steps
    rows = []

    eager = _variants(model, data, dtype, policy, None)
    for step, after in eager.values():  # warm-up
        _time(model, step, args.warmup, after)
    times, ratios = _alternate(model, eager, steps, args.repeats)
    o1_calls = _hook_calls(model, *eager["O1"])
    for v in eager:
        rows.append({"model": name, "mode": "eager", "variant": v, "us": times[v], **ratios[v],
                     "hook_calls": o1_calls if v == "O1" else None})

    if args.no_compile:
        return rows
    # Each variant compiled once, from one dynamo state emptied first, with a backend of its own that counts its
    # graphs: its graph breaks (counted before and after it), graphs and recompiles over --count-steps steps. Then
    # the same compiled steps timed side by side, so that they can alternate. (Each was compiled from an emptied
    # state, and compiled again for the timing, until stop 64: the variants' graphs and counts are their own either
    # way, each backend compiling only its own variant, and half the compilations went.)
    torch._dynamo.reset()
    counters.clear()
    compiled: dict[str, dict[str, Any]] = {}
    stepped: dict[str, tuple[Step, Callable[[], None]]] = {}
    for v in ("autocast", "O1_outside", "O1_handoff", "O1_inside"):
        backend, graphs = _counting(args.backend)
        step, after = stepped[v] = _variants(model, data, dtype, policy, backend)[v]
        breaks = sum(counters["graph_break"].values())
        _time(model, step, 1, after)
        first = graphs[0]
        _time(model, step, args.count_steps - 1, after)
        compiled[v] = {
            "graph_breaks": sum(counters["graph_break"].values()) - breaks,
            "graphs": graphs[0],
            "recompiles": graphs[0] - first,
            "hook_calls": _hook_calls(model, step, after),
        }
    for step, after in stepped.values():
        _time(model, step, args.warmup, after)
    times, ratios = _alternate(model, stepped, steps, args.repeats)
    for v in stepped:
        rows.append({"model": name, "mode": f"compiled ({args.backend})", "variant": v, "us": times[v], **ratios[v],
                     **compiled[v]})
    return rows


def split(name: str, dtype: torch.dtype, args: argparse.Namespace, rounds: int = 40) -> list[dict[str, Any]]:
    """Forward and backward timed apart for the eager variants (``--split``), in rotated rounds.

    One row per variant: the median forward and backward microseconds, and per round, the step's difference to
    ``mode_floor`` and to ``autocast``. The tiny goal's budget (O1 within 1.02x of ``mode_floor``) is
    ``budget_us`` = 2% of ``mode_floor``'s step; ``twin`` - ``autocast`` is what the table's semantics cost with no
    mode at all (its FP32 softmax, GELU and layer norms, and their casts), which that budget must also hold.
    """
    torch.manual_seed(0)
    model = TinyLM(**MODELS[name])
    idx = torch.randint(0, 64, (args.batch, 32))
    data = (idx, torch.roll(idx, -1, 1))
    policy = CastPolicy(half_dtype=dtype)
    null = contextlib.nullcontext
    forwards: dict[str, tuple[Callable[[], ContextManager[Any]], Callable[[], torch.Tensor], Callable[..., Any]]] = {
        "autocast": (lambda: torch.autocast("cpu", dtype=dtype), lambda: model(*data), torch.Tensor.backward),
        "mode_floor": (lambda: _autocast_and_mode(dtype), lambda: model(*data), torch.Tensor.backward),
        "O1": (policy.scope, lambda: model(*data), policy.backward),
        "twin": (null, lambda: model.twin(*data, dtype), torch.Tensor.backward),
        "twin_floor": (_PassThrough, lambda: model.twin(*data, dtype), torch.Tensor.backward),
    }
    per_round = 5 if name == "mid" else 20

    def halves(v: str) -> Callable[[], tuple[float, float]]:
        ctx, forward, backward = forwards[v]

        def run() -> tuple[float, float]:
            fwd = bwd = 0.0
            for _ in range(per_round):
                start = time.perf_counter()
                with ctx():
                    loss = forward()
                middle = time.perf_counter()
                backward(loss)
                fwd, bwd = fwd + middle - start, bwd + time.perf_counter() - middle
                model.zero_grad(set_to_none=True)
                policy.clear_cache()
            return fwd / per_round * 1e6, bwd / per_round * 1e6

        return run

    samples = _harness.interleave({v: halves(v) for v in forwards}, rounds, warmup_rounds=2)
    fwd = {v: [f for f, _ in s] for v, s in samples.items()}
    bwd = {v: [b for _, b in s] for v, s in samples.items()}
    step = {v: [f + b for f, b in s] for v, s in samples.items()}
    rows = []
    for v in forwards:
        rows.append({
            "model": name, "variant": v,
            "forward_us": statistics.median(fwd[v]),
            "backward_us": statistics.median(bwd[v]),
            "step_us": statistics.median(step[v]),
            "step_over_floor_us": _harness.paired(step[v], step["mode_floor"], difference=True).median,
            "step_over_autocast_us": _harness.paired(step[v], step["autocast"], difference=True).median,
            "forward_over_floor_us": _harness.paired(fwd[v], fwd["mode_floor"], difference=True).median,
            "backward_over_floor_us": _harness.paired(bwd[v], bwd["mode_floor"], difference=True).median,
            "budget_us": 0.02 * statistics.median(step["mode_floor"]),
        })
    return rows


def tables(rows: list[dict[str, Any]], halves: list[dict[str, Any]], pad: bool = False) -> dict[str, str]:
    """The step rows (each O1 ratio with its IQR, dynamo's counts for the compiled rows) and the split rows."""

    def ratio(row: dict[str, Any], ref: str) -> str | None:
        if f"over_{ref}" not in row:
            return None
        return _harness.Spread(row[f"over_{ref}"], *row[f"over_{ref}_iqr"]).text(suffix="x")

    out = {"steps: median us, ratios within a round (IQR)": _harness.markdown_table(
        ["model", "mode", "variant", "us/step", "/autocast", "/floor", "/twin", "/twin_floor", "breaks", "graphs",
         "recompiles", "hook calls"],
        [[r["model"], r["mode"], r["variant"], f"{r['us']:.0f}", ratio(r, "autocast"), ratio(r, "mode_floor"),
          ratio(r, "twin"), ratio(r, "twin_floor"), r.get("graph_breaks"), r.get("graphs"), r.get("recompiles"),
          r.get("hook_calls")] for r in rows], align="lll" + "r" * 9, pad=pad)}  # fmt: skip
    if halves:
        out["forward and backward apart (medians, us; differences within a round)"] = _harness.markdown_table(
            ["model", "variant", "forward", "backward", "fwd - floor", "bwd - floor", "step - floor",
             "step - autocast", "2% of floor"],
            [[h["model"], h["variant"], *(f"{h[k]:.0f}" for k in (
                "forward_us", "backward_us", "forward_over_floor_us", "backward_over_floor_us", "step_over_floor_us",
                "step_over_autocast_us", "budget_us"))] for h in halves], align="ll" + "r" * 7, pad=pad)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "mid"])
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--steps", type=int, default=100, help="steps per sample for tiny (a quarter for mid)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps per variant before the timed ones")
    parser.add_argument("--count-steps", type=int, default=20,
                        help="steps of each compiled variant over which dynamo's graphs and recompiles are counted")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--no-compile", action="store_true", help="eager rows only")
    parser.add_argument("--split", action="store_true", help="also time forward and backward apart (see split())")
    parser.add_argument("--out", type=Path, default=_harness.default_out("cast_overhead"))
    args = parser.parse_args(argv)
    if args.steps < 1 or args.repeats < 1 or args.batch < 1 or args.warmup < 0 or args.count_steps < 2:
        parser.error(f"--steps={args.steps}, --repeats={args.repeats} and --batch={args.batch} must be at least 1, "
                     f"--warmup={args.warmup} at least 0 and --count-steps={args.count_steps} at least 2")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    machine = _harness.machine()  # before the runs: the load they start under
    rows = [row for name in args.models for row in run_model(name, dtype, args)]
    halves = [row for name in args.models for row in split(name, dtype, args)] if args.split else []
    for title, table in tables(rows, halves, pad=True).items():
        print(f"\n{title}:\n{table}")
    result = {
        "benchmark": "cast_overhead",
        "command": _harness.command(argv),
        **machine,
        "loadavg": [machine["loadavg"], _harness.load_average()],
        "dtype": args.dtype,
        "steps": args.steps,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "count_steps": args.count_steps,
        "batch": args.batch,
        "backend": args.backend,
        "rows": rows,
        "split": halves,
    }
    _harness.save(args.out, result, tables(rows, halves))
    return result


if __name__ == "__main__":
    main()
