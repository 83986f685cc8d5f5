"""Two-process cases of tests/test_fabric_gan_carried_scales_ddp.py (gloo, one launch): a Fabric DDP GAN at O2 float16
whose generator's optimizer the plugin meets only at its first step, a read of the scale between D's and G's first steps
on rank 0 only (``read="rank0"``) or on both ranks (``"both"``), D's first loss overflowing on rank 1 only; with G
registered up front (``mpx.setup_optimizers``) and without; SGD and fused AdamW (``skip_on_device=True``); Fabric's
``"16-mixed"`` and FP32 for reference.

Each rank writes ``$MPX_OUT/rank{r}.json``: per case G's weights after its first step, the final weights, the final
scale (``None`` for FP32) and the error of a case that raised.
"""

from __future__ import annotations

import os
import sys

if "RANK" not in os.environ:  # the launcher
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.launch import launch_ranks

    raise SystemExit(launch_ranks(__file__))

from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from tests.launch import case_error, end_ranks, write_rank_results  # noqa: E402

SCALING = {"init_scale": 256.0, "growth_interval": 1}
STEPS = 3


def _gan(kind: str, read: str, register: bool, optim: str, rank: int) -> dict[str, Any]:
    """``kind``: "O2" (ours, float16), "skip_on_device" (ours, the found-inf check on the device), "native"
    (Fabric's "16-mixed", a GradScaler) or "fp32"."""
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    mpx = None
    if kind in ("O2", "skip_on_device"):
        mpx = FabricMixedPrecisionPlugin("O2", half_dtype="float16", skip_on_device=kind == "skip_on_device",
                                         **SCALING)  # fmt: skip
        fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[mpx])
    elif kind == "native":
        from lightning.fabric.plugins.precision import MixedPrecision

        native = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **SCALING))
        fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=[native])
    else:
        fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", precision="32-true")
    fabric.launch()
    torch.manual_seed(0)
    g_net, d_net = nn.Linear(4, 4), nn.Linear(4, 1)

    def opt(params: Any) -> torch.optim.Optimizer:
        if optim == "adamw":
            return torch.optim.AdamW(params, lr=1e-2, fused=True)
        return torch.optim.SGD(params, lr=0.1)

    g, g_opt = fabric.setup(g_net, opt(g_net.parameters()))
    d, d_opt = fabric.setup(d_net, opt(d_net.parameters()))
    if register and mpx is not None:
        mpx.setup_optimizers(g_opt, d_opt)
    first: list[list[float]] = []
    for step in range(STEPS):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        boost = 6e4 if step == 0 and rank == 1 and kind != "fp32" else 1.0  # D's first loss overflows on rank 1
        fabric.backward(d(x).float().pow(2).mean() * boost)
        fabric.backward(g(x).float().pow(2).mean())
        d_opt.step()
        if step == 0 and kind != "fp32" and (read == "both" or (read == "rank0" and rank == 0)):
            fabric._precision.scaler.get_scale()
        g_opt.step()
        if step == 0:
            first = [p.detach().float().flatten().tolist() for p in g_net.parameters()]
        d_opt.zero_grad()
        g_opt.zero_grad()
    final = fabric._precision.scaler.get_scale() if kind != "fp32" else None
    return {"first": first, "final": final,
            "weights": [p.detach().float().flatten().tolist() for p in (*g_net.parameters(), *d_net.parameters())]}


CASES = [
    (kind, read, register, optim)
    for optim in ("sgd", "adamw")
    for kind, read, register in (
        ("fp32", "none", False), ("native", "both", False), ("O2", "none", True), ("O2", "both", False),
        ("O2", "rank0", False), ("skip_on_device", "both", False), ("skip_on_device", "rank0", False),
    )
    if optim == "adamw" or kind != "skip_on_device"
]  # skip_on_device with a rank-0-only read hung before the read stopped ending the iteration on one rank


def main() -> None:
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ.get("MPX_HANG_S", "100")), exit=True)  # a hang fails fast
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    only = os.environ.get("MPX_CASES")
    for kind, read, register, optim in CASES:
        if only and f"{optim}-{kind}-{read}" not in only.split(","):
            continue
        name = f"{optim}-{kind}-{read}-{'registered' if register else 'late'}"
        with case_error(results.setdefault(name, {})) as out:
            out.update(_gan(kind, read, register, optim, rank))
    write_rank_results(results)
    end_ranks()


if __name__ == "__main__":
    main()
