"""A GAN trained with manual optimization (generator and discriminator, each its own optimizer), shared by
tests/test_hostile_manual_optimization.py and, when run as a script, its two-process DDP cases (gloo, one launch).

As a script each rank fits, in turn, every case of :data:`CASES` and writes what it ended with to
``$MPX_OUT/rank{r}.json``:

- ``reference``: Lightning's ``"32-true"``, the overflowed steps left out by hand;
- ``o1_sgd``: ``MixedPrecisionPlugin("O1")`` (bfloat16, dynamic scale), an inf in the discriminator's gradient on
  rank 0 only, then in the generator's on rank 1 only (after DDP's all-reduce: the ranks agree only through the
  plugin), and ``plugin.metrics()`` read on rank 0 only inside the training step, between the discriminator's step
  and the generator's backward (``if trainer.is_global_zero``, the way people log);
- ``o2_fused``: the same at O2 with ``AdamW(fused=True)`` (skipped on the device, ``skip_on_device=None``), and
  ``o2_host``, its reference: the flags read on the host (``skip_on_device=False``);
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from tests.launch import end_ranks

#: batch index -> (the optimizer whose gradient gets an inf, the ranks it happens on) in the DDP cases
DDP_OVERFLOWS: dict[int, tuple[str, tuple[int, ...]]] = {1: ("d", (0,)), 3: ("g", (1,))}
CASES = ("reference", "o1_sgd", "o2_fused", "o2_host")


class ManualGAN(pl.LightningModule):
    """A small GAN stepped by hand: per batch ``n_critic`` discriminator steps, then one generator step.

    Args:
        optimizer: ``"sgd"`` (momentum), ``"adam"``, ``"adamw"`` or ``"adamw_fused"``.
        overflows: batch index -> (``"d"`` or ``"g"``, the ranks, ``None``: every rank): an inf is written into that
            optimizer's gradient after its backward (in the first critic step only).
        reference: Leave the overflowed steps out by hand instead (a run without the plugin).
        n_critic: Discriminator steps per batch (WGAN's critic loop).
        accumulate: Step every ``accumulate`` batches (gradients added up by hand in between).
        closure: Step the discriminator with ``opt.step(closure=...)``.
        clip_val: Clip each optimizer's gradients by norm with ``self.clip_gradients`` before its step.
        schedulers: A per-step ``StepLR`` for each optimizer, stepped by hand after its optimizer's step.
        mid_step: Called with the Trainer between the discriminator's step and the generator's backward.
        ask_skipped: Ask the plugin after each step whether it was skipped (``step_was_skipped``: a read, which with
            ``skip_on_device`` waits for the device).
    """

    def __init__(
        self,
        optimizer: str = "sgd",
        overflows: dict[int, tuple[str, tuple[int, ...] | None]] | None = None,
        reference: bool = False,
        n_critic: int = 1,
        accumulate: int = 1,
        closure: bool = False,
        clip_val: float | None = None,
        schedulers: bool = False,
        mid_step: Callable[[pl.Trainer], Any] | None = None,
        ask_skipped: bool = True,
    ) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.optimizer, self.overflows, self.reference = optimizer, overflows or {}, reference
        self.n_critic, self.accumulate, self.closure, self.clip_val = n_critic, accumulate, closure, clip_val
        self.schedulers, self.mid_step, self.ask_skipped = schedulers, mid_step, ask_skipped
        self.skipped: list[tuple[str, int]] = []  # (optimizer, batch) of each step the plugin said it skipped
        self.lrs: list[float] = []  # the discriminator's learning rate after each batch
        self.batch_dtypes: set[str] = set()  # what the training step received

    def _overflows(self, which: str, batch_idx: int) -> bool:
        what = self.overflows.get(batch_idx)
        if what is None or what[0] != which:
            return False
        # the reference leaves the step out on every rank, as the plugin's ranks agree to
        return self.reference or what[1] is None or self.global_rank in what[1]

    def _after_backward(self, which: str, batch_idx: int, critic: int) -> bool:
        """Write the overflow of this step (not in the reference); whether the step is to be left out by hand."""
        if critic or not self._overflows(which, batch_idx):
            return False
        if not self.reference:
            module = self.generator if which == "g" else self.discriminator
            module[0].weight.grad[0, 0] = float("inf")
        return self.reference

    def _step(self, opt: Any, which: str, batch_idx: int, skip: bool, closure: Any = None) -> None:
        plugin = self.trainer.precision_plugin
        if self.clip_val is not None and closure is None:
            self.clip_gradients(opt, gradient_clip_val=self.clip_val, gradient_clip_algorithm="norm")
        if closure is not None:
            opt.step(closure=closure)
        elif not skip:
            opt.step()
        if self.ask_skipped and hasattr(plugin, "step_was_skipped") and plugin.step_was_skipped(opt):
            self.skipped.append((which, batch_idx))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        real = batch[0]
        self.batch_dtypes.add(str(real.dtype))
        n = real.shape[0]
        z = torch.randn(n, 4, generator=torch.Generator().manual_seed(batch_idx))
        stepping = (batch_idx + 1) % self.accumulate == 0
        for critic in range(self.n_critic):
            self.toggle_optimizer(opt_d)
            skip = False

            def d_closure() -> torch.Tensor:
                nonlocal skip
                logits = self.discriminator(torch.cat([real, self.generator(z).detach()]))
                labels = torch.cat([torch.ones(n, 1), torch.zeros(n, 1)])
                loss = F.binary_cross_entropy_with_logits(logits, labels) / self.accumulate
                self.manual_backward(loss, **self._loss_id(1))
                skip = self._after_backward("d", batch_idx, critic)
                return loss

            if self.closure and stepping and not (self.reference and self._overflows("d", batch_idx) and not critic):
                self._step(opt_d, "d", batch_idx, False, closure=d_closure)
            else:
                d_closure()
                if stepping:
                    self._step(opt_d, "d", batch_idx, skip)
            if stepping:
                opt_d.zero_grad()
            self.untoggle_optimizer(opt_d)
        if self.mid_step is not None:
            self.mid_step(self.trainer)
        self.toggle_optimizer(opt_g)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(self.generator(z)), torch.ones(n, 1))
        self.manual_backward(g_loss / self.accumulate, **self._loss_id(0))
        skip = self._after_backward("g", batch_idx, 0)
        if stepping:
            self._step(opt_g, "g", batch_idx, skip)
            opt_g.zero_grad()
            if self.schedulers:
                for scheduler in self.lr_schedulers():
                    scheduler.step()
        self.untoggle_optimizer(opt_g)
        self.lrs.append(opt_d.param_groups[0]["lr"])

    def _loss_id(self, loss_id: int) -> dict[str, int]:
        """``manual_backward``'s ``loss_id`` when the plugin has a scaler per loss (Lightning's plugins take none)."""
        amp = getattr(self.trainer.precision_plugin, "amp", None)
        return {"loss_id": loss_id} if amp is not None and len(amp.scalers) > 1 else {}

    def configure_optimizers(self) -> Any:
        def make(params: Any) -> torch.optim.Optimizer:
            if self.optimizer == "sgd":
                return torch.optim.SGD(params, lr=0.1, momentum=0.9)
            if self.optimizer == "adam":
                return torch.optim.Adam(params, lr=1e-2)
            return torch.optim.AdamW(params, lr=1e-2, fused=self.optimizer == "adamw_fused")

        opt_g, opt_d = make(self.generator.parameters()), make(self.discriminator.parameters())
        if not self.schedulers:
            return opt_g, opt_d
        step_lr = torch.optim.lr_scheduler.StepLR
        return [opt_g, opt_d], [step_lr(opt_g, step_size=1, gamma=0.9), step_lr(opt_d, step_size=1, gamma=0.9)]


def gan_data(n: int = 64, batch_size: int = 8) -> torch.utils.data.DataLoader:
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(1))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=batch_size, shuffle=False)


def _read_on_rank_zero(trainer: pl.Trainer) -> None:
    if trainer.is_global_zero:
        trainer.precision_plugin.metrics()


def _run_case(case: str) -> dict[str, Any]:
    from lightning_mpx import MixedPrecisionPlugin
    from tests.lightning_helpers import make_trainer

    settings: dict[str, Any] = dict(half_dtype="bfloat16", loss_scale="dynamic", init_scale=256.0, growth_interval=3)
    model_kwargs: dict[str, Any] = dict(overflows=DDP_OVERFLOWS)
    plugin: Any = None
    if case == "reference":
        model_kwargs["reference"] = True
    elif case == "o1_sgd":
        plugin = MixedPrecisionPlugin("O1", **settings)
        model_kwargs["mid_step"] = _read_on_rank_zero
    else:
        plugin = MixedPrecisionPlugin("O2", skip_on_device=None if case == "o2_fused" else False, **settings)
        model_kwargs["optimizer"] = "adamw_fused"
    model = ManualGAN(**model_kwargs)
    trainer = make_trainer(
        plugin, precision=None if plugin is not None else "32-true", strategy="ddp_find_unused_parameters_true",
        devices=2,
    )
    trainer.fit(model, gan_data(n=64, batch_size=8))  # 4 batches per rank
    return {
        "params": [p.detach().float().flatten().tolist() for p in model.parameters()],
        "skipped": model.skipped,
        "scales": [s.get_scale() for s in plugin.amp.scalers] if plugin is not None else None,
        "skipped_steps": plugin.amp.skipped_steps if plugin is not None else None,
        "batch_dtypes": sorted(model.batch_dtypes),
    }


def main() -> None:
    results = {}
    rank = 0
    for case in CASES:
        results[case] = _run_case(case)
        rank = torch.distributed.get_rank()
    with open(os.path.join(os.environ["MPX_OUT"], f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    end_ranks()


if __name__ == "__main__":
    main()
