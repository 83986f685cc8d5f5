"""Train a small classifier with Hugging Face Accelerate and an Apex-style opt level.

The only lightning_mpx-specific lines are the import and the ``Accelerator(...)`` call: the loop is a plain Accelerate
loop (prepare, accumulate, backward, clip_grad_norm_, step, log, save_state). Run it on one process or several:

    python examples/accelerate_train.py                                   # O2; float16 on a GPU, bfloat16 on a CPU
    python examples/accelerate_train.py --opt-level O1 --half-dtype bfloat16
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_train.py --cpu   # two CPU processes

TensorBoard logs (your loss and accuracy plus mpx/loss_scale, mpx/overflows, mpx/skipped_steps, mpx/grad_norm) go
to --project-dir (``tensorboard --logdir runs/accelerate_train``), and the final checkpoint to its ``checkpoint``
folder.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs


def make_dataset(n: int = 2048) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    w = torch.randn(32, 8, generator=g)
    y = (x @ w + 0.5 * torch.randn(n, 8, generator=g)).argmax(-1)
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(32, 128), nn.BatchNorm1d(128), nn.GELU(),
        nn.Linear(128, 128), nn.LayerNorm(128), nn.GELU(),
        nn.Linear(128, 8),
    )


def pick_half_dtype(choice: str) -> str:
    """``--half-dtype auto``: float16 on a GPU, bfloat16 on a CPU (many CPUs emulate float16 matmuls)."""
    return choice if choice != "auto" else ("float16" if torch.cuda.is_available() else "bfloat16")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--opt-level", default="O2", choices=["O0", "O1", "O2", "O3"])
    parser.add_argument("--half-dtype", default="auto", choices=("auto", "float16", "bfloat16"),
                        help="auto: float16 on a GPU, bfloat16 on a CPU (where float16 matmuls are often emulated)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="per process and micro-batch")
    parser.add_argument("--accumulation", type=int, default=2, help="gradient accumulation steps")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--project-dir", default="runs/accelerate_train", help="TensorBoard logs and the checkpoint")
    parser.add_argument("--cpu", action="store_true", help="train on CPU even when a GPU is present")
    args = parser.parse_args()
    args.half_dtype = pick_half_dtype(args.half_dtype)
    return args


def main() -> None:
    args = parse_args()
    project_dir = args.project_dir  # the same path on every process
    accelerator = Accelerator(
        mixed_precision=args.opt_level,  # "O0".."O3"; Accelerate's "no", "fp16", "bf16" work too
        gradient_accumulation_steps=args.accumulation,
        log_with="tensorboard",
        project_dir=project_dir,
        cpu=args.cpu,
        kwargs_handlers=[MixedPrecisionKwargs(half_dtype=args.half_dtype)],
    )
    accelerator.init_trackers("accelerate_train", config=vars(args) | {"project_dir": project_dir})
    accelerator.print(f"{args.opt_level}: {accelerator.amp.properties.description}")  # the run's own settings

    torch.manual_seed(0)  # the same initial weights on every process
    dataset = make_dataset()
    train_loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True)
    eval_loader = DataLoader(dataset, batch_size=512)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=args.epochs * len(train_loader) // args.accumulation
    )
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )

    start, step = time.perf_counter(), 0
    for epoch in range(args.epochs):
        model.train()
        for x, y in train_loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)   # O1: cast policy in the forward; O2/O3: half model
                accelerator.backward(loss)            # scaled, divided by the accumulation steps
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)  # unscaled gradients
                optimizer.step()                      # skipped when the gradients overflowed
                scheduler.step()                      # ... and then the schedule does not advance
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                step += 1
                if step % 20 == 0:                    # the mpx/* metrics are added to this call
                    accelerator.log({"train/loss": loss.item(), "lr": scheduler.get_last_lr()[0]}, step=step)

        model.eval()
        correct = total = 0
        with torch.no_grad():
            for x, y in eval_loader:
                predictions, labels = accelerator.gather_for_metrics((model(x).argmax(-1), y))
                correct += (predictions == labels).sum().item()
                total += labels.numel()
        accelerator.log({"eval/accuracy": correct / total}, step=step)
        accelerator.print(f"epoch {epoch}: loss {loss.item():.4f}, accuracy {correct / total:.3f}")

    accelerator.save_state(f"{project_dir}/checkpoint")  # model, FP32 masters, optimizer, scheduler, loss scale
    metrics = accelerator.mpx_metrics()
    accelerator.print(
        f"done: {step} optimizer steps in {time.perf_counter() - start:.1f}s on {accelerator.num_processes} "
        f"process(es), loss scale {metrics['mpx/loss_scale']:g}, skipped steps {metrics['mpx/skipped_steps']:g}, "
        f"final accuracy {correct / total:.3f}\nlogs and checkpoint in {project_dir}"
    )
    accelerator.end_training()


if __name__ == "__main__":
    main()
