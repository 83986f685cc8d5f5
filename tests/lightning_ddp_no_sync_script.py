"""Ranks of tests/test_lightning_ddp_no_sync.py (gloo, ONE launch): DDP ``no_sync`` habits and the deferred raw-step
refusal's surroundings (engine/unsynced.py) under the Trainer and Fabric at O2 bfloat16, each case also run under
Lightning's ``"bf16-mixed"`` (the reference). Each rank writes, per case, its final weights (FP32: the masters at O2).

Fabric cases (``strategy="ddp"``, 2 ranks, inside ``fabric.launch``):

* ``nosync_off``: every backward inside ``fabric.no_backward_sync(model, enabled=False)`` (a flag left off): must be
  the plain run's weights bit for bit (``plain``);
* ``two_models``: two models, accumulation of 2 with ``no_backward_sync`` on the first model only;
* ``setup_twice``: after 3 steps the original module set up again (``fabric.setup(model.module, optimizer)``),
  3 steps more;
* ``uneven``: a second model, accumulation of 2 under its ``no_backward_sync``, whose forward rank 1 skips in the
  first micro-batch (it ran no forward there before the engine's first backward);
* ``uneven_raw``: the same, with a raw SGD over the second model stepped (and zeroed) after the third micro-batch's
  backward (under ``no_sync``): both ranks must refuse, at the step;
* ``nograd_rank0``: rank 0 alone runs a ``torch.no_grad()`` forward through the wrapper before a (synchronised)
  backward; each rank writes whether a refusal after it would be kept for the step (``kept``);
  ``nograd_rank0_raw`` adds the raw step (both ranks refuse it at the next backward; it parted the ranks before
  gap66's fix);
* ``unused_branch``: ``find_unused_parameters=True``, a branch rank 1 skips at even steps.

Trainer cases (``strategy="ddp"``): ``accumulate`` (``accumulate_grad_batches=3``), ``manual_block`` (manual
optimization accumulating under ``self.trainer.strategy.block_backward_sync()``), ``fit_validate_fit`` (fit one
epoch, ``trainer.validate``, then a second fit of the same Trainer to two epochs from ``ckpt_path="last"``).

The suite runs ``CASES``; ``ATTACK66A_CASES=all`` runs every case but the parting probe, ``ATTACK66A_CASES=a,b`` the
cases named.
"""

from __future__ import annotations

import datetime
import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy
from torch import nn

from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin
from tests.launch import case_error, finish_cases

PRECISIONS = ("O2", "bf16-mixed")


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(4, 8, generator=gen), torch.randint(0, 4, (4,), generator=gen)


def _values(*modules: nn.Module) -> list[float]:
    return torch.cat([v.detach().float().flatten() for m in modules for v in m.state_dict().values()]).tolist()


def _fabric(precision: str, **ddp: Any) -> Fabric:
    strategy = DDPStrategy(**ddp) if ddp else "ddp"
    if precision == "O2":
        return Fabric(accelerator="cpu", devices=2, strategy=strategy, plugins=[FabricMixedPrecisionPlugin("O2")])
    return Fabric(accelerator="cpu", devices=2, strategy=strategy, precision=precision)


def _sgd(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)


def fabric_case(kind: str, precision: str) -> dict[str, Any]:
    fabric = _fabric(precision)

    def train(fabric: Fabric) -> dict[str, Any]:
        rank = fabric.global_rank
        if kind in ("nograd_rank0", "nograd_rank0_raw"):
            net = _net()
            model, opt = fabric.setup(net, _sgd(net))
            raw = torch.optim.SGD(net.parameters(), lr=0.1)  # not set up: a careless user's
            kept = []
            for step in range(3):
                x, y = _batch(step, rank)
                loss = F.cross_entropy(model(x), y)
                if rank == 0 and step == 1:
                    with torch.no_grad():
                        model(x[:1])  # rank 0 only: a look at one sample through the wrapper (no collective)
                fabric.backward(loss)  # synchronised by DDP on both ranks
                machine = fabric._precision.amp._machine
                kept.append(machine.unsynced_at == machine.steps_taken)  # a refusal now: kept (True) or raised
                if kind == "nograd_rank0_raw" and step == 1:  # rank 0 keeps its refusal for the step, rank 1 raises
                    raw.step()  # it at the next backward while rank 0 waits in DDP's all-reduce: the ranks part
                    raw.zero_grad()
                    continue
                opt.step()
                opt.zero_grad()
            return {"final": _values(net), "kept": kept}
        if kind in ("plain", "nosync_off", "setup_twice"):
            net = _net()
            model, opt = fabric.setup(net, _sgd(net))
            for step in range(6):
                if kind == "setup_twice" and step == 3:
                    model, opt = fabric.setup(model.module, opt.optimizer)
                x, y = _batch(step, rank)
                if kind == "nosync_off":
                    with fabric.no_backward_sync(model, enabled=False):
                        fabric.backward(F.cross_entropy(model(x), y))
                else:
                    fabric.backward(F.cross_entropy(model(x), y))
                opt.step()
                opt.zero_grad()
            return {"final": _values(net)}
        if kind in ("two_models", "uneven", "uneven_raw"):
            a, b = _net(0), _net(1)
            model_a, opt_a = fabric.setup(a, _sgd(a))
            model_b, opt_b = fabric.setup(b, _sgd(b))
            raw = torch.optim.SGD(b.parameters(), lr=0.1)  # not set up: a careless user's
            for step in range(6):
                x, y = _batch(step, rank)
                last = step % 2 == 1
                with fabric.no_backward_sync(model_a, enabled=not last and kind == "two_models"):
                    with fabric.no_backward_sync(model_b, enabled=not last):
                        out = model_a(x)
                        if kind == "two_models" or step > 0 or rank == 0:  # rank 1: not at the first
                            out = out + model_b(x)
                        fabric.backward(F.cross_entropy(out, y) / 2)
                if kind == "uneven_raw" and step == 2:  # a raw step over B (refused), where B is in no_sync
                    raw.step()
                    raw.zero_grad()
                if last:
                    opt_a.step()
                    opt_b.step()
                    opt_a.zero_grad()
                    opt_b.zero_grad()
            return {"final": _values(a, b)}
        raise ValueError(kind)

    return fabric.launch(train)


class Branchy(nn.Module):
    """``unused_branch``: rank 1 skips ``b`` at even steps (through the wrapper's forward)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.a(x) + self.b(x) if use_b else self.a(x)


def fabric_unused(precision: str) -> dict[str, Any]:
    fabric = _fabric(precision, find_unused_parameters=True)

    def train(fabric: Fabric) -> dict[str, Any]:
        rank = fabric.global_rank
        net = Branchy()
        model, opt = fabric.setup(net, _sgd(net))
        for step in range(6):
            x, y = _batch(step, rank)
            fabric.backward(F.cross_entropy(model(x, not (rank == 1 and step % 2 == 0)), y))
            opt.step()
            opt.zero_grad()
        return {"final": _values(net)}

    return fabric.launch(train)


class Lit(pl.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = not manual
        self.net = _net()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        loss = F.cross_entropy(self.net(batch[0]), batch[1])
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        last = batch_idx % 3 == 2
        if last:
            self.manual_backward(loss / 3)
            opt.step()
            opt.zero_grad()
        else:
            with self.trainer.strategy.block_backward_sync():
                self.manual_backward(loss / 3)
        return None

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val", F.cross_entropy(self.net(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self) -> Any:
        return _sgd(self)


def _loader(rank: int) -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(48, 8, generator=gen)  # 6 batches of 4 per rank
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long()), batch_size=4)


def trainer_case(kind: str, precision: str, out: Path) -> dict[str, Any]:
    def trainer(**extra: Any) -> pl.Trainer:
        plugins = dict(plugins=[MixedPrecisionPlugin("O2")]) if precision == "O2" else dict(precision=precision)
        return pl.Trainer(
            accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False, enable_progress_bar=False,
            enable_model_summary=False, **plugins, **extra,
        )  # fmt: skip

    model = Lit(manual=kind == "manual_block")
    rank = dist.get_rank()
    if kind == "accumulate":
        trainer(accumulate_grad_batches=3, enable_checkpointing=False).fit(model, _loader(rank))
    elif kind == "manual_block":
        trainer(enable_checkpointing=False).fit(model, _loader(rank))
    else:
        folder = out / f"fvf_{precision}"
        callback = pl.callbacks.ModelCheckpoint(dirpath=str(folder), save_last=True)
        t = trainer(callbacks=[callback])
        t.fit(model, _loader(rank), _loader(rank))
        t.validate(model, _loader(rank))
        t.fit_loop.max_epochs = 2
        t.fit(model, _loader(rank), _loader(rank), ckpt_path="last")
    return {"final": _values(model)}


ALL_CASES = (
    *(f"fabric_{k}/{p}" for k in ("plain", "nosync_off", "two_models", "setup_twice", "uneven") for p in PRECISIONS),
    "fabric_uneven_raw/O2",
    "fabric_nograd_rank0/O2",
    "fabric_nograd_rank0_raw/O2",
    *(f"fabric_unused_branch/{p}" for p in PRECISIONS),
    *(f"trainer_{k}/{p}" for k in ("accumulate", "manual_block", "fit_validate_fit") for p in PRECISIONS),
)
# The suite's launch (the rest held too: ATTACK66A_CASES=all runs them, as probes)
CASES = (
    "fabric_uneven/O2", "fabric_uneven/bf16-mixed", "fabric_uneven_raw/O2", "fabric_plain/O2", "fabric_nosync_off/O2",
    "fabric_two_models/O2", "fabric_two_models/bf16-mixed", "fabric_nograd_rank0/O2", "fabric_nograd_rank0_raw/O2",
)  # fmt: skip


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a stray collective: an error, no hang
    torch.set_num_threads(1)
    out = Path(os.environ["MPX_OUT"])
    results: dict[str, Any] = {}
    chosen = os.environ.get("ATTACK66A_CASES")
    cases = CASES if not chosen else ALL_CASES if chosen == "all" else tuple(chosen.split(","))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for case in cases:
            kind, precision = case.split("/")
            with case_error(results.setdefault(case, {})) as result:
                if kind == "fabric_unused_branch":
                    result.update(fabric_unused(precision))
                elif kind.startswith("fabric_"):
                    result.update(fabric_case(kind.removeprefix("fabric_"), precision))
                else:
                    result.update(trainer_case(kind.removeprefix("trainer_"), precision, out))
    finish_cases(results)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    main()
