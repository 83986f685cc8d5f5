"""Run by tests/test_fsdp_engine.py: the core ``Amp`` loop on a model sharded by hand with FSDP2's ``fully_shard``,
two CPU processes (gloo), the user's own per-module ``MixedPrecisionPolicy`` (no lightning_mpx helper).

For each case in ``$MPX_CASES`` (``level:dtype:steps``) both ranks train the same model (seed 0) on their halves of
a global batch, with clipping by norm; at step ``POISON_AT`` rank 0 alone writes an inf into its own shard of one
gradient. Rank 0 then trains the same model unsharded, in one process, on the whole global batch, at the same
level and in FP32 (the references). Every rank writes ``$MPX_OUT/{level}_{dtype}_rank{r}.json``.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from lightning_mpx import Amp
from lightning_mpx.engine.sharding import local_tensor
from tests.launch import end_ranks, launch_ranks

POISON_AT = 3
MAX_NORM = 0.5
BATCH = 16  # global


def build() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU(),
        nn.Linear(64, 4),
    )
    # Running statistics: the same normalisation on a rank's half batch as on the whole one (batch statistics
    # would differ between them whatever the precision); its weight and bias still train.
    model[1].eval()
    return model


def shard(model: nn.Sequential, level: str, half: torch.dtype, mesh=None) -> None:
    """What a user writes by hand: per level, the policies the contract describes. ``mesh``: HSDP's 2-D mesh
    (replicas x shards), where every parameter is replicated across the first dimension."""
    where = {} if mesh is None else {"mesh": mesh}
    if level == "O3":  # half before sharding; the root's policy only casts its inputs to half, outputs to FP32
        model.to(half)
        for index in (0, 3, 6):
            fully_shard(model[index], **where)
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=half, output_dtype=torch.float32), **where)
        return
    block = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
    root = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32, output_dtype=torch.float32)
    island = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=half)
    fully_shard(model[1], mp_policy=island, **where)  # batch norm: its running statistics are FP32
    for index in (0, 3, 6):
        fully_shard(model[index], mp_policy=block, **where)
    fully_shard(model, mp_policy=root, **where)


def data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)) for _ in range(steps)]


def train(level, half_dtype, steps, *, rank, world, sharded, reference_fp32=False, hsdp=False, fused=False,
          skip_on_device=None):
    half = getattr(torch, half_dtype)
    model = build()
    amp = Amp("O0" if reference_fp32 else level, half_dtype=half_dtype, init_scale=2.0**12, on_floor="continue",
              growth_interval=1000, skip_on_device=skip_on_device)
    if sharded:
        mesh = None
        if hsdp:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        shard(model, level, half, mesh)
    amp.prepare_model(model)
    if fused:  # skips on the device by default (the flags reduced across ranks, not read on the host)
        optimizer = amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01, fused=True))
    else:
        optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    out = {"losses": [], "norms": [], "ref_norms": [], "skipped": [], "scales": []}
    per_rank = BATCH // world
    for step, (x, y) in enumerate(data(steps)):
        if sharded:
            x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        if step == 1:
            amp.request_telemetry()  # measured on each rank's shards
        with amp.forward_context():
            pred = amp.cast_outputs(model(amp.cast_inputs(x)))
            loss = F.mse_loss(pred.float(), y)
        amp.backward(loss)
        if step == POISON_AT and rank == 0:
            # Sharded: rank 0's own shard only (the ranks agree through the engine's collective alone); the
            # single-process references skip the same step.
            local_tensor(model[3].weight.grad).view(-1)[0] = float("inf")
        if sharded:
            # The reference: the full gradients gathered in FP64, divided by the scale the backward used.
            scale = float(amp.scalers[0].scale_tensor)
            full = [p.grad.full_tensor().double() for p in model.parameters() if p.grad is not None]
            out["ref_norms"].append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in full]))) / scale)
        norm = amp.clip_grad_norm_(optimizer, MAX_NORM) if not (fused and step % 2) else None  # every other step
        out["norms"].append(None if norm is None else float(norm))
        stepped = amp.step(optimizer)
        out["on_device"] = type(stepped).__name__ == "StepOutcome"
        out["skipped"].append(not stepped)  # read before zero_grad: the record names the parameter
        amp.update()
        optimizer.zero_grad()
        out["scales"].append(float(amp.scalers[0].scale_tensor))
        if step == 1:
            metrics = amp.metrics()
            out["telemetry"] = {k: float(v) for k, v in metrics.items() if k.startswith(("mpx/underflow", "mpx/zeros"))}
        if sharded:
            total = loss.detach().float().reshape(1).clone()
            dist.all_reduce(total)
            out["losses"].append(float(total) / world)
        else:
            out["losses"].append(float(loss))
    if sharded:
        out["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
        out["param_types"] = sorted({type(p).__name__ for p in model.parameters()})
        out["local_param_bytes"] = sum(local_tensor(p).numel() * p.element_size() for p in model.parameters())
        out["full_fp32_bytes"] = sum(p.numel() * 4 for p in model.parameters())
        out["state"] = repr(sorted(amp.state_dict().items(), key=lambda kv: kv[0]))
        out["masters"] = len(amp.master_weights)
        out["weights"] = [p.full_tensor().double().flatten()[:8].tolist() for p in model.parameters()]
        out["overflow_parameters"] = amp.last_overflow_parameters
        record = amp.last_overflow
        out["overflow_record_parameters"] = sorted(record.parameters) if record is not None else []
        out["overflow_ranks"] = list(record.ranks) if record is not None else []
        out["overflow_modules"] = sorted(record.modules) if record is not None else []
    return out


def main() -> int:
    if "RANK" not in os.environ:
        return launch_ranks(__file__)
    out_dir = os.environ["MPX_OUT"]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    for case in os.environ["MPX_CASES"].split(","):
        level, half_dtype, steps, *mesh = case.split(":")
        hsdp = mesh == ["hsdp"]
        if mesh == ["fused"]:
            # AdamW(fused=True): the default skips on the device; against the host read (skip_on_device=False).
            result = {"sharded": train(level, half_dtype, int(steps), rank=rank, world=world, sharded=True,
                                       fused=True),
                      "host": train(level, half_dtype, int(steps), rank=rank, world=world, sharded=True, fused=True,
                                    skip_on_device=False)}  # fmt: skip
            with open(os.path.join(out_dir, f"{level}_{half_dtype}_fused_rank{rank}.json"), "w") as f:
                json.dump(result, f)
            dist.barrier()
            continue
        result = {"sharded": train(level, half_dtype, int(steps), rank=rank, world=world, sharded=True, hsdp=hsdp)}
        if rank == 0:
            result["single"] = train(level, half_dtype, int(steps), rank=0, world=1, sharded=False)
            result["fp32"] = train(level, half_dtype, int(steps), rank=0, world=1, sharded=False, reference_fp32=True)
        name = f"{level}_{half_dtype}{'_hsdp' if hsdp else ''}_rank{rank}.json"
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(result, f)
        dist.barrier()
    end_ranks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
