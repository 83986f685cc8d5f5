"""The Trainer plugin at O2/O3 under Lightning's ``FSDPStrategy`` (FSDP1): Lightning reaches ``training_step`` through
the FSDP1 root's ``forward``, so FSDP's root input cast would cast the whole batch (float targets too) to half, and
the model's own outputs stayed half at O2 (its FP32 parameters are gathered in half, so no boundary was put on it):
the loss ran in half. The step now sees what it sees on one device: the batch as it is, the model's output in FP32,
an FP32 loss; and it trains as on one device. One process (a gloo group of one), the CPU ``FSDPStrategy`` of
tests/lightning_fsdp_script.py. (Lightning writes the launch variables into ``os.environ`` here: tests/conftest.py's
``_launch_environment`` puts them back after the test.)"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.launch import one_process_group

pytest.importorskip("torch.distributed.fsdp")

import lightning.pytorch as pl  # noqa: E402

from lightning_mpx import MixedPrecisionPlugin  # noqa: E402
from tests.lightning_fsdp_script import CPUFSDPStrategy  # noqa: E402


class Regression(pl.LightningModule):
    """A child model and an MSE loss on float targets; records the dtypes the step sees."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.seen: dict[str, torch.dtype] = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        loss = F.mse_loss(out, y)
        self.seen = {"x": x.dtype, "y": y.dtype, "out": out.dtype, "loss": loss.dtype}
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def _fit(level: str, strategy) -> Regression:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)) for _ in range(6)]
    model = Regression()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=6, logger=False,
                         use_distributed_sampler=False,  # the same batch order as on one device
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         plugins=[MixedPrecisionPlugin(level, half_dtype="bfloat16")])  # fmt: skip
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=None))
    return model


def _weights(model: Regression) -> torch.Tensor:
    from torch.distributed.fsdp import FullyShardedDataParallel

    roots = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
    with FullyShardedDataParallel.summon_full_params(roots[0], writeback=False) if roots else torch.no_grad():
        return torch.cat([p.detach().float().flatten() for p in model.net.parameters()])


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_the_step_sees_what_it_sees_on_one_device_and_trains_as_there(level):
    with one_process_group():
        sharded = _fit(level, CPUFSDPStrategy())
        weights = _weights(sharded)
    alone = _fit(level, "auto")
    expected = {"x": torch.float32, "y": torch.float32, "out": torch.float32, "loss": torch.float32}
    assert alone.seen == expected
    assert sharded.seen == expected  # was bfloat16 for all four at O2 (x and y at O3)
    assert torch.allclose(weights, _weights(alone), rtol=0, atol=5e-3)  # a bfloat16 rounding or two
