"""A hostile Hugging Face user of ``lightning_mpx.accelerate.Accelerator(mixed_precision="O1"/"O2"/"O3")``, each run
held to Accelerate's own ``Accelerator(mixed_precision="bf16")`` (or to the straight run it resumes): the
``accumulate`` loop with ``clip_grad_norm_`` only when ``sync_gradients`` and a scheduler prepared with
``step_scheduler_with_optimizer``; ``save_state`` before the first step, a registered object and a
``skip_first_batches`` resume; T5 (labels with -100) built from a config; and what an O2 export (``get_state_dict``,
``save_model``, the Trainer's ``save_model()``) says about the frozen parameters it holds in bfloat16. Tiny models,
CPU, bfloat16."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
import safetensors.torch as safetensors_torch  # noqa: E402 - a dependency of transformers

from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs, mpx_trainer  # noqa: E402
from tests.accelerate_helpers import reset_accelerate_state  # noqa: E402
from tests.test_hf_trainer import GPT2, SCALED, lm_data  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

transformers.logging.set_verbosity_error()

BF16 = MixedPrecisionKwargs(half_dtype="bfloat16")
LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
FROZEN_WARNING = r"frozen parameter.*'model\.embed_tokens\.weight'.*fp32_modules=\['model\.embed_tokens'\]"


def _accelerator(mp: str, *, kwargs: MixedPrecisionKwargs = BF16, **options: Any) -> Any:
    """Accelerate's own ``Accelerator`` for its native modes, lightning_mpx's for an opt level; fresh state."""
    reset_accelerate_state()
    if mp.startswith("O"):
        return Accelerator(mixed_precision=mp, cpu=True, kwargs_handlers=[kwargs], **options)
    return accelerate.Accelerator(mixed_precision=mp, cpu=True, **options)


def _mlp_run(mp: str) -> tuple[Any, ...]:
    """The ``accumulate`` loop of the docs on a small MLP: accumulation 2, clip on sync steps only, a scheduler
    stepped with the optimizer. Returns the FP32 weights, the clip norms, the last learning rate and the skip flags."""
    acc = _accelerator(mp, gradient_accumulation_steps=2, step_scheduler_with_optimizer=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g))
    model, opt, loader, sched = acc.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=4), sched)
    norms, skipped = [], []
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(F.cross_entropy(model(x), y))
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), 1.0)))
            opt.step()
            sched.step()
            opt.zero_grad()
            skipped.append(acc.optimizer_step_was_skipped)
    weights = {k: v.detach().float().clone() for k, v in acc.get_state_dict(model).items()}
    return weights, norms, sched.get_last_lr(), skipped


def test_accumulate_clip_on_sync_and_a_scheduler_stepped_with_the_optimizer_follow_accelerate_bf16():
    level = "O2"
    ref_weights, ref_norms, ref_lr, ref_skipped = _mlp_run("bf16")
    weights, norms, lr, skipped = _mlp_run(level)
    assert len(norms) == len(ref_norms) == 4 and lr == ref_lr and skipped == ref_skipped == [False] * 8
    assert norms == pytest.approx(ref_norms, rel=5e-3)  # the true (unscaled) norm, once per window
    assert weights.keys() == ref_weights.keys() and all(w.dtype == torch.float32 for w in weights.values())
    assert max((weights[k] - ref_weights[k]).abs().max().item() for k in weights) <= 1e-4


class _Counter:
    """A custom object registered for checkpointing (``register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def _resumable(level: str) -> tuple[Any, ...]:
    acc = _accelerator(level, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g), torch.randint(0, 4, (32,), generator=g))
    counter = _Counter()
    acc.register_for_checkpointing(counter)
    prepared = acc.prepare(model, opt, torch.utils.data.DataLoader(data, batch_size=4), sched)
    return (acc, *prepared, counter)


def _train(acc, model, opt, loader, sched, counter, skip=0, stop=None, save=None) -> dict[str, torch.Tensor] | None:
    for i, (x, y) in enumerate(acc.skip_first_batches(loader, skip) if skip else loader, start=skip):
        if i == stop:
            acc.save_state(save)
            return None
        with acc.accumulate(model):
            acc.backward(F.cross_entropy(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
            counter.n += 1
    return {k: v.detach().float().clone() for k, v in acc.get_state_dict(model).items()}


@pytest.mark.parametrize(("level", "stop"), [("O2", 0), ("O3", 4)], ids=["O2-before-the-first-step", "O3-at-a-window"])
def test_save_state_with_a_registered_object_resumes_through_skip_first_batches_bit_for_bit(tmp_path, level, stop):
    straight = _train(*_resumable(level))
    _train(*_resumable(level), stop=stop, save=str(tmp_path))
    acc, *rest = _resumable(level)
    acc.load_state(str(tmp_path))
    assert rest[-1].n == stop  # the registered object came back
    resumed = _train(acc, *rest, skip=stop)
    assert resumed.keys() == straight.keys() and all(torch.equal(resumed[k], straight[k]) for k in straight)


def _t5() -> Any:
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def _lora_llama_checkpointed() -> Any:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    model.gradient_checkpointing_enable()
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(model, config)


def _hf_batches(kind: str) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(2):
        ids = torch.randint(1, 64, (2, 12), generator=g)
        if kind == "t5":
            labels = torch.randint(1, 64, (2, 6), generator=g)
            labels[:, 4:] = -100  # padding left out of the loss
            out.append(dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels))
        else:
            out.append(dict(input_ids=ids, labels=ids))
    return out


def test_t5_with_ignored_labels_at_o2_follows_accelerate_bf16():
    kind, level, make = "t5", "O2", _t5
    losses = {}
    for mp in ("bf16", level):
        acc = _accelerator(mp)
        model = make()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        model, opt = acc.prepare(model, opt)
        losses[mp] = []
        for batch in _hf_batches(kind):
            out = model(**batch)
            assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
            acc.backward(out.loss)
            opt.step()
            opt.zero_grad()
            losses[mp].append(out.loss.item())
        assert not acc.optimizer_step_was_skipped
    assert losses[level] == pytest.approx(losses["bf16"], abs=5e-3)


def _llama_frozen_embeddings(level: str, kwargs: MixedPrecisionKwargs = BF16) -> tuple[Any, Any, torch.Tensor]:
    """A Llama whose input embeddings are frozen (a common fine-tuning habit), trained 2 steps; and their values."""
    acc = _accelerator(level, kwargs=kwargs)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    model.model.embed_tokens.weight.requires_grad_(False)
    initial = model.model.embed_tokens.weight.detach().clone()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, opt = acc.prepare(model, opt)
    for batch in _hf_batches("llama"):
        acc.backward(model(**batch).loss)
        opt.step()
        opt.zero_grad()
    return acc, model, initial


def test_o2_export_of_frozen_half_parameters_warns_naming_them_and_the_workaround(tmp_path):
    """At O2 a frozen parameter is held in bfloat16 without an FP32 copy (a LoRA base must not double its memory):
    ``get_state_dict``/``save_model`` exported its bfloat16 rounding in place of the FP32 values Accelerate's own
    ``"bf16"`` exports, without a word. The export now warns, naming the parameters and ``fp32_modules``; following
    that advice exports them exactly. ``save_state`` (which resumes exactly) and a peft model's export do not warn."""
    acc, model, initial = _llama_frozen_embeddings("O2")
    with pytest.warns(UserWarning, match=FROZEN_WARNING):
        state = acc.get_state_dict(model)
    assert state["model.embed_tokens.weight"].dtype == torch.bfloat16  # what the warning says
    assert state["model.layers.0.mlp.up_proj.weight"].dtype == torch.float32  # a trained one: its FP32 master
    with pytest.warns(UserWarning, match=FROZEN_WARNING):
        acc.save_model(model, str(tmp_path / "export"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc.save_state(str(tmp_path / "state"))

    kept = MixedPrecisionKwargs(half_dtype="bfloat16", fp32_modules=["model.embed_tokens"])
    acc, model, initial = _llama_frozen_embeddings("O2", kept)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc.save_model(model, str(tmp_path / "kept"))
    saved = safetensors_torch.load_file(str(tmp_path / "kept" / "model.safetensors"))
    assert torch.equal(saved["model.embed_tokens.weight"], initial)

    acc = _accelerator("O2")
    lora = _lora_llama_checkpointed()
    lora, opt = acc.prepare(lora, torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        acc.get_state_dict(lora)  # the peft no_trainer habit: save_pretrained keeps the adapters of it


def test_trainer_save_model_of_frozen_half_parameters_warns_and_fp32_modules_keeps_them(tmp_path):
    """``transformers.Trainer`` via the mixin, a GPT-2 with frozen position embeddings at O2: ``save_model()`` wrote
    their bfloat16 rounding under a ``config.json`` saying float32 without a word. It now warns, naming them and
    ``fp32_modules``; with ``fp32_modules=["transformer.wpe"]`` they are exported exactly, without a warning."""
    results = {}
    for name, kwargs in (("default", SCALED), ("kept", dataclasses.replace(SCALED, fp32_modules=["transformer.wpe"]))):
        reset_accelerate_state()
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(GPT2)
        model.transformer.wpe.weight.requires_grad_(False)
        initial = model.transformer.wpe.weight.detach().clone()
        args = transformers.TrainingArguments(output_dir=str(tmp_path / name), use_cpu=True, report_to=[],
                                              max_steps=1, per_device_train_batch_size=4, save_strategy="no",
                                              disable_tqdm=True)  # fmt: skip
        trainer = mpx_trainer()(model=model, args=args, train_dataset=lm_data(4), opt_level="O2", mpx_kwargs=kwargs)
        trainer.train()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.save_model(str(tmp_path / name / "final"))
        final = Path(tmp_path / name / "final")
        saved = safetensors_torch.load_file(str(final / "model.safetensors"))["transformer.wpe.weight"]
        messages = [str(w.message) for w in caught if "frozen parameter" in str(w.message)]
        results[name] = messages, saved, initial, json.loads((final / "config.json").read_text())["dtype"]
    messages, saved, initial, dtype = results["default"]
    assert len(messages) == 1 and "save_model()" in messages[0] and "'transformer.wpe.weight'" in messages[0]
    assert "fp32_modules=['transformer.wpe']" in messages[0]
    assert saved.dtype == torch.bfloat16 and torch.equal(saved, initial.to(torch.bfloat16)) and dtype == "float32"
    messages, saved, initial, dtype = results["kept"]
    assert messages == [] and torch.equal(saved, initial) and dtype == "float32"


def test_accelerates_autocast_kwargs_with_an_opt_level_are_refused_naming_what_takes_their_place():
    """``Accelerator(mixed_precision="O1", kwargs_handlers=[AutocastKwargs(cache_enabled=True)])`` (a habit from
    Accelerate's own modes) was refused with "pass the loss-scaler settings in MixedPrecisionKwargs instead", which
    AutocastKwargs are not. The refusal now names the handler and what takes its place for each kind."""
    from accelerate.utils import AutocastKwargs, GradScalerKwargs

    reset_accelerate_state()
    refused = r"AutocastKwargs\(.*cache_enabled=True.*cast_table=.*disable_casts\(\)"
    with pytest.raises(ValueError, match=refused) as err:
        Accelerator(mixed_precision="O1", cpu=True, kwargs_handlers=[AutocastKwargs(cache_enabled=True)])
    assert "loss-scaler" not in str(err.value)
    reset_accelerate_state()
    with pytest.raises(ValueError, match=r"GradScalerKwargs\(init_scale=8\.0.*MixedPrecisionKwargs instead"):
        Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=[GradScalerKwargs(init_scale=8.0)])
