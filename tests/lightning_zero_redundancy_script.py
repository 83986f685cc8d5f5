"""Ranks of tests/test_lightning_zero_redundancy.py: ``torch.distributed.optim.ZeroRedundancyOptimizer`` (ZeRO-1) and
DDP communication hooks under DDP, two CPU processes (gloo), ONE launch for every multi-rank check. Each rank writes
``$MPX_OUT/rank{r}.json``; a case that raises leaves its traceback in the case's ``"error"``.

Cases (each records the flat weights after training, ``"w"``, and the initial ones, ``"w0"``):

* ``core/{fp32,bf16,O1,O2}/zero``: a raw DDP loop, ZeroRedundancyOptimizer(AdamW); ``fp32``/``bf16``: torch's own
  (``torch.autocast`` bfloat16), ``O1``/``O2``: ``Amp(..., half_dtype=torch.bfloat16)``. ``core/O2/zero_before``:
  the ZeRO optimizer built over the FP32 parameters before ``prepare_model``.
* ``core/{bf16,O1,O2}/hook``: plain AdamW, ``bf16_compress_hook`` registered on the DDP model.
* ``lightning/{bf16-mixed,O1,O2}/zero``: ``Trainer(strategy="ddp")``, ZeRO from ``configure_optimizers``, 3 steps,
  ``trainer.save_checkpoint``, then a fresh Trainer resumed from it to 5 steps (``"w3"``, ``"w"``, ``"ckpt_state"``:
  how many parameters have optimizer state in the checkpoint).
* ``lightning/{bf16-mixed,O2}/hook``: plain AdamW, the hook registered on ``trainer.model`` in ``on_train_start``
  (``DDPStrategy(ddp_comm_hook=...)`` registers one on CUDA only).
* ``fabric/{O1,O2}/zero``: ``Fabric(strategy="ddp")``, ``fabric.setup(model, ZeRO(...))``, core()'s loop.

O2 cases also record the FP32 masters (``"m"``); every case its seconds (``"s"``).
"""

from __future__ import annotations

import datetime
import functools
import os
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from lightning_mpx import Amp, FabricMixedPrecisionPlugin, MixedPrecisionPlugin
from tests.launch import case_error, finish_cases

LR = 1e-2
STEPS = 4


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, 4, generator=g)
    return x, x.sum(1).tanh()


def flat(tensors: Any) -> list[float]:
    return torch.cat([t.detach().float().flatten() for t in tensors]).tolist()


def _bf16_hook(state: Any, bucket: Any) -> Any:
    return bf16_compress_hook(state, bucket)


# torch's bf16_compress_hook under another name (DDP refuses that name off NCCL/CUDA; gloo reduces bfloat16), with its
# signature (DDP checks the annotations, which this module's future import makes strings)
bf16_hook = functools.wraps(bf16_compress_hook)(_bf16_hook)
bf16_hook.__name__ = "bf16_hook"


def zero(params: Any) -> ZeroRedundancyOptimizer:
    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=LR)


# -- 1. the core loop
def core(r: dict, mode: str, variant: str) -> None:
    rank = dist.get_rank()
    model = net()
    r["w0"] = flat(model.parameters())
    amp = Amp(mode, half_dtype=torch.bfloat16) if mode in ("O1", "O2") else None
    early = zero(model.parameters()) if variant == "zero_before" else None
    if amp is not None:
        model = amp.prepare_model(model)
    ddp = DistributedDataParallel(model)
    if variant == "hook":
        ddp.register_comm_hook(None, bf16_hook)
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(ddp.parameters(), lr=LR)
    else:
        optimizer = early if early is not None else zero(ddp.parameters())
    if amp is not None:
        optimizer = amp.prepare_optimizer(optimizer)
    for step in range(STEPS):
        x, y = batch(step, rank)
        if amp is not None:
            with amp.forward_context():
                loss = F.mse_loss(amp.cast_outputs(ddp(amp.cast_inputs(x))).squeeze(-1), y)
            amp.backward(loss)
            amp.step(optimizer)
            amp.update()
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "bf16"):
                loss = F.mse_loss(ddp(x).squeeze(-1).float(), y)
            loss.backward()
            optimizer.step()
        optimizer.zero_grad()
    r["w"] = flat(model.parameters())
    if mode == "O2":
        r["m"] = flat(amp.master_params(optimizer))


# -- 2. the Trainer
class Module(pl.LightningModule):
    def __init__(self, use_zero: bool) -> None:
        super().__init__()
        self.net = net()
        self.use_zero = use_zero

    def on_train_start(self) -> None:
        if not self.use_zero:  # DDPStrategy(ddp_comm_hook=...) registers its hook on CUDA only: on the DDP model here
            self.trainer.model.register_comm_hook(None, bf16_hook)

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x).squeeze(-1).float(), y)

    def configure_optimizers(self) -> Any:
        if self.use_zero:
            return zero(self.parameters())
        return torch.optim.AdamW(self.parameters(), lr=LR)


def _loader(rank: int) -> torch.utils.data.DataLoader:
    xs, ys = zip(*(batch(step, rank) for step in range(STEPS + 1)))
    data = torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))
    return torch.utils.data.DataLoader(data, batch_size=8)  # each rank its own batches (no sampler: set below)


def _trainer(precision: str, max_steps: int) -> pl.Trainer:
    kwargs: dict[str, Any] = {"precision": precision}
    if precision in ("O1", "O2"):
        kwargs = {"plugins": [MixedPrecisionPlugin(precision, half_dtype=torch.bfloat16)]}
    return pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, max_steps=max_steps, use_distributed_sampler=False,
        **kwargs,
    )  # fmt: skip


def lightning(r: dict, precision: str, variant: str, tmp: Path) -> None:
    rank = dist.get_rank()
    hook = variant == "hook"
    module = Module(use_zero=not hook)
    r["w0"] = flat(module.parameters())
    trainer = _trainer(precision, 3)
    trainer.fit(module, _loader(rank))
    r["w3"] = flat(module.parameters())
    if hook:
        r["w"] = r["w3"]
        if precision == "O2":
            r["m"] = flat(trainer.precision_plugin.amp.fp32_state_dict(module).values())
        return
    path = str(tmp / f"{precision}.ckpt")
    trainer.save_checkpoint(path)
    dist.barrier()
    saved = torch.load(path, weights_only=False)
    r["ckpt_state"] = len(saved["optimizer_states"][0]["state"])
    module = Module(use_zero=True)
    _trainer(precision, 5).fit(module, _loader(rank), ckpt_path=path)
    r["w"] = flat(module.parameters())


# -- 3. Fabric
def fabric_case(r: dict, precision: str) -> None:
    from lightning.fabric import Fabric

    plugin = FabricMixedPrecisionPlugin(precision, half_dtype=torch.bfloat16)
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=plugin)
    fabric.launch()  # the ranks are forked already: no process is started
    module = net()
    r["w0"] = flat(module.parameters())
    model, optimizer = fabric.setup(module, zero(module.parameters()))
    for step in range(STEPS):
        x, y = batch(step, fabric.global_rank)
        fabric.backward(F.mse_loss(model(x).squeeze(-1).float(), y))
        optimizer.step()
        optimizer.zero_grad()
    r["w"] = flat(module.parameters())


def _case(results: dict, name: str, fn: Any, *args: Any) -> None:
    start = time.perf_counter()
    with case_error(results.setdefault(name, {})) as r:
        fn(r, *args)
    r["s"] = round(time.perf_counter() - start, 2)


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    torch.set_num_threads(1)
    tmp = Path(os.environ["MPX_OUT"])
    results: dict = {"world": dist.get_world_size()}
    for mode in ("fp32", "bf16", "O1", "O2"):
        _case(results, f"core/{mode}/zero", core, mode, "zero")
    _case(results, "core/O2/zero_before", core, "O2", "zero_before")
    for mode in ("bf16", "O1", "O2"):
        _case(results, f"core/{mode}/hook", core, mode, "hook")
    for precision in ("bf16-mixed", "O1", "O2"):
        _case(results, f"lightning/{precision}/zero", lightning, precision, "zero", tmp)
    for precision in ("bf16-mixed", "O2"):
        _case(results, f"lightning/{precision}/hook", lightning, precision, "hook", tmp)
    for precision in ("O1", "O2"):  # the loop is core()'s: held to core/bf16/zero
        _case(results, f"fabric/{precision}/zero", fabric_case, precision)
    finish_cases(results)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    warnings.simplefilter("ignore")
    main()
