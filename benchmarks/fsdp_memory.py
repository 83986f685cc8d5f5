"""What O1 keeps alive for the backward under FSDP2: the half all-gather against the FP32 one (Apex's exact O1).

FSDP frees each block's gathered weights after its forward and gathers them again for its backward; that is where
its memory saving comes from. A cast made *from* a gathered FP32 weight (O1's cast policy on an FP32 gather, or
``torch.autocast``, the recipe of Lightning's FSDP "bf16-mixed") is a new tensor that autograd saves for the
backward, outside FSDP's reach: it stays alive from the forward to the backward, a half copy of every weight a
matmul used. Gathering in half (``lightning_mpx.integrations.fsdp.shard_model``'s default at O1) makes the half weight
the gathered one, which FSDP frees and regathers like any other.

The measure is exact, not timed: the bytes of the distinct storages that autograd holds for the backward, read at
the end of the forward (after FSDP has freed what it frees), on one rank (world size 1, gloo; the per-rank bytes do
not depend on the number of ranks, only the shards do). Rows:

* ``O1 gather=half``: ``shard_model(model, Amp("O1"))`` and the cast policy (the default);
* ``O1 gather=fp32``: the same with ``gather="fp32"`` (Apex-exact O1);
* ``O2``: ``shard_model(model, Amp("O2"))``: FP32 shards gathered in half (the half compute copies are FSDP's
  gathered parameters, freed after each block and regathered for the backward);
* ``fsdp + autocast``: ``fully_shard`` per block and root, FP32 parameters, ``torch.autocast`` (Lightning's FSDP2
  "bf16-mixed").

    python benchmarks/fsdp_memory.py [--width 512] [--layers 8] [--batch 4] [--half-dtype bfloat16] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path
from typing import Any, Callable

import _harness  # benchmarks/ is on sys.path when a script runs


def _model(width: int, layers: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()) for _ in range(layers)]
    return nn.Sequential(*blocks, nn.Linear(width, 8))


def _saved_bytes(model: Any, forward: Callable[[Any], Any], x: Any) -> int:
    """Bytes of the distinct storages autograd saved for the backward, alive at the end of the forward."""
    import torch

    saved: list[Any] = []

    def pack(tensor: Any) -> Any:
        saved.append(tensor.untyped_storage())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = forward(x).float().pow(2).mean()
    alive = sum({s.data_ptr(): s.nbytes() for s in saved if s.nbytes()}.values())
    loss.backward()
    return alive


def measure(width: int, layers: int, batch: int, half_dtype: str) -> list[dict[str, Any]]:
    """The three rows (see the module docstring), in one process with a world-size-1 gloo group."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from lightning_mpx import Amp
    from lightning_mpx.integrations.fsdp import shard_model

    half = getattr(torch, half_dtype)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(1))
    fp32_bytes = sum(p.numel() * 4 for p in _model(width, layers).parameters())
    rows = []
    for level, gather in (("O1", "half"), ("O1", "fp32"), ("O2", "half")):
        model = _model(width, layers)
        amp = Amp(level, half_dtype=half_dtype)
        shard_model(model, amp, blocks=list(model)[:-1], gather=gather)
        amp.prepare_model(model)

        def forward(inp: Any, model: Any = model, amp: Any = amp) -> Any:
            with amp.forward_context():
                return model(inp)

        name = f"O1 gather={gather}" if level == "O1" else "O2"
        rows.append({"variant": name, "saved_bytes": _saved_bytes(model, forward, x)})
    model = _model(width, layers)
    for block in list(model)[:-1]:
        fully_shard(block)
    fully_shard(model)

    def autocast_forward(inp: Any) -> Any:
        with torch.autocast("cpu", dtype=half):
            return model(inp)

    rows.append({"variant": "fsdp + autocast", "saved_bytes": _saved_bytes(model, autocast_forward, x)})
    for row in rows:
        row["model_fp32_bytes"] = fp32_bytes
        row["fraction_of_model"] = row["saved_bytes"] / fp32_bytes
    if dist.is_initialized():
        dist.destroy_process_group()
    return rows


def table(rows: list[dict[str, Any]], pad: bool = False) -> str:
    return _harness.markdown_table(
        ("variant", "saved for backward (bytes)", "model FP32 (bytes)", "fraction of the model"),
        [(r["variant"], str(r["saved_bytes"]), str(r["model_fp32_bytes"]), f"{r['fraction_of_model']:.3f}")
         for r in rows],
        pad=pad,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--half-dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        dist.init_process_group("gloo", rank=0, world_size=1)
    rows = measure(args.width, args.layers, args.batch, args.half_dtype)
    result = {"benchmark": "fsdp_memory", **_harness.machine("cpu"), "command": _harness.command(),
              "width": args.width, "layers": args.layers, "batch": args.batch, "half_dtype": args.half_dtype,
              "rows": rows}  # fmt: skip
    print(table(rows, pad=True))
    _harness.save(args.out or _harness.default_out("fsdp_memory"), result, {"saved for backward": table(rows)})
    return result


if __name__ == "__main__":
    main()
