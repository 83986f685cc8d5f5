"""Stop 59's ``generate`` wrapper and EMA warnings through two more doors, from the user's side: transformers'
``Seq2SeqTrainer``/``Trainer`` with :class:`MpxTrainerMixin` at O2 bfloat16 (held to the Trainer's own ``bf16=True``
on tiny Bart and GPT-2 models built from configs, nothing downloaded) and the Apex layer's ``amp.initialize``."""

from __future__ import annotations

import copy
import sys
import warnings
from typing import Any, Callable

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from lightning_mpx.accelerate import MixedPrecisionKwargs, mpx_trainer  # noqa: E402
from lightning_mpx.apex import amp  # noqa: E402
from tests.accelerate_helpers import accelerate_state_reset  # noqa: E402

transformers.logging.set_verbosity_error()
BF16 = MixedPrecisionKwargs(half_dtype="bfloat16")
BART = transformers.BartConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                               decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                               max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                               pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                               forced_bos_token_id=None, forced_eos_token_id=None, init_std=0.5)  # fmt: skip
GPT2 = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)  # fmt: skip


def seq2seq_data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(3, 64, (8,), generator=g), "labels": torch.randint(3, 64, (6,), generator=g)}
            for _ in range(8)]  # fmt: skip


def python_calls(fn: Callable[[], Any]) -> int:
    """The Python and C function calls ``fn`` makes (``sys.setprofile``), under ``torch.no_grad()``."""
    count = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            count[0] += 1

    sys.setprofile(profile)
    try:
        with torch.no_grad():
            fn()
    finally:
        sys.setprofile(None)
    return count[0]


def seq2seq_run(tmp: Any, level: str | None) -> dict[str, Any]:
    """``predict()`` with ``predict_with_generate`` (transformers' own ``bf16=True`` where ``level`` is None), then a
    greedy loop of the prepared model's forward, and the Python calls per generated token and per forward."""
    data = seq2seq_data()
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(BART)
    args = transformers.Seq2SeqTrainingArguments(
        output_dir=str(tmp), use_cpu=True, report_to=[], per_device_eval_batch_size=8, predict_with_generate=True,
        generation_max_length=8, disable_tqdm=True, save_strategy="no", bf16=level is None,
    )

    def metrics(p: Any) -> dict[str, float]:
        return {"first_token": float(p.predictions[:, 1].mean())}

    common = dict(model=model, args=args, train_dataset=data, compute_metrics=metrics)
    with accelerate_state_reset():
        if level is None:
            trainer = transformers.Seq2SeqTrainer(**common)
        else:
            trainer = mpx_trainer(transformers.Seq2SeqTrainer)(**common, opt_level=level, mpx_kwargs=BF16)
        out = trainer.predict(data)
        model = trainer.model.eval()
        ids = torch.stack([d["input_ids"] for d in data])
        tokens = torch.full((8, 1), BART.decoder_start_token_id)
        with torch.no_grad():
            for _ in range(7):
                logits = model(input_ids=ids, decoder_input_ids=tokens).logits
                tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], 1)

        def generate(n: int) -> Callable[[], Any]:
            return lambda: model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

        per_token = (python_calls(generate(4)) - python_calls(generate(2))) / 2
        start = tokens[:, :1]
        scope = python_calls(lambda: model(input_ids=ids, decoder_input_ids=start)) - python_calls(
            lambda: type(model).forward(model, input_ids=ids, decoder_input_ids=start)
        )
        weight = next(model.parameters()).dtype
        return dict(out=out, greedy=tokens, logits=logits, per_token=per_token, scope=scope, weight=weight)


def test_seq2seq_predict_with_generate_at_o2_matches_a_greedy_loop_and_bf16(tmp_path):
    """``Seq2SeqTrainer`` + the mixin, ``predict_with_generate=True``: ``predict()`` generates on the half model
    (tokens equal to a greedy loop of its own forward, FP32 logits, metrics computed), as transformers' ``bf16=True``
    does; each generated token costs no more Python calls above ``bf16=True``'s than the forward's scope does
    (measured: +252 per token, O2's forward scope 395)."""
    native, ours = seq2seq_run(tmp_path / "bf16", None), seq2seq_run(tmp_path / "o2", "O2")
    assert ours["weight"] == torch.bfloat16 and ours["logits"].dtype == torch.float32
    for run in (native, ours):
        predictions = torch.as_tensor(run["out"].predictions)
        assert "test_first_token" in run["out"].metrics
        same = []
        for row, want in zip(predictions, run["greedy"]):
            ends = (want[1:] == BART.eos_token_id).nonzero()
            n = int(ends[0]) + 2 if len(ends) else len(want)  # up to the first eos after the start token
            same.append(torch.equal(row[:n], want[:n]))
        assert sum(same) >= 6, same  # the loop recomputes without the cache: a near tie in bfloat16 may differ
    agree = (torch.as_tensor(ours["out"].predictions) == torch.as_tensor(native["out"].predictions)).float().mean()
    assert agree >= 0.75  # bfloat16 weights against bfloat16 autocast: argmax ties may differ
    assert ours["per_token"] - native["per_token"] <= ours["scope"], (ours["per_token"], native["per_token"])


def test_tied_gpt2_with_gradient_checkpointing_trains_as_bf16_without_an_ema_warning(tmp_path):
    """A GPT-2 with tied embeddings and ``gradient_checkpointing=True`` (reentrant) under the mixin at O2: no EMA
    warning (its tied head is the embedding, held by the optimizer), and the weights follow the Trainer's own
    ``bf16=True`` run within bfloat16's tolerance."""
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    weights = {}
    for level in (None, "O2"):
        with accelerate_state_reset(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.manual_seed(0)
            model = transformers.GPT2LMHeadModel(GPT2)
            args = transformers.TrainingArguments(
                output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=2, per_device_train_batch_size=4,
                learning_rate=0.5, optim="sgd", disable_tqdm=True, save_strategy="no", bf16=level is None,
                gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True},
            )
            if level is None:
                trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
            else:
                trainer = mpx_trainer()(model=model, args=args, train_dataset=data, opt_level=level, mpx_kwargs=BF16)
            trainer.train()
            assert trainer.model.lm_head.weight is trainer.model.transformer.wte.weight
            state = trainer.model.state_dict() if level is None else trainer.accelerator.amp.fp32_state_dict(model)
            weights[level] = {k: v.float().clone() for k, v in state.items()}
        assert not [w for w in caught if "EMA" in str(w.message)], level
    torch.manual_seed(0)
    start = transformers.GPT2LMHeadModel(GPT2).state_dict()
    moved = max((weights[None][k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-2, moved
    assert max((weights["O2"][k] - weights[None][k]).abs().max().item() for k in start) <= 0.1 * moved


class Pair(nn.Module):
    """A student, its EMA (a trainable ``deepcopy``, no optimizer holds it) and a frozen momentum teacher."""

    def __init__(self) -> None:
        super().__init__()
        self.student = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
        self.ema = copy.deepcopy(self.student)
        self.teacher = copy.deepcopy(self.student).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.student(x)


def apex_run(**kwargs: Any) -> tuple[list[warnings.WarningMessage], int]:
    """Six O2 bfloat16 steps through ``amp.initialize`` and ``amp.scale_loss``, the EMA and teacher updated by hand
    after each; the warnings and the line of the user's ``with amp.scale_loss``."""
    torch.manual_seed(0)
    net = Pair()
    opt = torch.optim.SGD(net.student.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net, opt = amp.initialize(net, opt, opt_level="O2", cast_model_type=torch.bfloat16, verbosity=0, **kwargs)
        for _ in range(6):
            loss = net(torch.randn(8, 8).to(torch.bfloat16)).float().pow(2).mean()
            line = sys._getframe().f_lineno + 1
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for e, t, s in zip(net.ema.parameters(), net.teacher.parameters(), net.student.parameters()):
                    e.lerp_(s, 1e-3)
                    t.lerp_(s, 1e-3)
    return [w for w in caught if "EMA" in str(w.message)], line


@pytest.mark.parametrize("kwargs", [{}, {"keep_batchnorm_fp32": False}], ids=["default", "half_batchnorm"])
def test_apex_o2_warns_once_each_about_a_half_ema_and_teacher_at_the_users_line(kwargs):
    """Each warning fires once, names the child, and points at the user's ``with amp.scale_loss(...)`` line (it
    pointed at contextlib.py, the generator context manager's exit); with ``keep_batchnorm_fp32=False`` the half
    BatchNorm parameters are counted too."""
    caught, line = apex_run(**kwargs)
    assert len(caught) == 2
    children, frozen = (str(w.message) for w in caught)
    count = 6 if kwargs else 4
    assert f"{count} bfloat16 parameters of Pair ('ema') require grad" in children
    assert f"{count} frozen bfloat16 parameters of Pair ('teacher')" in frozen
    assert {(w.filename, w.lineno) for w in caught} == {(__file__, line)}


def test_apex_o2_without_master_weights_stays_silent():
    """``master_weights=False``: the student itself is half with no FP32 master, and the warning's recipe (average
    the FP32 masters) has none to average, so neither warning fires."""
    assert apex_run(master_weights=False)[0] == []
    assert apex_run(master_weights=False, keep_batchnorm_fp32=True)[0] == []


def test_apex_ema_warning_names_a_recipe_the_apex_layer_offers():
    """The recipe in the warning at the Apex door works there."""
    caught, _ = apex_run()
    for warning in caught:  # the trainable EMA's and the frozen teacher's
        message = str(warning.message)
        assert "fp32_modules" not in message and "amp.master_of" not in message, message
        assert "out of the model given to amp.initialize" in message and "amp.master_params(optimizer)" in message
