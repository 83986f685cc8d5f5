"""Run by tests/test_fabric_fsdp1_frozen_heap.py: ``FabricMixedPrecisionPlugin("O1", float16)`` under Fabric's
``FSDPStrategy`` (FSDP1, the root the only unit), two CPU processes (gloo), the heap frozen by the user
(``gc.freeze()``, as before forking data-loader workers) between ``fabric.setup`` and the first step, or not.

``$MPX_CASES`` lists the runs, comma-separated: ``plain`` and ``frozen``. The loop: ``STEPS`` steps, at ``INF_AT`` an
inf in rank 0's own shard of a gradient only (rank 1's gradients are finite). Every rank writes
``$MPX_OUT/rank<r>.json``, an entry per case (``error`` when it raised).
"""

from __future__ import annotations

import gc
import os
from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin
from tests.fabric_fsdp1_script import CPUFSDPStrategy, full_weights
from tests.launch import case_error, end_ranks, write_rank_results

STEPS = 4
INF_AT = 2
BATCH = 8  # global
CLIP = 0.05  # below every norm: every clip scales
SETTINGS: dict[str, Any] = {"half_dtype": "float16", "loss_scale": "dynamic", "init_scale": 2.0**10}


def run(frozen: bool, out: dict[str, Any]) -> None:
    plugin = FabricMixedPrecisionPlugin("O1", **SETTINGS)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=CPUFSDPStrategy(), plugins=[plugin])
    fabric.launch()  # the first run starts the process group; the second finds it running
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    out["found_before_the_first_step"] = not plugin._unchecked  # the wrapper is looked for after the freeze
    if frozen:
        gc.collect()
        gc.freeze()  # the user's: everything alive now, the FSDP1 wrapper among it, is out of the collector's view
    rank = fabric.global_rank
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 2, generator=g)) for _ in range(STEPS)]
    try:
        for step, (x, y) in enumerate(data):
            mine = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
            fabric.backward(F.mse_loss(model(x[mine]).float(), y[mine]))
            if step == INF_AT and rank == 0:  # rank 0's own shard only: the other rank's gradients are finite
                grad = next(p.grad for p in model.parameters() if p.grad is not None and p.grad.numel())
                grad.view(-1)[0] = float("inf")
            out["norms"].append(float(fabric.clip_gradients(model, optimizer, max_norm=CLIP)))
            optimizer.step()
            optimizer.zero_grad()
            out["skipped"].append(plugin.step_was_skipped(optimizer))
            out["scales"].append(float(plugin.metrics()["mpx/loss_scale"]))
    finally:
        if frozen:
            gc.unfreeze()
    out["sharded"] = plugin.amp.sharded
    record = plugin.amp.last_overflow
    out["overflow"] = (sorted(record.parameters), list(record.ranks)) if record is not None else None
    out["weights"] = full_weights(model)


def main() -> None:
    results: dict[str, Any] = {}
    for case in os.environ["MPX_CASES"].split(","):
        with case_error({"skipped": [], "scales": [], "norms": []}) as out:
            run(case == "frozen", out)
        results[case] = out
    write_rank_results(results)
    end_ranks()


if __name__ == "__main__":
    main()
