"""Run by tests/test_hostile_accelerate.py under `accelerate launch` with two gloo processes (not collected by pytest).

Habits of Accelerate scripts under DDP at O2 (float16), in one launch:

* ``accumulate`` (``gradient_accumulation_steps=2``, DDP's ``no_sync`` on the first micro-batch) with an inf in rank 1's
  input on a micro-batch that does not synchronise, and later an inf put into rank 0's gradient after DDP's all-reduce
  on a synchronising one (only the all-reduced overflow flag can make rank 1 skip): every rank must skip those
  windows' steps, and only them;
* ``save_state`` called on rank 0 only (``if accelerator.is_main_process:``), mid-run, at a window's end; then
  ``free_memory``, a fresh Accelerator, model, optimizer and scheduler, ``load_state`` on every rank and the rest of
  the run: the same bits as the run without the interruption.

Each rank writes OUT_DIR/rank{r}.json (skips, learning rates, scales) and OUT_DIR/rank{r}.pt (final weights).
"""

from __future__ import annotations

import faulthandler
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs
from tests.launch import end_ranks

STEPS = 8  # micro-batches: four windows of two
SAVE_AT = 4  # saved before micro-batch 4 (after the second window)
INF_AT = 2  # rank 1's input holds an inf in micro-batch 2 (the first of the second window: no_sync)
GRAD_INF_AT = 7  # rank 0's gradient gets an inf after the all-reduce of micro-batch 7 (the last window's sync)


def _fresh(accelerator: Accelerator) -> tuple[nn.Module, object, object]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    model, opt, sched = accelerator.prepare(sched, opt, model)[::-1]  # any order
    return model, opt, sched


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
    if step == INF_AT and rank == 1:
        x[0, 0] = float("inf")
    return x, y


def _train(accelerator: Accelerator, model, opt, sched, steps: range, record: dict) -> None:
    rank = accelerator.process_index
    for step in steps:
        x, y = _batch(step, rank)
        with accelerator.accumulate(model):
            accelerator.backward(F.cross_entropy(model(x), y))
            if step == GRAD_INF_AT and rank == 0:
                with torch.no_grad():
                    accelerator.unwrap_model(model)[0].weight.grad[0, 0] = float("inf")
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            record["skipped"].append(bool(opt.step_was_skipped))
            record["lr"].append(sched.get_last_lr()[0])
            record["scale"].append(accelerator.amp.scalers[0].get_scale())


def _accelerator() -> Accelerator:
    return Accelerator(
        mixed_precision="O2",
        cpu=True,
        gradient_accumulation_steps=2,
        kwargs_handlers=[MixedPrecisionKwargs(half_dtype="float16", init_scale=2.0**10)],
    )


def main(out_dir: Path) -> None:
    # Each run has an Accelerator of its own: free_memory() keeps the loss scale (as Accelerate keeps its GradScaler),
    # and each run here starts from init_scale.
    accelerator = _accelerator()
    rank = accelerator.process_index
    straight = {"skipped": [], "lr": [], "scale": []}
    model, opt, sched = _fresh(accelerator)
    _train(accelerator, model, opt, sched, range(STEPS), straight)
    straight_weights = [p.detach().clone() for p in accelerator.amp.master_params(opt.optimizer)]
    accelerator.free_memory()

    accelerator = _accelerator()
    resumed = {"skipped": [], "lr": [], "scale": []}
    model, opt, sched = _fresh(accelerator)
    _train(accelerator, model, opt, sched, range(SAVE_AT), resumed)
    checkpoint = out_dir / "checkpoint"
    if accelerator.is_main_process:  # the habit: only the main process writes checkpoints
        accelerator.save_state(str(checkpoint))
    accelerator.wait_for_everyone()
    _train(accelerator, model, opt, sched, range(SAVE_AT, STEPS), resumed)
    accelerator.free_memory()

    accelerator = _accelerator()
    reloaded = {"skipped": [], "lr": [], "scale": []}
    model, opt, sched = _fresh(accelerator)
    accelerator.load_state(str(checkpoint))
    _train(accelerator, model, opt, sched, range(SAVE_AT, STEPS), reloaded)
    reloaded_weights = [p.detach().clone() for p in accelerator.amp.master_params(opt.optimizer)]

    torch.save({"straight": straight_weights, "reloaded": reloaded_weights}, out_dir / f"rank{rank}.pt")
    report = {"world_size": accelerator.num_processes, "straight": straight, "resumed": resumed, "reloaded": reloaded}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    # Not accelerator.end_training(): the gloo group's teardown at exit was seen to abort one rank ("terminate called
    # without an active exception") or hang it in a loaded full run; end_ranks waits for every rank and leaves.
    end_ranks()


if __name__ == "__main__":
    # A rank that hangs prints every thread's stack and exits before the test's timeout, so that the test's failure
    # shows where (the test prints the launch's stderr).
    faulthandler.dump_traceback_later(150, exit=True)
    main(Path(sys.argv[1]))
