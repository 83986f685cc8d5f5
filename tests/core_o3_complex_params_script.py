"""Ranks of tests/test_core_o3_complex_params.py (two CPU processes, gloo): a model with a complex parameter under FSDP2
(``shard_model``, the core ``Amp``) and under DDP, against the same loop on one process and the whole batch; O3's
loss promotion under FSDP2; and O3 under FSDP2 with ``fp32_modules`` (the pinned module's exact values). Every rank
writes ``$MPX_OUT/rank{r}.json``."""

from __future__ import annotations

import traceback
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_mpx import Amp
from lightning_mpx.engine.sharding import local_tensor
from lightning_mpx.integrations.fsdp import shard_model
from tests.launch import end_ranks, write_rank_results
from tests.test_complex_params import Spectral  # the same model as the one-process tests

STEPS, BATCH, INF_AT = 3, 16, 1
SETTINGS = {"half_dtype": "bfloat16", "loss_scale": "dynamic", "init_scale": 2.0**10}


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def train(level: str, how: str, rank: int, world: int) -> dict:
    model = Spectral()
    amp = Amp(level, **SETTINGS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "fsdp2":
            shard_model(model, amp, blocks=[model.lin])  # the complex parameter alone in the root's unit
        amp.prepare_model(model)
        if how == "ddp":
            model = DistributedDataParallel(model)
        optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        skipped, norms = [], []
        for step in range(STEPS):
            x, y = data(step)
            if how != "one":
                per = BATCH // world
                x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
            with amp.forward_context():
                loss = F.mse_loss(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y)
            amp.backward(loss)
            phase = getattr(model, "module", model).phase
            if step == INF_AT and (how != "fsdp2" or rank == 1):  # an inf in an imaginary part: rank 1's shard only
                grad = local_tensor(phase.grad)
                if grad.numel():
                    torch.view_as_real(grad)[-1, 1] = float("inf")
            norms.append(float(amp.clip_grad_norm_(optimizer, 1e3)))
            skipped.append(not amp.step(optimizer))
            amp.update()
            optimizer.zero_grad()
    inner = getattr(model, "module", model)
    phase = inner.phase.full_tensor() if hasattr(inner.phase, "full_tensor") else inner.phase
    return {
        "phase": torch.view_as_real(phase.detach().to(torch.complex64)).flatten().tolist(),
        "phase_dtype": str(phase.dtype), "skipped": skipped, "norms": norms,
        "warnings": sorted({str(w.message)[:120] for w in caught if "imaginary" in str(w.message)}),
    }


def o3_loss(rank: int) -> dict:
    """O3 under FSDP2: a loss on the FP32 output and a target made in the half dtype."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    amp = Amp("O3", **SETTINGS)
    shard_model(model, amp)
    amp.prepare_model(model)
    x, y = data(0)
    with amp.forward_context():
        out = amp.cast_outputs(model(amp.cast_inputs(x)))
        loss = F.huber_loss(out, y.to(torch.bfloat16))
    amp.backward(loss)
    return {"dtype": str(loss.dtype), "out_dtype": str(out.dtype)}


class Scaled(nn.Module):
    """A layer with an FP32 constant that bfloat16 rounds (3.14159 by 9.7e-4)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("factor", torch.tensor([1 / 3, 0.1, 3.14159, 2 / 7]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.factor


def pinned() -> dict:
    """O3 under FSDP2 with ``fp32_modules``: the pinned module's weight and buffer, off their FP32 values by."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Scaled())
    weight, factor = model[1].lin.weight.detach().clone(), model[1].factor.clone()
    amp = Amp("O3", fp32_modules=["1"], **SETTINGS)
    shard_model(model, amp)
    amp.prepare_model(model)
    got = model[1].lin.weight.full_tensor()
    return {"dtypes": [str(got.dtype), str(model[1].factor.dtype)],
            "off": [float((got - weight).abs().max()), float((model[1].factor - factor).abs().max())]}  # fmt: skip


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict = {}
    cases = [("O1", "one"), ("O1", "fsdp2"), ("O3", "one"), ("O3", "fsdp2"), ("O2", "one"), ("O2", "ddp")]
    for level, how in cases:
        try:
            results[f"{level}/{how}"] = train(level, how, rank, world)
        except Exception as error:  # noqa: BLE001 - the test reads the failure by case
            results[f"{level}/{how}"] = {"error": f"{type(error).__name__}: {error}"[:400],
                                         "tb": traceback.format_exc()[-1500:]}  # fmt: skip
    try:
        results["o3_loss"] = o3_loss(rank)
    except Exception as error:  # noqa: BLE001
        results["o3_loss"] = {"error": f"{type(error).__name__}: {error}"[:400]}
    try:
        results["pinned"] = pinned()
    except Exception as error:  # noqa: BLE001
        results["pinned"] = {"error": f"{type(error).__name__}: {error}"[:400]}
    write_rank_results(results)
    end_ranks()


if __name__ == "__main__":
    main()
