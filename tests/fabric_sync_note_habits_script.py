"""Ranks of tests/test_fabric_sync_note_habits.py (gloo, ONE launch): gap66's ``SyncNote`` (engine/unsynced.py) under
habits that run forwards through the DDP wrapper beside the backward's own, at O2 bfloat16 with Fabric
``strategy="ddp"``.

Each case runs three iterations, a synchronised backward each (the middle one with the habit), and writes per rank
whether a raw-step refusal after each backward would be kept for the step (``kept``: it must be alike on both
ranks) and the final weights; the ``*_raw`` cases step a raw SGD (never set up) after the middle backward and must be
refused on both ranks, the ranks still meeting afterwards (``after``).

* ``nograd0`` / ``inference0``: rank 0 alone looks at a sample under ``torch.no_grad()`` / ``torch.inference_mode()``
  between the forward and the backward;
* ``logging0``: rank 0 alone runs a second forward with grad enabled whose output no backward uses (a logged metric);
* ``two_forwards``: two forwards, one backward of their summed losses;
* ``checkpoint``: activation checkpointing inside the wrapped module (``torch.utils.checkpoint``, non-reentrant);
* ``unused``: ``find_unused_parameters=True``, a branch rank 1 skips in the middle iteration;
* ``static``: ``static_graph=True``;
* ``setup_again``: a new wrapper (the module set up again) after the first iteration;
* ``copies``: a ``copy.deepcopy`` and a pickled copy of the set-up model run a forward with grad (rank 0 alone) before
  the middle backward;
* ``nosync_raw``: a micro-batch under ``fabric.no_backward_sync``, a raw step, then the middle backward (the refusal
  kept on both ranks, raised at the step on both);
* ``trainer_refit`` / ``trainer_refit_raw``: a second ``trainer.fit`` (a new DDP wrapper) of a manual-optimization
  module, rank 0 alone looking under ``torch.no_grad()`` at its second batch (and a raw step after that batch's
  backward);
* ``trainer_switch_raw``: manual optimization stepping the prepared optimizer for three batches, then a raw one alone
  (a second optimizer never returned from ``configure_optimizers``): refused on both ranks at the backward after the
  first raw step. gap66's ``SyncNote`` took the Trainer's every backward after its second batch for unsynchronised
  (Lightning's manual redirection ends each ``training_step`` forward with ``require_backward_grad_sync`` off, and
  re-prepares the reducer in ``manual_backward``): the refusal was kept for a prepared step that never came.
"""

from __future__ import annotations

import copy
import datetime
import io
import os
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin
from tests.launch import case_error, finish_cases


class Net(nn.Module):
    def __init__(self, ckpt: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.head = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 4)
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = checkpoint(self.a, x, use_reentrant=False) if self.ckpt else self.a(x)
        if use_b:
            h = h + self.b(x)
        return self.head(torch.tanh(h))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen)


def case(kind: str) -> dict[str, Any]:
    ddp = {"unused": dict(find_unused_parameters=True), "static": dict(static_graph=True)}.get(kind.split("_")[0], {})
    fabric = Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(**ddp) if ddp else "ddp",
                    plugins=[FabricMixedPrecisionPlugin("O2")])  # fmt: skip

    def train(fabric: Fabric) -> dict[str, Any]:
        rank = fabric.global_rank
        net = Net(ckpt=kind == "checkpoint")
        model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
        raw = torch.optim.SGD(net.parameters(), lr=0.1)  # not set up: a careless user's
        kept = []
        for step in range(3):
            if kind == "setup_again" and step == 1:
                model, opt = fabric.setup(net, opt.optimizer)
            x, y = _batch(step, rank)
            middle = step == 1
            nosync = kind.startswith("nosync") and middle
            if nosync:  # a micro-batch under no_sync, a raw step, then the middle backward (synchronised)
                with fabric.no_backward_sync(model):
                    fabric.backward(F.cross_entropy(model(x.flip(0)), y) / 2)
                raw.step()
                raw.zero_grad()
            with fabric.no_backward_sync(model, enabled=False):
                use_b = not (kind.startswith("unused") and middle and rank == 1)
                loss = F.cross_entropy(model(x, use_b), y)
                if kind == "two_forwards":
                    loss = loss + F.cross_entropy(model(x.flip(0)), y)
                if middle and rank == 0:
                    if kind.startswith("nograd0"):
                        with torch.no_grad():
                            model(x[:1])
                    elif kind.startswith("inference0"):
                        with torch.inference_mode():
                            model(x[:1])
                    elif kind.startswith("logging0"):
                        model(x[:1]).float().mean().item()  # with grad, never backwarded
                    elif kind.startswith("copies"):
                        look = x[:1].to(net.a.weight.dtype)
                        copy.deepcopy(net)(look).sum()
                        buffer = io.BytesIO()
                        torch.save(net, buffer)
                        buffer.seek(0)
                        torch.load(buffer, weights_only=False)(look).sum()
                        copy.deepcopy(model)(x[:1]).sum()  # the Fabric wrapper, DDP wrapper and all
                fabric.backward(loss)
            machine = fabric._precision.amp._machine
            kept.append(machine.unsynced_at == machine.steps_taken)
            if middle and kind.endswith("_raw") and not nosync:
                raw.step()
                raw.zero_grad()
                continue
            opt.step()
            opt.zero_grad()
        return {"final": torch.cat([p.detach().float().flatten() for p in net.parameters()]).tolist(), "kept": kept}

    return fabric.launch(train)


class Lit(pl.LightningModule):
    def __init__(self, raw: bool, switch: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.net, self.raw, self.switch, self.kept, self.fits = Net(), raw, switch, [], 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def on_fit_start(self) -> None:
        self.fits += 1
        self.raw_opt = torch.optim.SGD(self.net.parameters(), lr=0.1)  # not set up: a careless user's

    def training_step(self, batch: Any, batch_idx: int) -> None:
        look = self.fits == 2 and batch_idx == 1
        loss = F.cross_entropy(self.net(batch[0]), batch[1])
        if look and self.global_rank == 0:
            with torch.no_grad():
                self.net(batch[0][:1])  # in the wrapper's forward (training_step)
        self.manual_backward(loss)
        machine = self.trainer.precision_plugin.amp._machine
        self.kept.append(machine.unsynced_at == machine.steps_taken)
        if (look and self.raw) or (self.switch and batch_idx >= 3):  # switch: the raw optimizer alone from batch 3
            self.raw_opt.step()
            self.raw_opt.zero_grad()
            return
        opt = self.optimizers()
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net.parameters(), lr=0.1)


def trainer_case(raw: bool, switch: bool = False) -> dict[str, Any]:
    rank = dist.get_rank()
    batches = [_batch(i, rank) for i in range(10 if switch else 3)]
    data = torch.utils.data.TensorDataset(*(torch.cat(t) for t in zip(*batches)))
    module = Lit(raw, switch)
    for epochs in (1,) if switch else (1, 2):
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=epochs, logger=False,
                             enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                             plugins=[MixedPrecisionPlugin("O2")])  # fmt: skip
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=4))
    return {"final": torch.cat([p.detach().float().flatten() for p in module.net.parameters()]).tolist(),
            "kept": module.kept}  # fmt: skip


KINDS = ("nograd0", "inference0", "logging0", "two_forwards", "checkpoint", "unused", "static", "setup_again", "copies")
ALL_CASES = (
    *KINDS,
    *(f"{k}_raw" for k in ("nograd0", "inference0", "logging0", "unused", "static", "copies", "nosync")),
    "trainer_refit",
    "trainer_refit_raw",
    "trainer_switch_raw",
)
# The suite's launch (the rest held too: REVIEW66B_CASES=all runs them, as probes)
CASES = ("checkpoint", *(f"{k}_raw" for k in ("inference0", "logging0", "nosync", "trainer_switch")))  # fmt: skip


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a stray collective: an error, no hang
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    chosen = os.environ.get("REVIEW66B_CASES")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for kind in CASES if not chosen else ALL_CASES if chosen == "all" else tuple(chosen.split(",")):
            with case_error(results.setdefault(kind, {})) as result:
                if kind.startswith("trainer"):
                    result.update(trainer_case(kind.endswith("_raw"), switch="switch" in kind))
                else:
                    result.update(case(kind))
    finish_cases(results)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    main()
