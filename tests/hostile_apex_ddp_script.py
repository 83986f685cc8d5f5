"""Two-process cases of tests/test_hostile_apex.py (gloo, one launch): an Apex script that wraps the model in
``torch.nn.parallel.DistributedDataParallel`` after ``amp.initialize``, each rank seeded differently (DDP's broadcast
of rank 0's weights makes them equal), an inf loss on rank 0 only at one step.

Each rank writes ``$MPX_OUT/rank{r}.json``: per case the scales after each step, Apex's expected scales, the final
weights, and the FP32 reference (the whole batch on one process, the overflowed step left out).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

if "RANK" not in os.environ:  # the launcher: two ranks with torchrun's environment, without importing torch itself
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.launch import free_port

    env = dict(os.environ, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    procs = [
        subprocess.Popen([sys.executable, __file__], env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in (0, 1)
    ]
    raise SystemExit(max(p.wait() for p in procs))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from tests.launch import end_ranks  # noqa: E402

STEPS = 4
BAD_STEP = 1
CASES = {"o1": ("O1", {}), "o2": ("O2", {}), "o2_bf16_dynamic": ("O2", {"cast_model_type": torch.bfloat16,
                                                                         "loss_scale": "dynamic"})}


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 4, generator=g) * 0.1, torch.randn(8, 2, generator=g)) for _ in range(STEPS)]


def _reference() -> list[float]:
    model = _model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step, (x, y) in enumerate(_batches()):
        if step == BAD_STEP:
            continue
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return _flat(model)


def _flat(model: nn.Module) -> list[float]:
    return torch.cat([p.detach().float().reshape(-1) for p in model.parameters()]).tolist()


def _run_case(opt_level: str, kwargs: dict, rank: int) -> dict:
    from lightning_mpx.apex import _amp_state, amp

    _amp_state.reset()
    model = _model(rank)  # ranks differ until DDP broadcasts rank 0's weights
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0, **kwargs)
    model = nn.parallel.DistributedDataParallel(model)
    scales, expected, scale = [], [], 65536.0
    for step, (x, y) in enumerate(_batches()):
        shard = slice(rank * 4, rank * 4 + 4)
        loss = F.mse_loss(model(x[shard]).float(), y[shard])
        if step == BAD_STEP and rank == 0:
            loss = loss * float("inf")
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        scale = scale / 2 if step == BAD_STEP else scale
        scales.append(_amp_state.loss_scalers[0].loss_scale())
        expected.append(scale)
    return {"scales": scales, "expected_scales": expected, "weights": _flat(model.module),
            "reference": _reference()}


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    results = {name: _run_case(level, dict(kwargs), rank) for name, (level, kwargs) in CASES.items()}
    with open(os.path.join(os.environ["MPX_OUT"], f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    end_ranks()


if __name__ == "__main__":
    main()
