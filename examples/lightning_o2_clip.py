"""O2 with Lightning: a half convolutional net with batch norm kept in FP32, FP32 master weights for the optimizer,
gradient clipping by norm on the unscaled gradients, a per-step LR schedule (which does not advance on skipped
steps) and the loss-scale metrics in TensorBoard.

    python examples/lightning_o2_clip.py
    tensorboard --logdir runs/lightning_o2_clip
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from lightning_mpx import MixedPrecisionPlugin


class ConvNet(pl.LightningModule):
    def __init__(self, steps: int) -> None:
        super().__init__()
        self.steps = steps
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )  # fmt: skip
        self.classifier = nn.Linear(32, 4)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch  # FP32 images: the plugin casts them to half at the model's boundary
        loss = F.cross_entropy(self.classifier(self.features(images)), labels)  # FP32 logits, FP32 loss
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, nesterov=True)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=self.steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}



def pick_half_dtype(choice: str) -> str:
    """``--half-dtype auto``: float16 on a GPU, bfloat16 on a CPU (many CPUs emulate float16 matmuls)."""
    return choice if choice != "auto" else ("float16" if torch.cuda.is_available() else "bfloat16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--half-dtype", default="auto", choices=("auto", "float16", "bfloat16"),
                        help="auto: float16 on a GPU, bfloat16 on a CPU (where float16 matmuls are often emulated)")
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    args.half_dtype = pick_half_dtype(args.half_dtype)

    pl.seed_everything(0)
    images = torch.randn(512, 3, 16, 16)
    labels = (images[:, 0].mean((1, 2)) > 0).long() + 2 * (images[:, 1].mean((1, 2)) > 0).long()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels), batch_size=32, shuffle=True)

    # loss_scale="dynamic": the default in float16; in bfloat16 (static 1.0 by default) it shows the scale move too.
    plugin = MixedPrecisionPlugin(
        "O2", half_dtype=args.half_dtype, keep_batchnorm_fp32=True, loss_scale="dynamic", growth_interval=20
    )
    trainer = pl.Trainer(
        plugins=[plugin],
        max_steps=args.steps,
        gradient_clip_val=1.0,  # by norm, on the true (unscaled) gradients
        logger=TensorBoardLogger("runs", name="lightning_o2_clip"),
        log_every_n_steps=5,
        enable_checkpointing=False,
    )
    model = ConvNet(args.steps)
    trainer.fit(model, loader)
    bn, conv = model.features[1], model.features[0]
    print(f"conv weight {conv.weight.dtype}, batch norm weight {bn.weight.dtype}, optimizer steps "
          f"{plugin.amp.master_of(conv.weight).dtype} masters")
    print({"train/loss": round(float(trainer.callback_metrics["train/loss"]), 4), **plugin.metrics()})


if __name__ == "__main__":
    main()
