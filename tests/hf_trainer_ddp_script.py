"""Two-process cases of tests/test_hf_trainer_ddp.py (gloo, one launch): ``transformers.Trainer`` with the door
(``mpx_trainer()``) under DDP, as ``torchrun`` users run it: the Trainer's ``TrainingArguments(use_cpu=True,
ddp_backend="gloo")`` picks the process group up from the launch's RANK/WORLD_SIZE/MASTER_* through Accelerate's
``PartialState``; its ``DistributedSampler`` gives each rank its own rows.

Cases (each rank writes ``$MPX_OUT/rank{r}.json`` and its weights to ``$MPX_OUT/w_{case}_rank{r}.pt``):
- ``fp32``/``bf16``/``o2``: a tiny GPT2 from a config, SGD, ``max_grad_norm`` below the gradients' norm, gradient
  accumulation 2, 4 optimizer steps; the DDP all-reduces counted per optimizer step with a comm hook. ``o2`` also
  saves ``checkpoint-2``/``checkpoint-4`` and ``save_model()`` at the end;
- ``o2_resume``: ``resume_from_checkpoint=checkpoint-2`` of ``o2`` on both ranks, to step 4;
- ``fp16``: a tiny linear model at O2 float16 with a dynamic scale, gradient accumulation 2, rank 1's loss inf in
  the first micro-batch (the one under ``no_sync``) of steps ``OVERFLOW_AT``:
  per step the scale, the global step and the weights on each rank, against a ``torch.amp.GradScaler``'s scales;
  ``fp16_resume``: its ``checkpoint-3`` (the scale backed off twice) resumed on both ranks;
- ``eval_first``: ``evaluate()`` then ``train()`` at O2 bfloat16 (the door prepares the model in the evaluation).
"""

from __future__ import annotations

import os
import sys
import time

if "RANK" not in os.environ:  # the launcher
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.launch import launch_ranks

    raise SystemExit(launch_ranks(__file__))

from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook  # noqa: E402

from lightning_mpx.accelerate import MixedPrecisionKwargs, mpx_trainer  # noqa: E402
from tests.launch import case_error, end_ranks, write_rank_results  # noqa: E402

transformers.logging.set_verbosity_error()
OUT = Path(os.environ["MPX_OUT"])
RANK = int(os.environ["RANK"])
# SGD without momentum: no optimizer state tensors. On a CPU, transformers 5.3 resumes an optimizer under DDP with
# torch.load(map_location=args.device), "cpu:0", which torch refuses for any state tensor (Adam's), with bf16=True
# as with the opt level (seen here, not the door's).
STEPS, ACCUM, LR, CLIP = 4, 2, 0.5, 0.05
SCALING = {"init_scale": 256.0, "growth_interval": 2}
OVERFLOW_AT = (1, 2)  # fp16 case: optimizer steps (from 0) whose loss is inf on rank 1 only


def _flat(model: torch.nn.Module) -> torch.Tensor:
    """The model's weights as the user reads them (at O2 ``state_dict()`` gives the FP32 masters), flattened; GPT2's
    ``lm_head.weight`` (tied to ``transformer.wte.weight``) once."""
    state = model.state_dict()
    return torch.cat([state[k].detach().float().reshape(-1) for k in sorted(state) if k != "lm_head.weight"])


class _Watch(transformers.TrainerCallback):
    """Counts the DDP model's all-reduces (a comm hook) per optimizer step; keeps the weights after each step."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.calls = 0
        self.per_step: list[int] = []
        self.weights: list[torch.Tensor] = []
        self.scales: list[float] = []
        self.steps: list[int] = []
        self.ddp = False

    def _hook(self, state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations: none (a string here)
        self.calls += 1
        return allreduce_hook(state, bucket)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        wrapped = self.trainer.model_wrapped
        self.ddp = isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
        if self.ddp:
            wrapped.register_comm_hook(None, self._hook)
        self.weights.append(_flat(model))

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.per_step.append(self.calls)
        self.calls = 0
        self.weights.append(_flat(model))
        self.steps.append(state.global_step)
        if getattr(self.trainer.accelerator, "amp", None) is not None:
            self.scales.append(self.trainer.accelerator.mpx_metrics().get("mpx/loss_scale", float("nan")))


def _gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _gpt_data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2 * 2 * ACCUM * STEPS, 8), generator=g)  # per device 2, 2 ranks
    return [{"input_ids": row, "labels": row} for row in ids]


def _args(folder: Path, **kw: Any) -> Any:
    base = dict(
        output_dir=str(folder), use_cpu=True, ddp_backend="gloo", report_to=[], max_steps=STEPS,
        per_device_train_batch_size=2, gradient_accumulation_steps=ACCUM, learning_rate=LR, optim="sgd",
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=CLIP, logging_steps=1, save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, seed=0, data_seed=0,
    )  # fmt: skip
    base.update(kw)
    return transformers.TrainingArguments(**base)


def _gpt_run(case: str, **kw: Any) -> dict[str, Any]:
    resume = kw.pop("resume", None)
    save_model = kw.pop("save_model", False)
    watch = _Watch()
    if case.startswith("o2"):
        mpx = MixedPrecisionKwargs(half_dtype="bfloat16")
        trainer = mpx_trainer()(model=_gpt(), args=_args(OUT / case, **kw), train_dataset=_gpt_data(),
                                callbacks=[watch], opt_level="O2", mpx_kwargs=mpx)  # fmt: skip
    else:
        trainer = transformers.Trainer(model=_gpt(), args=_args(OUT / case, bf16=case == "bf16", **kw),
                                       train_dataset=_gpt_data(), callbacks=[watch])  # fmt: skip
    watch.trainer = trainer
    trainer.train(resume_from_checkpoint=resume)
    logs = [e for e in trainer.state.log_history if "loss" in e]
    torch.save(torch.stack(watch.weights), OUT / f"w_{case}_rank{RANK}.pt")
    result = {
        "ddp": watch.ddp, "world": trainer.args.world_size, "per_step": watch.per_step,
        "losses": [e["loss"] for e in logs], "grad_norms": [e.get("grad_norm") for e in logs],
        "global_step": trainer.state.global_step,
    }  # fmt: skip
    if save_model:
        trainer.save_model(str(OUT / case / "final"))
        dist.barrier()
        if RANK == 0:
            loaded = transformers.GPT2LMHeadModel.from_pretrained(str(OUT / case / "final"))
            result["saved_dtypes"] = sorted({str(p.dtype) for p in loaded.parameters()})
            result["saved_vs_trained"] = (_flat(loaded) - watch.weights[-1]).abs().max().item()
    if RANK == 0 and kw.get("save_strategy") == "steps":
        ckpt = OUT / case / f"checkpoint-{kw['save_steps']}"
        result["ckpt_files"] = sorted(os.listdir(ckpt))
        result["ckpt_sizes"] = {n: (ckpt / n).stat().st_size for n in result["ckpt_files"]}
        result["checkpoints"] = sorted(n for n in os.listdir(OUT / case) if n.startswith("checkpoint-"))
    return result


class _Linear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": ((self.lin(x).squeeze(-1).float() - labels) ** 2).mean()}


def _fp16_run(case: str, resume: str | None = None) -> dict[str, Any]:
    base = mpx_trainer()

    class Poisoning(base):  # type: ignore[misc, valid-type]
        micro = 0

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            self.micro += 1
            # The first micro-batch of the step: the one the Trainer runs under DDP's no_sync (no all-reduce).
            if RANK == 1 and self.state.global_step in OVERFLOW_AT and self.micro % ACCUM == 1:
                loss = loss * float("inf")
            return loss

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * 2 * ACCUM * 6, 4, generator=g)
    data = [{"x": row, "labels": row.sum()} for row in x]
    watch = _Watch()
    args = _args(OUT / case, max_steps=6, learning_rate=1e-2, max_grad_norm=1.0, save_strategy="steps", save_steps=3)
    trainer = Poisoning(model=_Linear(), args=args, train_dataset=data, callbacks=[watch], opt_level="O2",  # fmt: skip
                        mpx_kwargs=MixedPrecisionKwargs(half_dtype="float16", loss_scale="dynamic", **SCALING))
    watch.trainer = trainer
    trainer.train(resume_from_checkpoint=resume)
    torch.save(torch.stack(watch.weights), OUT / f"w_{case}_rank{RANK}.pt")
    # The reference: torch's GradScaler with the same settings, an inf gradient at the same steps.
    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", **SCALING)
    expected = []
    for step in range(6):
        opt.zero_grad()
        scaler.scale(p.sum() * (float("inf") if step in OVERFLOW_AT else 1.0)).backward()
        scaler.step(opt)
        scaler.update()
        expected.append(scaler.get_scale())
    metrics = trainer.accelerator.mpx_metrics()
    return {"scales": watch.scales, "expected_scales": expected, "steps": watch.steps, "ddp": watch.ddp,
            "per_step": watch.per_step, "skipped": metrics.get("mpx/skipped_steps"),
            "global_step": trainer.state.global_step}  # fmt: skip


def _eval_first_run() -> dict[str, Any]:
    """``evaluate()`` before ``train()`` (a baseline, a common habit): the door prepares the model for training
    there (O2's masters from the FP32 weights); ``train()`` must still run it under DDP."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * 2 * ACCUM * STEPS, 4, generator=g)
    data = [{"x": row, "labels": row.sum()} for row in x]
    watch = _Watch()
    trainer = mpx_trainer()(model=_Linear(), args=_args(OUT / "eval_first", learning_rate=1e-2, max_grad_norm=1.0),
                            train_dataset=data, eval_dataset=data[:8], callbacks=[watch], opt_level="O2",
                            mpx_kwargs=MixedPrecisionKwargs(half_dtype="bfloat16"))  # fmt: skip
    watch.trainer = trainer
    trainer.evaluate()
    trainer.train()
    torch.save(torch.stack(watch.weights), OUT / f"w_eval_first_rank{RANK}.pt")
    return {"ddp": watch.ddp, "per_step": watch.per_step, "global_step": trainer.state.global_step}


def main() -> None:
    results: dict[str, Any] = {}
    for case, kw in (
        ("fp32", {}),
        ("bf16", {}),
        ("o2", {"save_strategy": "steps", "save_steps": 2, "save_model": True}),
        ("o2_resume", {"resume": str(OUT / "o2" / "checkpoint-2")}),
    ):
        with case_error(results.setdefault(case, {})) as out:
            start = time.perf_counter()
            out.update(_gpt_run(case, **kw))
            out["seconds"] = time.perf_counter() - start
        dist.barrier()
    with case_error(results.setdefault("fp16", {})) as out:
        out.update(_fp16_run("fp16"))
    dist.barrier()
    with case_error(results.setdefault("fp16_resume", {})) as out:
        out.update(_fp16_run("fp16_resume", resume=str(OUT / "fp16" / "checkpoint-3")))
    with case_error(results.setdefault("eval_first", {})) as out:
        out.update(_eval_first_run())
    write_rank_results(results, rank=RANK)
    end_ranks()


main()
