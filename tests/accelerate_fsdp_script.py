"""Run by tests/test_accelerate_fsdp.py: ``lightning_mpx.integrations.accelerate.Accelerator`` with Accelerate's own
FSDP (FSDP2, then FSDP1), two CPU processes (gloo), written as an Accelerate user writes it.

Accelerate selects FSDP only for GPU-like devices (``accelerate/state.py``: the FSDP branch is reached from
``MULTI_GPU``/``MULTI_NPU``/...; ``cpu=True`` gives ``MULTI_CPU``, i.e. DDP, and there is no environment variable that
changes this). :func:`fsdp_accelerator` therefore takes one step no user takes: after the process group is set up on
CPU it tells Accelerate's shared state that the processes are ``MULTI_GPU`` on device ``cpu``, so that the
``Accelerator`` then selects FSDP as on a GPU machine. Everything after that is Accelerate's own FSDP code:
``_prepare_fsdp2``/``fsdp2_prepare_model`` (auto-wrap, ``fully_shard``, the optimizer's parameter swap), FSDP1's
wrapper, ``save_state``/``load_state`` through distributed checkpoints.

For each case in ``$MPX_CASES`` (``version:level:dtype:steps[:gather]``) both ranks train the same model (seed 0) on
their halves of a global batch with ``accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)``; at step ``POISON_AT``
rank 0 alone writes an inf into its own shard of one gradient. Rank 0 also trains the same model unsharded in one
process on the whole batch with the core ``Amp`` (the reference). ``$MPX_RESUME`` (``version:level:dtype:steps``)
saves the state half-way, trains on, then loads the state into a fresh accelerator and trains the same steps again.
Every rank writes ``$MPX_OUT/{case}_rank{r}.json``.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch import nn

from lightning_mpx import Amp
from lightning_mpx.engine.sharding import local_tensor
from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs
from tests.accelerate_helpers import reset_accelerate_state
from tests.launch import end_ranks, launch_ranks

POISON_AT = 3
MAX_NORM = 0.5
BATCH = 16  # global
SCALER = dict(init_scale=2.0**12, growth_interval=1000, on_floor="continue")


def build() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU(),
        nn.Linear(64, 4),
    )
    model[1].eval()  # running statistics: the same normalisation on a half batch as on the whole one
    return model


def data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)) for _ in range(steps)]


def fsdp_accelerator(
    version: int, level: str, dtype: str, accumulation: int = 1, gather: str = "half", wrap: bool = True
) -> Accelerator:
    reset_accelerate_state()
    PartialState(cpu=True)  # the gloo process group (set up once; kept across cases)
    # The one step no user takes (see the module docstring): Accelerate selects FSDP for GPU-like devices only.
    # "cpu", not "cpu:0": FSDP1 checks its device_id against the compute device "cpu".
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    PartialState._shared_state["device"] = torch.device("cpu")
    # Each Linear a unit of its own (wrap=False: Accelerate wraps nothing but the root, for a model already sharded)
    wrapping = dict(auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Linear"]) if wrap else {}
    plugin = FullyShardedDataParallelPlugin(fsdp_version=version, **wrapping)
    accelerator = Accelerator(
        mixed_precision=level, fsdp_plugin=plugin, cpu=True, gradient_accumulation_steps=accumulation,
        kwargs_handlers=[MixedPrecisionKwargs(half_dtype=dtype, fsdp_gather=gather, **SCALER)],
    )
    assert accelerator.distributed_type == DistributedType.FSDP and accelerator.num_processes == 2
    return accelerator


def prepared(accelerator: Accelerator, version: int):
    model = build()
    if version == 2:  # FSDP2: the model and its optimizer together (Accelerate swaps in the shards)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return accelerator.prepare(model, optimizer)
    model = accelerator.prepare(model)  # FSDP1: the optimizer is made on the wrapped model
    return model, accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))


def gathered_norm(model: nn.Module, version: int, scale: float) -> float:
    """The unscaled FP64 norm of the full gradients, gathered from every rank."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if version == 2:
        full = [g.full_tensor().double() for g in grads]
    else:  # FSDP1: each rank holds a piece of each flat gradient (padding is zero)
        pieces: list = [None, None]
        dist.all_gather_object(pieces, [g.double() for g in grads])
        full = [g for rank in pieces for g in rank]
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in full]))) / scale


def poison(model: nn.Module, version: int) -> None:
    if version == 2:  # rank 0's own shard of the second Linear's weight
        local_tensor(model[3].weight.grad).view(-1)[0] = float("inf")
    else:
        next(p for p in model.parameters() if p.grad is not None and p.grad.numel()).grad.view(-1)[0] = float("inf")


def train(accelerator, model, optimizer, version, batches, *, start=0, poison_at=POISON_AT):
    rank, world = accelerator.process_index, accelerator.num_processes
    per_rank = BATCH // world
    out = {"losses": [], "norms": [], "ref_norms": [], "skipped": [], "scales": []}
    for step in range(start, len(batches)):
        x, y = batches[step]
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        loss = F.mse_loss(model(x), y)
        accelerator.backward(loss)
        if step == poison_at and rank == 0:
            poison(model, version)
        out["ref_norms"].append(gathered_norm(model, version, accelerator.amp.scalers[0].get_scale()))
        out["norms"].append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
        out["skipped"].append(bool(optimizer.step_was_skipped))
        out["scales"].append(accelerator.amp.scalers[0].get_scale())
        total = loss.detach().float().reshape(1).clone()
        dist.all_reduce(total)
        out["losses"].append(float(total) / world)
    return out


def weights(model: nn.Module, version: int) -> list:
    if version == 2:
        return [p.full_tensor().double().flatten().tolist() for p in model.parameters()]
    return [local_tensor(p).double().flatten().tolist() for p in model.parameters()]  # this rank's pieces


def single(level: str, dtype: str, batches) -> dict:
    """The reference: the same model unsharded, one process, the whole batch, the core engine."""
    model = build()
    amp = Amp(level, half_dtype=dtype, **SCALER)
    amp.prepare_model(model)
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    out = {"losses": [], "skipped": [], "scales": []}
    for step, (x, y) in enumerate(batches):
        with amp.forward_context():
            loss = F.mse_loss(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y)
        amp.backward(loss)
        if step == POISON_AT:
            model[3].weight.grad.view(-1)[0] = float("inf")
        amp.clip_grad_norm_(optimizer, MAX_NORM)
        stepped = amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()
        out["losses"].append(float(loss))
        out["skipped"].append(not stepped)
        out["scales"].append(float(amp.scalers[0].scale_tensor))
    return out


def case(version: int, level: str, dtype: str, steps: int, gather: str = "half") -> dict:
    accelerator = fsdp_accelerator(version, level, dtype, gather=gather)
    model, optimizer = prepared(accelerator, version)
    batches = data(steps)
    result = train(accelerator, model, optimizer, version, batches)
    try:  # a part of the parameters: no global norm to compute for it
        accelerator.clip_grad_norm_(list(model.parameters())[:1], MAX_NORM)
    except ValueError as error:
        result["partial_clip_error"] = str(error)
    amp = accelerator.amp
    result.update(
        sharded=amp.sharded,
        reducer=amp.found_inf_reducer is not None,
        masters=len(amp.master_weights),
        param_types=sorted({type(p).__name__ for p in model.parameters()}),
        param_dtypes=sorted({str(p.dtype) for p in model.parameters()}),
        state=repr(sorted(amp.state_dict().items(), key=lambda kv: kv[0])),
        weights=weights(model, version),
        overflow_parameters=amp.last_overflow_parameters,
        local_param_bytes=sum(local_tensor(p).numel() * p.element_size() for p in model.parameters()),
        full_fp32_bytes=sum(p.numel() * 4 for p in build().parameters()),
    )
    # Clipping by value (Accelerate refuses it under FSDP; elementwise on each rank's shards it is exact).
    x, y = batches[0]
    accelerator.backward(F.mse_loss(model(x[:BATCH // 2]), y[:BATCH // 2]))
    accelerator.clip_grad_value_(model.parameters(), 1e-4)
    result["clipped_value_max"] = max(float(local_tensor(p.grad).abs().max()) for p in model.parameters())
    optimizer.step()
    optimizer.zero_grad()
    if version == 2:
        result["island_dtype"] = str(model[1].weight.dtype)  # batch norm: an FP32 unit of its own at O1-O3
    if accelerator.is_main_process:
        result["single"] = single(level, dtype, batches)
    return result


def accumulated(version: int, level: str, dtype: str, steps: int) -> dict:
    """The same global batches, each rank's half in two micro-batches under ``accelerator.accumulate(model)``."""
    accelerator = fsdp_accelerator(version, level, dtype, accumulation=2)
    model, optimizer = prepared(accelerator, version)
    rank, per_rank = accelerator.process_index, BATCH // accelerator.num_processes
    out = {"losses": [], "norms": [], "skipped": [], "scales": []}
    for step, (x, y) in enumerate(data(steps)):
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        total = torch.zeros(1)
        for micro in range(2):
            with accelerator.accumulate(model):
                part = slice(micro * per_rank // 2, (micro + 1) * per_rank // 2)
                loss = F.mse_loss(model(x[part]), y[part])
                accelerator.backward(loss)
                total += loss.detach().float() / 2
                if accelerator.sync_gradients:
                    if step == POISON_AT and rank == 0:
                        poison(model, version)
                    out["norms"].append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
                optimizer.step()
                optimizer.zero_grad()
        out["skipped"].append(bool(optimizer.step_was_skipped))
        out["scales"].append(accelerator.amp.scalers[0].get_scale())
        dist.all_reduce(total)
        out["losses"].append(float(total) / accelerator.num_processes)
    out["weights"] = weights(model, version)
    return out


def sharded_by_hand(steps: int) -> dict:
    """FSDP2, O2: the user shards with lightning_mpx.integrations.fsdp.shard_model before prepare; Accelerate keeps the
    sharding."""
    from lightning_mpx.integrations.fsdp import shard_model

    accelerator = fsdp_accelerator(2, "O2", "bfloat16", wrap=False)
    model = shard_model(build(), accelerator.amp, blocks=nn.Linear)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    result = train(accelerator, model, optimizer, 2, data(steps))
    result["sharded"] = accelerator.amp.sharded
    return result


def stale_optimizer() -> dict:
    """FSDP1: an optimizer made before Accelerate wrapped the model holds tensors that nothing trains."""
    accelerator = fsdp_accelerator(1, "O2", "bfloat16")
    model = build()
    try:
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05))
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


def resume(version: int, level: str, dtype: str, steps: int, checkpoint: str) -> dict:
    half = steps // 2
    batches = data(steps)
    accelerator = fsdp_accelerator(version, level, dtype)
    model, optimizer = prepared(accelerator, version)
    first = train(accelerator, model, optimizer, version, batches[:half])
    accelerator.save_state(checkpoint)
    state_saved = repr(sorted(accelerator.amp.state_dict().items(), key=lambda kv: kv[0]))
    straight = train(accelerator, model, optimizer, version, batches, start=half)
    straight_weights = weights(model, version)

    accelerator = fsdp_accelerator(version, level, dtype)
    model, optimizer = prepared(accelerator, version)
    accelerator.load_state(checkpoint)
    state_loaded = repr(sorted(accelerator.amp.state_dict().items(), key=lambda kv: kv[0]))
    resumed = train(accelerator, model, optimizer, version, batches, start=half)
    return {
        "first": first, "straight": straight, "resumed": resumed,
        "straight_weights": straight_weights, "resumed_weights": weights(model, version),
        "state_saved": state_saved, "state_loaded": state_loaded,
        "files": sorted(os.listdir(checkpoint)),
    }


def main() -> int:
    if "RANK" not in os.environ:
        return launch_ranks(__file__, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    out_dir = os.environ["MPX_OUT"]
    rank = int(os.environ["RANK"])
    jobs = [("case", c) for c in os.environ.get("MPX_CASES", "").split(",") if c]
    jobs += [("resume", c) for c in os.environ.get("MPX_RESUME", "").split(",") if c]
    jobs += [("accumulate", c) for c in os.environ.get("MPX_ACCUMULATE", "").split(",") if c]
    jobs += [("stale", "1:O2:bfloat16:0")] if os.environ.get("MPX_STALE") else []
    jobs += [("by_hand", "2:O2:bfloat16:6")] if os.environ.get("MPX_BY_HAND") else []
    for kind, spec in jobs:
        version, level, dtype, steps, *gather = spec.split(":")
        if kind == "stale":
            result = stale_optimizer()
        elif kind == "by_hand":
            result = sharded_by_hand(int(steps))
        elif kind == "accumulate":
            result = accumulated(int(version), level, dtype, int(steps))
        elif kind == "case":
            result = case(int(version), level, dtype, int(steps), *gather)
        else:
            checkpoint = os.path.join(out_dir, f"checkpoint_{spec.replace(':', '_')}")
            result = resume(int(version), level, dtype, int(steps), checkpoint)
        name = f"{kind}_{spec.replace(':', '_')}_rank{rank}.json"
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(result, f)
        dist.barrier()
    end_ranks()
    return 0


if __name__ == "__main__":
    sys.exit(main())
