"""Two costs around the O1 backward pass, each against a reference timed side by side in the same run (CPU).

- ``entry``: microseconds per call of ``policy.backward(loss)`` (what ``Amp.backward`` runs at O1) against a plain
  ``loss.backward()``, on a trivial graph, so that the call's own work shows.
- ``cache``: a training step of ``cast_overhead.py``'s model (forward in the policy's scope, then a plain
  ``loss.backward()``) with the parameter-cast cache still holding the half copies during the backward pass
  (``held``, what the policy did before stop 19) against the same step with the cache emptied before the backward
  pass (``dropped``, what ``policy.backward`` now does), both with ``policy.clear_cache()`` after the step.

- ``mode``: the backward pass alone of the same model's O1 forward, by ``policy.backward`` (its recompute mode on
  the mode stack, which the autograd engine restores for every node: what recomputing checkpointed code with the
  forward's casts costs when nothing is checkpointed) against a plain ``loss.backward()``, the cache emptied before
  both.

Variants alternate in rotated rounds; ratios are medians of within-round ratios with their interquartile range.

    python benchmarks/policy_backward.py [--model mid] [--rounds 16] [--steps 5] [--out PATH]

Prints a table and writes JSON (default ``benchmarks/results/policy_backward.json``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from _machine import cpu_model, write_json  # benchmarks/ is on sys.path when a script runs
from cast_overhead import MODELS, TinyLM
from lightning_mpx import CastPolicy


def _rounds(variants: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    names = list(variants)
    samples: dict[str, list[float]] = {v: [] for v in names}
    for r in range(rounds):
        for v in names[r % len(names):] + names[: r % len(names)]:
            samples[v].append(variants[v]())
    return samples


def _ratio(samples: dict[str, list[float]], a: str, b: str) -> tuple[float, list[float]]:
    values = sorted(x / y for x, y in zip(samples[a], samples[b]))
    q = statistics.quantiles(values, n=4)
    return statistics.median(values), [q[0], q[2]]


def entry(rounds: int, calls: int = 2000) -> dict[str, Any]:
    policy = CastPolicy(half_dtype=torch.bfloat16)
    leaf = torch.ones(2, requires_grad=True)

    def timed(backward: Callable[[torch.Tensor], None]) -> Callable[[], float]:
        def run() -> float:
            start = time.perf_counter()
            for _ in range(calls):
                backward((leaf * 2).sum())
            return (time.perf_counter() - start) / calls * 1e6

        return run

    samples = _rounds({"policy.backward": timed(policy.backward), "loss.backward": timed(torch.Tensor.backward)},
                      rounds)
    ratio, iqr = _ratio(samples, "policy.backward", "loss.backward")
    return {"part": "entry", "us": {k: statistics.median(v) for k, v in samples.items()},
            "ratio": ratio, "ratio_iqr": iqr, "reference": "loss.backward"}


def cache(model_name: str, rounds: int, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyLM(**MODELS[model_name])
    idx = torch.randint(0, 64, (2, 32))
    data = (idx, torch.roll(idx, -1, 1))
    policy = CastPolicy(half_dtype=torch.bfloat16)

    def timed(drop: bool) -> Callable[[], float]:
        def run() -> float:
            start = time.perf_counter()
            for _ in range(steps):
                with policy.scope():
                    loss = model(*data)
                if drop:
                    policy.clear_cache()
                loss.backward()
                model.zero_grad(set_to_none=True)
                policy.clear_cache()
            return (time.perf_counter() - start) / steps * 1e6

        return run

    return _compare("cache", model_name, {"held": timed(False), "dropped": timed(True)}, rounds)


def mode(model_name: str, rounds: int, steps: int) -> dict[str, Any]:
    """The backward pass alone of an O1 forward, run by ``policy.backward`` (its recompute mode on the
    torch-function mode stack, which the autograd engine restores for every node it runs: the price of
    recomputing checkpointed code with the forward's casts) against a plain ``loss.backward()`` with no mode on the
    stack; the cache is emptied before both, so that only the mode differs."""
    torch.manual_seed(0)
    model = TinyLM(**MODELS[model_name])
    idx = torch.randint(0, 64, (2, 32))
    data = (idx, torch.roll(idx, -1, 1))
    policy = CastPolicy(half_dtype=torch.bfloat16)

    def plain(loss: torch.Tensor) -> None:
        policy.clear_cache()
        loss.backward()

    def timed(backward: Callable[[torch.Tensor], None]) -> Callable[[], float]:
        def run() -> float:
            total = 0.0
            for _ in range(steps):
                with policy.scope():
                    loss = model(*data)
                start = time.perf_counter()
                backward(loss)
                total += time.perf_counter() - start
                model.zero_grad(set_to_none=True)
                policy.clear_cache()
            return total / steps * 1e6

        return run

    return _compare("mode", model_name, {"policy.backward": timed(policy.backward), "loss.backward": timed(plain)},
                    rounds)


def _compare(part: str, model_name: str, variants: dict[str, Callable[[], float]], rounds: int) -> dict[str, Any]:
    """Warm each variant up, time them in rotated rounds; the first variant's ratio to the second (the reference)."""
    for run in variants.values():
        run()  # warm-up
    samples = _rounds(variants, rounds)
    name, reference = list(variants)
    ratio, iqr = _ratio(samples, name, reference)
    return {"part": part, "model": model_name, "us": {k: statistics.median(v) for k, v in samples.items()},
            "ratio": ratio, "ratio_iqr": iqr, "reference": reference}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="mid")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5, help="training steps per sample of the cache part")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "policy_backward.json")
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.steps < 1:
        parser.error(f"--rounds {args.rounds} --steps {args.steps}: need at least 2 rounds and 1 step")
    torch.set_num_threads(1)
    rows = [entry(args.rounds), cache(args.model, args.rounds, args.steps), mode(args.model, args.rounds, args.steps)]
    print(f"{'part':<6} {'variant':<16} {'us':>10} {'ratio to reference (IQR)':>30}")
    for row in rows:
        for name, us in row["us"].items():
            ratio = "" if name == row["reference"] else f"{row['ratio']:.3f}x ({row['ratio_iqr'][0]:.3f}-" \
                                                       f"{row['ratio_iqr'][1]:.3f})"
            print(f"{row['part']:<6} {name:<16} {us:>10.1f} {ratio:>30}")
    result = {"benchmark": "policy_backward", "device": cpu_model(), "torch": torch.__version__, "threads": 1,
              "model": args.model, "rounds": args.rounds, "steps": args.steps, "rows": rows}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
