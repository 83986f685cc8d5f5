"""O2's FP32 masters for a LoRA model (Hugging Face peft): what they hold against the trainable and the whole model.

A Llama built from a config (nothing downloaded), LoRA adapters on ``q_proj``/``v_proj``, ``Amp("O2",
half_dtype="bfloat16")`` with the usual optimizer over every parameter (``AdamW(model.parameters())``, frozen ones
included), a few training steps; then counted: elements of the FP32 masters, of the trainable parameters and of the
whole model, and their bytes. Element counts, not timings: the same on any machine.

    python benchmarks/lora_masters.py [--hidden 256] [--layers 4] [--steps 2] [--out PATH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's lightning_mpx, without PYTHONPATH
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness  # noqa: E402


def measure(hidden: int, layers: int, steps: int) -> dict[str, Any]:
    """Train a LoRA Llama at O2 for ``steps`` steps and count what the masters hold."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_mpx import Amp

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=64)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(get_peft_model(LlamaForCausalLM(config), lora))
    optimizer = amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        with amp.forward_context():
            loss = model(input_ids=ids, labels=ids).loss
        amp.backward(loss)
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad(set_to_none=True)
    masters = [master for weights in amp.master_weights for _, master in weights.half_pairs]
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    return {
        "hidden": hidden, "layers": layers, "steps": steps,
        "model_elements": sum(p.numel() for p in params),
        "model_bytes": sum(p.numel() * p.element_size() for p in params),
        "trainable_tensors": len(trainable), "trainable_elements": sum(p.numel() for p in trainable),
        "master_tensors": len(masters), "master_elements": sum(m.numel() for m in masters),
        "master_bytes": sum(m.numel() * m.element_size() for m in masters),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=_harness.default_out("lora_masters"))
    args = parser.parse_args(argv)
    if args.hidden < 8 or args.hidden % 4 or args.layers < 1 or args.steps < 1:
        parser.error(f"--hidden={args.hidden} must be a multiple of 4 (at least 8), --layers={args.layers} and "
                     f"--steps={args.steps} at least 1")  # fmt: skip
    row = measure(args.hidden, args.layers, args.steps)
    table = _harness.markdown_table(
        ["what", "tensors", "elements", "MiB"],
        [["whole model (bfloat16, at O2)", "-", row["model_elements"], f"{row['model_bytes'] / 2**20:.2f}"],
         ["trainable (LoRA adapters)", row["trainable_tensors"], row["trainable_elements"], "-"],
         ["FP32 masters", row["master_tensors"], row["master_elements"], f"{row['master_bytes'] / 2**20:.2f}"]])
    print(table)
    result = {"benchmark": "lora_masters", "command": _harness.command(argv), **_harness.machine("cpu"), **row}
    _harness.save(args.out, result, {"O2 masters of a LoRA Llama (peft), AdamW over every parameter": table})
    return result


if __name__ == "__main__":
    main()
