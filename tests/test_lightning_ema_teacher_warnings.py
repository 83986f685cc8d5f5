"""Hostile review of the O2 warnings about half EMA / momentum teachers (lightning_mpx/engine/frozen_writes.py): false
alarms in real set-ups, misses, and where the warning points. A frozen ``nn.Embedding(max_norm=...)`` renormalises its
weight in place at each forward (no teacher); a teacher updated every N steps (ema_pytorch's ``update_every=10``) was
not written between the first two steps, the one window looked at; the same warning came from every DDP rank, where
the library's other warnings are rank zero only; and it pointed inside the library (``frozen_writes.py``), not at the
user's line, so ``filterwarnings`` by module missed it.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp, MixedPrecisionPlugin
from tests.lightning_helpers import classification_data, loader, make_trainer

HALF = torch.bfloat16
WARNED = "were written in place between two steps"


class Tuned(nn.Module):
    """A head trained over a backbone frozen before set-up (a fine-tuning's, never a teacher)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Linear(16, 16).requires_grad_(False)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x)).float().pow(2).mean()


def _caught(run: Callable[[], Any]) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [w for w in caught if WARNED in str(w.message)]


def _core(between: Callable[[Tuned, int, torch.optim.Optimizer], None], steps: int) -> list[warnings.WarningMessage]:
    def run() -> None:
        amp = Amp("O2", half_dtype=HALF)
        model = amp.prepare_model(Tuned())
        optimizer = amp.prepare_optimizer(torch.optim.SGD(model.head.parameters(), lr=0.1))
        g = torch.Generator().manual_seed(1)
        for step in range(steps):
            amp.backward(model(amp.cast_inputs(torch.randn(8, 16, generator=g))))
            amp.step(optimizer)
            amp.update()
            optimizer.zero_grad()
            between(model, step, optimizer)

    return _caught(run)


def _every_third(model: Tuned, step: int, optimizer: torch.optim.Optimizer) -> None:
    if step % 3 == 2:  # an EMA updated every 3 steps: after the 3rd and the 6th, never between the 1st and the 2nd
        with torch.no_grad():
            model.backbone.weight.mul_(0.999)


def test_teacher_updated_every_n_steps_is_warned_about_on_rank_zero_only(monkeypatch: pytest.MonkeyPatch) -> None:
    caught = _core(_every_third, steps=6)
    assert len(caught) == 1 and "parameters of Tuned ('backbone')" in str(caught[0].message), caught
    assert caught[0].filename == __file__  # the user's amp.backward line, not one inside the library
    monkeypatch.setenv("RANK", "1")  # another DDP rank: the same model, the same warning (the library's: rank zero)
    assert _core(_every_third, steps=6) == []


def test_a_part_unfrozen_trained_and_frozen_again_is_not_warned_about() -> None:
    """A freezing schedule: the backbone frozen at set-up (noted after the 1st step), unfrozen into the optimizer after
    the 2nd (its masters made, the steps write it), frozen again after the 4th, before the look after the 5th: its
    writes were the optimizer's."""

    def schedule(model: Tuned, step: int, optimizer: torch.optim.Optimizer) -> None:
        if step == 1:
            model.backbone.requires_grad_(True)
            optimizer.add_param_group({"params": list(model.backbone.parameters())})
        elif step == 3:
            model.backbone.requires_grad_(False)

    assert _core(schedule, steps=6) == []


class EmbeddingLit(pl.LightningModule):
    """A frozen pretrained embedding with ``max_norm`` (renormalised in place at each forward) under a trained head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(4, 16, max_norm=1.0).requires_grad_(False)
        self.head = nn.Linear(16, 4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.head(x + self.embed(y)).float(), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


def test_trainer_frozen_max_norm_embedding_is_not_warned_about() -> None:
    trainer = make_trainer(MixedPrecisionPlugin("O2", half_dtype=HALF), max_steps=4, max_epochs=-1)
    assert _caught(lambda: trainer.fit(EmbeddingLit(), loader(classification_data(n=64)))) == []


class TeacherLit(EmbeddingLit):
    def __init__(self) -> None:
        super().__init__()
        self.embed.max_norm = None  # an embedding teacher, not renormalised

    def on_train_batch_end(self, *args: Any) -> None:
        with torch.no_grad():
            self.embed.weight.mul_(0.999)  # a hand update, after the step


def test_trainer_warning_points_at_the_users_fit_line() -> None:
    trainer = make_trainer(MixedPrecisionPlugin("O2", half_dtype=HALF), max_steps=4, max_epochs=-1)
    data = loader(classification_data(n=64))
    caught = _caught(lambda: trainer.fit(TeacherLit(), data))  # the user's line
    assert len(caught) == 1 and "('embed')" in str(caught[0].message), caught
    first = test_trainer_warning_points_at_the_users_fit_line.__code__.co_firstlineno
    assert (caught[0].filename, caught[0].lineno) == (__file__, first + 3)
