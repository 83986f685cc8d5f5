"""The HF Trainer door (:func:`lightning_mpx.accelerate.mpx_trainer`) at O2 float16 with a dynamic scale when a step
overflows, held to what transformers' own loop does when Accelerate reports ``optimizer_step_was_skipped``
(``Trainer._inner_training_loop``): ``on_optimizer_step`` still fires and ``state.global_step`` still advances, the
LR scheduler is held, clipping at ``max_grad_norm`` sees the non-finite norm without crashing and without touching
the weights, and the logs (``mpx/overflows``, ``mpx/skipped_steps``) and ``state.log_history`` stay consistent."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_mpx.accelerate import MixedPrecisionKwargs, mpx_trainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

transformers.logging.set_verbosity_error()
POISONED = 1  # the optimizer step (from 0) whose forward overflows float16


class _Regression(torch.nn.Module):
    """One tiny linear layer; its input is multiplied past float16's range while ``poisoned`` (loss: inf)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.poisoned = False

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.lin(x * 1e5 if self.poisoned else x).squeeze(-1)
        return {"loss": ((out.float() - labels) ** 2).mean()}


class _Watch(transformers.TrainerCallback):
    """Poisons step ``POISONED``; records the events, the FP32 weights at each ``on_optimizer_step`` and the LR."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.weights: list[torch.Tensor] = []
        self.lrs: list[float] = []
        self.trainer: Any = None

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        model.poisoned = state.global_step == POISONED

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.events.append(("optimizer_step", state.global_step))
        amp = self.trainer.accelerator.amp if self.trainer is not None else None
        model = self.trainer.model if self.trainer is not None else kwargs["model"]
        weight = amp.fp32_state_dict(model)["lin.weight"] if amp is not None else model.lin.weight
        self.weights.append(weight.detach().float().clone())

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.events.append(("step_end", state.global_step))
        self.lrs.append(kwargs["lr_scheduler"].get_last_lr()[0])


def _run(tmp: Any, level: str | None) -> tuple[Any, _Watch]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, generator=g)
    data = [{"x": row, "labels": row.sum()} for row in x]
    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp), use_cpu=True, report_to=[], max_steps=4, per_device_train_batch_size=4,
        learning_rate=1e-2, lr_scheduler_type="linear", logging_steps=1, max_grad_norm=1.0, save_strategy="no",
        disable_tqdm=True, optim="adamw_torch",
    )  # fmt: skip
    watch = _Watch()
    if level is None:
        trainer = transformers.Trainer(model=_Regression(), args=args, train_dataset=data, callbacks=[watch])
    else:
        kwargs = MixedPrecisionKwargs(half_dtype=torch.float16, loss_scale="dynamic", init_scale=2.0**8)
        trainer = mpx_trainer()(model=_Regression(), args=args, train_dataset=data, callbacks=[watch],
                                opt_level=level, mpx_kwargs=kwargs)  # fmt: skip
        watch.trainer = trainer
    trainer.train()
    return trainer, watch


def test_o2_float16_overflow_is_a_skipped_step_as_transformers_loop_holds_one(tmp_path):
    reference, ref_watch = _run(tmp_path / "fp32", None)
    ours, watch = _run(tmp_path / "o2", "O2")

    # The events and the step count of transformers' loop: on_optimizer_step fires, global_step advances, each batch.
    assert watch.events == ref_watch.events
    assert ours.state.global_step == reference.state.global_step == 4
    # The skipped step changed no weight (clipping saw a non-finite norm and did not crash or scale the weights).
    assert torch.equal(watch.weights[POISONED], watch.weights[POISONED - 1])
    assert not torch.equal(watch.weights[POISONED + 1], watch.weights[POISONED])
    assert all(torch.isfinite(w).all() for w in watch.weights)
    # The scheduler held on the skipped step (as the Trainer holds it when Accelerate reports a skip): one step behind.
    assert watch.lrs[:POISONED] == pytest.approx(ref_watch.lrs[:POISONED])
    assert watch.lrs[POISONED] == pytest.approx(watch.lrs[POISONED - 1])
    assert watch.lrs[POISONED + 1 :] == pytest.approx(ref_watch.lrs[POISONED : len(ref_watch.lrs) - 1])

    logs = [entry for entry in ours.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logs] == [1, 2, 3, 4]
    assert [entry["mpx/overflows"] for entry in logs] == [0.0, 1.0, 0.0, 0.0]  # since the previous log
    assert [entry["mpx/skipped_steps"] for entry in logs] == [0.0, 1.0, 1.0, 1.0]  # in all
    scales = [entry["mpx/loss_scale"] for entry in logs]
    assert scales == [2.0**8, 2.0**7, 2.0**7, 2.0**7]
    assert not math.isfinite(logs[POISONED]["grad_norm"])  # the Trainer's clip saw the overflow's norm
    assert all(math.isfinite(entry["grad_norm"]) for i, entry in enumerate(logs) if i != POISONED)
    # The logged LR is the one the step used: held across the skip, as in the reference shifted by one.
    assert logs[POISONED + 1]["learning_rate"] == pytest.approx(logs[POISONED]["learning_rate"])
    assert all(math.isfinite(entry["loss"]) for entry in logs)  # logging_nan_inf_filter: the Trainer's own filter
