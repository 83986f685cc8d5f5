"""``transformers.Trainer`` with ``MpxTrainerMixin`` at O2 bfloat16, used with the habits Hugging Face users have, each
held to the same Trainer with its own ``bf16=True`` on the same data and seed: a schedule-free optimizer passed as
``optimizers=(opt, None)`` (the Trainer calls its ``train()``/``eval()`` itself), label smoothing (the Trainer's
``LabelSmoother`` outside the model), NEFTune (a forward hook on the input embeddings), gradient checkpointing
(reentrant and not), gradient accumulation with clipping, ``evaluate()``/``predict()`` before any training and
``train()`` twice on one Trainer. ``torch_compile=True`` also matches but takes over a minute on CPU: not here.
Tiny GPT-2 built from a config (nothing downloaded), CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
import safetensors.torch as safetensors_torch  # noqa: E402 - a dependency of transformers

from lightning_mpx.accelerate import MixedPrecisionKwargs, mpx_trainer  # noqa: E402
from tests.accelerate_helpers import accelerate_state_reset  # noqa: E402
from tests.test_accelerate_schedule_free import ScheduleFreeSGD  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

transformers.logging.set_verbosity_error()
GPT2 = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip


def lm_data(n: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in ids]


class Logs(transformers.TrainerCallback):
    """The Trainer's training logs (those with ``loss``), as its callbacks receive them."""

    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if logs is not None and "loss" in logs:
            self.logs.append(dict(logs))


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _trainer(out: Path, level: str | None, schedule_free: bool = False, scaled: bool = False,
             **arguments: Any) -> tuple[Any, Logs]:  # fmt: skip
    """A Trainer of a seeded GPT-2: ``level=None`` is transformers' own with ``bf16=True``, else the mixin at
    ``level`` in bfloat16 (``scaled``: with a dynamic loss scale of 1024, which a gradient read before unscaling
    shows); ``schedule_free``: a :class:`ScheduleFreeSGD` passed as ``optimizers=(opt, None)``."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(GPT2)
    defaults = dict(max_steps=4, per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1,
                    save_strategy="no", disable_tqdm=True, optim="adamw_torch", bf16=level is None)  # fmt: skip
    args = transformers.TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[], **{**defaults, **arguments})
    logs = Logs()
    made: dict[str, Any] = dict(model=model, args=args, train_dataset=lm_data(16), eval_dataset=lm_data(8),
                                callbacks=[logs])  # fmt: skip
    if schedule_free:
        made["optimizers"] = (ScheduleFreeSGD(model.parameters(), lr=0.05), None)
    if level is None:
        return transformers.Trainer(**made), logs
    scaling = dict(loss_scale="dynamic", init_scale=2.0**10) if scaled else {}
    mpx_kwargs = MixedPrecisionKwargs(half_dtype="bfloat16", **scaling)
    return mpx_trainer()(**made, opt_level=level, mpx_kwargs=mpx_kwargs), logs


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return float(sum(((a[k] - b[k]) ** 2).sum() for k in a) ** 0.5)


def _close(ours: list[float], native: list[float], rel: float) -> None:
    assert len(ours) == len(native) > 0
    for a, b in zip(ours, native):
        assert a == pytest.approx(b, rel=rel), (ours, native)


def test_schedule_free_optimizer_evaluates_and_saves_at_the_averaged_point(tmp_path):
    """The Trainer calls ``optimizer.eval()`` at each evaluation and ``optimizer.train()`` at each step: at O2 they
    move the FP32 masters (and the half model with them), so the evaluation losses and ``save_model()`` after the
    last evaluation are at the averaged point as with ``bf16=True`` (reentrant gradient checkpointing on too)."""
    runs: dict[str | None, tuple[list[float], list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
    for level in (None, "O2"):
        with accelerate_state_reset():
            tr, logs = _trainer(tmp_path / str(level), level, schedule_free=True, eval_strategy="steps", eval_steps=1,
                                max_steps=2,
                                gradient_checkpointing=True,
                                gradient_checkpointing_kwargs={"use_reentrant": True})  # fmt: skip
            tr.train()
            tr.save_model(str(tmp_path / f"final-{level}"))
            saved = safetensors_torch.load_file(str(tmp_path / f"final-{level}" / "model.safetensors"))
            tr.optimizer.train()  # back to the training point: how far the averaged point is from it
            at_train_point = {k: v.float().clone() for k, v in tr.accelerator.get_state_dict(tr.model).items()
                              if k in saved}  # fmt: skip
            evals = [log["eval_loss"] for log in tr.state.log_history if "eval_loss" in log][:2]
            runs[level] = ([log["loss"] for log in logs.logs], evals, saved, at_train_point)
    native_losses, native_evals, native_saved, _ = runs[None]
    losses, evals, saved, at_train_point = runs["O2"]
    _close(losses, native_losses, rel=1e-3)  # measured 2.6e-5
    _close(evals, native_evals, rel=1e-4)  # 1.6e-5
    assert saved.keys() == native_saved.keys() and all(v.dtype == torch.float32 for v in saved.values())
    assert max_diff(saved, native_saved) < 1e-4  # measured 3.8e-5
    # The averaged point, not the training point (4.5 times as far from bf16's saved weights, measured):
    assert _distance(saved, native_saved) < _distance(at_train_point, native_saved) / 2


@pytest.mark.skipif(torch.__version__ < (2, 13), reason="torch < 2.13's uniform_ draws other values into bfloat16 "
                    "than float32 from one seed: NEFTune's noise (uniform_ on the embeddings' output, bfloat16 at O2, "
                    "float32 under bf16=True) differs, so the losses cannot follow bf16's")
def test_trainer_habits_follow_bf16(tmp_path):
    """Label smoothing, NEFTune, non-reentrant gradient checkpointing, accumulation 2 with ``max_grad_norm=1.0``;
    ``evaluate()``/``predict()`` before any training, then ``train()`` twice on one Trainer: the losses, the
    logged (unscaled, FP32-mastered) ``grad_norm``, the evaluation and the predictions follow ``bf16=True``."""
    habits = dict(label_smoothing_factor=0.1, neftune_noise_alpha=5.0, gradient_checkpointing=True,
                  gradient_checkpointing_kwargs={"use_reentrant": False}, gradient_accumulation_steps=2,
                  max_grad_norm=1.0, max_steps=2)  # fmt: skip
    runs: dict[str | None, dict[str, Any]] = {}
    for level in (None, "O2"):
        with accelerate_state_reset():
            tr, logs = _trainer(tmp_path / str(level), level, scaled=True, **habits)
            smoother, smoothed = tr.label_smoother, []

            def spy(outputs: Any, labels: Any, shift_labels: bool = False, smoother: Any = smoother) -> Any:
                smoothed.append(outputs["logits"].dtype)
                return smoother(outputs, labels, shift_labels=shift_labels)

            tr.label_smoother = spy
            initial = {k: v.clone() for k, v in tr.model.state_dict().items()}
            run: dict[str, Any] = {"eval": tr.evaluate()["eval_loss"], "pred": tr.predict(lm_data(4)).predictions}
            if level:  # no step yet: the masters hold the FP32 weights, not their bfloat16 rounding
                run["masters"] = max_diff(tr.accelerator.amp.fp32_state_dict(tr.model), initial)
                assert next(tr.model.parameters()).dtype == torch.bfloat16
            tr.train()
            first = {k: v.float().clone() for k, v in tr.accelerator.get_state_dict(tr.model).items()}
            tr.train()
            second = tr.accelerator.get_state_dict(tr.model)
            run["moved"] = max_diff({k: v.float() for k, v in second.items()}, first)
            run["logs"], run["smoothed"] = logs.logs, set(smoothed)
            runs[level] = run
    native, ours = runs[None], runs["O2"]
    assert ours["masters"] == 0.0  # made by the evaluation before training, from the FP32 weights
    assert ours["eval"] == pytest.approx(native["eval"], rel=1e-4)  # 1.4e-5
    logits, native_logits = ours["pred"][0], native["pred"][0]
    assert logits.dtype == native_logits.dtype == "float32"
    assert abs(logits - native_logits).max() < 5e-2  # 2.4e-3
    assert ours["smoothed"] == native["smoothed"] == {torch.float32}  # the LabelSmoother's log_softmax in FP32
    assert len(ours["logs"]) == len(native["logs"]) == 4  # two runs of two optimizer steps
    _close([log["loss"] for log in ours["logs"]], [log["loss"] for log in native["logs"]], rel=2e-3)  # 5.5e-4
    # The clip's norm, unscaled (a scaled one is 1024 times as large) and of the FP32-mastered gradients: 3.1e-3
    _close([log["grad_norm"] for log in ours["logs"]], [log["grad_norm"] for log in native["logs"]], rel=1e-2)
    assert [log["mpx/loss_scale"] for log in ours["logs"]] == [1024.0] * 4
    assert ours["moved"] == pytest.approx(native["moved"], rel=0.05)  # the second train() trains them on: 1.5e-4
