"""peft methods beyond LoRA trained through the Accelerate adapter at O1 and O2 (bfloat16), each against Accelerate's
own ``"bf16"`` and FP32 (``"no"``) at the same seed: DoRA, IA3, LoHa, LoKr, prompt tuning, prefix tuning, a
``modules_to_save=["score"]`` head on a sequence classifier, and AdaLoRA's documented loop
(``update_and_allocate`` after ``optimizer.step()``, which reads the ``lora_`` gradients and masks ``lora_E`` in
place). ``accelerator.save_model`` of a peft model at O2 (its half base). Tiny GPT-2 / Llama built from configs
(nothing downloaded), on CPU."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from safetensors.torch import load_file  # noqa: E402 - a dependency of transformers

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

HALF = torch.bfloat16
LR = 1e-2


def _gpt2(cls_name: str = "GPT2LMHeadModel") -> Any:
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0)  # fmt: skip
    return getattr(transformers, cls_name)(config)


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=16)  # fmt: skip
    return LlamaForCausalLM(config)


# method: (base model, peft config); LoHa/LoKr take nn.Linear only (GPT-2's Conv1D is refused by peft), so Llama.
METHODS: dict[str, Any] = {
    "dora": lambda: (_gpt2(), peft.LoraConfig(r=4, target_modules=["c_attn"], use_dora=True, init_lora_weights=False)),
    "ia3": lambda: (_gpt2(), peft.IA3Config(target_modules=["c_attn", "mlp.c_proj"], init_ia3_weights=False,
                                           feedforward_modules=["mlp.c_proj"])),  # fmt: skip
    "loha": lambda: (_llama(), peft.LoHaConfig(r=4, target_modules=["q_proj", "v_proj"], init_weights=False)),
    "lokr": lambda: (_llama(), peft.LoKrConfig(r=4, target_modules=["q_proj", "v_proj"], init_weights=False)),
    "prompt": lambda: (_gpt2(), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)),
    "prefix": lambda: (_gpt2(), peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)),
    "score": lambda: (_gpt2("GPT2ForSequenceClassification"),
                      peft.LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["c_attn"], modules_to_save=["score"])),
}  # fmt: skip


def _accelerator(level: str, **kwargs: Any) -> Any:
    from accelerate import Accelerator as NativeAccelerator

    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    if level in ("bf16", "no"):
        return NativeAccelerator(mixed_precision=level, cpu=True)
    return Accelerator(mixed_precision=level, kwargs_handlers=[MixedPrecisionKwargs(**{"half_dtype": HALF, **kwargs})])


def _peft(method: str) -> Any:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's notes on Conv1D's fan_in_fan_out and on the tied lm_head
        base, config = METHODS[method]()
        return peft.get_peft_model(base, config)


def _batch(method: str, step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(2, 64, (2, 6), generator=torch.Generator().manual_seed(step))
    return {"input_ids": ids, "labels": torch.tensor([step % 2, 1 - step % 2]) if method == "score" else ids}


def _weights(accelerator: Any, model: Any, trained: bool) -> dict[str, torch.Tensor]:
    """The trained (FP32: at O2 their masters) or the frozen parameters, by name."""
    amp = getattr(accelerator, "amp", None)
    o2 = trained and amp is not None and amp.opt_level == "O2"
    named = accelerator.unwrap_model(model).named_parameters()
    return {name: (amp.master_of(p) if o2 else p).detach().clone() for name, p in named if p.requires_grad == trained}


def _run(method: str, level: str, steps: int = 2) -> dict[str, Any]:
    model = _peft(method)
    accelerator = _accelerator(level)
    trained = [p for p in model.parameters() if p.requires_grad]
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(trained, lr=LR))
    start, frozen = _weights(accelerator, model, True), _weights(accelerator, model, False)
    losses = []
    for step in range(steps):
        loss = model(**_batch(method, step)).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    end = _weights(accelerator, model, True)
    return dict(losses=losses, start=start, end=end, frozen=frozen, after=_weights(accelerator, model, False))


def test_peft_methods_train_at_o1_and_o2_as_in_fp32():
    """Two AdamW steps of each method (``METHODS``) at O1 and O2 (bfloat16): FP32 losses within bfloat16's reach of
    FP32's, every adapter parameter (the virtual token embeddings, the DoRA magnitude, IA3's vectors, LoHa/LoKr's
    factors, the score head's full copy) trained in FP32 (its master at O2) to within Adam's steps of FP32's end
    point, the frozen base unchanged (half at O2), nothing non-finite. (Accelerate's ``"bf16"`` lands as close: its
    figures are in the stop's notes; the AdaLoRA test below runs it.)"""
    for method in METHODS:
        runs = {level: _run(method, level) for level in ("no", "O1", "O2")}
        reference = runs["no"]
        assert reference["end"] and all(not torch.equal(v, reference["start"][n]) for n, v in reference["end"].items())
        for level in ("O1", "O2"):
            run = runs[level]
            for ours, fp32 in zip(run["losses"], reference["losses"]):
                assert ours.dtype == torch.float32 and torch.isfinite(ours), (method, level, ours)
                assert abs(ours.item() - fp32.item()) < 5e-3 * max(1.0, abs(fp32.item())), (method, level, ours, fp32)
            assert set(run["end"]) == set(reference["end"]), (method, level)
            for name, value in run["end"].items():
                assert value.dtype == torch.float32 and torch.isfinite(value).all(), (method, level, name)
                assert not torch.equal(value, run["start"][name]), (method, level, name)  # trained
                assert (value - reference["end"][name]).abs().max() <= 3 * LR, (method, level, name)
            for name, value in run["frozen"].items():
                assert torch.equal(run["after"][name], value), (method, level, name)  # frozen and unchanged
        assert {v.dtype for v in runs["O2"]["frozen"].values()} == {HALF}, method  # O2 made the base half


def _adalora(level: str, steps: int = 5, **kwargs: Any) -> dict[str, Any]:
    """AdaLoRA's documented loop: ``update_and_allocate(step)`` after ``optimizer.step()``, before ``zero_grad()``.
    Budget 12 -> 4 ranks over q_proj and v_proj: scores from step 0, a mask at step 2, the final mask at step 3."""
    torch.manual_seed(0)
    config = peft.AdaLoraConfig(init_r=6, target_r=2, target_modules=["q_proj", "v_proj"], total_step=steps,
                                tinit=1, tfinal=2, deltaT=1)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(_llama(), config)
    accelerator = _accelerator(level, **kwargs)
    trained = [p for p in model.parameters() if p.requires_grad]
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(trained, lr=LR))
    inner = accelerator.unwrap_model(model)
    amp = getattr(accelerator, "amp", None)
    lora_e = {n: p for n, p in inner.named_parameters() if "lora_E" in n}
    first_a = next(p for n, p in inner.named_parameters() if "lora_A" in n)
    losses, stepped, grads = [], [], []
    for step in range(steps):
        loss = model(**_batch("adalora", step)).loss
        accelerator.backward(loss)
        optimizer.step()
        grads.append(first_a.grad.detach().float().clone())  # what update_and_allocate reads next
        # The values the step produced (at O2 the masters'): a mask the masters missed shows here, at the next step.
        stepped.append({n: (amp.master_of(p) if amp and amp.opt_level == "O2" else p).detach().float().clone()
                        for n, p in lora_e.items()})  # fmt: skip
        inner.base_model.update_and_allocate(step)
        optimizer.zero_grad()
        losses.append(loss.detach())
    held = {n: p.detach().float().clone() for n, p in lora_e.items()}
    masters = {n: amp.master_of(p) for n, p in lora_e.items()} if amp and amp.opt_level == "O2" else held
    pattern = inner.peft_config["default"].rank_pattern
    return dict(losses=losses, stepped=stepped, grads=grads, held=held, masters=masters, pattern=pattern)


def test_adalora_update_and_allocate_at_o2_masks_the_ranks_fp32_and_bf16_mask():
    """AdaLoRA at O2 (bfloat16): ``update_and_allocate`` reads the half ``lora_`` parameters' ``.grad`` after the
    step (bfloat16, at bfloat16's scale of 1.0: the true gradients' rounding, not None, not the masters') and
    ``masked_fill_``s the half ``lora_E`` in place; the masters take those writes before the next step (the values
    each step produces are FP32's, a masked rank restarting from 0), so the rank pattern, the masked entries (zero in
    the masters and in the model) and the losses are FP32's and ``"bf16"``'s."""
    runs = {level: _adalora(level) for level in ("no", "bf16", "O2")}
    reference = runs["no"]
    kept = sum(sum(ranks) for ranks in reference["pattern"].values())
    assert kept == 4 and len(reference["pattern"]) == 2  # the masking happened: 8 of 12 ranks masked
    for level in ("bf16", "O2"):
        run = runs[level]
        assert run["pattern"] == reference["pattern"], level
        for ours, fp32 in zip(run["losses"], reference["losses"]):
            assert ours.dtype == torch.float32 and abs(ours.item() - fp32.item()) < 5e-3 * fp32.item(), (level, ours)
        for ours, fp32 in zip(run["grads"], reference["grads"]):
            assert (ours - fp32).abs().max() <= 0.1 * fp32.abs().max() + 1e-9, level  # bfloat16 compute, scale 1
        for ours, fp32 in zip(run["stepped"], reference["stepped"]):
            for name in fp32:
                assert (ours[name] - fp32[name]).abs().max() <= 3 * LR, (level, name)
        for name, ranks in reference["pattern"].items():
            masked, name = ~torch.tensor(ranks), f"base_model.model.{name}"
            # the step after the final mask (step 3) starts a masked rank from 0: Adam moves it by about LR at most
            assert run["stepped"][4][name].view(-1)[masked].abs().max() <= 1.1 * LR, (level, name)
            for values in (run["held"][name], run["masters"][name]):
                assert torch.equal(values.view(-1)[masked], torch.zeros(int(masked.sum()))), (level, name)
            assert run["masters"][name].dtype == torch.float32, (level, name)


def test_adalora_at_o2_float16_with_a_changing_loss_scale_masks_the_ranks_fp32_masks():
    """AdaLoRA at O2 float16, the scale starting at 2 and doubling every step: the final budget (4 of 12 ranks kept,
    FP32's count, whatever the scores: the test above) is kept. (A strict xfail until stop 63: the float16 scores of
    the scaled half gradients tied at zero and masked all 12; tests/test_core_peft_merges.py.)"""
    pattern = _adalora("O2", half_dtype=torch.float16, init_scale=2.0, growth_interval=1)["pattern"]
    assert sum(sum(ranks) for ranks in pattern.values()) == 4


def test_save_model_of_a_peft_model_at_o2_writes_fp32_adapters_and_warns_about_its_half_base(tmp_path: Path):
    """``accelerator.save_model(peft_model)`` writes the whole model. Accelerate's ``"bf16"`` writes it all in FP32;
    at O2 the adapters (DoRA's magnitude too) are their FP32 masters, the same keys, but the frozen base is its
    bfloat16 rounding: it now says so, naming the base and the adapter route (``get_state_dict`` alone, the peft
    ``save_pretrained(state_dict=...)`` habit that keeps only the adapters, still does not warn)."""
    saved = {}
    for level in ("bf16", "O2"):
        model = _peft("dora")
        accelerator = _accelerator(level)
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=LR))  # fmt: skip
        accelerator.backward(model(**_batch("dora", 0)).loss)
        optimizer.step()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            accelerator.get_state_dict(model)
        if level == "O2":
            with pytest.warns(UserWarning, match=r"save_model at O2 exports \d+ frozen parameter.*base_model\.model"
                                                 r".*PeftModel\.from_pretrained"):  # fmt: skip
                accelerator.save_model(model, tmp_path / level)
        else:
            accelerator.save_model(model, tmp_path / level)
        saved[level] = load_file(tmp_path / level / "model.safetensors")
    assert set(saved["O2"]) == set(saved["bf16"])
    adapters = [key for key in saved["O2"] if "lora_" in key]
    assert len(adapters) == 3 and all(saved["O2"][key].dtype == torch.float32 for key in adapters)
    assert {saved["bf16"][key].dtype for key in saved["bf16"]} == {torch.float32}
    assert {saved["O2"][key].dtype for key in saved["O2"] if key not in adapters} == {HALF}
