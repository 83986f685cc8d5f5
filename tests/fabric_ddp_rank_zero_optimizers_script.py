"""Ranks of tests/test_fabric_ddp_rank_zero_optimizers.py: rank-0-only habits around stop 57's optimizers under Fabric
DDP, two CPU processes (gloo), ONE launch for every multi-rank check; O2 against Fabric's ``"bf16-mixed"`` on the same
code. Each rank writes ``$MPX_OUT/rank{r}.json``; a case that raises leaves its traceback in the case's ``"error"``.

At O2 a schedule-free optimizer's ``eval()``/``train()`` called through Fabric's optimizer moves no half weight (its
state is keyed by the FP32 masters); the engine redoes it on the masters at the next forward or state dict
(masters/swap.py ``follow_modes``). Rank 0 alone calling them must leave nothing collective behind and the ranks'
weights equal. The cases:

* ``sf/O2``, ``sf/ref``: tests/test_lightning_schedule_free.py's ``ScheduleFreeAdamW``; a baseline evaluation on rank 0
  alone before the first step (``optimizer.eval()``, a forward under ``no_grad``); each epoch ``optimizer.train()`` on
  every rank, two steps, then on rank 0 alone ``model.eval(); optimizer.eval()``, a validation forward under
  ``no_grad``, a ``torch.save(module.state_dict())`` export, ``optimizer.train(); model.train()``.
* ``trainer_sf/O2``: the same habit through the Trainer (DDP, manual optimization) in ``on_train_epoch_end``, on
  sf/ref's data; a forward after the export too.
* ``forget/O2``, ``forget/ref``: the same, but rank 0 forgets ``train()`` after the first evaluation (and no epoch
  calls it again). Each step is followed by a flag all-reduce so that a one-rank error ends the case on both ranks
  instead of leaving the other in DDP's next all-reduce.
* ``sam/O2``: tests/test_core_sam.py's ``DoorSAM`` at O2 float16 with a dynamic scale, the first pass under
  ``no_backward_sync`` (davda54/sam's README for DDP); at step 0 rank 1's first pass alone overflows (a huge input).
* ``la/O2``, ``la/ref``: tests/test_lightning_optimizer_wrappers_resume.py's timm Lookahead over AdamW; ``fabric.save``
  after step 3 (every rank calls it; rank 0 writes) and a ``torch.save`` of the model's and the optimizer's state dicts
  made on rank 0 alone; a fresh model and optimizer load each on both ranks (``fabric.load``; ``load_state_dict``),
  three more steps; against six straight steps.
"""

from __future__ import annotations

import datetime
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin
from tests.launch import case_error, finish_cases

BF16 = {"half_dtype": "bfloat16"}
FP16 = {"half_dtype": "float16", "loss_scale": "dynamic", "init_scale": 2.0**8, "growth_interval": 100}
OUT = os.environ.get("MPX_OUT", ".")


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(8, 4, generator=g)
    return x, x.sum(1, keepdim=True).tanh()


def flat(tensors: Any) -> list[float]:
    return torch.cat([t.detach().float().flatten() for t in tensors]).tolist()


def fabric_for(level: str | None, settings: dict | None = None) -> tuple[Any, Any]:
    from lightning.fabric import Fabric

    plugin = None if level is None else FabricMixedPrecisionPlugin(level, **(settings or BF16))
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp", plugins=plugin,
                    precision=None if level else "bf16-mixed")  # fmt: skip
    fabric.launch()  # the ranks are forked already: no process is started
    return fabric, plugin


def weights(module: nn.Module, plugin: Any, optimizer: Any) -> dict[str, list[float]]:
    """The model's weights (and the masters at O2), read after a state dict: the documented way to have a
    schedule-free optimizer's last ``eval()``/``train()`` followed at O2 (docs/core.md)."""
    module.state_dict()
    out = {"model": flat(module.parameters())}
    if plugin is not None:
        out["masters"] = flat(plugin.master_params(optimizer))
    return out


# -- 1, 2. schedule-free, rank-0-only evaluation
def _schedule_free(level: str | None, r: dict, forget: bool) -> None:
    from tests.test_lightning_schedule_free import ScheduleFreeAdamW

    fabric, plugin = fabric_for(level)
    rank = fabric.global_rank
    module = net()
    model, optimizer = fabric.setup(module, ScheduleFreeAdamW(module.parameters(), lr=0.02))
    r.update(losses=[], val=[], export=[], eval_w=[], raised=None)
    if rank == 0:  # a baseline evaluation before the first step (the plugin has not met the optimizer yet)
        model.eval()
        optimizer.eval()
        with torch.no_grad():
            x, y = batch(1000, 0)
            r["val"].append(F.mse_loss(model(x).float(), y).item())
        model.train()
    step = 0
    for epoch in range(3):
        if not (forget and epoch > 0):
            optimizer.train()
        for _ in range(2):
            x, y = batch(step, rank)
            loss = F.mse_loss(model(x).float(), y)
            r["losses"].append(loss.item())
            fabric.backward(loss)
            error = None
            try:
                optimizer.step()
            except Exception as e:  # noqa: BLE001 - read by the test
                error = f"{type(e).__name__}: {e}"
            optimizer.zero_grad()
            flag = torch.tensor([float(error is not None)])
            dist.all_reduce(flag)  # a one-rank error ends the case on both ranks, not a hang in DDP's next all-reduce
            if flag.item():  # the user's recovery: the rank that raised calls train(), one more step on both
                r["raised"] = {"step": step, "error": error}
                if error is not None:
                    optimizer.train()
                x, y = batch(step + 1, rank)
                fabric.backward(F.mse_loss(model(x).float(), y))
                optimizer.step()
                optimizer.zero_grad()
                r["end"] = weights(module, plugin, optimizer)
                return
            step += 1
        if rank == 0:
            model.eval()
            optimizer.eval()
            with torch.no_grad():
                x, y = batch(1000, 0)
                r["val"].append(F.mse_loss(model(x).float(), y).item())
            path = os.path.join(OUT, f"sf_{level}_{forget}.pt")
            torch.save(module.state_dict(), path)
            r["export"].append(flat(torch.load(path).values()))
            r["eval_w"].append(flat(module.parameters()))
            if not (forget and epoch == 0):
                optimizer.train()
            model.train()
    r["end"] = weights(module, plugin, optimizer)


# -- 1b. the same habit through the Trainer (one case: O2), held to sf/ref's Fabric "bf16-mixed" on the same data
def _trainer_schedule_free(r: dict) -> None:
    import lightning.pytorch as pl

    from lightning_mpx import MixedPrecisionPlugin
    from tests.lightning_helpers import make_trainer
    from tests.test_lightning_schedule_free import ScheduleFreeAdamW

    class Lit(pl.LightningModule):
        """Manual optimization (the optimizer ignores a closure); rank 0 alone evaluates and exports at each training
        epoch's end, between ``optimizer.eval()`` and ``optimizer.train()``."""

        def __init__(self) -> None:
            super().__init__()
            self.net = net()
            self.automatic_optimization = False

        def training_step(self, _: Any, __: int) -> None:
            opt = self.optimizers()
            x, y = batch(self.global_step, self.global_rank)
            self.manual_backward(F.mse_loss(self.net(x).float(), y))
            opt.step()
            opt.zero_grad()

        def on_train_epoch_start(self) -> None:
            self.optimizers().train()

        def on_train_epoch_end(self) -> None:
            if self.trainer.is_global_zero:
                opt = self.optimizers()
                self.net.eval()
                opt.eval()
                with torch.no_grad():
                    x, y = batch(1000, 0)
                    r["val"].append(F.mse_loss(self.net(x).float(), y).item())
                path = os.path.join(OUT, "sf_trainer.pt")
                torch.save(self.state_dict(), path)
                r["export"].append(flat(torch.load(path).values()))
                with torch.no_grad():  # again, after the state dict (which follows the eval() at O2)
                    r["val_after_save"].append(F.mse_loss(self.net(x).float(), y).item())
                opt.train()
                self.net.train()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return ScheduleFreeAdamW(self.parameters(), lr=0.02)

    r.update(val=[], export=[], val_after_save=[])
    module = Lit()
    plugin = MixedPrecisionPlugin("O2", **BF16)
    trainer = make_trainer(plugin, devices=2, strategy="ddp", max_epochs=3, limit_train_batches=2)
    data = torch.utils.data.TensorDataset(torch.zeros(4, 1))  # two batches a rank; the data is batch()'s
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=1))
    module.state_dict()
    r["end"] = {"model": flat(module.parameters()), "masters": flat(plugin.amp.master_params(trainer.optimizers[0]))}


# -- 3. SAM, one rank's first pass overflows
def _sam(r: dict) -> None:
    from tests.test_core_sam import DoorSAM

    fabric, plugin = fabric_for("O2", FP16)
    rank = fabric.global_rank
    module = net()
    model, optimizer = fabric.setup(module, DoorSAM(module.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9))
    plugin.setup_optimizers(optimizer)  # the recipe: the plugin meets it before first_step
    r.update(w=[flat(module.parameters())], masters=[flat(plugin.master_params(optimizer))], took=[])
    for step in range(3):
        x, y = batch(step, rank)
        huge = 1e6 if (step == 0 and rank == 1) else 1.0
        with fabric.no_backward_sync(model):  # davda54/sam's README: the first pass unsynced under DDP
            fabric.backward(F.mse_loss(model(x * huge).float(), y))
        optimizer.first_step(zero_grad=True)
        fabric.backward(F.mse_loss(model(x).float(), y))
        optimizer.second_step()
        optimizer.step()
        optimizer.zero_grad()
        r["w"].append(flat(module.parameters()))
        r["masters"].append(flat(plugin.master_params(optimizer)))
    r["scale"] = plugin.amp.scalers[0].get_scale()


# -- 4. Lookahead checkpoint written by rank 0, loaded on both
def _lookahead(level: str | None, r: dict) -> None:
    from tests.test_lightning_optimizer_wrappers_resume import TimmLookahead

    fabric, plugin = fabric_for(level)
    rank = fabric.global_rank
    path = os.path.join(OUT, f"la_{level}.ckpt")

    def run(steps: range, load: str = "") -> tuple[nn.Module, Any]:
        module = net()
        model, optimizer = fabric.setup(module, TimmLookahead(torch.optim.AdamW(module.parameters(), lr=0.02), k=2))
        if load and plugin is not None:
            plugin.setup_optimizers(optimizer)  # the documented order: the plugin meets it before the load
        if load == "fabric":
            fabric.load(path, {"model": model, "optimizer": optimizer})
        elif load == "torch":
            saved = torch.load(path + ".pt", weights_only=False)
            module.load_state_dict(saved["model"])
            optimizer.load_state_dict(saved["optimizer"])
        for step in steps:
            x, y = batch(step, rank)
            fabric.backward(F.mse_loss(model(x).float(), y))
            optimizer.step()
            optimizer.zero_grad()
            if step == 2 and not load:
                fabric.save(path, {"model": model, "optimizer": optimizer})  # rank 0 writes, then a barrier
                if rank == 0:  # the plain habit: rank 0 alone makes the state dicts and writes them
                    torch.save({"model": module.state_dict(), "optimizer": optimizer.state_dict()}, path + ".pt")
                fabric.barrier()
        return module, optimizer

    module, optimizer = run(range(6))
    r["straight"] = weights(module, plugin, optimizer)
    r["wrote"] = os.path.exists(path)
    module, optimizer = run(range(3, 6), load="fabric")
    r["resumed"] = weights(module, plugin, optimizer)
    module, optimizer = run(range(3, 6), load="torch")
    r["resumed_torch"] = weights(module, plugin, optimizer)


def main() -> None:
    # A short timeout: a collective left waiting by a one-rank error fails here instead of after 30 minutes.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    torch.set_num_threads(1)
    results: dict = {"world": dist.get_world_size()}
    for level in ("O2", None):
        name = level or "ref"
        with case_error(results.setdefault(f"sf/{name}", {})) as r:
            _schedule_free(level, r, forget=False)
        with case_error(results.setdefault(f"forget/{name}", {})) as r:
            _schedule_free(level, r, forget=True)
        with case_error(results.setdefault(f"la/{name}", {})) as r:
            _lookahead(level, r)
    with case_error(results.setdefault("trainer_sf/O2", {})) as r:
        _trainer_schedule_free(r)
    with case_error(results.setdefault("sam/O2", {})) as r:
        _sam(r)
    finish_cases(results)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    warnings.simplefilter("ignore")
    main()
