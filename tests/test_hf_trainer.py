"""``transformers.Trainer`` with an opt level (:mod:`lightning_mpx.integrations.hf_trainer`), from the user's side: the
Trainer's own loop (its gradient accumulation, clipping, scheduler, checkpoints, evaluation and export) on the
Accelerate adapter, held to the Trainer's own ``bf16=True`` and FP32 runs. Tiny GPT-2 and BERT built from configs
(nothing downloaded), bfloat16, on CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_mpx.accelerate import MixedPrecisionKwargs, MpxTrainerMixin, mpx_trainer  # noqa: E402
from tests.accelerate_helpers import accelerate_state_reset  # noqa: E402
from tests.test_docs_examples import block, run, substitute  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


transformers.logging.set_verbosity_error()
GPT2 = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
BERT = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                               intermediate_size=64, max_position_embeddings=16, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0, num_labels=3)  # fmt: skip
# bfloat16 with a dynamic scale: a logged norm that was not unscaled would be 1024 times too large.
SCALED = MixedPrecisionKwargs(half_dtype="bfloat16", loss_scale="dynamic", init_scale=2.0**10)


def lm_data(n: int = 24) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row} for row in ids]


def cls_data(n: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 64, (n, 16), generator=g), torch.randint(0, 3, (n,), generator=g)
    return [{"input_ids": i, "labels": y} for i, y in zip(ids, labels)]


class Logs(transformers.TrainerCallback):
    """The Trainer's training logs, as its callbacks (and so every ``report_to`` integration) receive them."""

    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if logs is not None and "loss" in logs:
            self.logs.append(dict(logs))


class PoisonedTrainer(MpxTrainerMixin, transformers.Trainer):
    """The loss of the optimizer steps in ``poison`` (global steps, from 0) is infinite: the step overflows."""

    poison: tuple[int, ...] = ()

    def compute_loss(self, model: Any, inputs: Any, **kwargs: Any) -> Any:
        loss = super().compute_loss(model, inputs, **kwargs)
        return loss * float("inf") if self.state.global_step in self.poison else loss


def trainer(tmp: Path, level: str | None, config: Any = GPT2, data: Any = None, cls: Any = None,
            mpx_kwargs: MixedPrecisionKwargs = SCALED, **arguments: Any) -> tuple[Any, Logs]:  # fmt: skip
    """A Trainer (``level=None``: transformers' own) of a seeded model from ``config`` in ``tmp``."""
    torch.manual_seed(0)
    model = (transformers.GPT2LMHeadModel if config is GPT2 else transformers.BertForSequenceClassification)(config)
    defaults = dict(max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1,
                    save_strategy="no", disable_tqdm=True, optim="adamw_torch")  # fmt: skip
    args = transformers.TrainingArguments(output_dir=str(tmp), use_cpu=True, report_to=[], **{**defaults, **arguments})
    logs = Logs()
    data = lm_data() if data is None else data
    if level is None:
        return transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[logs]), logs
    cls = cls or mpx_trainer()
    made = cls(model=model, args=args, train_dataset=data, callbacks=[logs], opt_level=level, mpx_kwargs=mpx_kwargs)
    return made, logs


def trained(tmp: Path, level: str | None, **arguments: Any) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    """The FP32 weights and training logs of a run, each run with a fresh Accelerate state."""
    with accelerate_state_reset():
        tr, logs = trainer(tmp, level, **arguments)
        tr.train()
        weights = tr.model.state_dict() if level is None else tr.accelerator.amp.fp32_state_dict(tr.model)
        return {k: v.float().clone() for k, v in weights.items()}, logs.logs


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_o1_o2_track_the_trainers_bf16_and_fp32_runs(tmp_path):
    """Gradient accumulation 2, ``max_grad_norm=1.0``: losses, the logged (unscaled) ``grad_norm`` and the weights
    follow the FP32 run as closely as the Trainer's own ``bf16=True``; the scale reaches the logs."""
    common = dict(max_steps=2, gradient_accumulation_steps=2, max_grad_norm=1.0)
    fp32, fp32_logs = trained(tmp_path / "fp32", None, **common)
    bf16, bf16_logs = trained(tmp_path / "bf16", None, bf16=True, **common)
    bf16_error = max_diff(bf16, fp32)
    for level in ("O1", "O2"):
        weights, logs = trained(tmp_path / level, level, **common)
        assert len(logs) == len(fp32_logs) == 2
        for ours, ref, native in zip(logs, fp32_logs, bf16_logs):
            assert ours["loss"] == pytest.approx(ref["loss"], rel=1e-2)
            assert ours["loss"] == pytest.approx(native["loss"], rel=1e-2)
            assert ours["grad_norm"] == pytest.approx(ref["grad_norm"], rel=5e-2)  # clipped at 1.0, unscaled
            assert ours["mpx/loss_scale"] == 1024.0 and ours["mpx/overflows"] == 0.0
            assert ours["learning_rate"] == ref["learning_rate"]
        assert max_diff(weights, fp32) <= 2 * bf16_error + 1e-4, level


def test_overflow_skips_the_step_and_resume_continues_exactly(tmp_path):
    """An infinite loss at step 1: the step is skipped (weights unchanged, the scheduler held as the Trainer does for
    its own fp16), the scale halves, the logs say so; resuming from the checkpoint at step 3 gives the bits, optimizer
    state, scale and skip count of the uninterrupted run."""
    cls = type("Poisoned", (PoisonedTrainer,), {"poison": (1,)})
    snapshots: list[torch.Tensor] = []

    class Snapshot(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            snapshots.append(model.transformer.h[0].attn.c_attn.weight.detach().clone())

    with accelerate_state_reset():
        full, logs = trainer(tmp_path / "full", "O2", cls=cls, max_steps=5, save_strategy="steps", save_steps=3)
        full.add_callback(Snapshot())
        full.train()
        full_weights = full.accelerator.amp.fp32_state_dict(full.model)
        full_amp = full.accelerator.amp.state_dict()
        full_optimizer = full.optimizer.state_dict()
    assert torch.equal(snapshots[1], snapshots[0])  # the skipped step changed nothing
    assert not torch.equal(snapshots[2], snapshots[1])
    lrs = [log["learning_rate"] for log in logs.logs]
    assert lrs[2] == lrs[1] and lrs[1] < lrs[0] and lrs[3] < lrs[2]  # no scheduler step on the skipped one
    assert [log["mpx/loss_scale"] for log in logs.logs] == [1024.0, 512.0, 512.0, 512.0, 512.0]
    assert [log["mpx/overflows"] for log in logs.logs] == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert logs.logs[-1]["mpx/skipped_steps"] == 1.0
    assert logs.logs[0]["grad_norm"] < 10  # unscaled (the scale is 1024)

    checkpoint = tmp_path / "full" / "checkpoint-3"
    with accelerate_state_reset():
        resumed, resumed_logs = trainer(tmp_path / "resumed", "O2", cls=cls, max_steps=5)
        resumed.train(resume_from_checkpoint=str(checkpoint))
        assert max_diff(resumed.accelerator.amp.fp32_state_dict(resumed.model), full_weights) == 0.0
        amp = resumed.accelerator.amp.state_dict()
        assert amp["scalers"] == full_amp["scalers"] and amp["skipped_steps"] == full_amp["skipped_steps"]
        state = resumed.optimizer.state_dict()["state"]
        for key, value in full_optimizer["state"].items():
            assert torch.equal(state[key]["exp_avg"], value["exp_avg"])
    assert [log["learning_rate"] for log in resumed_logs.logs] == lrs[3:]
    assert [log["mpx/loss_scale"] for log in resumed_logs.logs] == [512.0, 512.0]
    assert resumed_logs.logs[-1]["mpx/skipped_steps"] == 1.0


def test_o2_evaluate_predict_and_save_model_as_the_fp32_weights(tmp_path):
    """BERT at O2: ``evaluate()`` before ``train()`` does not round the FP32 weights the masters start from;
    ``predict()`` returns FP32 logits close to the Trainer's own ``bf16=True``; ``save_model()`` writes the FP32
    weights with ``config.json`` naming float32, so ``from_pretrained`` loads them exactly."""
    data = cls_data()
    with accelerate_state_reset():
        native, _ = trainer(tmp_path / "bf16", None, config=BERT, data=data, bf16=True)
        native.train()
        native_logits = native.predict(data[:8]).predictions
    masters_at_start: list[float] = []

    class AtStart(transformers.TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            masters_at_start.append(max_diff(tr.accelerator.amp.fp32_state_dict(model), initial))

    with accelerate_state_reset():
        tr, _ = trainer(tmp_path / "o2", "O2", config=BERT, data=data)
        tr.add_callback(AtStart())
        initial = {k: v.clone() for k, v in tr.model.state_dict().items()}
        assert tr.evaluate(eval_dataset=data[:8])["eval_loss"] > 0
        assert max_diff(tr.accelerator.amp.fp32_state_dict(tr.model), initial) == 0.0  # not rounded to bfloat16
        tr.train()
        assert masters_at_start == [0.0]  # the masters the optimizer steps start from the FP32 weights
        weights = tr.accelerator.amp.fp32_state_dict(tr.model)
        logits = tr.predict(data[:8]).predictions
        assert logits.dtype == native_logits.dtype == "float32"
        assert abs(logits - native_logits).max() < 5e-2
        tr.save_model(str(tmp_path / "final"))
    assert json.loads((tmp_path / "final" / "config.json").read_text())["dtype"] == "float32"
    loaded = transformers.BertForSequenceClassification.from_pretrained(str(tmp_path / "final")).state_dict()
    assert max_diff({k: loaded[k] for k in weights}, weights) == 0.0
    assert all(loaded[k].dtype == torch.float32 for k in weights)


def test_refused_combinations_name_both_sides(tmp_path):
    with pytest.raises(ValueError, match=r"bf16=True.*opt_level='O2'"):
        trainer(tmp_path, "O2", bf16=True)
    with pytest.raises(ValueError, match=r"opt_level='o2'.*'O0', 'O1', 'O2', 'O3'"):
        trainer(tmp_path, "o2")
    with pytest.raises(TypeError, match="trainer_cls=.*transformers.Trainer"):
        mpx_trainer(torch.nn.Module)
    # A checkpoint of transformers' own Trainer has no loss scale or masters to resume from.
    with accelerate_state_reset():
        plain, _ = trainer(tmp_path / "plain", None, max_steps=1, save_strategy="steps", save_steps=1)
        plain.train()
    with accelerate_state_reset():
        tr, _ = trainer(tmp_path / "o1", "O1", max_steps=2)
        with pytest.raises(FileNotFoundError, match="lightning_mpx_amp.bin.*opt_level='O1'"):
            tr.train(resume_from_checkpoint=str(tmp_path / "plain" / "checkpoint-1"))


def test_docs_trainer_block_runs(tmp_path):
    """docs/accelerate.md's ``transformers.Trainer`` block as a user copies it (sizes shrunk, CPU, no reporting)."""
    code = block("docs/accelerate.md", "class MpxTrainer(MpxTrainerMixin, Trainer)")
    code = substitute(code, '"runs/hf', '"' + str(tmp_path / "hf"))  # output_dir and the final model's folder
    code = substitute(code, "max_steps=1000", "max_steps=2, use_cpu=True, report_to=[]")
    code = substitute(code, "save_steps=500", "save_steps=2")
    code = substitute(code, "logging_steps=50", "logging_steps=1")
    torch.manual_seed(0)
    ns = run(code, "docs/accelerate.md", model=transformers.GPT2LMHeadModel(GPT2), train_dataset=lm_data(),
             eval_dataset=lm_data(8))  # fmt: skip
    assert ns["metrics"]["eval_loss"] > 0
    logged = [log for log in ns["trainer"].state.log_history if "loss" in log]
    assert {"mpx/loss_scale", "mpx/overflows", "mpx/skipped_steps", "grad_norm"} <= set(logged[-1])
    assert json.loads((tmp_path / "hf" / "final" / "config.json").read_text())["dtype"] == "float32"


def test_free_memory_keeps_the_fp32_values_of_a_model_prepared_without_optimizer():
    """The Trainer's habit on the adapter: ``prepare_model(model)`` (here by an evaluation before training), then
    ``free_memory()`` at the start of ``train()``, then ``prepare(model, optimizer)``: the O2 masters start from the
    FP32 weights, not from their bfloat16 rounding (the fresh engine took only the masters already made)."""
    from lightning_mpx.accelerate import Accelerator

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    handlers = [MixedPrecisionKwargs(half_dtype="bfloat16")]
    accelerator = Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=handlers)
    accelerator.prepare_model(model)
    accelerator.free_memory()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0))
    assert model.weight.dtype == torch.bfloat16
    assert max_diff(accelerator.amp.fp32_state_dict(model), initial) == 0.0
    assert torch.equal(accelerator.amp.master_params(optimizer.optimizer)[0], initial["weight"])
