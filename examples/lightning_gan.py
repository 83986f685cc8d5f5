"""A GAN with two optimizers and two losses, each loss with its own loss scale (Apex's ``num_losses``).

Manual optimization: ``self.manual_backward(loss, loss_id=...)`` picks the scaler. Each optimizer skips on its own
overflow, and each scale is updated once per iteration.

    python examples/lightning_gan.py --opt-level O1
    python examples/lightning_gan.py --opt-level O2 --half-dtype bfloat16
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import MixedPrecisionPlugin

G_LOSS, D_LOSS = 0, 1


class GAN(pl.LightningModule):
    """Learns to generate points of a ring in 2-D."""

    def __init__(self, noise: int = 8) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.noise = noise
        self.generator = nn.Sequential(nn.Linear(noise, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        real = batch[0]
        z = torch.randn(real.shape[0], self.noise)  # FP32; cast to half at the generator's boundary at O2/O3

        self.toggle_optimizer(opt_g)
        fake = self.generator(z)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), torch.ones(len(real), 1))
        self.manual_backward(g_loss, loss_id=G_LOSS)
        opt_g.step()
        opt_g.zero_grad()
        self.untoggle_optimizer(opt_g)

        self.toggle_optimizer(opt_d)
        logits = self.discriminator(torch.cat([real, fake.detach()]))
        targets = torch.cat([torch.ones(len(real), 1), torch.zeros(len(real), 1)])
        d_loss = F.binary_cross_entropy_with_logits(logits, targets)
        self.manual_backward(d_loss, loss_id=D_LOSS)
        opt_d.step()
        opt_d.zero_grad()
        self.untoggle_optimizer(opt_d)
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss}, prog_bar=True)

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return (
            torch.optim.Adam(self.generator.parameters(), lr=1e-3, betas=(0.5, 0.999)),
            torch.optim.Adam(self.discriminator.parameters(), lr=1e-3, betas=(0.5, 0.999)),
        )



def pick_half_dtype(choice: str) -> str:
    """``--half-dtype auto``: float16 on a GPU, bfloat16 on a CPU (many CPUs emulate float16 matmuls)."""
    return choice if choice != "auto" else ("float16" if torch.cuda.is_available() else "bfloat16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--opt-level", default="O1", choices=("O0", "O1", "O2", "O3"))
    parser.add_argument("--half-dtype", default="auto", choices=("auto", "float16", "bfloat16"),
                        help="auto: float16 on a GPU, bfloat16 on a CPU (where float16 matmuls are often emulated)")
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    args.half_dtype = pick_half_dtype(args.half_dtype)

    pl.seed_everything(0)
    angle = torch.rand(4096) * 2 * torch.pi
    ring = torch.stack([angle.cos(), angle.sin()], 1) + 0.05 * torch.randn(4096, 2)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ring), batch_size=128, shuffle=True)

    # loss_scale="dynamic": the default in float16; in bfloat16 (static 1.0 by default) it shows the scales move too.
    plugin = MixedPrecisionPlugin(args.opt_level, half_dtype=args.half_dtype, num_losses=2, loss_scale="dynamic",
                                  growth_interval=50)
    trainer = pl.Trainer(plugins=[plugin], max_epochs=args.epochs, logger=False, enable_checkpointing=False)
    model = GAN()
    trainer.fit(model, loader)
    with torch.no_grad():
        samples = model.generator(torch.randn(1000, model.noise, dtype=model.generator[0].weight.dtype)).float()
    # The GAN is deliberately tiny and untuned: the example is about the API, not about sample quality.
    print(f"generated points: mean radius {samples.norm(dim=1).mean():.3f} (real data: 1.0)")
    print(plugin.metrics())  # mpx/loss_scale/loss0 (generator), mpx/loss_scale/loss1 (discriminator), ...


if __name__ == "__main__":
    main()
