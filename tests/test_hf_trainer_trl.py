"""TRL's ``SFTTrainer`` and ``DPOTrainer`` through the ``transformers.Trainer`` door (``mpx_trainer(SFTTrainer)``) at
O1/O2 bfloat16, each held to the same trainer with TRL's own ``bf16=True`` and in FP32 at the same seed: SFT of a full
model (pre-tokenized, packed) and of a LoRA (TRL applies peft in its constructor, before the door prepares the model;
prompt-completion data with ``completion_only_loss``, gradient checkpointing), exported and reloaded in FP32; DPO with
an explicit ``ref_model`` (TRL prepares it for evaluation: half at O2, never stepped, no masters) and with a LoRA's
implicit reference (adapters disabled). TRL's configs turn ``bf16`` on when it is left unset: the door's refusal says
to pass ``bf16=False``. Tiny Llama built from a config, a WordLevel tokenizer built here (nothing downloaded), CPU.
Skipped without trl (not a dev dependency)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

trl = pytest.importorskip("trl")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import datasets  # noqa: E402 - a dependency of trl

from lightning_mpx.accelerate import MixedPrecisionKwargs, mpx_trainer  # noqa: E402
from tests.accelerate_helpers import accelerate_state_reset  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

transformers.logging.set_verbosity_error()
LLAMA = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
             vocab_size=128, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=1)  # fmt: skip
# "bf16": TRL's own mixed precision (bf16=True); "fp32": bf16=False; O1/O2: the door in bfloat16.
LEVELS = ("fp32", "bf16", "O2")


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2, **{f"w{i}": i + 3 for i in range(125)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]",
                                                unk_token="[UNK]")  # fmt: skip


def _model() -> Any:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


def _words(gen: torch.Generator, n: int) -> str:
    return " ".join(f"w{int(i)}" for i in torch.randint(0, 125, (n,), generator=gen))


def _data(kind: str) -> Any:
    gen = torch.Generator().manual_seed(1)
    if kind == "ids":  # pre-tokenized, no tokenizer needed for the data
        columns = {"input_ids": [torch.randint(3, 128, (10,), generator=gen).tolist() for _ in range(12)]}
    elif kind == "completion":
        columns = {"prompt": [_words(gen, 6) for _ in range(12)], "completion": [_words(gen, 6) for _ in range(12)]}
    else:  # preference pairs
        columns = {key: [_words(gen, 5) for _ in range(8)] for key in ("prompt", "chosen", "rejected")}
    return datasets.Dataset.from_dict(columns)


def _lora() -> Any:
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def _train(out: Path, level: str, dpo: bool, data: str, save: bool = False, **extra: Any) -> tuple[Any, list, dict]:
    """Train 3 steps; the trainer, its training logs and its FP32 weights (the masters at O2) (``save``:
    ``save_model(out / "export")`` after training)."""
    common = dict(output_dir=str(out / level), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
                  logging_steps=1, report_to=[], disable_tqdm=True, save_strategy="no", use_cpu=True, seed=0,
                  bf16=level == "bf16", max_length=32, gradient_checkpointing=False)  # fmt: skip
    peft_config = extra.pop("peft_config", None)
    ref_model = extra.pop("ref_model", None)
    if dpo:
        cls, args = trl.DPOTrainer, trl.DPOConfig(beta=0.1, **{**common, **extra})
        made: dict[str, Any] = {} if ref_model is None else {"ref_model": ref_model}
    else:
        cls, args, made = trl.SFTTrainer, trl.SFTConfig(**{**common, **extra}), {}
    if level in ("O1", "O2"):
        cls = mpx_trainer(cls)
        made.update(opt_level=level, mpx_kwargs=MixedPrecisionKwargs(half_dtype="bfloat16"))
    with accelerate_state_reset():
        tr = cls(model=_model(), args=args, train_dataset=_data(data), processing_class=_tokenizer(),
                 peft_config=peft_config, **made)  # fmt: skip
        tr.train()
        if save:
            tr.save_model(str(out / "export"))
        weights = {k: v.detach().clone() for k, v in tr.accelerator.get_state_dict(tr.model).items()}
    return tr, [log for log in tr.state.log_history if "loss" in log], weights


def _near(runs: dict[str, list[dict[str, float]]], key: str, tol: float, level: str = "O2") -> None:
    """``level``'s logged ``key`` within ``tol`` of FP32's and of ``bf16=True``'s at every step."""
    ours = [log[key] for log in runs[level]]
    assert len(ours) == 3
    for ref in ("fp32", "bf16"):
        assert ours == pytest.approx([log[key] for log in runs[ref]], abs=tol), (key, ref)


def test_trl_configs_default_bf16_refusal_says_pass_bf16_false(tmp_path):
    """``SFTConfig(output_dir=...)`` sets ``bf16=True`` itself (TRL's default when ``fp16`` is unset): the door
    refuses the two mixed precisions, and its message says to pass ``bf16=False``, not only to "drop" a flag the
    user never wrote."""
    args = trl.SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert args.bf16 is True
    with pytest.raises(ValueError, match=r"SFTConfig sets bf16=True when it is left unset .*bf16=False"):
        mpx_trainer(trl.SFTTrainer)(model=_model(), args=args, train_dataset=_data("ids"),
                                    processing_class=_tokenizer(), opt_level="O2")  # fmt: skip


def test_sft_packed_full_model_o2_follows_bf16_and_exports_fp32(tmp_path):
    """Pre-tokenized data packed (``packing=True``, TRL's padding-free batches), 2 accumulated micro-batches (TRL's
    ``compute_loss`` divides by ``num_items_in_batch``, the Trainer then does not by the accumulation): O2's loss and
    ``grad_norm`` follow FP32's and ``bf16=True``'s; ``save_model()`` writes the FP32 masters, ``from_pretrained``
    reloads them exactly in FP32."""
    habits = dict(packing=True, per_device_train_batch_size=1, gradient_accumulation_steps=2)
    runs = {level: _train(tmp_path, level, dpo=False, data="ids", save=level == "O2", **habits) for level in LEVELS}
    logs = {k: v[1] for k, v in runs.items()}
    _near(logs, "loss", 5e-3)  # measured 6e-4
    _near(logs, "grad_norm", 2e-2)  # measured 8e-4 (norms 0.6); a loss divided twice: half
    tr = runs["O2"][0]
    assert {p.dtype for p in tr.model.parameters()} == {torch.bfloat16}
    back = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "export"))
    assert back.dtype == torch.float32
    fp32 = runs["O2"][2]
    for name, value in back.state_dict().items():
        assert torch.equal(value, fp32[name]), name


def test_sft_lora_completion_only_checkpointed_o2_trains_adapters_only(tmp_path):
    """``peft_config=LoraConfig`` (TRL wraps the model before the door prepares it), prompt-completion data with
    ``completion_only_loss=True`` and ``gradient_checkpointing=True``: O2's loss follows FP32's and ``bf16=True``'s,
    only the adapters train (the frozen base is its FP32 values' bfloat16 rounding, unmoved), and the saved adapter
    reloads in FP32 equal to the trained masters."""
    habits = dict(completion_only_loss=True, gradient_checkpointing=True, peft_config=_lora())
    runs = {
        level: _train(tmp_path, level, dpo=False, data="completion", save=level == "O2", **habits) for level in LEVELS
    }
    _near({k: v[1] for k, v in runs.items()}, "loss", 5e-3)  # measured 1e-4
    tr = runs["O2"][0]
    model = tr.accelerator.unwrap_model(tr.model)
    initial = _model().state_dict()
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in name for name in trained)
    for name, p in model.named_parameters():
        if "lora_" not in name:
            key = name.replace("base_model.model.", "").replace(".base_layer", "")
            assert torch.equal(p, initial[key].to(torch.bfloat16)), name
    fp32 = runs["O2"][2]
    assert any(fp32[name].abs().max() > 0 for name in trained if "lora_B" in name)  # lora_B starts at zero
    back = peft.PeftModel.from_pretrained(_model(), str(tmp_path / "export"))
    loaded = {name: p for name, p in back.named_parameters() if "lora_" in name}
    assert len(loaded) == len(trained)
    for name, value in loaded.items():
        assert value.dtype == torch.float32 and torch.equal(value, fp32[name]), name


def test_dpo_explicit_ref_model_o2_is_half_never_stepped_rewards_follow_bf16(tmp_path):
    """``DPOTrainer(ref_model=...)``: TRL prepares the reference for evaluation; at O2 it is bfloat16 (the rounding
    of its FP32 weights, as the door's evaluation-only models are), gets no masters, is in no optimizer and never
    moves; the DPO loss, ``rewards/chosen`` and ``rewards/margins`` follow FP32's and ``bf16=True``'s."""
    runs = {level: _train(tmp_path, level, dpo=True, data="pairs", ref_model=_model()) for level in LEVELS}
    logs = {k: v[1] for k, v in runs.items()}
    _near(logs, "loss", 5e-3)  # measured 7e-4
    _near(logs, "rewards/chosen", 5e-3)  # measured 1.1e-3 (rewards reach 0.14)
    _near(logs, "rewards/margins", 5e-3)  # measured 2.6e-3 (margins reach 0.28)
    assert logs["O2"][-1]["rewards/margins"] > 0.2  # trained against a reference that stays put
    tr = runs["O2"][0]
    initial = _model().state_dict()
    for name, p in tr.ref_model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, initial[name].to(torch.bfloat16)), name
    held = {id(p) for group in tr.optimizer.param_groups for p in group["params"]}
    assert not any(id(p) in held for p in tr.ref_model.parameters())
    assert len(tr.accelerator.amp._masters.weights) == 1  # the policy's; none for the reference


@pytest.mark.parametrize("level", ["O1"])
def test_dpo_lora_implicit_reference_follows_bf16(tmp_path, level):
    """A LoRA policy without ``ref_model``: TRL's reference pass disables the adapters. At O1 (O2 measured alike; its
    test above has an explicit reference) the DPO loss and rewards follow FP32's and ``bf16=True``'s; the first
    step's rewards are 0 (policy = reference)."""
    runs = {lv: _train(tmp_path, lv, dpo=True, data="pairs", peft_config=_lora()) for lv in ("fp32", "bf16", level)}
    logs = {k: v[1] for k, v in runs.items()}
    for key in ("loss", "rewards/chosen", "rewards/margins"):
        _near(logs, key, 2e-3, level=level)  # measured 3e-4
    assert logs[level][0]["rewards/margins"] == 0.0 and logs[level][-1]["rewards/margins"] > 0.005
