"""Pretrain a litgpt model with Lightning Fabric and an Apex-style opt level, in the shape of litgpt's own loop.

litgpt's entry points (``litgpt pretrain``, ``litgpt finetune_*``) build their ``Fabric`` themselves from a
``precision`` string (``"bf16-true"``, ``"bf16-mixed"``, ``"32-true"``; only the quantized fine-tuning scripts pass a
plugin of their own), so a precision plugin cannot be handed to them. This script is ``litgpt/pretrain.py``'s ``fit``
loop (gradient accumulation under ``fabric.no_backward_sync``, ``fabric.clip_gradients``, a warm-up then cosine
schedule, ``fabric.save`` of its state) with the plugin in place of the precision string. Three lines differ:

* ``Fabric(plugins=[mpx])`` instead of ``Fabric(precision=...)``;
* ``"mpx": mpx`` in the state that is saved and loaded (loss scale, FP32 masters, counters);
* the schedule follows the optimizer steps taken (``state["step_count"]``, which a skipped step does not advance)
  rather than the micro-batches seen, so that it holds on a step skipped for overflow.

The model is a small ``litgpt.GPT`` built from a ``litgpt.Config`` (nothing is downloaded), trained on a synthetic
token sequence. Run it with any opt level, or a Fabric precision to compare with::

    python examples/fabric_litgpt.py --precision O2 --half-dtype bfloat16
    python examples/fabric_litgpt.py --precision 32-true
    python examples/fabric_litgpt.py --precision O1 --half-dtype float16 --devices 2   # DDP, two CPU processes
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import lightning as L
import torch
from litgpt import GPT, Config
from litgpt.pretrain import get_lr, initialize_weights
from litgpt.utils import chunked_cross_entropy

from lightning_mpx import FabricMixedPrecisionPlugin


@dataclasses.dataclass
class TrainArgs:
    """The part of litgpt's ``TrainArgs`` the loop reads (micro-batches of ``micro_batch_size`` sequences)."""

    max_iters: int = 24  # micro-batches
    micro_batch_size: int = 4
    gradient_accumulation_iters: int = 2
    learning_rate: float = 3e-3
    min_lr: float = 3e-4
    lr_warmup_steps: int = 3
    max_norm: float = 1.0
    weight_decay: float = 0.01
    log_interval: int = 1  # optimizer steps
    tie_embeddings: bool = True


def tiny_config() -> Config:
    """A LLaMA-shaped model small enough for a CPU: RMSNorm, SwiGLU MLP, rotary embeddings."""
    return Config(
        name="tiny-llama",
        block_size=32,
        vocab_size=96,
        padded_vocab_size=96,
        n_layer=2,
        n_head=4,
        n_embd=32,
        rotary_percentage=1.0,
        parallel_residual=False,
        bias=False,
        norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP",
        intermediate_size=64,
    )


def synthetic_batches(config: Config, train: TrainArgs, seed: int = 0) -> list[torch.Tensor]:
    """Token sequences of a fixed arithmetic progression modulo the vocabulary, each starting somewhere random:
    learnable, so the loss falls within a few steps."""
    g = torch.Generator().manual_seed(seed)
    length = config.block_size + 1
    batches = []
    for _ in range(train.max_iters):
        start = torch.randint(0, config.vocab_size, (train.micro_batch_size, 1), generator=g)
        stride = torch.randint(1, 4, (train.micro_batch_size, 1), generator=g)
        batches.append((start + stride * torch.arange(length)) % config.vocab_size)
    return batches


def make_fabric(precision: str, half_dtype: str = "bfloat16", devices: int = 1, **plugin_settings: Any) -> L.Fabric:
    """``Fabric`` with an opt level (``"O0"``-``"O3"``) through the plugin, or with one of Fabric's own precisions."""
    strategy = "ddp" if devices > 1 else "auto"
    if precision.startswith("O"):
        mpx = FabricMixedPrecisionPlugin(precision, half_dtype=half_dtype, **plugin_settings)
        return L.Fabric(accelerator="cpu", devices=devices, strategy=strategy, plugins=[mpx])
    return L.Fabric(
        accelerator="cpu", devices=devices, strategy=strategy, precision=precision  # type: ignore[arg-type]
    )


def main(fabric: L.Fabric, train: TrainArgs, out_dir: Path | None = None, seed: int = 42) -> dict[str, Any]:
    """Build the model and optimizer as ``litgpt/pretrain.py`` does, train, save; returns what a test reads."""
    mpx = fabric.strategy.precision if isinstance(fabric.strategy.precision, FabricMixedPrecisionPlugin) else None
    fabric.seed_everything(seed, verbose=False)
    config = tiny_config()
    with fabric.init_module(empty_init=True):
        model = GPT(config)
    initialize_weights(fabric, model, n_layer=config.n_layer, n_embd=config.n_embd)
    if train.tie_embeddings:
        model.transformer.wte.weight = model.lm_head.weight

    model = fabric.setup(model)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=train.learning_rate, weight_decay=train.weight_decay, betas=(0.9, 0.95)
    )
    optimizer = fabric.setup_optimizers(optimizer)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "iter_num": 0, "step_count": 0}
    if mpx is not None:
        state["mpx"] = mpx  # the loss scale, FP32 masters and counters go into the checkpoint with the rest

    data = synthetic_batches(config, train)[fabric.global_rank :: fabric.world_size]
    losses = fit(fabric, state, data, train)
    if out_dir is not None:
        fabric.save(out_dir / "final" / "lit_model.pth", state)
    return {"losses": losses, "state": state, "model": model}


def fit(fabric: L.Fabric, state: dict[str, Any], data: list[torch.Tensor], train: TrainArgs) -> list[float]:
    """litgpt's ``fit``: accumulation under ``no_backward_sync``, clipping, a warm-up schedule; returns the loss of
    each optimizer step (the mean over its micro-batches and processes)."""
    model, optimizer, mpx = state["model"], state["optimizer"], state.get("mpx")
    accumulation = train.gradient_accumulation_iters
    max_steps = len(data) // accumulation
    losses: list[float] = []
    running = torch.zeros(())
    for train_data in data:
        # The schedule follows the optimizer steps taken: a step skipped for overflow does not advance it.
        lr = get_lr(train.learning_rate, state["step_count"], train.lr_warmup_steps, max_steps, train.min_lr)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        state["iter_num"] += 1

        input_ids = train_data[:, : model.max_seq_length].contiguous().long()
        targets = train_data[:, 1 : model.max_seq_length + 1].contiguous().long()
        is_accumulating = state["iter_num"] % accumulation != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            logits = model(input_ids)
            loss = chunked_cross_entropy(logits, targets)
            fabric.backward(loss / accumulation)
        running += loss.detach() / accumulation

        if not is_accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=train.max_norm)
            optimizer.step()
            optimizer.zero_grad()
            if mpx is None or not mpx.step_was_skipped(optimizer):
                state["step_count"] += 1
            step_loss = fabric.all_reduce(running, reduce_op="mean").item()
            running.zero_()
            losses.append(step_loss)
            if len(losses) % train.log_interval == 0:
                metrics = {"loss": step_loss, "learning_rate": lr, "step": state["step_count"]}
                if mpx is not None:
                    metrics.update(mpx.metrics())  # mpx/loss_scale, mpx/overflows, mpx/skipped_steps
                fabric.log_dict(metrics, step=state["iter_num"] - 1)
                fabric.print(
                    f"iter {state['iter_num']} step {state['step_count']} | loss {step_loss:.4f} | lr {lr:.2e}"
                    + (f" | loss scale {metrics['mpx/loss_scale']:g}" if mpx is not None else "")
                )
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", default="O2", help="O0-O3 (the plugin), or a Fabric precision: 32-true, ...")
    parser.add_argument("--half-dtype", default="bfloat16", choices=["float16", "bfloat16"])
    parser.add_argument("--iters", type=int, default=24, help="micro-batches")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--out-dir", type=Path, default=Path("out/fabric_litgpt"))
    args = parser.parse_args()
    fabric = make_fabric(args.precision, args.half_dtype, args.devices)
    fabric.launch()
    result = main(fabric, TrainArgs(max_iters=args.iters), args.out_dir)
    losses = result["losses"]
    fabric.print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; checkpoint in {args.out_dir / 'final'}")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
