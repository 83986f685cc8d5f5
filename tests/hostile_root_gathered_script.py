"""Cases of tests/test_fsdp_reconfigure.py, run in ``tests/fsdp_reconfigure_script.py``'s launch (``gathered/<case>``
in its ``$MPX_CASES``; :func:`run_case`): the Trainer with ``ModelParallelStrategy`` and ``configure_model``
calling ``shard_model`` with FSDP's default for the root (``reshard_after_forward=None``: the root stays gathered
after a forward with no backward), on two CPU processes (gloo), each run against the same run with
``reshard_after_forward=True`` (every unit resharded after its forward: nothing left gathered by an evaluation).

A case is ``<level>:<order>``; order is one of ``ORDERS``. Every run is made twice (``none``: the default; ``true``:
the reference).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_mpx import MixedPrecisionPlugin
from lightning_mpx.integrations.fsdp import shard_model
from tests.fsdp_reconfigure_script import Block, Model  # the same model as the reconfigure runs
from tests.lightning_helpers import classification_data, loader, make_trainer

BATCH = 8  # per rank
ORDERS = ("val_each_epoch", "fit_fit", "predict_fit", "validate_fit", "fit_test", "resume")


class Lit(pl.LightningModule):
    """The README's pattern, with what the test compares recorded: the training losses, the dtype of the root's
    parameters at each checkpoint save, and the dtypes and types of the saved model state."""

    def __init__(self, reshard: bool | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Model()
        self.reshard = reshard
        self.train_losses: list[float] = []
        self.saved: list[dict[str, Any]] = []

    def configure_model(self) -> None:
        kwargs = {} if self.reshard is None else {"reshard_after_forward": self.reshard}
        shard_model(self.model, self.trainer.precision_plugin, mesh=self.device_mesh["data_parallel"], blocks=Block,
                    **kwargs)  # fmt: skip

    def _loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.train_losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._loss(batch)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(batch[0])

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("state_dict", {})
        self.saved.append(dict(
            root_dtype=str(self.model.out.weight.dtype),
            state={k: [type(v).__name__, str(v.dtype)] for k, v in state.items() if isinstance(v, torch.Tensor)},
        ))  # fmt: skip

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def _trainer(level: str, **kwargs: Any) -> pl.Trainer:
    plugin = MixedPrecisionPlugin(level, half_dtype="bfloat16")
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    settings: dict[str, Any] = dict(strategy=strategy, devices=2, max_epochs=1, limit_train_batches=2,
                                    limit_val_batches=1)  # fmt: skip
    settings.update(kwargs)
    return make_trainer(plugin, **settings)


def _data(seed: int = 1) -> Any:
    return loader(classification_data(n=BATCH * 2 * 2, seed=seed), BATCH)


def _weights(model: Lit) -> dict[str, list[float]]:
    """Every parameter's full FP32 value (the stored shards, gathered), after putting gathered units back."""
    for unit in model.model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().flatten().tolist()
        for name, p in model.model.named_parameters()
    }


def _stored_dtypes(model: Lit) -> list[str]:
    return sorted({f"{type(p).__name__}:{p.dtype}" for p in model.model.parameters()})


def run(level: str, order: str, reshard: bool | None) -> dict[str, Any]:
    model = Lit(reshard)
    data = _data()
    record: dict[str, Any] = {}
    try:
        if order == "val_each_epoch":
            _trainer(level, max_epochs=2, num_sanity_val_steps=2, val_check_interval=1).fit(model, data, data)
        elif order == "fit_fit":
            _trainer(level).fit(model, data, data)
            record["between"] = _stored_dtypes(model)
            _trainer(level).fit(model, data, data)
        elif order == "predict_fit":
            trainer = _trainer(level)
            trainer.predict(model, data)
            trainer.fit(model, data, data)
        elif order == "validate_fit":
            trainer = _trainer(level)
            trainer.validate(model, data)
            trainer.fit(model, data, data)
        elif order == "fit_test":
            trainer = _trainer(level)
            trainer.fit(model, data, data)
            trainer.test(model, data)
        elif order == "resume":
            # Uninterrupted: 2 epochs, a checkpoint after each validation (the root gathered by it). Resumed: a new
            # model and Trainer from the first epoch's checkpoint.
            # in the test's folder ($MPX_OUT): one in /tmp was left behind by every run
            shared = tempfile.mkdtemp(dir=os.environ.get("MPX_OUT")) if dist.get_rank() == 0 else None
            holder = [shared]
            dist.broadcast_object_list(holder)
            folder = os.path.join(holder[0], f"{level}_{reshard}")
            checkpoint = ModelCheckpoint(dirpath=folder, save_top_k=-1, every_n_epochs=1)
            trainer = _trainer(level, max_epochs=2, enable_checkpointing=True, callbacks=[checkpoint])
            trainer.fit(model, data, data)
            first = sorted(os.listdir(folder))[0]
            record["saved"] = model.saved
            resumed = Lit(reshard)
            _trainer(level, max_epochs=2).fit(resumed, data, data, ckpt_path=os.path.join(folder, first))
            record["resumed_losses"] = resumed.train_losses
            record["resumed_weights"] = _weights(resumed)
    except Exception as error:  # noqa: BLE001 - the test names what was raised
        record["error"] = f"{type(error).__name__}: {error}"
        return record
    record["stored_dtypes"] = _stored_dtypes(model)
    record["train_losses"] = model.train_losses
    record["weights"] = _weights(model)
    return record


def run_case(case: str) -> dict[str, Any]:
    """One ``<level>:<order>`` case on this rank: the run with the default (``none``) and the reference (``true``)."""
    level, order = case.split(":")
    return {"none": run(level, order, None), "true": run(level, order, True)}
