"""Ranks of tests/test_lightning_o2_write_warnings.py: stop 60's O2 warnings under the Trainer's DDP (two CPU processes,
gloo), ONE launch. Each rank writes ``$MPX_OUT/rank{r}.json``: the count of each warning it saw (a case that raises
leaves its traceback in the case's ``"error"``).

* ``ema``: an EMA child inside ``SGD(self.parameters())``, ``lerp_`` after each batch: the held-parameters warning.
* ``rounding``: a backbone frozen in ``__init__`` (before set-up), unfrozen at epoch 1: the rounding warning.
Each must come once on rank zero and never on rank one.
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

from lightning_mpx import MixedPrecisionPlugin
from tests.launch import case_error, end_ranks, write_rank_results

SIGNS = {"ema": "that the optimizer holds got no gradient", "rounding": "frozen when the model was cast to half"}


class WithEma(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.ema = copy.deepcopy(self.net)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.net(batch[0]).float(), batch[1])

    def on_train_batch_end(self, *args: Any) -> None:
        with torch.no_grad():
            for e, s in zip(self.ema.parameters(), self.net.parameters()):
                e.lerp_(s, 0.001)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class FrozenInInit(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone, self.head = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), nn.Linear(4, 4)
        self.backbone.requires_grad_(False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.head(self.backbone(batch[0])).float(), batch[1])

    def on_train_epoch_start(self) -> None:
        if self.current_epoch >= 1:
            self.backbone.requires_grad_(True)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(model: pl.LightningModule, r: dict, **ddp: Any) -> None:
    from lightning.pytorch.strategies import DDPStrategy

    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, torch.randint(0, 4, (32,), generator=g))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=DDPStrategy(**ddp), logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, max_epochs=3,
        plugins=[MixedPrecisionPlugin("O2", half_dtype="bfloat16")],
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    for key, sign in SIGNS.items():
        r[key] = sum(sign in str(w.message) for w in caught)


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    torch.set_num_threads(1)
    results: dict = {"world": dist.get_world_size()}
    with case_error(results.setdefault("ema", {})) as r:
        _fit(WithEma(), r, find_unused_parameters=True)  # the EMA child gets no gradient
    with case_error(results.setdefault("rounding", {})) as r:
        _fit(FrozenInInit(), r, find_unused_parameters=True)
    write_rank_results(results)
    end_ranks()


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    warnings.simplefilter("ignore")
    main()
