"""Run by tests/test_core_fsdp2_device_skip.py (its cases in the Trainer script's launch,
tests/hostile_lightning_fsdp_script.py, through :func:`run_case`), or alone: hostile attacks on FSDP2's device skip
(a fused AdamW on a model sharded with ``fully_shard``, ``skip_on_device=None``), two gloo processes, each case
against the same run with ``skip_on_device=False`` (the host read).

``$MPX_CASES`` lists the cases (names in :data:`CASES`); every rank writes ``$MPX_OUT/{case}_rank{r}.json`` with the
device run and the host run of the case. The model, its sharding and the data are tests/fsdp_engine_script.py's.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_mpx import Amp, LossScaleFloorError
from lightning_mpx.engine.sharding import local_tensor
from tests.fsdp_engine_script import BATCH, build, data, shard
from tests.launch import end_ranks, launch_ranks

STEPS = 5


def poison(param: torch.nn.Parameter) -> None:
    """An inf in rank 0's own shard of ``param``'s gradient (the other rank's stays finite)."""
    local_tensor(param.grad).view(-1)[0] = float("inf")


def record_of(amp: Amp) -> dict[str, Any] | None:
    record = amp.last_overflow
    if record is None:
        return None
    return {"step": record.step, "ranks": list(record.ranks), "parameters": sorted(record.parameters),
            "modules": sorted(record.modules)}  # fmt: skip


def train(case: str, *, rank: int, world: int, skip_on_device: bool | None) -> dict[str, Any]:
    """One run of ``case``; what both runs of a case must agree on."""
    level, dtype = ("O1", "bfloat16") if case.startswith("floor") else ("O2", "float16")
    on_floor = "raise" if case.startswith("floor") else "continue"
    poison_at = {"step0": 0, "accum": 2, "floor": 2, "floor_reads": 2, "floor_last": STEPS - 1}.get(case, 1)
    model = build()
    amp = Amp(level, half_dtype=dtype, init_scale=2.0**12, growth_interval=2, on_floor=on_floor,
              skip_on_device=skip_on_device)  # fmt: skip
    shard(model, level, getattr(torch, dtype))
    amp.prepare_model(model)
    if case == "two_opt":  # a fused AdamW on the first layer, SGD on the rest: each takes its own path
        first = list(model[0].parameters())
        rest = [p for p in model.parameters() if all(p is not q for q in first)]
        optimizers = [torch.optim.AdamW(first, lr=0.01, fused=True), torch.optim.SGD(rest, lr=0.05, momentum=0.9)]
    else:
        optimizers = [torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)]
    for optimizer in optimizers:
        amp.prepare_optimizer(optimizer)
    micro = 2 if case == "accum" else 1
    per_rank = BATCH // world
    out: dict[str, Any] = {"scales": [], "errors": [], "rank0_reads": [], "stepped": []}
    resumed = None
    batches = data(STEPS * micro)
    step = 0
    while step < STEPS:
        try:
            for m in range(micro):
                x, y = batches[step * micro + m]
                x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
                with amp.forward_context():
                    loss = F.mse_loss(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y)
                amp.backward(loss / micro)
                if step == poison_at and m == micro - 1 and rank == 0:
                    poison(model[0].weight if case == "two_opt" else model[3].weight)
            if case == "two_opt" and step == 3 and rank == 0:
                poison(model[3].weight)  # the SGD's turn (host path) with the AdamW on the device
            outcomes = []
            for optimizer in optimizers:
                if case == "clip":
                    amp.clip_grad_norm_(optimizer, 0.5)
                elif case == "unscale_clip":
                    amp.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 0.5)
                outcomes.append(amp.step(optimizer))
            if case not in ("rank0_reads", "floor_reads", "checkpoint"):  # every rank reads at once: names kept
                out["stepped"].append([bool(o) for o in outcomes])
            elif case in ("rank0_reads", "floor_reads") and rank == 0:  # a logger on rank 0 alone: every read is local
                stepped = bool(outcomes[0])  # read first: the metrics then count this step
                metrics = amp.metrics()
                saved = amp.state_dict()["skipped_steps"]  # the rank that saves, alone
                out["rank0_reads"].append([stepped, float(metrics["mpx/skipped_steps"]), list(amp.skipped_steps),
                                           saved, record_of(amp) is not None])  # fmt: skip
            amp.update()
            for optimizer in optimizers:
                optimizer.zero_grad()
            out["scales"].append(float(amp.scalers[0].scale_tensor))
            if case == "checkpoint" and step == poison_at and resumed is None:
                # Saved on every rank right after the overflow step (nothing read, no further backward), loaded
                # into a fresh engine, model and optimizer that continue (the straight run continues in "host").
                saved = {"amp": amp.state_dict(), "model": model.state_dict(),
                         "optim": optimizers[0].state_dict()}  # fmt: skip
                model = build()
                amp = Amp(level, half_dtype=dtype, init_scale=2.0**12, growth_interval=2, on_floor=on_floor,
                          skip_on_device=skip_on_device)  # fmt: skip
                shard(model, level, getattr(torch, dtype))
                amp.prepare_model(model)
                model.load_state_dict(saved["model"])
                optimizers = [amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01, fused=True))]
                optimizers[0].load_state_dict(saved["optim"])
                amp.load_state_dict(saved["amp"])
                resumed = step
        except LossScaleFloorError as error:
            out["errors"].append([step, type(error).__name__])
            amp.update()
            for optimizer in optimizers:
                optimizer.zero_grad()
            out["scales"].append(float(amp.scalers[0].scale_tensor))
        step += 1
    try:
        amp.settle_step_outcomes()  # every rank together: the last step's overflow is settled
    except LossScaleFloorError as error:
        out["errors"].append(["settle", type(error).__name__])
    out["on_device"] = [bool(s.on_device) for s in amp._machine.optimizers.values()]
    out["skipped"] = list(amp.skipped_steps)
    out["last"] = record_of(amp)
    out["scalers"] = repr(amp.state_dict()["scalers"])
    out["weights"] = [p.full_tensor().double().flatten().tolist() for p in model.parameters()]
    out["adam_steps"] = sorted(float(s["step"]) for s in optimizers[0].state.values())
    return out


def run_case(case: str, rank: int, world: int) -> dict[str, Any]:
    """One case on this rank, in a running process group: the device run and the host run."""
    return {
        "device": train(case, rank=rank, world=world, skip_on_device=None),
        "host": train(case, rank=rank, world=world, skip_on_device=False),
    }


def main() -> int:
    if "RANK" not in os.environ:
        return launch_ranks(__file__)
    out_dir = os.environ["MPX_OUT"]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for case in os.environ["MPX_CASES"].split(","):
        with open(os.path.join(out_dir, f"{case}_rank{rank}.json"), "w") as f:
            json.dump(run_case(case, rank, world), f)
        dist.barrier()
    end_ranks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
