"""Helper xfails63: strict xfails made to pass, from the user's side.

1. peft's merges at O2 (``merge_and_unload``, ``safe_merge``, DoRA, ``merge_adapter``/``unmerge_adapter``) give the
   half rounding of peft's own FP32 merge of the masters (an FP32 model holding the upcast half base and the FP32
   adapters), not peft's merge of the adapters' half copies. Tiny GPT-2 built from a config, bfloat16, CPU.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from tests import test_peftzoo62 as zoo  # noqa: E402
from tests.test_peft61 import HALF, _ids, _lora, _prepared, _train  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def _fp32_twin(inner: Any, amp: Any, **extra: Any) -> Any:
    """The FP32 model peft would merge in FP32: the trained model's half base upcast (exact), its adapters their
    FP32 masters."""
    twin = _lora(**extra)
    with torch.no_grad():
        for (name, param), (other, ours) in zip(twin.named_parameters(), inner.named_parameters(), strict=True):
            assert name == other
            param.copy_(amp.master_of(ours) if ours.requires_grad else ours.float())
    return twin


def _merged(model: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's note on Conv1D's fan_in_fan_out
        merged = model.merge_and_unload(**kwargs)
    return {name: p.detach() for name, p in merged.named_parameters()}


@pytest.mark.parametrize("kind", ["lora", "safe_merge", "dora"])
def test_o2_merge_and_unload_is_the_rounding_of_peft_s_fp32_merge_of_the_masters(kind: str) -> None:
    extra = {"use_dora": True} if kind == "dora" else {}
    accelerator, model, optimizer = _prepared("O2", _lora(**extra))
    _train(accelerator, model, optimizer, range(3))
    inner = accelerator.unwrap_model(model)
    want = _merged(_fp32_twin(inner, accelerator.amp, **extra), safe_merge=kind == "safe_merge")
    got = _merged(inner, safe_merge=kind == "safe_merge")
    assert set(got) == set(want) and {p.dtype for p in got.values()} == {HALF}
    for name, value in want.items():
        assert torch.equal(got[name], value.to(HALF)), name


def test_o2_merge_adapter_then_unmerge_adapter_trains_on_as_before() -> None:
    """``merge_adapter()`` for a fast evaluation, ``unmerge_adapter()`` after it (both in FP32 now): the base is back
    within the two roundings (the merged value's and the result's), the adapters and their masters untouched, and
    training goes on."""
    accelerator, model, optimizer = _prepared("O2", _lora())
    _train(accelerator, model, optimizer, range(2))
    inner = accelerator.unwrap_model(model)
    layer = inner.base_model.model.transformer.h[0].attn.c_attn
    base = layer.base_layer.weight.detach().clone()
    adapters = [
        (p, p.detach().clone(), accelerator.amp.master_of(p).clone())
        for p in (layer.lora_A.default.weight, layer.lora_B.default.weight)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inner.merge_adapter()
        merged = layer.base_layer.weight.detach().clone()
        with torch.no_grad():
            merged_logits = model(input_ids=_ids(9)).logits
        inner.unmerge_adapter()
    with torch.no_grad():
        logits = model(input_ids=_ids(9)).logits
    assert (merged_logits - logits).abs().max() < 0.05
    half_ulps = (merged.float().abs() + base.float().abs()) * 2.0**-8  # bfloat16: 8 significant bits
    assert ((layer.base_layer.weight.float() - base.float()).abs() <= half_ulps).all()
    assert not torch.equal(merged, base)
    for param, value, master in adapters:
        assert torch.equal(param, value) and torch.equal(accelerator.amp.master_of(param), master)
    _train(accelerator, model, optimizer, range(2, 3))
    assert all(not torch.equal(accelerator.amp.master_of(p), m) for p, _, m in adapters)


def test_a_deep_copy_of_a_layer_merges_as_peft_does() -> None:
    """A deep copy of the trained peft model (the wrappers hold the layer and the engine weakly, which a deep copy
    refuses) copies, and merges with peft's own methods (its values are the copy's own)."""
    accelerator, model, optimizer = _prepared("O2", _lora())
    _train(accelerator, model, optimizer, range(1))
    inner = accelerator.unwrap_model(model)
    twin = copy.deepcopy(inner)
    assert {p.dtype for p in _merged(twin).values()} == {HALF}


def _adalora(level: str, clip: float, **kwargs: Any) -> tuple[dict[str, list[bool]], list[dict[str, torch.Tensor]]]:
    """AdaLoRA's documented loop with ``clip_grad_norm_`` before the step: the final rank pattern, and the smoothed
    importance scores after each step before the final mask (which resets them)."""
    torch.manual_seed(0)
    config = peft.AdaLoraConfig(init_r=6, target_r=2, target_modules=["q_proj", "v_proj"], total_step=5, tinit=1,
                                tfinal=2, deltaT=1)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(zoo._llama(), config)
    accelerator = zoo._accelerator(level, **kwargs)
    trained = [p for p in model.parameters() if p.requires_grad]
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(trained, lr=zoo.LR))
    tuner = accelerator.unwrap_model(model).base_model
    scores = []
    for step in range(5):
        accelerator.backward(model(**zoo._batch("adalora", step)).loss)
        accelerator.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        tuner.update_and_allocate(step)
        optimizer.zero_grad()
        scores.append({n: v.float().clone() for n, v in tuner.rankallocator.exp_avg_ipt.items()})
    return tuner.peft_config["default"].rank_pattern, scores[:3]


def test_adalora_at_o2_float16_with_a_growing_scale_and_a_clip_scores_as_fp32() -> None:
    pattern, scores = _adalora("no", clip=1e-3)
    got_pattern, got = _adalora("O2", clip=1e-3, half_dtype=torch.float16, init_scale=2.0, growth_interval=1)
    assert got_pattern == pattern and sum(sum(r) for r in pattern.values()) == 4
    for ours, fp32 in zip(got, scores, strict=True):
        assert set(ours) == set(fp32) and fp32
        for name, value in fp32.items():
            assert ours[name].dtype == torch.float32  # smoothed in FP32, as under FP32 training
            assert (ours[name] - value).abs().max() <= 0.25 * value.abs().max(), name  # float16 gradients of ~1e-6
