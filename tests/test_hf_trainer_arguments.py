"""``transformers.Trainer`` with ``MpxTrainerMixin`` at O1/O2 bfloat16, with the ``TrainingArguments`` habits not held
elsewhere (``tests/test_hf_trainer_habits.py`` has label smoothing, NEFTune, gradient checkpointing, accumulation with
clipping): clipping that bites (``max_grad_norm`` below the norm, SGD: the step's length is the clip's),
``weight_decay`` with the Trainer's no-decay groups (built from the FP32 model before the door prepares it),
``optim="adamw_torch_fused"``, ``lr_scheduler_type="cosine_with_restarts"``, ``include_num_input_tokens_seen``,
``torch_empty_cache_steps``, ``optim="adafactor"``, and evaluation with ``eval_accumulation_steps`` +
``prediction_loss_only=False`` + ``compute_metrics``. Each run is held to the same Trainer with its own ``bf16=True`` at
the same seed. Tiny GPT-2 built from a config (nothing downloaded), CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_mpx.accelerate import MixedPrecisionKwargs, mpx_trainer  # noqa: E402
from tests.accelerate_helpers import accelerate_state_reset  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

transformers.logging.set_verbosity_error()
GPT2 = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
# None: transformers' own Trainer with bf16=True. O1 trains the FP32 parameters under the optimizer as bf16=True does
# (its clip and groups are those of an FP32 model): it is held to bf16 where its outputs differ (the evaluation).
LEVELS = (None, "O2")


def _data(n: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in ids]


def _trainer(out: Path, level: str | None, scaled: bool = False, **arguments: Any) -> Any:
    """A seeded GPT-2's Trainer: ``bf16=True`` where ``level`` is None, else the mixin at ``level`` in bfloat16
    (``scaled``: a dynamic loss scale of 1024, which a norm read before unscaling would show)."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(GPT2)
    defaults = dict(max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1,
                    save_strategy="no", disable_tqdm=True, optim="adamw_torch", bf16=level is None)  # fmt: skip
    args = transformers.TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[], **{**defaults, **arguments})
    made = dict(model=model, args=args, train_dataset=_data(12), eval_dataset=_data(4))
    if level is None:
        return transformers.Trainer(**made)
    scaling = dict(loss_scale="dynamic", init_scale=2.0**10) if scaled else {}
    return mpx_trainer()(**made, opt_level=level, mpx_kwargs=MixedPrecisionKwargs(half_dtype="bfloat16", **scaling))


def _train(tmp_path: Path, level: str | None, **arguments: Any) -> tuple[Any, list[dict[str, float]], dict]:
    """Train; the training logs and the FP32 weights (the masters at O2)."""
    with accelerate_state_reset():
        tr = _trainer(tmp_path / str(level), level, **arguments)
        tr.train()
        weights = {k: v.detach().float().clone() for k, v in tr.accelerator.get_state_dict(tr.model).items()}
    return tr, [log for log in tr.state.log_history if "loss" in log], weights


def _initial() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(GPT2).state_dict()


def _norm(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return float(sum(((a[k].float() - b[k].float()) ** 2).sum() for k in b) ** 0.5)


def _close(ours: list[dict[str, float]], native: list[dict[str, float]], key: str, rel: float) -> None:
    assert len(ours) == len(native) > 0
    assert [log[key] for log in ours] == pytest.approx([log[key] for log in native], rel=rel), key


def test_max_grad_norm_clips_the_unscaled_fp32_gradients_as_bf16(tmp_path):
    """SGD, ``max_grad_norm=0.05`` (the gradients' norm is ~1.5: the clip bites): the logged ``grad_norm`` is the
    unscaled norm (O2 scales by 1024 here) and each step moves the weights by ``lr * 0.05``, as under ``bf16=True``;
    unclipped, each step would be ``grad_norm / 0.05`` (26 to 32) times as long."""
    habits = dict(optim="sgd", learning_rate=0.1, max_grad_norm=0.05)
    runs = {level: _train(tmp_path, level, scaled=level == "O2", **habits) for level in LEVELS}
    _, native_logs, native_weights = runs[None]
    initial = _initial()
    native_moved = _norm(native_weights, initial)
    # Plain SGD steps of length lr * 0.05 (0.1, 0.075, 0.05 by the linear schedule), not all in one direction:
    assert 0.005 < native_moved < (0.1 + 0.075 + 0.05) * 0.05
    tr, logs, weights = runs["O2"]
    _close(logs, native_logs, "loss", rel=1e-4)  # measured 4e-5
    _close(logs, native_logs, "grad_norm", rel=5e-3)  # 3.5e-4; a scaled norm would be 1024 times as large
    assert all(log["grad_norm"] > 1.0 for log in logs)  # the clip bites at each step
    assert _norm(weights, initial) == pytest.approx(native_moved, rel=1e-3)  # 1e-4
    assert _norm(weights, native_weights) < 0.05 * native_moved  # measured 0.7%
    assert runs["O2"][1][-1]["mpx/loss_scale"] == 1024.0


def test_weight_decay_groups_fused_adamw_cosine_restarts_and_tokens_seen_follow_bf16(tmp_path):
    """``weight_decay=0.5`` with ``optim="adamw_torch_fused"``, ``cosine_with_restarts`` (2 cycles, a warm-up step),
    ``include_num_input_tokens_seen`` and ``torch_empty_cache_steps=1``. The Trainer builds its decay groups from the
    FP32 model's ``named_parameters()`` before the door prepares it: at O2 its groups hold the half parameters of the
    same names (the masters stepped by those groups' settings), so biases and LayerNorm weights are not decayed."""
    habits = dict(optim="adamw_torch_fused", learning_rate=1e-2, weight_decay=0.5, max_steps=5, warmup_steps=1,
                  lr_scheduler_type="cosine_with_restarts", lr_scheduler_kwargs={"num_cycles": 2},
                  include_num_input_tokens_seen=True, torch_empty_cache_steps=1)  # fmt: skip
    runs = {level: _train(tmp_path, level, **habits) for level in LEVELS}
    native_tr, native_logs, native_weights = runs[None]
    decayed = set(native_tr.get_decay_parameter_names(native_tr.model))
    assert any("ln_" in name for name in native_weights) and not any("ln_" in name for name in decayed)
    tr, logs, weights = runs["O2"]
    # The learning rates and token counts are the Trainer's own, exactly:
    assert [log["learning_rate"] for log in logs] == [log["learning_rate"] for log in native_logs]
    assert [log["num_input_tokens_seen"] for log in logs] == [64, 128, 192, 256, 320]
    assert tr.state.num_input_tokens_seen == native_tr.state.num_input_tokens_seen == 320
    _close(logs, native_logs, "loss", rel=1e-3)  # measured 6e-5
    _close(logs, native_logs, "grad_norm", rel=2e-2)  # 6.4e-3
    names = {id(p): n for n, p in tr.model.named_parameters()}
    groups = tr.optimizer.optimizer.param_groups if hasattr(tr.optimizer, "optimizer") else tr.optimizer.param_groups
    by_decay = {g["weight_decay"]: {names[id(p)] for p in g["params"]} for g in groups}
    named = set(names.values())  # lm_head.weight is tied to (and named as) transformer.wte.weight
    assert by_decay == {0.5: named & decayed, 0.0: named - decayed} and "transformer.wte.weight" in decayed
    # Not decayed, as under bf16=True (decayed, each would be (1 - sum(lr) * 0.5) = 0.985 times as large):
    for name in ("transformer.ln_f.weight", "transformer.h.0.ln_1.weight"):
        # measured 1e-5; .item(): pytest 9.2's approx iterates a 0-d tensor
        assert weights[name].mean().item() == pytest.approx(native_weights[name].mean().item(), abs=2e-4)
    # The decayed weights shrink as bf16's do:
    shrunk = sum(weights[k].norm() ** 2 for k in named & decayed) ** 0.5
    native_shrunk = sum(native_weights[k].norm() ** 2 for k in named & decayed) ** 0.5
    assert float(shrunk) == pytest.approx(float(native_shrunk), rel=1e-3)  # measured 7e-5; decayed LayerNorms: 1.5e-2
    assert _norm(weights, native_weights) < 0.2 * _norm(native_weights, _initial())  # measured 5%


def test_adafactor_and_evaluation_with_accumulated_fp32_predictions(tmp_path):
    """``optim="adafactor"`` (the Trainer's ``Adafactor``, fixed learning rate); then ``evaluate()`` with
    ``eval_accumulation_steps=1``, ``prediction_loss_only=False`` and ``compute_metrics``, and ``predict()``: the
    metrics see FP32 logits (numpy arrays) as under ``bf16=True``, and the losses and logits follow it."""
    habits = dict(optim="adafactor", eval_accumulation_steps=1, prediction_loss_only=False,
                  per_device_eval_batch_size=2)  # fmt: skip
    runs: dict[str | None, dict[str, Any]] = {}
    for level in (*LEVELS, "O1"):
        with accelerate_state_reset():
            tr = _trainer(tmp_path / str(level), level, **habits)
            seen: list[Any] = []

            def metrics(prediction: Any, seen: list[Any] = seen) -> dict[str, float]:
                seen.append(prediction.predictions)
                return {"argmax_hits": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}

            tr.compute_metrics = metrics
            tr.train()
            run = {"logs": [log for log in tr.state.log_history if "loss" in log], "eval": tr.evaluate(),
                   "pred": tr.predict(_data(4)), "seen": seen}  # fmt: skip
            runs[level] = run
    native = runs[None]
    for level in ("O2", "O1"):
        ours = runs[level]
        _close(ours["logs"], native["logs"], "loss", rel=5e-4)  # measured 4.3e-5
        _close(ours["logs"], native["logs"], "grad_norm", rel=1e-2)  # 8.6e-4
        assert len(ours["seen"]) == 2 and all(isinstance(p, np.ndarray) for p in ours["seen"])
        assert {p.dtype for p in ours["seen"]} == {p.dtype for p in native["seen"]} == {np.dtype("float32")}
        assert ours["seen"][0].shape == (4, 16, 64)  # the 2 evaluation batches, accumulated
        assert ours["eval"]["eval_loss"] == pytest.approx(native["eval"]["eval_loss"], rel=2e-4)  # 2.5e-5
        assert ours["eval"]["eval_argmax_hits"] == pytest.approx(native["eval"]["eval_argmax_hits"], abs=0.05)
        logits, native_logits = ours["pred"].predictions, native["pred"].predictions
        assert logits.dtype == native_logits.dtype == np.float32
        assert np.abs(logits - native_logits).max() < 2e-2  # measured 3.9e-3
        assert ours["pred"].metrics["test_loss"] == pytest.approx(native["pred"].metrics["test_loss"], rel=2e-4)
