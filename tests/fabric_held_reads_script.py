"""Ranks of tests/test_fabric_held_reads.py (gloo, ONE launch), and the same loops on one process (the test imports
:func:`run_case` and runs it without a process group).

Fabric at O2 float16, a dynamic scale that grows every :data:`SCALING` ``growth_interval`` steps, an overflow injected
at step :data:`OVERFLOW_AT` (on rank 1 only under the group: the flag is all-reduced), the same batches on every rank
(DDP's average is then the one process's gradient). After each iteration ``mpx.metrics()`` and ``mpx.scaler`` are
read on rank 0 only (``if fabric.global_rank == 0``), in:

* ``body``: the optimizer holds the head; the body still requires grad (its gradients wait for good: every read
  holds the scale update back), SGD, and fused AdamW with ``skip_on_device``;
* ``gan``: a GAN whose G's optimizer the plugin meets at its first step, at iteration :data:`LATE` (before it G's
  gradients wait, unheld: those reads hold the update back);
* ``plain``: one optimizer over the whole model (nothing waits: the reads end the iteration, as on one process).

Each rank writes ``$MPX_OUT/rank{r}.json``: per case and ``reads`` (with the reads, or without them) the values read
(rank 0), whether the read held the update back, the final weights' fingerprint and the live scaler state.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any

import torch
from torch import nn

from tests.launch import run_cases

SCALING = {"half_dtype": "float16", "init_scale": 256.0, "growth_interval": 2}
STEPS, OVERFLOW_AT, LATE = 6, 2, 3
CASES = ("body", "body_skip_on_device", "gan", "plain")


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(100 + step))  # the same on every rank


def _fingerprint(params: Any) -> list[float]:
    flat = torch.cat([p.detach().double().flatten() for p in params])
    return [flat.sum().item(), (flat * torch.arange(flat.numel(), dtype=torch.float64)).sum().item()]


def _read(mpx: Any) -> dict[str, Any]:
    """What rank 0 logs: ``mpx.metrics()`` and the ``GradScaler``-API view's reads."""
    metrics = mpx.metrics()
    view = mpx.scaler
    state = view.state_dict()
    return {
        "loss_scale": metrics["mpx/loss_scale"], "overflows": metrics["mpx/overflows"],
        "skipped_steps": metrics["mpx/skipped_steps"], "get_scale": view.get_scale(), "state_scale": state["scale"],
        "growth_tracker": state["_growth_tracker"], "_scale": view._scale.item(),
    }  # fmt: skip


def run_case(case: str, reads: bool, devices: int) -> dict[str, Any]:
    """One loop of ``case`` on ``devices`` processes (2: under the launch's group, DDP; 1: no group), reading on rank
    0 after each iteration when ``reads``."""
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    skip = case == "body_skip_on_device"
    mpx = FabricMixedPrecisionPlugin("O2", skip_on_device=skip, **SCALING)
    fabric = Fabric(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", plugins=[mpx])
    if devices > 1:
        fabric.launch()
    rank = fabric.global_rank
    torch.manual_seed(0)
    make = (lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True)) if skip else (lambda p: torch.optim.SGD(p, lr=0.1))
    if case == "gan":
        gen, disc = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)), nn.Linear(4, 1)
        gen, opt_g = fabric.setup(gen, make(gen.parameters()))  # met at its first step, at iteration LATE
        disc, opt_d = fabric.setup(disc, make(disc.parameters()))
        optimizers, params = [opt_d, opt_g], [*gen.parameters(), *disc.parameters()]

        def forward(x: torch.Tensor) -> torch.Tensor:
            return disc(gen(x))
    else:
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        held = model[2].parameters() if case.startswith("body") else model.parameters()  # body: requires grad still
        model, opt = fabric.setup(model, make(held))
        optimizers, params, forward = [opt], list(model.parameters()), model
    out: dict[str, Any] = {"records": [], "held": []}
    with warnings.catch_warnings():  # the body requires grad on purpose (the case): the plugin's advice is known
        warnings.filterwarnings("ignore", message=".*require grad but no optimizer holds them")
        for step in range(STEPS):
            for optimizer in optimizers:
                optimizer.zero_grad()  # at the top: what waits at the read is this iteration's
            loss = forward(_batch(step)).float().pow(2).mean()
            if step == OVERFLOW_AT and rank == devices - 1:
                loss = loss * float("inf")  # rank 1's alone under the group: the all-reduced flag skips both
            fabric.backward(loss)
            optimizers[0].step()  # (the GAN's D)
            if case == "gan" and step >= LATE:
                optimizers[1].step()
            if reads and rank == 0:
                out["records"].append(_read(mpx))
                out["held"].append(mpx.amp.iteration.update_pending)  # the read held the update back
    out["weights"] = _fingerprint(params)
    mpx.amp.end_iteration()  # on every rank, as the next forward would: rank 0's last read may have ended it there
    out["live"] = [mpx.amp.scalers[0].state_dict(), mpx.amp.iteration.index]
    return out


def main() -> None:
    cases = [(case, reads) for case in CASES for reads in (True, False)]
    run_cases({f"{case}-{reads}": functools.partial(run_case, case, reads, devices=2) for case, reads in cases})


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    main()
