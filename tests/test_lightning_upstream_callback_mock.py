"""Contract breaks found by rerunning Lightning's, Fabric's and Accelerate's own tests with the plugins after stop 54
(FP32 state dicts at O2), ported here. The table of every upstream failure and its class is in docs/testing.md
("The frameworks' own suites, run with the plugins (stops 53, 55)")."""

from __future__ import annotations

from unittest.mock import Mock

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_mpx.lightning import MixedPrecisionPlugin


def _fit(level: str, callbacks: list, root) -> BoringModel:
    seed_everything(0)
    model = BoringModel()
    trainer = Trainer(
        max_steps=2, logger=False, default_root_dir=root, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, accelerator="cpu", devices=1, callbacks=callbacks,
        plugins=[MixedPrecisionPlugin(level, half_dtype="bfloat16")],
    )
    trainer.fit(model)
    return model


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_mock_spec_callback_trains_as_without(level, tmp_path):
    """Lightning ``tests_pytorch/trainer/connectors/test_checkpoint_connector.py::
    test_stateful_trainer_ckpt_path_support`` (NeMo's pattern): a ``Mock(spec=ModelCheckpoint)`` callback. The
    plugin asked ``type(cb).on_before_optimizer_step`` (``Mock`` has none) and the fit raised ``AttributeError``; now
    the fit runs, Lightning calls the mock's hook each step, and the weights match a run without the mock."""
    reference = _fit(level, [], tmp_path / "reference")
    checkpoint = Mock(spec=ModelCheckpoint)
    model = _fit(level, [checkpoint], tmp_path / "mocked")
    assert checkpoint.on_before_optimizer_step.call_count == 2
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=0, atol=0)
