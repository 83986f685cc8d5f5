"""The Accelerate adapter at O2 and the most common save of Accelerate scripts (transformers' ``run_*_no_trainer.py``):
``accelerator.unwrap_model(model).save_pretrained(out, is_main_process=..., save_function=accelerator.save)``, without
``state_dict=``. Accelerate's own ``"bf16"`` writes the FP32 weights training produced; at O2 the prepared model holds
their bfloat16 rounding, and its ``state_dict()`` gives the FP32 masters (``MastersInStateDict``, as the Trainer and
Fabric plugins' models), so the same save writes them, and ``from_pretrained(out, dtype=torch.float32)`` gives them
back exactly. Also after ``free_memory()`` and the model prepared again (a retried training function): the new
engine's masters. bfloat16, a one-layer GPT-2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel  # noqa: E402

HALF = torch.bfloat16
LR = 1e-3


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(seed))


def _train(accelerator: Any, model: Any, optimizer: Any, seeds: range) -> None:
    for seed in seeds:
        ids = _ids(seed)
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()


def _save(accelerator: Any, model: Any, out: Path) -> dict[str, torch.Tensor]:
    """The no_trainer examples' save, then the file it wrote."""
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(out, is_main_process=accelerator.is_main_process, save_function=accelerator.save)
    return load_file(out / "model.safetensors")


def _assert_masters_on_disk(saved: dict[str, torch.Tensor], masters: dict[str, Any], out: Path) -> None:
    assert {value.dtype for value in saved.values()} == {torch.float32}
    for key, value in saved.items():
        assert torch.equal(value, masters[key]), key  # the masters exactly, not their bfloat16 rounding
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    for key, value in loaded.items():
        if key in masters:
            assert torch.equal(value, masters[key].float()), key


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_o2_save_pretrained_without_a_state_dict_writes_the_fp32_masters_as_accelerates_bf16(tmp_path: Path) -> None:
    from accelerate import Accelerator as NativeAccelerator

    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    native = NativeAccelerator(mixed_precision="bf16", cpu=True)
    ref = _model()
    ref, ref_opt = native.prepare(ref, torch.optim.AdamW(ref.parameters(), lr=LR))
    _train(native, ref, ref_opt, range(3))
    reference = _save(native, ref, tmp_path / "native")
    reset_accelerate_state()

    accelerator = Accelerator(mixed_precision="O2", kwargs_handlers=[MixedPrecisionKwargs(half_dtype=HALF)])
    model = _model()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    _train(accelerator, model, optimizer, range(3))
    assert next(accelerator.unwrap_model(model).parameters()).dtype == HALF  # O2: the model holds bfloat16
    masters = accelerator.get_state_dict(model)
    saved = _save(accelerator, model, tmp_path / "o2")

    assert {value.dtype for value in reference.values()} == {torch.float32}  # Accelerate's "bf16": FP32 on disk
    assert saved.keys() == reference.keys()
    _assert_masters_on_disk(saved, masters, tmp_path / "o2")
    for key, value in saved.items():  # three Adam steps of at most ~LR each, both ways, from the same FP32 start
        assert (value - reference[key]).abs().max() <= 6 * LR, key
    # What the save did not change: get_state_dict (save_model) gives the same masters after it, and training goes on.
    after = accelerator.get_state_dict(model)
    assert all(torch.equal(after[key], masters[key]) for key in masters)
    _train(accelerator, model, optimizer, range(3, 4))
    assert not torch.equal(accelerator.get_state_dict(model)["transformer.h.0.mlp.c_fc.weight"], saved[
        "transformer.h.0.mlp.c_fc.weight"])


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_o2_save_pretrained_after_free_memory_and_prepare_again_writes_the_new_engines_masters(
    tmp_path: Path,
) -> None:
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    accelerator = Accelerator(mixed_precision="O2", kwargs_handlers=[MixedPrecisionKwargs(half_dtype=HALF)])
    model = _model()
    prepared, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    _train(accelerator, prepared, optimizer, range(2))
    accelerator.free_memory()  # a retried training function (find_executable_batch_size): a fresh engine
    prepared, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    _train(accelerator, prepared, optimizer, range(2, 4))
    masters = accelerator.get_state_dict(prepared)
    saved = _save(accelerator, prepared, tmp_path)
    _assert_masters_on_disk(saved, masters, tmp_path)


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_o2_a_weight_clamp_right_after_load_state_survives_the_next_forward(tmp_path: Path) -> None:
    """``save_state`` takes the model's state dict (now the masters, noted as handed out); ``load_state`` writes them
    back; a WGAN clamp through ``p.data`` before the next forward stays, as in FP32 (the load is no write of the
    user's through the state dict)."""
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    accelerator = Accelerator(mixed_precision="O2", kwargs_handlers=[MixedPrecisionKwargs(half_dtype=HALF)])
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x = torch.randn(4, 8)
    accelerator.backward(model(x).float().pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()
    accelerator.save_state(str(tmp_path))
    accelerator.load_state(str(tmp_path))
    for p in model.parameters():
        p.data.clamp_(-0.05, 0.05)
    clamped = [p.detach().clone() for p in model.parameters()]
    model(x)
    for p, want in zip(model.parameters(), clamped):
        assert torch.equal(p.detach(), want)  # the clamp, not the loaded values


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_o2_a_weight_clamp_after_a_step_that_follows_get_state_dict_survives_the_next_forward() -> None:
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    accelerator = Accelerator(mixed_precision="O2", kwargs_handlers=[MixedPrecisionKwargs(half_dtype=HALF)])
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x = torch.randn(4, 8)
    accelerator.backward(model(x).float().pow(2).mean())
    accelerator.get_state_dict(model)  # between backward and step (a checkpoint there)
    optimizer.step()
    optimizer.zero_grad()
    for p in model.parameters():
        p.data.clamp_(-0.01, 0.01)
    clamped = [p.detach().clone() for p in model.parameters()]
    model(x)
    for p, want in zip(model.parameters(), clamped):
        assert torch.equal(p.detach(), want)  # the clamp, not the step's values
