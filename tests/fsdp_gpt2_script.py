"""Run by tests/test_fsdp_real_models.py: a Hugging Face GPT-2 built from a config (nothing downloaded) trained by a
Lightning ``Trainer`` with ``MixedPrecisionPlugin`` under ``ModelParallelStrategy`` (FSDP2, two CPU processes, gloo;
``configure_model`` shards it with ``lightning_mpx.integrations.fsdp.shard_model``, one unit per ``GPT2Block``), or,
with ``MPX_SINGLE=1``, the same model and plugin in one process on the whole batch (the reference; the test calls
:func:`fit` for it in its own process, which saves a process start).

Every step's batch is one global batch of token sequences (no distributed sampler: every rank gets it whole); under
FSDP each rank trains on its half. Each process writes ``$MPX_OUT/{single|rank<r>}_{level}.json``: the global loss
of every step, the engine's clip norm, the skipped steps, whether the engine saw a sharded model, its masters."""

import json
import os

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import transformers
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_mpx import MixedPrecisionPlugin
from lightning_mpx.integrations.fsdp import shard_model
from tests.launch import end_ranks

STEPS = 6
BATCH = 8  # global
SEQ = 16


class Tokens(torch.utils.data.Dataset):
    """``STEPS`` global batches of random tokens (a ``batch_size=None`` loader: each item is a batch)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.batches = [torch.randint(0, 64, (BATCH, SEQ), generator=g) for _ in range(STEPS)]

    def __len__(self) -> int:
        return STEPS

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.batches[index]


class LitGPT2(pl.LightningModule):
    def __init__(self, sharded: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        self.gpt2 = transformers.GPT2LMHeadModel(config)
        self.sharded = sharded
        self.losses: list[float] = []
        self.norms: list[float] = []

    def configure_model(self) -> None:
        if self.sharded:
            block = type(self.gpt2.transformer.h[0])
            shard_model(self.gpt2, self.trainer.precision_plugin, mesh=self.device_mesh["data_parallel"], blocks=block)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        if self.sharded:  # this rank's half of the global batch
            half = BATCH // self.trainer.world_size
            batch = batch[self.global_rank * half : (self.global_rank + 1) * half]
        loss = self.gpt2(input_ids=batch, labels=batch).loss
        total = loss.detach().float().clone()
        if self.sharded:
            dist.all_reduce(total)
            total /= self.trainer.world_size
        self.losses.append(float(total))
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.norms.append(float(self.trainer.precision_plugin.metrics().get("mpx/grad_norm", float("nan"))))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(level: str, single: bool) -> tuple[str, dict]:
    """Train at ``level`` (one process on the whole batch, or this rank's half under FSDP); the record's name
    (``single`` or ``rank<r>``) and the record."""
    plugin = MixedPrecisionPlugin(level, half_dtype="bfloat16", on_floor="continue")
    strategy = "auto" if single else ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1 if single else 2, strategy=strategy, plugins=[plugin], max_steps=STEPS,
        gradient_clip_val=1.0, use_distributed_sampler=False, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    model = LitGPT2(sharded=not single)
    trainer.fit(model, torch.utils.data.DataLoader(Tokens(), batch_size=None, shuffle=False))
    name = "single" if single else f"rank{trainer.global_rank}"
    return name, {"losses": model.losses, "norms": model.norms, "skipped": sum(plugin.amp.skipped_steps),
                  "sharded": plugin.amp.sharded, "masters": len(plugin.amp.master_weights)}  # fmt: skip


def main() -> None:
    out, single = os.environ["MPX_OUT"], os.environ.get("MPX_SINGLE") == "1"
    for level in os.environ["MPX_LEVELS"].split(","):
        name, record = fit(level, single)
        with open(os.path.join(out, f"{name}_{level}.json"), "w") as f:
            json.dump(record, f)
    end_ranks()


if __name__ == "__main__":
    main()
