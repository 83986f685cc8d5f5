"""litgpt's LoRA fine-tuning through Lightning Fabric with the Fabric plugin, as a litgpt user runs it
(``examples/fabric_litgpt_lora.py``: ``init_module``, ``mark_only_lora_as_trainable``, the optimizer over all the
parameters as litgpt's, ``load_raw`` of an FP32 base with ``strict=False`` before or after ``setup``, chunked logits
into ``chunked_cross_entropy``, ``no_backward_sync``, ``clip_gradients``, ``get_lr``, the LoRA weights saved, then
``merge_lora_weights``), against litgpt's own precisions (``bf16-mixed``, ``32-true``): losses, the saved LoRA
weights (the O2 masters), the frozen base's memory, float16's dynamic scale, and generation with the KV cache after a
``max_seq_length`` change. The adapters and the full fine-tune are in ``tests/test_hostile_third_party.py``.

``fabric.save(..., filter={"model": lora_filter})`` at O2 writes the FP32 masters (a strict xfail when this file was
written: the half weights then).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("litgpt")
pytest.importorskip("lightning")

from litgpt.generate.base import generate  # noqa: E402
from litgpt.lora import lora_filter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
try:
    import fabric_litgpt_lora as example  # noqa: E402
finally:
    sys.path.remove(str(ROOT / "examples"))

_RUNS: dict[tuple, dict[str, Any]] = {}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return example.save_base_checkpoint(tmp_path_factory.mktemp("base") / "lit_model.pth")


def _run(precision: str, base: Path, tmp: Path, half: str = "bfloat16", iters: int = 6, before: bool = False,
         **settings: Any) -> dict[str, Any]:  # fmt: skip
    key = (precision, half, iters, before, tuple(sorted(settings.items())))
    if key not in _RUNS:
        fabric = example.make_fabric(precision, half, **settings)
        result = example.main(fabric, example.TrainArgs(max_iters=iters), base, tmp / "_".join(map(str, key[:4])),
                              base_before_setup=before)  # fmt: skip
        result["mpx"] = fabric.strategy.precision
        _RUNS[key] = result
    return _RUNS[key]


@pytest.mark.parametrize("before", [False, True], ids=["base-after-setup", "base-before-setup"])
def test_o2_lora_tracks_bf16_mixed_and_saves_the_fp32_masters(base, tmp_path, before):
    """Loss per micro-batch within bfloat16's tolerance of litgpt's default ``bf16-mixed`` whichever side of
    ``setup`` the base is loaded; the saved LoRA weights are the FP32 masters exactly (FP32 values off bfloat16's
    grid, not its rounding); the frozen base is half with no FP32 copy kept (masters for the LoRA matrices only)."""
    ours, theirs = _run("O2", base, tmp_path, before=before), _run("bf16-mixed", base, tmp_path)
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=2e-3, atol=0)
    model, mpx, saved = ours["model"], ours["mpx"], ours["lora"]
    trainable = {n: p for n, p in model.module.named_parameters() if p.requires_grad}
    assert set(saved) == set(trainable) and set(saved) == set(theirs["lora"]) and len(saved) == 18
    loaded = torch.load(ours["path"])["model"]  # litgpt's layout (save_lora_checkpoint's, merge_lora's)
    for name, param in trainable.items():
        assert loaded[name].dtype == torch.float32
        assert torch.equal(loaded[name], mpx.amp.master_of(param))
    assert any(not torch.equal(v, v.bfloat16().float()) for v in loaded.values())  # not their half rounding
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    fp32_held = sum(v.numel() for weights in mpx.amp.master_weights for v in weights.fp32_values().values())
    assert fp32_held == sum(p.numel() for p in trainable.values()) < sum(p.numel() for p in model.parameters()) / 10
    # Resuming the LoRA as litgpt's load_checkpoint_update does (base and LoRA file merged into one state dict,
    # loaded into the set-up model): the new run's masters are the saved FP32 weights exactly.
    fabric = example.make_fabric("O2")
    with fabric.init_module(empty_init=False):
        fresh = example.GPT(example.Config(**example.BASE, **example.LORA))
    example.mark_only_lora_as_trainable(fresh)
    fresh = fabric.setup_module(fresh)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad]))
    fresh.load_state_dict({**torch.load(base), **torch.load(ours["path"])["model"]}, strict=False)
    masters = dict(zip(trainable, fabric.strategy.precision.master_params(optimizer)))
    assert all(torch.equal(masters[name], loaded[name]) for name in trainable)


def test_o1_lora_is_bf16_mixed(base, tmp_path):
    """At O1 the LoRA loop (load after setup, chunked logits, clip, accumulation) is ``bf16-mixed``'s: the same
    losses to FP32 rounding and the saved LoRA weights to bfloat16's."""
    ours, theirs = _run("O1", base, tmp_path), _run("bf16-mixed", base, tmp_path)
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=1e-5, atol=0)
    for name, value in theirs["lora"].items():
        torch.testing.assert_close(ours["lora"][name], value, rtol=0.02, atol=1e-4)


def test_fabric_save_with_litgpts_lora_filter_writes_the_masters(base, tmp_path):
    """litgpt's way to save the LoRA weights, at O2: the FP32 masters, what a litgpt user wants written."""
    run = _run("O2", base, tmp_path)
    model, mpx = run["model"], run["mpx"]
    path = tmp_path / "lora.pth"
    example.make_fabric("O2").save(path, {"model": model}, filter={"model": lora_filter})
    saved = torch.load(path)["model"]
    assert {n: p.dtype for n, p in saved.items()} == {n: torch.float32 for n in saved}
    for name, value in saved.items():
        assert torch.equal(value, mpx.amp.master_of(model.get_parameter(name)))


def test_float16_o2_lora_skips_overflows_and_tracks_32_true(base, tmp_path):
    """float16 at O2 with a dynamic scale from 2**20: the first step overflows and is skipped (nothing written to
    the LoRA masters: the saved weights are finite), the scale comes down, the other steps train, and the losses
    follow ``32-true``'s within float16's tolerance."""
    ours = _run("O2", base, tmp_path, half="float16", init_scale=2.0**20)
    theirs = _run("32-true", base, tmp_path)
    metrics = ours["mpx"].metrics()
    assert 1 <= metrics["mpx/skipped_steps"] < 3 and metrics["mpx/loss_scale"] < 2.0**20
    assert all(torch.isfinite(v).all() for v in ours["lora"].values())
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=3e-3, atol=0)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_generation_after_lora_training_follows_the_fp32_model(base, tmp_path, level):
    """After training (``max_seq_length`` shortened after ``setup``, the LoRA merged into the half weights at O2),
    litgpt's ``generate`` with a KV cache made in and outside ``fabric.init_tensor()``, through the set-up model and
    the bare module: no crash, a bfloat16 cache, and logits and greedy tokens of the FP32 model built from the base
    checkpoint and the saved LoRA file. Then ``max_seq_length`` raised again rebuilds the rope cache for the model."""
    run = _run(level, base, tmp_path)
    model = run["model"]  # what fabric.setup returned
    reference = example.GPT(example.Config(**example.BASE, **example.LORA))
    reference.load_state_dict({**torch.load(base), **run["lora"]}, strict=False)
    reference.max_seq_length = model.max_seq_length
    model.eval(), reference.eval()
    prompt = torch.randint(0, 128, (6,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits, want = model(prompt[None]).float(), reference(prompt[None])
    torch.testing.assert_close(logits, want, rtol=0, atol=0.02 * want.abs().max().item())
    reference.set_kv_cache(batch_size=1)
    expected = generate(reference, prompt, 12, top_k=1)
    fabric = example.make_fabric(level)
    for target, in_init_tensor in [(model, False), (model, True), (model.module, False)]:
        if in_init_tensor:
            with fabric.init_tensor():
                target.set_kv_cache(batch_size=1)
        else:
            target.set_kv_cache(batch_size=1)
        tokens = generate(target, prompt, 12, top_k=1)
        assert tokens[6].item() == expected[6].item() and (tokens == expected).float().mean() >= 0.75
        if target is model:
            assert model.transformer.h[0].attn.kv_cache.k.dtype == torch.bfloat16
        target.clear_kv_cache()
    model.max_seq_length = 32
    reference.max_seq_length = 32
    long = torch.randint(0, 128, (1, 30), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        logits, want = model(long).float(), reference(long)
    assert model.cos.shape[0] == 32
    torch.testing.assert_close(logits, want, rtol=0, atol=0.03 * want.abs().max().item())
