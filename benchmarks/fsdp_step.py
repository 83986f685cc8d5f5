"""Sharded training speed and memory: lightning_mpx under FSDP against Lightning's own FSDP mixed precision.

One GPU, one rank: FSDP with a world size of 1 still runs its whole machinery (the all-gather of each block's
parameters before its forward and backward, the reduce-scatter of the gradients, the sharded optimizer step), so the
figures say what the mixed-precision layer costs on top of it, not what sharding saves across ranks. The model is
``benchmarks/step.py``'s GPT-2 small (sequence 512, batch 8; ``--size small`` on CPU), AdamW, each variant in its own
fresh subprocess:

* ``fsdp2-lightning-bf16-mixed``: Lightning's ``ModelParallelStrategy`` (FSDP2, ``fully_shard`` per block and on the
  root, FP32 parameters) with ``precision="bf16-mixed"`` (autocast on top). Lightning refuses "16-mixed" there.
* ``fsdp2-mpx-O{1,2}-{fp16,bf16}``: the same strategy with ``MixedPrecisionPlugin``; ``configure_model`` shards with
  ``lightning_mpx.integrations.fsdp.shard_model`` (the level's per-module policies: half all-gather, FP32 reduction).
* ``fsdp1-lightning-{bf16,16}-mixed``, ``fsdp1-mpx-O2-fp16``: Lightning's ``FSDPStrategy`` (FSDP1, one unit per
  block) with its own ``FSDPPrecision`` (``ShardedGradScaler`` for "16-mixed") and with the plugin (on CPU, for
  ``--check``, through a subclass that gives FSDP1 ``device_id=cpu``).

Step time is the median over ``--steps`` steps after ``--warmup``, timed from ``on_train_batch_start`` to
``on_train_batch_end`` with ``torch.cuda.synchronize()``; peak memory is ``torch.cuda.max_memory_allocated`` (CPU:
the child's peak RSS, which says little). Ratios: throughput and peak memory against ``fsdp2-lightning-bf16-mixed``.
Targets (issue 24): O2 fp16 throughput >= that row's, and peak memory <= it.

    python benchmarks/fsdp_step.py [--device cpu|cuda] [--size small|real] [--steps 20] [--warmup 5] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import _harness  # benchmarks/ is on sys.path when a script runs
import step

FSDP2_VARIANTS = (
    "fsdp2-lightning-bf16-mixed",
    "fsdp2-mpx-O2-fp16",
    "fsdp2-mpx-O1-fp16",
    "fsdp2-mpx-O2-bf16",
    "fsdp2-mpx-O1-bf16",
)
FSDP1_VARIANTS = ("fsdp1-lightning-bf16-mixed", "fsdp1-lightning-16-mixed", "fsdp1-mpx-O2-fp16")
VARIANTS = FSDP2_VARIANTS + FSDP1_VARIANTS
REFERENCE = "fsdp2-lightning-bf16-mixed"
#: The variants ``--check`` runs (CPU, one step): the reference and the plugin at O2 on FSDP2, and the plugin on
#: FSDP1 (through a CPU subclass of Lightning's ``FSDPStrategy``).
CHECK_VARIANTS = ("fsdp2-lightning-bf16-mixed", "fsdp2-mpx-O2-bf16", "fsdp1-mpx-O2-fp16")


def _module(net: Any, variant: str) -> Any:
    """A LightningModule over ``net`` (AdamW, lr 1e-3); FSDP2 variants shard it in ``configure_model``."""
    import lightning.pytorch as pl
    import torch

    class Sharded(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def configure_model(self) -> None:
            if not variant.startswith("fsdp2"):
                return
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            if "-mpx-" in variant:
                from lightning_mpx.integrations.fsdp import shard_model

                shard_model(self.net, self.trainer.precision_plugin, mesh=mesh, blocks=list(self.net.blocks))
            else:  # Lightning's documented recipe: fully_shard per block, then the root; autocast does the rest
                for block in self.net.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return step._loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Sharded()


def _strategy(variant: str, net: Any, device: str) -> Any:
    if variant.startswith("fsdp2"):
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    from lightning.pytorch.strategies import FSDPStrategy

    if device == "cuda":
        return FSDPStrategy(auto_wrap_policy={type(net.blocks[0])})
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel

    class CPUFSDPStrategy(FSDPStrategy):
        """For ``--check`` only: Lightning passes ``device_id=None`` on CPU, where FSDP1 looks for a GPU; wrapped here
        with Lightning's own arguments and ``device_id=cpu``, the rest is Lightning's."""

        def _setup_model(self, model: Any) -> Any:
            if not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
                model = FullyShardedDataParallel(
                    model, mixed_precision=self.mixed_precision_config, device_id=torch.device("cpu"), **self.kwargs
                )
                self.kwargs.pop("auto_wrap_policy", None)  # applied above
            return super()._setup_model(model)

    return CPUFSDPStrategy(auto_wrap_policy={type(net.blocks[0])})


def run_child(variant: str, size: str, steps: int, warmup: int, device: str) -> dict[str, Any]:
    """Train ``variant`` for ``warmup + steps`` steps in this process; returns its step times and peak memory."""
    import lightning.pytorch as pl
    import torch

    from lightning_mpx import MixedPrecisionPlugin

    torch.manual_seed(0)
    cuda = device == "cuda"
    spec = step.SPECS[("gpt", size)]
    total = warmup + steps
    batches = step.make_batches("gpt", spec, min(total, 8), torch.device(device))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    net = step.build_model("gpt", spec)
    times: list[float] = []

    class Timer(pl.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            sync()
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            sync()
            times.append(time.perf_counter() - self.start)

    if "-mpx-" in variant:
        level, half = variant.split("-")[2], step.half_dtype_of(variant)
        precision: dict[str, Any] = {"plugins": [MixedPrecisionPlugin(level, half_dtype=half, on_floor="continue")]}
    else:
        precision = {"precision": variant.split("-lightning-")[1]}
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu", devices=1, strategy=_strategy(variant, net, device), max_steps=total,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[Timer()], **precision,
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(step.ListDataset(batches), batch_size=None, shuffle=False)
    trainer.fit(_module(net, variant), loader)
    timed = times[warmup:]
    median = statistics.median(timed)
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    plugin = trainer.precision_plugin
    out: dict[str, Any] = {
        "variant": variant,
        "steps_timed": len(timed),
        "step_ms_median": median * 1e3,
        "step_ms_iqr": _harness.iqr_width(timed) * 1e3,
        "tokens_per_second": spec.batch * spec.seq / median,
        "peak_memory_bytes": int(peak),
        "peak_memory_kind": "cuda_max_memory_allocated" if cuda else "peak_rss",
        "lightning_precision": str(trainer.precision),
    }
    if isinstance(plugin, MixedPrecisionPlugin):
        out["skipped_steps"] = sum(plugin.amp.skipped_steps)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return out


def _spawn(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--_child", variant, "--size", args.size, "--steps",
           str(args.steps), "--warmup", str(args.warmup), "--device", args.device]  # fmt: skip
    return _harness.run_child(cmd, f"variant {variant}", args.child_timeout)


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Throughput and peak memory of each row against :data:`REFERENCE` (when it ran)."""
    ref = next((r for r in rows if r["variant"] == REFERENCE), None)
    for row in rows:
        row["throughput_vs_reference"] = None if ref is None else ref["step_ms_median"] / row["step_ms_median"]
        row["memory_vs_reference"] = None if ref is None else row["peak_memory_bytes"] / ref["peak_memory_bytes"]


def check_targets(rows: list[dict[str, Any]], device: str) -> list[dict[str, Any]]:
    """Issue 24's targets: ``fsdp2-mpx-O2-fp16`` throughput >= the reference's, and peak memory <= it (GPU only)."""
    row = next((r for r in rows if r["variant"] == "fsdp2-mpx-O2-fp16"), None)
    if device != "cuda" or row is None or row.get("throughput_vs_reference") is None:
        return []
    return [
        {"target": f"fsdp2-mpx-O2-fp16 throughput >= {REFERENCE}", "value": row["throughput_vs_reference"],
         "goal": 1.0, "met": row["throughput_vs_reference"] >= 1.0},
        {"target": f"fsdp2-mpx-O2-fp16 peak memory <= {REFERENCE}", "value": row["memory_vs_reference"],
         "goal": 1.0, "met": row["memory_vs_reference"] <= 1.0},
    ]  # fmt: skip


def table(rows: list[dict[str, Any]], pad: bool = False) -> str:
    columns = ("variant", "ms/step", "tokens/s", "peak MiB", "x throughput", "x memory")
    body = [
        (r["variant"], _harness.cell(r["step_ms_median"], ".2f"), _harness.cell(r["tokens_per_second"], ".0f"),
         _harness.cell(r["peak_memory_bytes"] / 2**20, ".0f"), _harness.cell(r.get("throughput_vs_reference"), ".3f"),
         _harness.cell(r.get("memory_vs_reference"), ".3f"))
        for r in rows
    ]  # fmt: skip
    return _harness.markdown_table(columns, body, pad=pad)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--size", choices=("small", "real"), default=None, help="default: real on cuda, small on cpu")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=None, metavar="VARIANT")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--child-timeout", type=float, default=180.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = build_parser().parse_args(argv)
    args.size = args.size or ("real" if args.device == "cuda" else "small")
    if args._child:
        print(json.dumps(run_child(args._child, args.size, args.steps, args.warmup, args.device)), flush=True)
        return None
    variants = args.variants or (VARIANTS if args.device == "cuda" else FSDP2_VARIANTS)
    rows: list[dict[str, Any]] = []
    failed: dict[str, str] = {}
    for variant in variants:
        try:
            rows.append(_spawn(variant, args))
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            failed[variant] = str(error)[-2000:]
    add_ratios(rows)
    result = {"benchmark": "fsdp_step", **_harness.machine(args.device), "command": _harness.command(),
              "size": args.size, "spec": vars(step.SPECS[("gpt", args.size)]), "steps": args.steps,
              "warmup": args.warmup, "rows": rows, "failed": failed,
              "targets": check_targets(rows, args.device)}  # fmt: skip
    print(table(rows, pad=True))
    for name, error in failed.items():
        print(f"{name} failed:\n{error}")
    out = args.out or _harness.default_out("fsdp_step")
    _harness.save(out, result, {"steps": table(rows)})
    return result


if __name__ == "__main__":
    main()
