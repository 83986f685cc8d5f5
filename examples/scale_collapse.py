"""When the loss scale collapses: small Lightning runs that are healthy, underflow, or overflow, for the doctor.

Each setting trains the same small classifier (modules ``encoder``, ``boom``, ``norm``, ``head``) at O1 in float16 with
a TensorBoardLogger into ``OUT/<setting>``:

- ``healthy``: a dynamic loss scale (the default);
- ``too_low``: a static ``loss_scale=1`` and a loss weighted by 1e-5, so the gradients fall under float16's range;
- ``underflow_module``: a dynamic scale, and a ``tiny`` branch whose gradients are 2^-30 of the rest's;
- ``overflow``: the layer ``boom`` has weights so large that its activations exceed float16's maximum (65504) on
  every step; ``on_floor="continue"`` keeps the run going with the scale at its floor;
- ``promote``: the same with ``on_floor="promote"`` (when this version of ``Amp`` has it): ``boom`` runs in FP32
  once the scale reaches its floor, and training goes on.

::

    python examples/scale_collapse.py runs/scale_collapse          # all settings, ~1 min on a laptop CPU
    lightning-mpx doctor runs/scale_collapse/overflow               # then read the diagnosis
    lightning-mpx plot runs/scale_collapse/overflow                 # and the curves
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from lightning_mpx import Amp, MixedPrecisionPlugin

SETTINGS = ("healthy", "too_low", "underflow_module", "overflow", "promote")


class Classifier(pl.LightningModule):
    """An MLP whose ``boom`` layer can be made to overflow in float16 and whose loss can be made tiny.

    Args:
        boom_gain: Multiplies ``boom``'s weights at step ``boom_at_step`` (as a bad update or a checkpoint loaded at
            the wrong scale would): 3e5 puts a quarter of its outputs past float16's 65504 from then on. The
            LayerNorm after it (``norm``) brings them back, so in FP32 the model trains on as before.
        boom_at_step: The step the weights blow up at.
        loss_weight: Multiplies the loss (and so every gradient): 1e-5 makes the gradients underflow at a scale of 1.
        tiny_branch: Add a ``tiny`` branch to the logits, weighted by 2^-30: its gradients are 2^-30 of the rest's.
    """

    def __init__(
        self, boom_gain: float = 1.0, boom_at_step: int = 50, loss_weight: float = 1.0, tiny_branch: bool = False
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(nn.Linear(32, 64), nn.GELU())
        self.boom = nn.Linear(64, 64)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 8)
        self.tiny = nn.Linear(32, 8) if tiny_branch else None
        self.boom_gain, self.boom_at_step = boom_gain, boom_at_step
        self.loss_weight = loss_weight

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.boom_gain != 1.0 and self.trainer.global_step == self.boom_at_step:
            with torch.no_grad():
                self.boom.weight.mul_(self.boom_gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(self.boom(self.encoder(x))))
        if self.tiny is not None:
            logits = logits + 2.0**-30 * self.tiny(x)
        return logits

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss)
        return loss * self.loss_weight

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def promote_supported() -> bool:
    """Whether this version of :class:`~lightning_mpx.Amp` accepts ``on_floor="promote"``."""
    try:
        Amp("O1", on_floor="promote")  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return True


def setting(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the plugin's arguments of one setting."""
    if name == "healthy":
        return {}, {}
    if name == "too_low":
        return {"loss_weight": 1e-5}, {"loss_scale": 1.0}
    if name == "underflow_module":
        return {"tiny_branch": True}, {}
    if name == "overflow":
        return {"boom_gain": 3e5}, {"on_floor": "continue"}
    if name == "promote":
        return {"boom_gain": 3e5}, {"on_floor": "promote"}
    raise ValueError(f"setting={name!r} is not valid; valid choices: {', '.join(SETTINGS)}.")


def train(name: str, out: Path, steps: int = 200, log_every: int = 5, boom_at_step: int = 50) -> dict[str, Any]:
    """Train one setting into ``out/name``; returns its summary row."""
    model_kwargs, plugin_kwargs = setting(name)
    if "boom_gain" in model_kwargs:
        model_kwargs["boom_at_step"] = boom_at_step
    pl.seed_everything(0, verbose=False)
    x = torch.randn(4096, 32)
    y = (x @ torch.randn(32, 8)).argmax(-1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True)
    plugin = MixedPrecisionPlugin("O1", half_dtype="float16", growth_interval=25, **plugin_kwargs)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        plugins=[plugin],
        max_steps=steps,
        logger=TensorBoardLogger(str(out), name=name, version=""),
        log_every_n_steps=log_every,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Classifier(**model_kwargs), loader)
    metrics = plugin.metrics()
    return {
        "setting": name,
        "train/loss": float(trainer.callback_metrics.get("train/loss", math.nan)),
        "skipped steps": int(metrics["mpx/skipped_steps"]),
        "final loss scale": metrics["mpx/loss_scale"],
        "run dir": str(out / name),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", metavar="OUT", help="folder for the runs (one subfolder per setting)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=5, help="log the mpx/* metrics every N steps (default: 5)")
    parser.add_argument("--only", nargs="+", choices=SETTINGS, default=None, help="train these settings only")
    args = parser.parse_args(argv)
    names = list(args.only or SETTINGS)
    if "promote" in names and not promote_supported():
        print("skipping 'promote': this version of Amp does not accept on_floor='promote'")
        names.remove("promote")
    rows = [train(name, Path(args.out), args.steps, args.log_every) for name in names]
    print(f"{'setting':<18}{'train/loss':>12}{'skipped':>9}{'scale':>10}  run dir")
    for row in rows:
        print(
            f"{row['setting']:<18}{row['train/loss']:>12.4f}{row['skipped steps']:>9}{row['final loss scale']:>10g}  "
            f"{row['run dir']}"
        )
    last = Path(args.out) / names[-1]
    print(f"next: lightning-mpx doctor {last}   and   lightning-mpx plot {last}")


if __name__ == "__main__":
    main()
