"""A short training loop that drives lightning_mpx's core directly, with no framework.

Trains the same small classifier in FP32 and with an opt level, on CPU (or CUDA when present), and prints the final
losses side by side with the loss-scale metrics:

    python examples/train_core.py                 # O1; float16 on a GPU, bfloat16 on a CPU
    python examples/train_core.py --opt-level O2 --half-dtype bfloat16 --steps 300
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp, resolve_properties


def make_data(device: torch.device, n: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    w = torch.randn(32, 8, generator=g)
    y = (x @ w + 0.5 * torch.randn(n, 8, generator=g)).argmax(-1)
    return x.to(device), y.to(device)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 128), nn.BatchNorm1d(128), nn.GELU(),
        nn.Linear(128, 128), nn.LayerNorm(128), nn.GELU(),
        nn.Linear(128, 8),
    )


def train(opt_level: str | None, half_dtype: str, steps: int, device: torch.device) -> tuple[float, Amp | None]:
    x, y = make_data(device)
    model = make_model().to(device)
    amp = Amp(opt_level, half_dtype=half_dtype) if opt_level else None
    if amp is not None:
        model = amp.prepare_model(model)  # O2/O3: half model (batch norm FP32 at O2), FP32 masters at O2
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if amp is not None:
        optimizer = amp.prepare_optimizer(optimizer)  # O2: amp.step() steps FP32 masters for its half params
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (128,), generator=g).to(device)
        if amp is None:
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        else:
            with amp.forward_context():  # O1: the cast table applies to torch calls in this block only
                logits = amp.cast_outputs(model(amp.cast_inputs(x[idx])))
                loss = F.cross_entropy(logits, y[idx])
            amp.backward(loss)                     # scaled backward
            amp.clip_grad_norm_(optimizer, 1.0)    # unscale + overflow check + clip, on true gradients
            amp.step(optimizer)                    # skipped if gradients overflowed
            amp.update()                           # adjust the scale once per iteration
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        if amp is None:
            logits = model(x)
        else:
            with amp.forward_context():
                logits = amp.cast_outputs(model(amp.cast_inputs(x)))
        return F.cross_entropy(logits.float(), y).item(), amp



def pick_half_dtype(choice: str) -> str:
    """``--half-dtype auto``: float16 on a GPU, bfloat16 on a CPU (many CPUs emulate float16 matmuls)."""
    return choice if choice != "auto" else ("float16" if torch.cuda.is_available() else "bfloat16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--opt-level", default="O1", choices=["O0", "O1", "O2", "O3"])
    parser.add_argument("--half-dtype", default="auto", choices=("auto", "float16", "bfloat16"),
                        help="auto: float16 on a GPU, bfloat16 on a CPU (where float16 matmuls are often emulated)")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    args.half_dtype = pick_half_dtype(args.half_dtype)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    print(f"{args.opt_level}: {resolve_properties(args.opt_level, half_dtype=args.half_dtype).description}")
    fp32, _ = train(None, args.half_dtype, args.steps, device)
    mixed, amp = train(args.opt_level, args.half_dtype, args.steps, device)
    assert amp is not None
    metrics = {k: float(v) for k, v in amp.metrics().items()}
    print(f"{'variant':<22} {'final loss':>10}")
    print(f"{'FP32':<22} {fp32:>10.4f}")
    print(f"{args.opt_level + ' ' + args.half_dtype:<22} {mixed:>10.4f}   ({(mixed - fp32) / fp32:+.2%} vs FP32)")
    print(
        f"loss scale {metrics['mpx/loss_scale']:g}, skipped steps {metrics['mpx/skipped_steps']:g}, "
        f"overflows {metrics['mpx/overflows']:g}, device {device}"
    )


if __name__ == "__main__":
    main()
