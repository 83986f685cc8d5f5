"""Run by tests/test_core_shared_head_groups.py: two optimizers holding the same parameters of an FSDP-sharded model
under Fabric (``ModelParallelStrategy``'s FSDP2, ``FSDPStrategy``'s FSDP1),
``FabricMixedPrecisionPlugin("O1", float16)``, two CPU processes (gloo).

``$MPX_CASES``, comma-separated: ``fsdp2-shared`` (the whole model's optimizer and the head's own; ``fsdp2-clip``:
the head's gradients clipped by ``fabric.clip_gradients`` between the two steps), ``fsdp2-groups``
(the fix named by the refusal: one optimizer, a group each), ``fsdp1-shared`` (two optimizers over the flat
parameter). Every rank writes ``$MPX_OUT/rank<r>.json``, an entry per case (``error`` when it raised), with the
full weights at the end.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard

from lightning_mpx import FabricMixedPrecisionPlugin
from tests.fabric_fsdp1_script import CPUFSDPStrategy, full_weights
from tests.launch import case_error, end_ranks, write_rank_results

STEPS = 3
BATCH = 8  # global
CLIP = 0.05  # below the head's norm: the clip scales
SETTINGS: dict[str, Any] = {"half_dtype": "float16", "loss_scale": "dynamic", "init_scale": 2.0**10}


def build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)) for _ in range(STEPS)]


def optimizers(model: nn.Module, inner: nn.Sequential, case: str) -> list[torch.optim.Optimizer]:
    """The whole model's SGD and the head's (FSDP2); one SGD with a group each; FSDP1: two over the flat parameter."""
    if case == "fsdp2-groups":
        trunk = list(inner[0].parameters())
        return [torch.optim.SGD([{"params": trunk}, {"params": list(inner[2].parameters()), "lr": 0.3}], lr=0.05)]
    head = model.parameters() if case == "fsdp1-shared" else inner[2].parameters()
    return [torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(head, lr=0.3)]


def run(case: str, out: dict[str, Any]) -> None:
    plugin = FabricMixedPrecisionPlugin("O1", **SETTINGS)
    if case.startswith("fsdp2"):

        def parallelize(model: nn.Sequential, mesh: Any) -> nn.Module:
            fully_shard(model[2], mesh=mesh["data_parallel"])
            return fully_shard(model, mesh=mesh["data_parallel"])

        strategy: Any = ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=1)
    else:
        strategy = CPUFSDPStrategy()
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[plugin])
    fabric.launch()  # the first run starts the process group; later ones find it running
    inner = build()
    model = fabric.setup_module(inner)
    opts = fabric.setup_optimizers(*optimizers(model, inner, case))
    opts = list(opts) if isinstance(opts, (list, tuple)) else [opts]
    rank, per = fabric.global_rank, BATCH // 2
    for x, y in batches():
        fabric.backward(F.mse_loss(model(x[rank * per : (rank + 1) * per]).float(), y[rank * per : (rank + 1) * per]))
        for i, opt in enumerate(opts):
            if i == 1 and case == "fsdp2-clip":  # the head's, after the whole model's step (its gradients unscaled)
                fabric.clip_gradients(model, opt, max_norm=CLIP)
            opt.step()
        for opt in opts:
            opt.zero_grad()
    if case.startswith("fsdp2"):
        out["weights"] = [p.full_tensor().double().flatten().tolist() for p in model.parameters()]
    else:
        out["weights"] = full_weights(model)


def main() -> None:
    results: dict[str, Any] = {}
    for case in os.environ["MPX_CASES"].split(","):
        with case_error({}) as out:
            run(case, out)
        results[case] = out
    write_rank_results(results)
    end_ranks()


if __name__ == "__main__":
    main()
