"""LightningModules of the shapes people write, shared by tests/test_hostile_ddp_redirect.py and, run as a script, its
two-process DDP cases (gloo, one launch): the Trainer reaches ``training_step`` and ``validation_step`` through DDP's
``forward`` (Lightning's forward redirection), where the plugin's casts at the LightningModule's boundary must let
the step pass as on one device.

Models (:data:`MODELS`): ``flat_self`` (layers directly on the LightningModule, ``self(x)`` in the step),
``flat_forward`` (the same, ``self.forward(x)``), ``tokens_net`` (a child model with an embedding, called as
``self.net(tokens)``), ``tokens_self`` (the same through ``self(tokens)``). Batches are dicts, targets float (MSE).

As a script each rank fits every ``<level>:<model>`` of :data:`CASES` (``bf16-true``: Lightning's own precision) and
writes to ``$MPX_OUT/rank{r}.json`` the weights, the validation losses and the dtypes the steps saw.
"""

from __future__ import annotations

import json
import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from tests.launch import end_ranks

MODELS = ("flat_self", "flat_forward", "tokens_net", "tokens_self")
CASES = tuple(f"{level}:{model}" for level in ("O2", "O3") for model in MODELS) + (
    "bf16-true:flat_self", "bf16-true:tokens_net",
)
PER_RANK = 8  # batch size per rank; one process takes 2 * PER_RANK


class Regressor(pl.LightningModule):
    """A regression model of one of :data:`MODELS`, recording what its steps saw."""

    def __init__(self, model: str) -> None:
        super().__init__()
        self.model_kind = model
        torch.manual_seed(0)
        if model.startswith("flat"):
            self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 1)
        else:
            self.net = nn.Sequential(nn.Embedding(32, 8), nn.Flatten(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 1))
        self.initial = [p.detach().flatten().tolist() for p in self.parameters()]
        self.seen: set[str] = set()  # "<step>:<name>:<dtype>"
        self.val_losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.model_kind.startswith("flat"):
            return self.l2(torch.tanh(self.l1(x)))
        return self.net(x)

    def _loss(self, batch: dict[str, torch.Tensor], step: str) -> torch.Tensor:
        x, y = batch["x"], batch["y"]
        kind = self.model_kind
        pred = self.forward(x) if kind == "flat_forward" else self.net(x) if kind == "tokens_net" else self(x)
        self.seen.update({f"{step}:x:{x.dtype}", f"{step}:y:{y.dtype}", f"{step}:pred:{pred.dtype}"})
        return F.mse_loss(pred.float(), y.float())  # torch 2.11's mse_loss backward refuses a bfloat16 target

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._loss(batch, "train")

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss = self._loss(batch, "val")
        self.val_losses.append(float(loss))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class _Dicts(torch.utils.data.Dataset):
    def __init__(self, model: str, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        if model.startswith("flat"):
            self.x = torch.randn(n, 8, generator=g)
        else:
            self.x = torch.randint(0, 32, (n, 4), generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


def data(model: str, batch_size: int, n: int = 64, seed: int = 1) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(_Dicts(model, n, seed), batch_size=batch_size, shuffle=False)


def fit(case: str, devices: int = 1, **trainer: Any) -> tuple[Regressor, Any]:
    """Fit ``<level>:<model>`` on ``devices`` processes (one process: the global batch)."""
    from lightning_mpx import MixedPrecisionPlugin
    from tests.lightning_helpers import make_trainer

    level, model_kind = case.split(":")
    plugin = None if level.startswith("bf16") or level.startswith("32") else MixedPrecisionPlugin(
        level, half_dtype="bfloat16", loss_scale=1.0)
    model = Regressor(model_kind)
    kwargs: dict[str, Any] = dict(devices=devices, limit_val_batches=2, **trainer)
    if plugin is None:
        kwargs["precision"] = level
    if devices > 1:
        kwargs.setdefault("strategy", "ddp")
    batch = PER_RANK * (2 // devices)
    make_trainer(plugin, **kwargs).fit(model, data(model_kind, batch), data(model_kind, batch, n=32, seed=2))
    return model, plugin


def result(model: Regressor) -> dict[str, Any]:
    return {
        "params": [p.detach().float().flatten().tolist() for p in model.parameters()],
        "initial": model.initial,
        "val_losses": model.val_losses,
        "seen": sorted(model.seen),
    }


def main() -> None:
    results: dict[str, Any] = {}
    for case in CASES:
        try:
            results[case] = result(fit(case, devices=2)[0])
        except Exception as error:  # noqa: BLE001 (recorded for the test to show)
            import traceback

            results[case] = {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()[-3000:]}
    rank = torch.distributed.get_rank()
    with open(os.path.join(os.environ["MPX_OUT"], f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    end_ranks()


if __name__ == "__main__":
    main()
