"""Small LightningModules and a Trainer factory shared by the Lightning integration tests (and their subprocesses)."""

from __future__ import annotations

import copy
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn


def make_trainer(plugin: Any = None, **kwargs: Any) -> pl.Trainer:
    """A quiet one-epoch CPU Trainer (no logger, checkpoints, progress bar or summary) with ``plugin``; keywords
    override these settings. Without a plugin it runs Lightning's own precision (``precision=...``, default FP32)."""
    settings: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_epochs=1,
    )
    settings.update(kwargs)
    if plugin is not None:
        settings["plugins"] = [plugin, *settings.get("plugins", [])]
    return pl.Trainer(**settings)


def classification_data(n: int = 64, features: int = 16, classes: int = 4, seed: int = 0) -> torch.utils.data.Dataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, classes, generator=g)
    return torch.utils.data.TensorDataset(x, (x @ w).argmax(-1))


def loader(dataset: torch.utils.data.Dataset, batch_size: int = 16) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False)


class Classifier(pl.LightningModule):
    """An MLP classifier that records what tests need to see.

    Args:
        inject_inf_at: Global steps (optimizer steps taken so far) at which an inf is written into the first layer's
            gradient after backward, to simulate an overflow.
        optimizer: "sgd", "adamw", "adamw_fused" or "lbfgs".
        scheduler: Add a per-step StepLR (step_size 1, gamma 0.5).
    """

    def __init__(
        self,
        inject_inf_at: tuple[int, ...] = (),
        optimizer: str = "sgd",
        lr: float = 0.1,
        scheduler: bool = False,
        features: int = 16,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, 4))
        self.inject_inf_at = set(inject_inf_at)
        self.optimizer_name = optimizer
        self.lr = lr
        self.use_scheduler = scheduler
        self.hidden_dtypes: dict[str, torch.dtype] = {}
        self.snapshots: dict[int, dict[str, Any]] = {}
        self.after_injection: dict[int, dict[str, Any]] = {}
        self.losses: list[float] = []
        self._stage = "train"
        # The dtype the first layer computed in, per kind of step (a hook sees what the layer really produced).
        self.net[0].register_forward_hook(self._record_dtype)

    def _record_dtype(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        self.hidden_dtypes[self._stage] = output.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _step(self, batch: Any, stage: str) -> torch.Tensor:
        x, y = batch
        self._stage = stage
        logits = self(x)
        self.logits_dtype = logits.dtype
        return F.cross_entropy(logits, y)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._step(batch, "train")
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._step(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._step(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._step(batch, "predict")
        return self(batch[0])

    def on_after_backward(self) -> None:
        step = self.trainer.global_step
        if step in self.inject_inf_at:
            self.snapshots[step] = snapshot(self, self.trainer.optimizers[0])
            self.net[0].weight.grad[0, 0] = float("inf")

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        for step, before in self.snapshots.items():
            if step not in self.after_injection:
                self.after_injection[step] = snapshot(self, self.trainer.optimizers[0])

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        elif self.optimizer_name == "adamw":
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        elif self.optimizer_name == "adamw_fused":
            opt = torch.optim.AdamW(self.parameters(), lr=self.lr, fused=True)
        elif self.optimizer_name == "lbfgs":
            opt = torch.optim.LBFGS(self.parameters(), lr=self.lr)
        else:
            raise ValueError(self.optimizer_name)
        if not self.use_scheduler:
            return opt
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class RecordingSGD(torch.optim.SGD):
    """SGD that records, in :attr:`seen`, the gradients it is handed at each step (at O2: the FP32 masters')."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.seen: list[list[torch.Tensor]] = []

    def step(self, closure: Any = None) -> Any:
        self.seen.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


class RecordingClassifier(Classifier):
    """A :class:`Classifier` stepped by :class:`RecordingSGD` at learning rate 0: every step sees the same weights."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return RecordingSGD(self.parameters(), lr=0.0)


def true_gradients(batch: Any) -> list[torch.Tensor]:
    """The FP32 gradients of a fresh :class:`Classifier` (the weights every test model starts from) on ``batch``."""
    reference = Classifier()
    x, y = batch
    F.cross_entropy(reference(x), y).backward()
    return [p.grad for p in reference.parameters()]


def snapshot(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's state dict (at O2 the FP32 masters: a prepared model's ``state_dict()`` gives them), the
    parameters of the optimizer's groups (at O2 the half ones: the masters stand in only for the step) and its state,
    cloned."""
    return {
        "model": {k: v.detach().clone() for k, v in module.state_dict().items()},
        "optimizer_params": [p.detach().clone() for g in optimizer.param_groups for p in g["params"]],
        "optimizer_state": copy.deepcopy(optimizer.state_dict()["state"]),
    }


def assert_same(a: Any, b: Any) -> None:
    """Bit-identical nested tensors."""
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


class RecordingLogger(pl.loggers.Logger):
    """A Lightning logger that keeps every ``log_metrics`` call as ``(step, metrics)`` in :attr:`logged`."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((int(step or 0), dict(metrics)))
