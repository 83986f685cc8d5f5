"""O1 with Lightning: the cast table sends matmuls to half and keeps softmax, reductions and the loss in FP32.

    python examples/lightning_basic.py                      # O1; float16 on a GPU, bfloat16 on a CPU
    python examples/lightning_basic.py --half-dtype bfloat16
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import MixedPrecisionPlugin


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)  # half under O1 (a matmul) ...
        loss = F.cross_entropy(logits, y)  # ... but the loss is computed in FP32 (the table's "float" list)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)



def pick_half_dtype(choice: str) -> str:
    """``--half-dtype auto``: float16 on a GPU, bfloat16 on a CPU (many CPUs emulate float16 matmuls)."""
    return choice if choice != "auto" else ("float16" if torch.cuda.is_available() else "bfloat16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--half-dtype", default="auto", choices=("auto", "float16", "bfloat16"),
                        help="auto: float16 on a GPU, bfloat16 on a CPU (where float16 matmuls are often emulated)")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    args.half_dtype = pick_half_dtype(args.half_dtype)

    pl.seed_everything(0)
    x = torch.randn(2048, 32)
    y = (x @ torch.randn(32, 10)).argmax(-1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True)

    plugin = MixedPrecisionPlugin("O1", half_dtype=args.half_dtype)
    trainer = pl.Trainer(plugins=[plugin], max_epochs=args.epochs, logger=False, enable_checkpointing=False)
    trainer.fit(Classifier(), loader)
    print({"train/loss": round(float(trainer.callback_metrics["train/loss"]), 4), **plugin.metrics()})


if __name__ == "__main__":
    main()
