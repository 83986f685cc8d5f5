"""LoRA fine-tuning of a litgpt model with Lightning Fabric and an Apex-style opt level.

The loop has ``litgpt/finetune/lora.py``'s shape: ``fabric.init_module``, ``mark_only_lora_as_trainable``, the
optimizer over all the parameters (only the LoRA ones train), the pretrained FP32 base loaded with
``fabric.load_raw(..., strict=False)`` after ``fabric.setup``, logits in chunks into ``chunked_cross_entropy``,
accumulation under ``fabric.no_backward_sync``, ``fabric.clip_gradients``, a ``get_lr`` schedule, the LoRA weights
saved, then ``merge_lora_weights``.

What differs from litgpt's script:

* ``Fabric(plugins=[mpx])`` instead of ``Fabric(precision=...)``;
* the schedule follows the optimizer steps taken (``mpx.step_was_skipped(optimizer)``), so it holds on a skipped step;
* the LoRA weights are saved from ``mpx.fp32_state_dict(model)`` (in ``save_lora_checkpoint``'s layout, which
  ``litgpt merge_lora`` reads): at O2 the model holds half weights and the optimizer trains their FP32 masters, which
  this saves exactly (as ``fabric.save(path, {"model": model}, filter={"model": lora_filter})`` and litgpt's
  ``save_lora_checkpoint`` now do: a set-up model's ``state_dict()`` gives the masters at O2).

At O2 the frozen base is stored in half with no FP32 copy (no master: the optimizer does not train it); only the LoRA
matrices get FP32 masters. The model is a small ``litgpt.lora.GPT`` (nothing is downloaded); the "pretrained" base is
a randomly initialised ``litgpt.GPT`` saved in FP32. Run it::

    python examples/fabric_litgpt_lora.py --precision O2 --half-dtype bfloat16
    python examples/fabric_litgpt_lora.py --precision bf16-mixed        # litgpt's default, to compare with
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import lightning as L
import litgpt
import torch
from litgpt.lora import GPT, Config, lora_filter, mark_only_lora_as_trainable, merge_lora_weights
from litgpt.pretrain import get_lr
from litgpt.utils import chunked_cross_entropy

from lightning_mpx import FabricMixedPrecisionPlugin

BASE = {
    "name": "tiny-llama", "block_size": 32, "vocab_size": 128, "padded_vocab_size": 128, "n_layer": 2, "n_head": 4,
    "n_query_groups": 2, "n_embd": 64, "rotary_percentage": 1.0, "parallel_residual": False, "bias": False,
    "norm_class_name": "RMSNorm", "mlp_class_name": "LLaMAMLP", "intermediate_size": 128,
}  # fmt: skip
LORA = {"lora_r": 4, "lora_alpha": 8, "lora_query": True, "lora_value": True, "lora_mlp": True, "lora_head": True}


@dataclasses.dataclass
class TrainArgs:
    """The part of litgpt's fine-tuning ``TrainArgs`` the loop reads."""

    max_iters: int = 16  # micro-batches
    micro_batch_size: int = 2
    gradient_accumulation_iters: int = 2
    learning_rate: float = 1e-2
    min_lr: float = 1e-3
    lr_warmup_steps: int = 1
    max_norm: float = 1.0
    max_seq_length: int = 24


def make_fabric(precision: str, half_dtype: str = "bfloat16", **plugin_settings: Any) -> L.Fabric:
    """``Fabric`` with an opt level (``"O0"``-``"O3"``) through the plugin, or with one of Fabric's own precisions."""
    if precision.startswith("O"):
        mpx = FabricMixedPrecisionPlugin(precision, half_dtype=half_dtype, **plugin_settings)
        return L.Fabric(accelerator="cpu", devices=1, plugins=[mpx])
    return L.Fabric(accelerator="cpu", devices=1, precision=precision)  # type: ignore[arg-type]


def save_base_checkpoint(path: Path, seed: int = 3) -> Path:
    """A stand-in for a downloaded ``lit_model.pth``: a plain ``litgpt.GPT``'s FP32 state dict."""
    torch.manual_seed(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(litgpt.GPT(litgpt.Config(**BASE)).state_dict(), path)
    return path


def lora_state_dict(fabric: L.Fabric, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA weights to save: at an opt level their FP32 values (the O2 masters, not their half rounding)."""
    mpx = fabric.strategy.precision
    state = mpx.fp32_state_dict(model) if isinstance(mpx, FabricMixedPrecisionPlugin) else model.state_dict()
    return {name: value for name, value in state.items() if lora_filter(name, value)}


def main(
    fabric: L.Fabric,
    train: TrainArgs,
    base_checkpoint: Path,
    out_dir: Path,
    seed: int = 0,
    base_before_setup: bool = False,
) -> dict[str, Any]:
    """Fine-tune, save the LoRA weights to ``out_dir/final/lit_model.pth.lora``, merge; returns what a test reads.
    ``base_before_setup``: load the base before ``fabric.setup`` (into the FP32 model) rather than after."""
    mpx = fabric.strategy.precision if isinstance(fabric.strategy.precision, FabricMixedPrecisionPlugin) else None
    fabric.seed_everything(seed, verbose=False)
    with fabric.init_module(empty_init=False):
        model = GPT(Config(**BASE, **LORA))
    mark_only_lora_as_trainable(model)
    if base_before_setup:
        fabric.load_raw(base_checkpoint, model, strict=False)
    model = fabric.setup_module(model)
    # Over all the parameters, as litgpt's script passes them: the frozen base gets no gradient, so no FP32 master.
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.learning_rate, weight_decay=0.02)
    optimizer = fabric.setup_optimizers(optimizer)
    if not base_before_setup:
        fabric.load_raw(base_checkpoint, model, strict=False)  # litgpt's load_checkpoint: the base, no LoRA weights
    model.max_seq_length = train.max_seq_length  # rebuilds the rope cache, as litgpt's fit does

    g = torch.Generator().manual_seed(seed + 1)
    data = torch.randint(0, BASE["vocab_size"], (train.max_iters, train.micro_batch_size, train.max_seq_length + 1),
                         generator=g)  # fmt: skip
    accumulation, max_steps = train.gradient_accumulation_iters, train.max_iters // train.gradient_accumulation_iters
    losses, step_count = [], 0
    for iter_num, batch in enumerate(data, start=1):
        lr = get_lr(train.learning_rate, step_count, train.lr_warmup_steps, max_steps, train.min_lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        is_accumulating = iter_num % accumulation != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            logits = model(batch[:, :-1], lm_head_chunk_size=8)
            logits[-1] = logits[-1][..., :-1, :]  # shift the targets as litgpt does: output n predicts token n+1
            loss = chunked_cross_entropy(logits, batch[:, 1:-1].contiguous())
            fabric.backward(loss / accumulation)
        losses.append(loss.item())
        if not is_accumulating:
            fabric.clip_gradients(model, optimizer, max_norm=train.max_norm)
            optimizer.step()
            optimizer.zero_grad()
            if mpx is None or not mpx.step_was_skipped(optimizer):
                step_count += 1
            fabric.print(f"iter {iter_num} step {step_count} | loss {loss.item():.4f} | lr {lr:.2e}")

    saved = lora_state_dict(fabric, model)
    save_path = out_dir / "final" / "lit_model.pth.lora"
    save_path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": saved}, save_path)  # save_lora_checkpoint's layout, which `litgpt merge_lora` reads
    merge_lora_weights(model.module)  # on the model as trained (half at O2), as litgpt's merge_lora does
    return {"losses": losses, "lora": saved, "model": model, "optimizer": optimizer, "path": save_path}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", default="O2", help="O0-O3 (the plugin), or a Fabric precision: bf16-mixed, ...")
    parser.add_argument("--half-dtype", default="bfloat16", choices=["float16", "bfloat16"])
    parser.add_argument("--iters", type=int, default=16, help="micro-batches")
    parser.add_argument("--out-dir", type=Path, default=Path("out/fabric_litgpt_lora"))
    args = parser.parse_args()
    base = save_base_checkpoint(args.out_dir / "base" / "lit_model.pth")
    result = main(make_fabric(args.precision, args.half_dtype), TrainArgs(max_iters=args.iters), base, args.out_dir)
    print(f"loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}; LoRA weights in {result['path']}")
