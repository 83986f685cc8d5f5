"""Contract breaks found by running more of Lightning's and Fabric's own test directories with the plugins (stop 59:
loops, tuner, callbacks, core, trainer flags/logging/connectors; Fabric loggers, utilities, wrappers), ported here.
The table of every upstream failure and its class is in docs/testing.md."""

from __future__ import annotations

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_mpx.lightning import MixedPrecisionPlugin


class _Logged(BoringModel):
    def validation_step(self, batch, batch_idx):
        loss = self.step(batch)
        self.log("val_loss", loss)
        return loss


def _trainer(plugins: list) -> Trainer:
    return Trainer(
        max_steps=2, limit_train_batches=2, limit_val_batches=2, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        devices=1, plugins=plugins,
    )


def test_validate_another_model_after_fit_o2(tmp_path):
    """Lightning ``tests_pytorch/loops/test_fetchers.py::test_step_methods_with_dataloader_iter``: ``trainer.fit(a)``
    then ``trainer.validate(b)`` with the same Trainer. At O2 the plugin registered the fit's optimizer (``a``'s,
    kept by the Trainer) with ``b``'s engine, which has no masters, and the validate raised "prepare_model() must run
    before prepare_optimizer()". Now it validates ``b`` as an FP32 Trainer does, leaves ``b`` FP32, and ``b`` then
    trains."""
    seed_everything(0)
    trainer = _trainer([MixedPrecisionPlugin("O2", half_dtype="bfloat16")])
    trainer.fit(BoringModel())
    seed_everything(1)
    other = _Logged()
    before = [p.detach().clone() for p in other.parameters()]
    seed_everything(2)  # the same validation batches (BoringModel draws them when its dataloader is made)
    ours = trainer.validate(other, verbose=False)[0]["val_loss"]
    seed_everything(2)
    reference = _trainer([]).validate(other, verbose=False)[0]["val_loss"]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(reference), rtol=2e-2, atol=1e-2)
    for p, q in zip(other.parameters(), before, strict=True):
        assert p.dtype == torch.float32 and torch.equal(p, q)
    trainer.fit(other)
    assert trainer.global_step == 2
    assert any(not torch.equal(p.float(), q) for p, q in zip(other.parameters(), before, strict=True))
