"""A LoRA user around O2 training through the Accelerate adapter, each against Accelerate's own ``"bf16"`` (or FP32)
on the same code: adapters of DoRA, ``nn.Embedding`` LoRA and ``modules_to_save=["lm_head"]`` saved by
``save_pretrained`` (the FP32 masters, reloaded in FP32), ``merge_and_unload`` (into the half base) and the FP32 merge
recipe, ``disable_adapter()`` as a DPO-like reference inside a training step at O1/O2, a second adapter added after
``prepare`` (``add_adapter``/``set_adapter``), one frozen at ``prepare`` and switched to, ``get_peft_model``
applied to a model already prepared, and ``load_adapter`` into the prepared model mid-training. Tiny GPT-2 built
from a config (nothing downloaded), bfloat16, on CPU."""

from __future__ import annotations

import json
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
ADAM = 3 * 2 * LR  # Adam's first steps move each entry by about the learning rate: a sign flip near 0 is 2 * LR


def _gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(config)


def _lora(**extra: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's notes on Conv1D's fan_in_fan_out and on the tied lm_head
        return peft.get_peft_model(_gpt2(), _config(**extra))


def _config(**extra: Any) -> Any:
    return peft.LoraConfig(**{"r": 4, "target_modules": ["c_attn"], "init_lora_weights": False, **extra})


def _accelerator(level: str) -> Any:
    from accelerate import Accelerator as NativeAccelerator

    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    if level in ("bf16", "no"):
        return NativeAccelerator(mixed_precision=level, cpu=True)
    return Accelerator(mixed_precision=level, kwargs_handlers=[MixedPrecisionKwargs(half_dtype=HALF)])


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(2, 32, (2, 6), generator=torch.Generator().manual_seed(seed))


def _train(accelerator: Any, model: Any, optimizer: Any, seeds: range) -> float:
    for seed in seeds:
        ids = _ids(seed)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return loss.item()


def _prepared(level: str, model: Any) -> tuple[Any, Any, Any]:
    accelerator = _accelerator(level)
    trained = [p for p in model.parameters() if p.requires_grad]
    prepared, optimizer = accelerator.prepare(model, torch.optim.AdamW(trained, lr=LR))
    return accelerator, prepared, optimizer


def test_o2_dora_embedding_and_modules_to_save_adapters_save_as_their_masters_and_reload_in_fp32(tmp_path: Path):
    """DoRA on ``c_attn``, LoRA on the tied ``nn.Embedding`` ``wte`` and a trained full copy of ``lm_head``
    (``modules_to_save``): after three O2 steps ``save_pretrained`` writes every entry as its FP32 master exactly (the
    magnitude vector and the lm_head copy included), the same keys and ``adapter_config.json`` as Accelerate's
    ``"bf16"``, values within the steps' reach of its; ``PeftModel.from_pretrained`` on an FP32 base loads the
    masters."""
    extra: dict[str, Any] = dict(use_dora=True, modules_to_save=["lm_head"])
    saved, configs = {}, {}
    for level in ("bf16", "O2"):
        accelerator, model, optimizer = _prepared(level, _lora(**extra, target_modules=["c_attn", "wte"]))
        _train(accelerator, model, optimizer, range(3))
        inner = accelerator.unwrap_model(model)
        inner.save_pretrained(tmp_path / level)
        saved[level] = load_file(tmp_path / level / "adapter_model.safetensors")
        configs[level] = json.loads((tmp_path / level / "adapter_config.json").read_text())
    trained = {name: p for name, p in inner.named_parameters() if p.requires_grad}
    assert len(trained) == len(saved["O2"]) == 7 and {p.dtype for p in trained.values()} == {HALF}
    assert set(saved["O2"]) == set(saved["bf16"]) and configs["O2"] == configs["bf16"]
    assert configs["O2"]["use_dora"] and configs["O2"]["modules_to_save"] == ["lm_head"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = dict(peft.PeftModel.from_pretrained(_gpt2(), tmp_path / "O2").named_parameters())
    for name, param in trained.items():
        master = accelerator.amp.master_of(param)
        assert master.dtype == torch.float32 and torch.equal(reloaded[name], master), name
    for key, value in saved["O2"].items():
        assert value.dtype == torch.float32 and any(torch.equal(value, accelerator.amp.master_of(p))
                                                    for p in trained.values()), key  # fmt: skip
        assert (value - saved["bf16"][key]).abs().max() <= ADAM, key


def _merged_c_attn(model: Any) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.merge_and_unload().transformer.h[0].attn.c_attn.weight.detach()


def test_merge_and_unload_after_o2_gives_the_half_model_and_the_fp32_merge_goes_through_the_saved_adapter(tmp_path):
    """``merge_and_unload()`` on the model trained at O2 merges into its half base (O2 keeps no FP32 copy of a frozen
    base): a bfloat16 model, and its ``save_pretrained`` writes bfloat16 weights under a ``config.json`` that says so.
    The FP32 merge (Accelerate's ``"bf16"`` gives one) goes through the saved adapter: loaded onto the FP32 base and
    merged, it is the FP32 base plus the delta of the masters, close to ``"bf16"``'s merge."""
    merged = {}
    for level in ("bf16", "O2"):
        accelerator, model, optimizer = _prepared(level, _lora())
        _train(accelerator, model, optimizer, range(3))
        inner = accelerator.unwrap_model(model)
        inner.save_pretrained(tmp_path / "adapter" / level)
        layer = inner.base_model.model.transformer.h[0].attn.c_attn
        a, b = (accelerator.amp.master_of(x.default.weight) if level == "O2" else x.default.weight.detach()
                for x in (layer.lora_A, layer.lora_B))  # fmt: skip
        delta = (b @ a * layer.scaling["default"]).T  # Conv1D: fan_in_fan_out
        merged[level] = _merged_c_attn(inner)
        inner.base_model.model.save_pretrained(tmp_path / "merged" / level)
    assert merged["bf16"].dtype == torch.float32 and merged["O2"].dtype == HALF
    assert json.loads((tmp_path / "merged" / "O2" / "config.json").read_text())["dtype"] == "bfloat16"
    assert {v.dtype for v in load_file(tmp_path / "merged" / "O2" / "model.safetensors").values()} == {HALF}
    exact = _gpt2().transformer.h[0].attn.c_attn.weight.detach() + delta  # the FP32 base and the masters' delta
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp32 = _merged_c_attn(peft.PeftModel.from_pretrained(_gpt2(), tmp_path / "adapter" / "O2"))
    assert fp32.dtype == torch.float32 and torch.allclose(fp32, exact, rtol=0, atol=1e-6)
    assert (fp32 - merged["bf16"]).abs().max() <= 0.05  # three Adam steps of A and B each way (r=4, scaling 2)
    ulp = exact.abs().max().item() * 2.0**-8  # bfloat16's spacing at the largest entry
    assert (merged["O2"].float() - exact).abs().max() <= 3 * ulp  # the half model: the base's rounding and the sum's


def test_merge_and_unload_at_o2_is_the_rounding_of_the_half_base_plus_the_masters_delta():
    accelerator, model, optimizer = _prepared("O2", _lora())
    _train(accelerator, model, optimizer, range(3))
    layer = accelerator.unwrap_model(model).base_model.model.transformer.h[0].attn.c_attn
    a, b = (accelerator.amp.master_of(x.default.weight) for x in (layer.lora_A, layer.lora_B))
    best = (layer.base_layer.weight.float() + (b @ a * layer.scaling["default"]).T).to(HALF)
    assert torch.equal(_merged_c_attn(accelerator.unwrap_model(model)), best)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_disable_adapter_gives_the_reference_logits_of_a_dpo_like_step_as_bf16(level: str):
    """A DPO-like step: the reference logits under ``disable_adapter()`` and ``no_grad``, the policy's with the
    adapter, a loss of both; three steps give Accelerate's ``"bf16"`` losses and adapters to bfloat16's tolerance."""

    def run(level: str) -> tuple[list[float], list[torch.Tensor]]:
        accelerator, model, optimizer = _prepared(level, _lora())
        inner, losses = accelerator.unwrap_model(model), []
        for seed in range(3):
            ids = _ids(seed)
            with torch.no_grad(), inner.disable_adapter():
                reference = model(input_ids=ids).logits
            policy = model(input_ids=ids, labels=ids)
            assert reference.dtype == policy.logits.dtype == torch.float32
            loss = policy.loss + (policy.logits - reference).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        weights = accelerator.get_state_dict(model)
        return losses, [weights[k].float() for k in sorted(weights) if ".lora_" in k]

    (losses, adapters), (ref_losses, ref_adapters) = run(level), run("bf16")
    assert len(adapters) == 2 and {a.dtype for a in adapters} == {torch.float32}
    assert losses == pytest.approx(ref_losses, abs=5e-3)
    assert all((a - r).abs().max() <= ADAM for a, r in zip(adapters, ref_adapters, strict=True))


def test_a_second_adapter_added_after_prepare_trains_from_its_fp32_init_as_under_bf16():
    """``add_adapter`` on the prepared model mid-training, ``set_adapter`` to it and
    ``optimizer.add_param_group``: at O2 its parameters join the half model with FP32 masters from their FP32 init,
    and two steps move it as Accelerate's ``"bf16"`` does (nothing warned: nothing was lost)."""
    results = {}
    for level in ("bf16", "O2"):
        accelerator, model, optimizer = _prepared(level, _lora())
        _train(accelerator, model, optimizer, range(2))
        inner = accelerator.unwrap_model(model)
        torch.manual_seed(7)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            inner.add_adapter("second", _config())
            inner.set_adapter("second")
            init = {n: p.detach().clone() for n, p in inner.named_parameters() if ".second." in n}
            optimizer.add_param_group({"params": [p for n, p in inner.named_parameters() if ".second." in n]})
            loss = _train(accelerator, model, optimizer, range(2, 4))
        assert not [w for w in caught if "lightning_mpx" in str(w.message)]
        weights = accelerator.get_state_dict(model)
        results[level] = loss, {k: weights[k].float() for k in init}
    assert results["O2"][0] == pytest.approx(results["bf16"][0], abs=5e-3)
    trained = {n: p for n, p in inner.named_parameters() if ".second." in n}
    assert len(trained) == 2 and {p.dtype for p in trained.values()} == {HALF}
    for name, value in results["O2"][1].items():
        assert value.dtype == torch.float32 and torch.equal(value, accelerator.amp.master_of(trained[name]))
        assert 0.5 * LR < (value - init[name]).abs().max() <= 2 * 1.5 * LR  # two steps from the FP32 init
        assert (value - results["bf16"][1][name]).abs().max() <= 2 * 2 * LR


def test_switching_to_an_adapter_frozen_at_prepare_warns_naming_it():
    """Two adapters made before ``prepare``, the optimizer over ``model.parameters()`` (frozen ones included), then
    ``set_adapter("b")`` mid-training: at O2 "b" was frozen when the model was cast, so no FP32 value was kept for it;
    its masters start from its bfloat16 rounding, and the first step says so, naming its parameters."""
    accelerator = _accelerator("O2")
    lora = _lora()
    lora.add_adapter("b", _config())
    model, optimizer = accelerator.prepare(lora, torch.optim.AdamW(lora.parameters(), lr=LR))
    _train(accelerator, model, optimizer, range(2))
    accelerator.unwrap_model(model).set_adapter("b")
    with pytest.warns(UserWarning, match=r"lora_A\.b\.weight.*were frozen when the model was cast to half at O2"):
        _train(accelerator, model, optimizer, range(2, 3))


def test_get_peft_model_on_a_prepared_model_then_its_optimizer_trains_as_under_bf16():
    """``get_peft_model`` applied to the model ``prepare`` returned (at O2: adapters made FP32 inside the half
    model), then the adapters' optimizer prepared: it is converted with FP32 masters from their FP32 init, and three
    steps give Accelerate's ``"bf16"`` (same order) losses and adapters to bfloat16's tolerance."""
    results = {}
    for level in ("bf16", "O2"):
        accelerator = _accelerator(level)
        model = accelerator.prepare(_gpt2())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lora = peft.get_peft_model(accelerator.unwrap_model(model), _config())
        optimizer = accelerator.prepare(torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=LR))
        loss = _train(accelerator, model, optimizer, range(3))
        weights = accelerator.get_state_dict(model)
        results[level] = loss, [weights[k].float() for k in sorted(weights) if ".lora_" in k]
    assert {p.dtype for p in lora.parameters() if p.requires_grad} == {HALF}
    assert all(accelerator.amp.master_of(p).dtype == torch.float32 for p in lora.parameters() if p.requires_grad)
    assert results["O2"][0] == pytest.approx(results["bf16"][0], abs=5e-3) and len(results["O2"][1]) == 2
    assert all((a - r).abs().max() <= ADAM for a, r in zip(results["O2"][1], results["bf16"][1], strict=True))


@pytest.mark.parametrize("autocast", [True, False], ids=["default", "no_autocast"])
def test_load_adapter_into_the_prepared_model_mid_training_keeps_training_it(tmp_path: Path, autocast: bool):
    """A user loads a saved adapter back into the prepared model mid-training (``load_adapter(path, "default",
    is_trainable=True)``) and trains on: the adapters move on from the file's FP32 values, as under Accelerate's
    ``"bf16"``. peft's default ``autocast_adapter_dtype=True`` replaced the half adapters with FP32 copies of their
    rounding that no optimizer holds, and they stopped training, silently (``fp32_export.KeptAdapterLoad``)."""
    accelerator, model, optimizer = _prepared("O2", _lora())
    _train(accelerator, model, optimizer, range(2))
    inner = accelerator.unwrap_model(model)
    inner.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    inner.load_adapter(tmp_path, adapter_name="default", is_trainable=True, autocast_adapter_dtype=autocast)
    _train(accelerator, model, optimizer, range(2, 4))
    weights = accelerator.get_state_dict(model)
    for key, value in saved.items():
        moved = (weights[key.replace(".weight", ".default.weight")].float() - value).abs().max()
        assert LR < moved <= 4 * LR, key  # two Adam steps from the loaded FP32 values
