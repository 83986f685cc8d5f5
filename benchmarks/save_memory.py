"""How much host memory a checkpoint save takes at O2, over what the process held when the save began.

A model of ``--layers`` equal ``Linear(--width, --width)`` layers (default 6 x 2048: 96 MiB of FP32 weights), one SGD
step (no momentum: no optimizer state), then each door's documented save: ``fabric.save(path, {"model", "optimizer",
"mpx"})`` with ``FabricMixedPrecisionPlugin("O2")``, the Accelerate adapter's ``accelerator.save_state(folder)`` at
``"O2"``, the Apex layer's ``torch.save({"model": model.state_dict(), "optimizer": ..., "amp":
amp.state_dict()})`` at O2 and the Trainer's ``trainer.save_checkpoint(path)`` after a one-step ``trainer.fit`` with
``MixedPrecisionPlugin("O2")``, all bfloat16; the reference is the same model's ``fabric.save`` under Fabric's own
``"bf16-mixed"`` (FP32 weights, no copy to make), with Accelerate's own ``"bf16"`` beside it for the Accelerate row and
the Trainer's own ``"bf16-mixed"`` for the Trainer rows. Lightning's checkpoint IO serializes the whole file in
memory once the checkpoint is built (``_atomic_save``), so a copy made and dropped while it is built does not raise
the save's host peak there; the ``-stream`` rows write the checkpoint the Trainer builds (Lightning's
``dump_checkpoint``) with ``torch.save`` to the file, as a checkpoint IO that streams does, where it does (and on a
GPU such a copy is device memory: the masters live there).
Each row runs in a child process of its own with ``MALLOC_MMAP_THRESHOLD_=65536`` (freed buffers go back to the
system at once, so the resident size follows what is alive); the save's peak is the kernel's high-water mark
(``VmHWM``, reset through ``/proc/self/clear_refs`` as the save starts; ``/proc/self/statm`` sampled every 0.5 ms where
the reset is refused). Each row gives that peak in MiB, in FP32 weights, and against the reference's: Fabric's save
serializes the whole file in memory before it writes it (Lightning's ``_atomic_save``), so ``"bf16-mixed"`` peaks
about one model's FP32 weights over its start, and a Fabric save at O2 that also held an FP32 copy of every master
at once peaks about twice as high.

``--trees`` runs the same rows against other checkouts of the repository (a ``git worktree`` of an earlier commit),
side by side in one run. ``--check``: every row in this process, on a tiny model, to run the code path (the suite
does, in about a second): its figures mean nothing.

    python benchmarks/save_memory.py [--layers 6] [--width 2048] [--trees . /tmp/old] [--check] [--out PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if "--_child" not in sys.argv:  # a child imports lightning_mpx from the tree it was started for (PYTHONPATH)
    sys.path.insert(0, str(ROOT))

#: The rows, the reference first: (name, door, precision).
VARIANTS = (
    ("fabric-bf16-mixed", "fabric", "bf16-mixed"),
    ("fabric-O2", "fabric", "O2"),
    ("accelerate-bf16", "accelerate", "bf16"),
    ("accelerate-O2", "accelerate", "O2"),
    ("apex-O2", "apex", "O2"),
    ("trainer-bf16-mixed", "trainer", "bf16-mixed"),
    ("trainer-O2", "trainer", "O2"),
    ("trainer-bf16-mixed-stream", "trainer_stream", "bf16-mixed"),
    ("trainer-O2-stream", "trainer_stream", "O2"),
)
REFERENCE = "fabric-bf16-mixed"
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _high_water() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _reset_high_water() -> bool:
    """Set the kernel's high-water mark of this process to its resident size now (Linux 4.0 on); False: refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def peak_over_start(save: Callable[[], Any]) -> tuple[int, int, str]:
    """``(resident bytes as save() began, its peak above that, how the peak was read)``."""
    gc.collect()
    if _reset_high_water():
        start = _resident()
        save()
        return start, max(0, _high_water() - start), "VmHWM"
    start = _resident()
    peak, done = [start], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _resident())
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        save()
    finally:
        done.set()
        sampler.join()
    return start, max(0, max(peak[0], _resident()) - start), "statm every 0.5 ms"


def _model(layers: int, width: int) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _batch(width: int) -> Any:
    import torch

    return torch.randn(4, width, generator=torch.Generator().manual_seed(0))


def _fabric(precision: str, layers: int, width: int, folder: str) -> tuple[Callable[[], Any], Any]:
    import torch
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    mpx = FabricMixedPrecisionPlugin(precision, half_dtype=torch.bfloat16) if precision.startswith("O") else None
    fabric = Fabric(accelerator="cpu", devices=1, **({"plugins": [mpx]} if mpx else {"precision": precision}))
    model = _model(layers, width)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    fabric.backward(model(_batch(width)).float().pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
    state = {"model": model, "optimizer": optimizer, **({"mpx": mpx} if mpx else {})}
    return lambda: fabric.save(os.path.join(folder, "run.ckpt"), state), model


def _accelerate(precision: str, layers: int, width: int, folder: str) -> tuple[Callable[[], Any], Any]:
    import torch
    from accelerate.state import AcceleratorState, GradientState

    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    kwargs = {"kwargs_handlers": [MixedPrecisionKwargs(half_dtype=torch.bfloat16)]} if precision == "O2" else {}
    accelerator = Accelerator(mixed_precision=precision, cpu=True, **kwargs)
    model = _model(layers, width)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    accelerator.backward(model(_batch(width)).float().pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
    return lambda: accelerator.save_state(os.path.join(folder, "state")), model


def _apex(precision: str, layers: int, width: int, folder: str) -> tuple[Callable[[], Any], Any]:
    import torch

    from lightning_mpx.apex import amp

    model = _model(layers, width)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level=precision, cast_model_type=torch.bfloat16,
                                      verbosity=0)  # fmt: skip
    with amp.scale_loss(model(_batch(width).bfloat16()).float().pow(2).mean(), optimizer) as scaled:
        scaled.backward()
    optimizer.step()
    optimizer.zero_grad()

    def save() -> None:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}
        torch.save(state, os.path.join(folder, "run.pt"))

    return save, model


def _trainer(precision: str, layers: int, width: int, folder: str) -> tuple[Callable[[], Any], Any]:
    import lightning.pytorch as pl
    import torch

    from lightning_mpx import MixedPrecisionPlugin

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model(layers, width)

        def training_step(self, batch: Any, index: int) -> Any:
            return self.net(batch[0]).float().pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    plugin = MixedPrecisionPlugin(precision, half_dtype=torch.bfloat16) if precision.startswith("O") else None
    given = {"plugins": [plugin]} if plugin else {"precision": precision}
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, **given)  # fmt: skip
    module = Module()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(_batch(width)), batch_size=4)
    trainer.fit(module, data)
    return lambda: trainer.save_checkpoint(os.path.join(folder, "run.ckpt")), module


def _trainer_stream(precision: str, layers: int, width: int, folder: str) -> tuple[Callable[[], Any], Any]:
    """The checkpoint the Trainer's save builds (Lightning's ``dump_checkpoint``, which ``trainer.save_checkpoint``
    and ``ModelCheckpoint`` call) written by ``torch.save`` to the file, as a checkpoint IO that streams writes it."""
    import torch

    _, module = _trainer(precision, layers, width, folder)
    trainer = module.trainer
    return lambda: torch.save(trainer._checkpoint_connector.dump_checkpoint(), os.path.join(folder, "run.ckpt")), module


_DOORS = {"fabric": _fabric, "accelerate": _accelerate, "apex": _apex, "trainer": _trainer,
          "trainer_stream": _trainer_stream}  # fmt: skip


def measure(variant: str, layers: int, width: int) -> dict[str, Any]:
    """One row, in this process: the model trained one step through ``variant``'s door, then its save's peak."""
    door, precision = next((d, p) for name, d, p in VARIANTS if name == variant)
    with tempfile.TemporaryDirectory() as folder:
        try:
            save, model = _DOORS[door](precision, layers, width, folder)
            start, peak, method = peak_over_start(save)
            weights = sum(p.numel() for p in model.parameters()) * 4
            size = sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())
        finally:
            if door == "apex":
                from lightning_mpx.apex._state import _amp_state

                _amp_state.reset()
    return {"variant": variant, "fp32_weight_bytes": weights, "start_bytes": start, "peak_over_start_bytes": peak,
            "checkpoint_bytes": size, "peak_method": method}  # fmt: skip


def _child(tree: Path, variant: str, layers: int, width: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(tree), MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    argv = [sys.executable, str(Path(__file__).resolve()), "--_child", variant, "--layers", str(layers), "--width",
            str(width)]  # fmt: skip
    done = subprocess.run(argv, env=env, cwd="/", capture_output=True, text=True, timeout=900, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the child for {variant} in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def with_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with its save's peak over start in FP32 weights (``peak_over_weights``) and against the reference
    row's of the same tree (``peak_vs_bf16_mixed``; ``None`` where that one is under a page)."""
    reference = {r["tree"]: r["peak_over_start_bytes"] for r in rows if r["variant"] == REFERENCE}
    for row in rows:
        ref = reference.get(row["tree"])
        row["peak_over_weights"] = row["peak_over_start_bytes"] / row["fp32_weight_bytes"]
        row["peak_vs_bf16_mixed"] = row["peak_over_start_bytes"] / ref if ref and ref >= _PAGE else None
    return rows


def _mib(value: float | None) -> str | None:
    return None if value is None else f"{value / 2**20:.1f}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=None, help="equal Linear layers (default 6; --check: 2)")
    parser.add_argument("--width", type=int, default=None, help="their width (default 2048; --check: 32)")
    parser.add_argument("--variants", nargs="+", choices=[v[0] for v in VARIANTS], default=[v[0] for v in VARIANTS])
    parser.add_argument(
        "--trees",
        type=Path,
        nargs="+",
        default=[ROOT],
        help="repository checkouts to import lightning_mpx from (default: this one)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="every row in this process on a tiny model: runs the code path, measures nothing",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    layers = args.layers if args.layers is not None else 2 if args.check else 6
    width = args.width if args.width is not None else 32 if args.check else 2048
    if layers < 1 or width < 1:
        parser.error(f"--layers={layers} and --width={width} must be at least 1")
    if args._child:
        print(json.dumps(measure(args._child, layers, width)))
        return {}
    for tree in args.trees:
        if not (tree / "lightning_mpx" / "__init__.py").exists():
            parser.error(f"--trees: {tree} holds no lightning_mpx package")
    if args.check and args.trees != [ROOT]:
        parser.error("--check runs in this process: it takes no --trees")
    variants = list(dict.fromkeys([REFERENCE, *args.variants]))
    rows = []
    for tree in [t.resolve() for t in args.trees]:
        commit = _harness.git("-C", str(tree), "rev-parse", "--short", "HEAD") or "?"
        for variant in variants:
            row = measure(variant, layers, width) if args.check else _child(tree, variant, layers, width)
            rows.append({"tree": str(tree), "commit": commit, **row})
    rows = with_ratios(rows)
    table = _harness.markdown_table(
        ["tree", "commit", "variant", "FP32 weights MiB", "resident at start MiB", "save's peak over start MiB",
         "over start / FP32 weights", "over start vs fabric-bf16-mixed's"],
        [[r["tree"], r["commit"], r["variant"], _mib(r["fp32_weight_bytes"]), _mib(r["start_bytes"]),
          _mib(r["peak_over_start_bytes"]), f"{r['peak_over_weights']:.2f}",
          None if r["peak_vs_bf16_mixed"] is None else f"{r['peak_vs_bf16_mixed']:.3f}"] for r in rows],
    )  # fmt: skip
    print(table)
    device = "cpu (save_memory --check: one process, tiny model, measures nothing)" if args.check else None
    result = {"benchmark": "save_memory", "command": _harness.command(argv), **_harness.machine("cpu", device=device),
              "check": args.check, "layers": layers, "width": width, "rows": rows}  # fmt: skip
    out = args.out or _harness.default_out("save_memory_check" if args.check else "save_memory")
    _harness.save(out, result, {f"O2 saves of {layers} x Linear({width}, {width}): peak host memory": table})
    return result


if __name__ == "__main__":
    main()
