"""Ranks of tests/test_lightning_ddp_sync_notes.py (gloo, ONE launch): DDP habits around ``SyncNote`` and ``DdpWatch``
(engine/unsynced.py) under Fabric and the Trainer at O2 bfloat16, each case also run under Lightning's
``"bf16-mixed"`` (the reference). Each rank writes, per case, its final weights (FP32: the masters at O2).

Fabric cases (``strategy="ddp"``, 2 ranks, inside ``fabric.launch``):

* ``alternate``: ``fabric.no_backward_sync(model, enabled=step % 2 == 0)``, a step every second backward, the
  model's first forward inside ``torch.inference_mode()`` and rank 0 alone looking at a sample under
  ``torch.no_grad()`` through the wrapper inside each window (the three habits of the cases below at once);
* ``inference_first``: the model's first forward inside ``torch.inference_mode()`` (a look at a sample before
  training), then plain steps;
* ``interleaved``: two models, each accumulating 2 under its own ``no_backward_sync`` on alternate micro-batches
  (one synchronises where the other does not);
* ``alternate_raw``: the same with a raw SGD (never set up) stepped and zeroed after the backward of the third
  micro-batch (inside ``no_sync``): both ranks must refuse, at the step, and still meet;
* ``static_graph``: ``DDPStrategy(static_graph=True)``, rank 0 alone looking at a sample under ``torch.no_grad()``
  through the wrapper before a backward (``no_sync`` with a static graph fails in DDP's reducer under either
  precision);
* ``nograd_rank0_acc``: accumulation of 2 under ``no_backward_sync``; rank 0 alone looks at a sample under
  ``torch.no_grad()`` through the wrapper inside the window.

Trainer case (``strategy="ddp"``): ``eval_rank0`` (``accumulate_grad_batches=2``, rank 0 alone evaluates
``self(x)`` under ``torch.no_grad()`` in ``on_train_batch_end``). (``trainer.validate`` called from
``on_train_epoch_end`` fails in Lightning's logger connector under either precision: not a case.)

The suite runs ``CASES``; ``ATTACK67A_CASES=all`` runs every case, ``ATTACK67A_CASES=a,b`` the cases named.
"""

from __future__ import annotations

import datetime
import os
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric import Fabric

from lightning_mpx import MixedPrecisionPlugin
from tests.launch import case_error, finish_cases
from tests.lightning_ddp_no_sync_script import (  # the same model and Fabric set-up
    PRECISIONS,
    _batch,
    _fabric,
    _net,
    _sgd,
    _values,
)


def fabric_case(kind: str, precision: str) -> dict[str, Any]:
    fabric = _fabric(precision, static_graph=True) if kind == "static_graph" else _fabric(precision)

    def train(fabric: Fabric) -> dict[str, Any]:
        rank = fabric.global_rank
        if kind == "interleaved":
            a, b = _net(0), _net(1)
            model_a, opt_a = fabric.setup(a, _sgd(a))
            model_b, opt_b = fabric.setup(b, _sgd(b))
            for step in range(6):
                x, y = _batch(step, rank)
                with fabric.no_backward_sync(model_a, enabled=step % 2 == 0):
                    fabric.backward(F.cross_entropy(model_a(x), y) / 2)
                with fabric.no_backward_sync(model_b, enabled=step % 2 == 1):
                    fabric.backward(F.cross_entropy(model_b(x), y) / 2)
                if step % 2 == 1:
                    opt_a.step()
                    opt_a.zero_grad()
                if step % 2 == 0 and step > 0:
                    opt_b.step()
                    opt_b.zero_grad()
            return {"final": _values(a, b)}
        net = _net()
        model, opt = fabric.setup(net, _sgd(net))
        raw = torch.optim.SGD(net.parameters(), lr=0.1)  # not set up
        if kind in ("inference_first", "alternate", "alternate_raw"):
            with torch.inference_mode():
                model(_batch(99, rank)[0])
        for step in range(6):
            x, y = _batch(step, rank)
            window = step % 2 == 0  # a backward that does not synchronise, then one that does
            if kind in ("inference_first", "static_graph"):
                loss = F.cross_entropy(model(x), y)
                if kind == "static_graph" and rank == 0 and step == 3:
                    with torch.no_grad():
                        model(x[:1])  # rank 0 only: a look at one sample through the wrapper
                fabric.backward(loss)
            else:
                with fabric.no_backward_sync(model, enabled=window):
                    loss = F.cross_entropy(model(x), y) / 2
                    if kind in ("alternate", "nograd_rank0_acc") and rank == 0 and window:
                        with torch.no_grad():
                            model(x[:1])  # rank 0 only: a look at one sample through the wrapper
                    fabric.backward(loss)
                if kind == "alternate_raw" and step == 2:  # a careless user's raw step inside the window
                    raw.step()
                    raw.zero_grad()
                if window:
                    continue
            opt.step()
            opt.zero_grad()
        return {"final": _values(net)}

    return fabric.launch(train)


class Lit(pl.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.net = _net()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.kind == "eval_rank0" and self.global_rank == 0 and batch_idx % 2 == 0:
            with torch.no_grad():
                self(batch[0][:1])  # through the LightningModule: no wrapper, a user's look at a sample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def configure_optimizers(self) -> Any:
        return _sgd(self)


def _loader(rank: int) -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(32, 8, generator=gen)  # 8 batches of 4 per rank
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long()), batch_size=4)


def trainer_case(kind: str, precision: str) -> dict[str, Any]:
    plugins = dict(plugins=[MixedPrecisionPlugin("O2")]) if precision == "O2" else dict(precision=precision)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=2, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, accumulate_grad_batches=2, **plugins,
    )  # fmt: skip
    model = Lit(kind)
    trainer.fit(model, _loader(dist.get_rank()))
    amp = getattr(trainer.precision_plugin, "amp", None)
    weights = amp.fp32_state_dict(model) if amp is not None else model.state_dict()
    final = torch.cat([v.detach().float().flatten() for v in weights.values()]).tolist()
    return {"final": final}


ALL_CASES = (
    *(f"fabric_{k}/{p}" for k in ("alternate", "inference_first", "interleaved", "static_graph", "nograd_rank0_acc")
      for p in PRECISIONS),
    "fabric_alternate_raw/O2",
    *(f"trainer_eval_rank0/{p}" for p in PRECISIONS),
)  # fmt: skip
# The suite's launch (the rest held too: ATTACK67A_CASES=all runs them, as probes)
CASES = (
    "fabric_alternate/O2", "fabric_alternate/bf16-mixed", "fabric_alternate_raw/O2", "fabric_interleaved/O2",
)  # fmt: skip


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a stray collective: an error, no hang
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    chosen = os.environ.get("ATTACK67A_CASES")
    cases = CASES if not chosen else ALL_CASES if chosen == "all" else tuple(chosen.split(","))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for case in cases:
            kind, precision = case.split("/")
            with case_error(results.setdefault(case, {})) as result:
                if kind.startswith("fabric_"):
                    result.update(fabric_case(kind.removeprefix("fabric_"), precision))
                else:
                    result.update(trainer_case(kind.removeprefix("trainer_"), precision))
    finish_cases(results)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    main()
