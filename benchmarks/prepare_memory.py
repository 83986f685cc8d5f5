"""What preparing a model at O2 costs in host memory, and how far its FP32 masters are from the weights it was given.

A GPT-2 (transformers, built from a config, FP32 weights), then ``Amp("O2")``'s ``prepare_model`` and
``prepare_optimizer`` (AdamW over every parameter): the process's peak resident memory after each (a high-water mark,
so each row is a fresh child process), and the largest difference between a master and the FP32 weight it stands
for (in the same child, once its peaks are read: one import of transformers per row). ``--trees`` runs the same
child against other checkouts of the repository (a ``git worktree`` of an earlier commit), side by side in one run.

    python benchmarks/prepare_memory.py [--layers 12] [--hidden 768] [--half bfloat16] [--trees . /tmp/old] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, resource, sys, torch
from transformers import GPT2Config, GPT2LMHeadModel
from lightning_mpx import Amp
layers, hidden, half = int(sys.argv[1]), int(sys.argv[2]), getattr(torch, sys.argv[3])
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=hidden, n_head=max(1, hidden // 64), vocab_size=50257,
                                   n_positions=512))
built = peak()
amp = Amp("O2", half_dtype=half)
amp.prepare_model(model)
after_model = peak()
optimizer = amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
after_optimizer = peak()
print(json.dumps({"elements": sum(p.numel() for p in model.parameters()), "built_mib": built,
                  "prepare_model_mib": after_model, "prepare_optimizer_mib": after_optimizer}))
"""

_EXACTNESS = r"""
import json, sys, torch
from transformers import GPT2Config, GPT2LMHeadModel
from lightning_mpx import Amp
layers, hidden, half = int(sys.argv[1]), int(sys.argv[2]), getattr(torch, sys.argv[3])
torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=hidden, n_head=max(1, hidden // 64), vocab_size=50257,
                                   n_positions=512))
weights = {name: p.detach().clone() for name, p in model.named_parameters()}
amp = Amp("O2", half_dtype=half)
amp.prepare_model(model)
amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
gap = max((amp.master_of(p).float() - weights[name]).abs().max().item() for name, p in model.named_parameters())
exact = sum(torch.equal(amp.master_of(p).float(), weights[name]) for name, p in model.named_parameters())
print(json.dumps({"max_abs_gap": gap, "exact_tensors": int(exact), "tensors": len(weights)}))
"""


def _child(code: str, tree: Path, args: list[str]) -> list[dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, cwd="/", capture_output=True, text=True,
                          timeout=900, check=False)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the child for {tree} failed:\n{done.stderr[-3000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return [json.loads(line) for line in lines[-2:]]  # the peaks' line, then the exactness line


def measure(tree: Path, layers: int, hidden: int, half: str) -> dict[str, Any]:
    """One row: the peaks, then (in the same child, once they are read and printed) the masters' exactness."""
    args = [str(layers), str(hidden), half]
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip() or "?"  # fmt: skip
    peaks, exactness = _child(_CHILD + "del model, optimizer, amp\n" + _EXACTNESS, tree, args)
    return {"tree": str(tree), "commit": commit, **peaks, **exactness}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--half", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--trees", type=Path, nargs="+", default=[ROOT],
                        help="repository checkouts to import lightning_mpx from (default: this one)")
    parser.add_argument("--out", type=Path, default=_harness.default_out("prepare_memory"))
    args = parser.parse_args(argv)
    if args.layers < 1 or args.hidden < 64 or args.hidden % 64:
        parser.error(f"--layers={args.layers} must be at least 1 and --hidden={args.hidden} a multiple of 64")
    for tree in args.trees:
        if not (tree / "lightning_mpx" / "__init__.py").exists():
            parser.error(f"--trees: {tree} holds no lightning_mpx package")
    rows = [measure(tree.resolve(), args.layers, args.hidden, args.half) for tree in args.trees]
    table = _harness.markdown_table(
        ["tree", "commit", "parameters", "peak MiB built", "after prepare_model", "after prepare_optimizer",
         "masters equal to the FP32 weights", "largest |master - FP32 weight|"],
        [[r["tree"], r["commit"], r["elements"], f"{r['built_mib']:.0f}", f"{r['prepare_model_mib']:.0f}",
          f"{r['prepare_optimizer_mib']:.0f}", f"{r['exact_tensors']}/{r['tensors']}", f"{r['max_abs_gap']:.3g}"]
         for r in rows])  # fmt: skip
    print(table)
    result = {"benchmark": "prepare_memory", "command": _harness.command(argv), **_harness.machine("cpu"),
              "layers": args.layers, "hidden": args.hidden, "half": args.half, "rows": rows}  # fmt: skip
    _harness.save(args.out, result, {f"O2 prepare of a GPT-2 ({args.half}): peak host memory": table})
    return result


if __name__ == "__main__":
    main()
