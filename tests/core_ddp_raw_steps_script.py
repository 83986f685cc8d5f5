"""Ranks of tests/test_core_ddp_raw_steps.py: the raw-step check (engine/raw_steps.py) under DDP, two CPU processes
(gloo), ONE launch for every multi-rank check. Each rank writes ``$MPX_OUT/rank{r}.json``; a case that raises leaves its
traceback in the case's ``"error"``.

Under DDP an error on one rank while the other goes on into a collective is a hang (until the group's timeout: a
short one here, so that a hang fails the test instead of CI). The cases:

* ``trainer_raw``: Lightning's ``strategy="ddp"``, manual optimization, a raw ``torch.optim.SGD`` the module made
  itself (O2, bfloat16): both ranks must raise the raw-step error.
* ``fabric_raw/O2`` and ``fabric_raw/O1``: Fabric DDP, a raw optimizer beside the set-up one (O2 bfloat16, O1
  float16 with a dynamic scale): both ranks raise.
* ``accelerate_raw``: ``lightning_mpx.accelerate.Accelerator`` (DDP), the same.
* ``legit/O2`` and ``legit/ref``: habits that are no raw step, at O2 and under Fabric's ``"bf16-mixed"``: each rank
  its own initial weights (DDP's broadcast at wrap time writes them), ``no_backward_sync`` accumulation,
  ``find_unused_parameters=True`` with a branch only rank 0 uses, a rank-0-only EMA that reads the weights.
* ``overflow``: O1 float16, an inf loss on rank 1 only at step 1: both ranks skip it, no raw-step error.
* ``unheld_branch``: a raw SGD over a head no prepared optimizer holds, used by rank 0's forward only: both ranks
  must raise (the note of the parameters holding a gradient was taken before DDP's all-reduce gave rank 1 its
  gradient: rank 0 alone raised). The checking backward runs under ``no_backward_sync`` so that a one-rank error
  cannot hang the launch.
* ``subset_no_sync``: under ``no_backward_sync``, a raw SGD over part of a prepared optimizer's parameters (the trunk)
  while a branch only rank 0 uses keeps its gradient there: rank 1 (branch gradient None) refuses, rank 0 would not;
  after that unsynchronised backward the refusal waits for the step, where both raise (engine.unsynced; stop 65: rank
  1 raised at the backward alone).
* ``subset_no_sync_fused``: the same with a fused AdamW (its step skips on the device): the step is skipped on both
  ranks, and both raise at the next backward, where it is settled.
* ``branch_raw_no_sync``: the same with the raw SGD over the branch instead: it writes the branch on rank 0 alone;
  rank 0's view is ``subset_no_sync``'s with trunk and branch swapped, rank 1 sees nothing written. Neither refuses
  (rank 0 lets it pass: a gradient kept); a rule that made rank 0 refuse ``subset_no_sync`` from what it sees would
  refuse here on rank 0 alone.
"""

from __future__ import annotations

import copy
import datetime
import os
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin
from tests.launch import case_error, finish_cases

BF16 = {"half_dtype": "bfloat16", "loss_scale": "dynamic", "init_scale": 2.0**8}
FP16 = {"half_dtype": "float16", "loss_scale": "dynamic", "init_scale": 2.0**8}
LR = 0.05


class Branched(nn.Module):
    """A trunk and a branch head (``with_branch``); the branch joins the output when ``branch`` is true."""

    def __init__(self, seed: int, with_branch: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.branch = nn.Linear(4, 1) if with_branch else None

    def forward(self, x: torch.Tensor, branch: bool = False) -> torch.Tensor:
        out = self.trunk(x)
        if branch and self.branch is not None:
            out = out + self.branch(x)
        return out.squeeze(-1).float()


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 4, generator=g), torch.randn(4, generator=g)


def flat(tensors: Any) -> list[float]:
    return torch.cat([t.detach().float().flatten() for t in tensors]).tolist()


# -- 1. the Trainer
class RawModule(pl.LightningModule):
    """Manual optimization; ``training_step`` steps a raw SGD it made itself (never returned from
    ``configure_optimizers``)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.raw: torch.optim.Optimizer | None = None

    def training_step(self, batch: Any, index: int) -> None:
        if self.raw is None:
            self.raw = torch.optim.SGD(self.parameters(), lr=LR)
        loss = F.mse_loss(self.net(batch[0]).squeeze(-1).float(), batch[1])
        self.manual_backward(loss)
        self.raw.step()
        self.raw.zero_grad()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LR)


def _trainer_raw(r: dict) -> None:
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, generator=g))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, plugins=[MixedPrecisionPlugin("O2", **BF16)],
        max_steps=3,
    )  # fmt: skip
    trainer.fit(RawModule(), torch.utils.data.DataLoader(data, batch_size=4))


# -- 2. Fabric
def _fabric(level: str | None, settings: dict | None = None, precision: str | None = None, **ddp: Any) -> Any:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import DDPStrategy

    plugin = None if level is None else FabricMixedPrecisionPlugin(level, **(settings or BF16))
    fabric = Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(**ddp), plugins=plugin, precision=precision)
    fabric.launch()  # the ranks are forked already: no process is started
    return fabric, plugin


def _fabric_raw(level: str, settings: dict) -> None:
    fabric, _ = _fabric(level, settings)
    module = Branched(0, with_branch=False)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=LR))
    raw = torch.optim.SGD(module.parameters(), lr=LR)  # beside the set-up one
    for step in range(3):
        x, y = batch(step, fabric.global_rank)
        fabric.backward(F.mse_loss(model(x), y))
        (optimizer if step == 0 else raw).step()  # the plugin meets its optimizer at the first step
        optimizer.zero_grad()


# -- 3. the Accelerate adapter
def _accelerate_raw(r: dict) -> None:
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    accelerator = Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=[MixedPrecisionKwargs(**BF16)])
    module = Branched(0, with_branch=False)
    model, optimizer = accelerator.prepare(module, torch.optim.SGD(module.parameters(), lr=LR))
    r["wrapper"] = type(model).__name__
    raw = torch.optim.SGD(module.parameters(), lr=LR)
    for step in range(3):
        x, y = batch(step, accelerator.process_index)
        accelerator.backward(F.mse_loss(model(x), y))
        raw.step()
        raw.zero_grad()


# -- 4. legitimate habits
def _legit(level: str | None, r: dict) -> None:
    """Each rank its own initial weights (DDP's broadcast writes them), accumulation of two micro-batches under
    ``no_backward_sync``, a branch only rank 0 uses (``find_unused_parameters=True``), a rank-0-only EMA that reads
    the weights after each step."""
    fabric, plugin = _fabric(level, precision=None if level else "bf16-mixed", find_unused_parameters=True)
    rank = fabric.global_rank
    module = Branched(10 + rank)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=LR))
    ema = [p.detach().float().clone() for p in module.parameters()] if rank == 0 else None
    copied = copy.deepcopy(module)  # before the first backward (an AveragedModel made after set-up)
    for step in range(6):
        x, y = batch(step, rank)
        with fabric.no_backward_sync(model, enabled=step % 2 == 0):
            fabric.backward(F.mse_loss(model(x, branch=rank == 0), y) / 2)
        if step % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()
            if ema is not None:
                for e, p in zip(ema, module.parameters()):
                    e.lerp_(p.detach().float(), 0.5)
    r["w"] = flat(plugin.master_params(optimizer) if plugin is not None else module.parameters())
    copied(torch.zeros(1, 4).to(next(copied.parameters()).dtype), branch=True)  # after the first backward
    r["hooks_left"] = [  # the engine's DDP watch (engine/unsynced.py)
        sum(type(hook).__name__ == "DdpWatch" for m in net.modules() for hook in m._forward_pre_hooks.values())
        for net in (module, copied)
    ]
    r["watched"] = plugin is not None and len(plugin.amp._machine.ddp) == 1  # the wrapper was found


def _overflow(r: dict) -> None:
    """O1 float16: an inf loss on rank 1 only at step 1; the weights after each step."""
    fabric, plugin = _fabric("O1", {**FP16, "growth_interval": 100})
    rank = fabric.global_rank
    module = Branched(0, with_branch=False)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=LR))
    r["w"] = []
    for step in range(3):
        x, y = batch(step, rank)
        loss = F.mse_loss(model(x), y)
        if step == 1 and rank == 1:
            loss = loss * float("inf")
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        r["w"].append(flat(module.parameters()))
    r["scale"] = plugin.amp.scalers[0].get_scale()


# -- 5. rank-dependent decisions
def _unheld_branch(r: dict) -> None:
    """The set-up optimizer holds the trunk; a raw SGD steps the branch head, which rank 0's forward alone uses."""
    fabric, _ = _fabric("O2", find_unused_parameters=True)
    rank = fabric.global_rank
    module = Branched(0)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.trunk.parameters(), lr=LR))
    raw = torch.optim.SGD(module.branch.parameters(), lr=LR)
    x, y = batch(0, rank)
    fabric.backward(F.mse_loss(model(x), y))
    optimizer.step()  # the plugin meets its optimizer
    optimizer.zero_grad()
    fabric.backward(F.mse_loss(model(x, branch=rank == 0), y))  # DDP gives rank 1 the branch's gradient too
    r["branch_grad"] = module.branch.weight.grad is not None
    raw.step()
    raw.zero_grad()
    with fabric.no_backward_sync(model):  # no collective: a one-rank error cannot hang the launch
        fabric.backward(F.mse_loss(model(x), y))


def _subset_no_sync(r: dict) -> None:
    """Under ``no_backward_sync``: a raw SGD over the trunk of a set-up optimizer holding trunk and branch; the branch
    keeps a gradient on rank 0 only (its forward alone uses it)."""
    fabric, _ = _fabric("O2", find_unused_parameters=True)
    rank = fabric.global_rank
    module = Branched(0)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=LR))
    raw = torch.optim.SGD(module.trunk.parameters(), lr=LR)
    x, y = batch(0, rank)
    fabric.backward(F.mse_loss(model(x, branch=True), y))
    optimizer.step()
    optimizer.zero_grad()
    with fabric.no_backward_sync(model):
        fabric.backward(F.mse_loss(model(x, branch=rank == 0), y))
        raw.step()
        raw.zero_grad()
        fabric.backward(F.mse_loss(model(x), y))
    r["step_reached"] = True
    optimizer.step()  # the ranks meet: both refuse here (engine.unsynced)
    r["stepped"] = True


def _subset_no_sync_fused(r: dict) -> None:
    """``subset_no_sync`` with a fused AdamW, whose step skips on the device: both ranks refuse at the backward after
    the step, where the step is settled."""
    fabric, _ = _fabric("O2", find_unused_parameters=True)
    rank = fabric.global_rank
    module = Branched(0)
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=LR, fused=True))
    raw = torch.optim.SGD(module.trunk.parameters(), lr=LR)
    x, y = batch(0, rank)
    fabric.backward(F.mse_loss(model(x, branch=True), y))
    optimizer.step()
    optimizer.zero_grad()
    with fabric.no_backward_sync(model):
        fabric.backward(F.mse_loss(model(x, branch=rank == 0), y))
        raw.step()
        raw.zero_grad()
        fabric.backward(F.mse_loss(model(x), y))
    r["trunk_before_step"] = flat(module.trunk.parameters())
    optimizer.step()  # skipped on the device on both ranks
    r["trunk_after_step"] = flat(module.trunk.parameters())
    optimizer.zero_grad()
    fabric.backward(F.mse_loss(model(x), y))  # settled here: both refuse


def _branch_raw_no_sync(r: dict) -> None:
    """Under ``no_backward_sync``: a raw SGD over the branch of a set-up optimizer holding trunk and branch; the branch
    holds a gradient on rank 0 only (its forward alone uses it), so the raw step writes it there alone. Rank 0 sees
    what it sees in ``subset_no_sync`` with trunk and branch swapped (one part written, its gradients cleared, the
    other's kept); rank 1 sees nothing written."""
    fabric, _ = _fabric("O2", find_unused_parameters=True)
    rank = fabric.global_rank
    module = Branched(0)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=LR))
    raw = torch.optim.SGD(module.branch.parameters(), lr=LR)
    x, y = batch(0, rank)
    fabric.backward(F.mse_loss(model(x, branch=True), y))
    optimizer.step()
    optimizer.zero_grad()
    with fabric.no_backward_sync(model):
        fabric.backward(F.mse_loss(model(x, branch=rank == 0), y))
        before = module.branch.weight.detach().clone()
        raw.step()
        r["branch_written"] = not torch.equal(before, module.branch.weight)
        raw.zero_grad()
        fabric.backward(F.mse_loss(model(x), y))
    optimizer.step()  # the ranks meet at the step
    r["stepped"] = True


def main() -> None:
    # A short timeout: a collective left waiting by a one-rank error fails here instead of after 30 minutes.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    torch.set_num_threads(1)
    results: dict = {"world": dist.get_world_size()}
    with case_error(results.setdefault("trainer_raw", {})) as r:
        _trainer_raw(r)
    with case_error(results.setdefault("fabric_raw/O2", {})):
        _fabric_raw("O2", BF16)
    with case_error(results.setdefault("fabric_raw/O1", {})):
        _fabric_raw("O1", FP16)
    with case_error(results.setdefault("accelerate_raw", {})) as r:
        _accelerate_raw(r)
    with case_error(results.setdefault("legit/O2", {})) as r:
        _legit("O2", r)
    with case_error(results.setdefault("legit/ref", {})) as r:
        _legit(None, r)
    with case_error(results.setdefault("overflow", {})) as r:
        _overflow(r)
    with case_error(results.setdefault("unheld_branch", {})) as r:
        _unheld_branch(r)
    with case_error(results.setdefault("subset_no_sync", {})) as r:
        _subset_no_sync(r)
    with case_error(results.setdefault("subset_no_sync_fused", {})) as r:
        _subset_no_sync_fused(r)
    with case_error(results.setdefault("branch_raw_no_sync", {})) as r:
        _branch_raw_no_sync(r)
    finish_cases(results)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    warnings.simplefilter("ignore")
    main()
