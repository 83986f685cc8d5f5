"""Ranks of tests/test_lightning_ema_judgment.py: the Trainer's DDP (two CPU processes, gloo), ONE launch. Each rank
writes ``$MPX_OUT/rank{r}.json`` (a case that raises leaves its traceback in the case's ``"error"``).

* ``ema``: an EMA child inside ``Adagrad(self.parameters())`` (state for every parameter from construction), updated
  by ``torch._foreach_lerp_`` after each batch: ``warned`` (the EMA warning's count; ``other``: any other).
* ``backbone``: ``BackboneFinetuning`` (unfrozen at epoch 1) at O2 and under ``"bf16-mixed"``: the backbone's ``gap``
  between the two, how far ``"bf16-mixed"`` ``moved`` it, and the O2 run's ``warned`` count.
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

EMA = "that the optimizer holds got no gradient"


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


class WithEma(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()
        self.ema = copy.deepcopy(self.net)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.net(batch[0]).float(), batch[1])

    def on_train_batch_end(self, *args: Any) -> None:
        with torch.no_grad():
            torch._foreach_lerp_(list(self.ema.parameters()), list(self.net.parameters()), 0.001)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adagrad(self.parameters(), lr=0.05)


class Finetuned(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.backbone, self.head = _mlp(), nn.Linear(4, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.head(self.backbone(batch[0])).float(), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


def _fit(model: pl.LightningModule, precision: str, callbacks: list, **ddp: Any) -> list[str]:
    from lightning.pytorch.strategies import DDPStrategy

    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g))
    plugin = {"plugins": [MixedPrecisionPlugin("O2", half_dtype="bfloat16")]} if precision == "O2" else {
        "precision": precision}
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=DDPStrategy(**ddp), logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, max_epochs=2, callbacks=callbacks, **plugin,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
    return [str(w.message) for w in caught if "lightning_mpx:" in str(w.message)]


def main() -> None:
    from lightning.pytorch.callbacks import BackboneFinetuning

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    results: dict = {"world": dist.get_world_size()}
    with case_error(results.setdefault("ema", {})) as r:
        messages = _fit(WithEma(), "O2", [], find_unused_parameters=True)  # the EMA child gets no gradient
        r["warned"] = sum(EMA in m for m in messages)
        r["other"] = len(messages) - r["warned"]
    with case_error(results.setdefault("backbone", {})) as r:
        ours, mixed = Finetuned(), Finetuned()
        r["warned"] = len(_fit(ours, "O2", [BackboneFinetuning(unfreeze_backbone_at_epoch=1)]))
        _fit(mixed, "bf16-mixed", [BackboneFinetuning(unfreeze_backbone_at_epoch=1)])
        start, o2, mx = _mlp().state_dict(), ours.backbone.state_dict(), mixed.backbone.state_dict()
        r["gap"] = max((o2[k].float() - mx[k].float()).abs().max().item() for k in start)
        r["moved"] = max((mx[k].float() - start[k]).abs().max().item() for k in start)
    write_rank_results(results)
    end_ranks()


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    warnings.simplefilter("ignore")
    main()
