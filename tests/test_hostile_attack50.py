"""Hostile habits against the stop-50 fixes of the Accelerate adapter and the ``transformers.Trainer`` mixin: the FP32
export at O2 (``get_state_dict``, ``save_model``, the Trainer's ``save_model``) of a peft LoRA model and of GPT-2's
tied embeddings, an optimizer that stepped before its model was prepared, and the mixin's class checks. Each case is
held to a reference: the masters themselves (the same storage, bit for bit), Accelerate's own ``"no"``, or the run
prepared in one call. Tiny GPT-2 from a config, bfloat16, on CPU."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("accelerate")

from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs  # noqa: E402
from tests.accelerate_helpers import accelerate_state_reset, reset_accelerate_state  # noqa: E402
from tests.test_hf_trainer import GPT2, SCALED, lm_data  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

transformers.logging.set_verbosity_error()


def _accelerator(level: str) -> Accelerator:
    reset_accelerate_state()  # a fresh Accelerator, as in a new process
    handlers = [MixedPrecisionKwargs(half_dtype="bfloat16", init_scale=2.0**8)] if level.startswith("O") else None
    return Accelerator(mixed_precision=level, kwargs_handlers=handlers, cpu=True)


def _lora() -> Any:
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, init_lora_weights=False)
    return peft.get_peft_model(transformers.GPT2LMHeadModel(GPT2), config)


def _ids(step: int) -> torch.Tensor:
    return torch.stack([row["input_ids"] for row in lm_data(8)[2 * step : 2 * step + 2]])


def _train(accelerator: Accelerator, model: nn.Module, steps: int = 2) -> tuple[nn.Module, Any]:
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    for step in range(steps):
        accelerator.backward(model(input_ids=_ids(step), labels=_ids(step)).loss)
        opt.step()
        opt.zero_grad()
    return model, opt


def _fresh_bytes(state: dict[str, Any], *owners: dict[str, torch.Tensor]) -> int:
    """Bytes of the tensors in ``state`` that share storage with none of ``owners``' tensors: what making it cost."""
    own = {t.untyped_storage().data_ptr() for owner in owners for t in owner.values() if torch.is_tensor(t)}
    fresh = [t for t in state.values() if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in own]
    return sum(t.numel() * t.element_size() for t in fresh)


# -- the O2 export of a LoRA model: the masters handed, the frozen half base not copied to FP32 ----------------------
def test_o2_get_state_dict_of_a_lora_model_hands_the_masters_and_copies_no_frozen_weight():
    """Found at stop 50 (attack): ``get_state_dict`` of a peft LoRA model at O2 (so ``save_model``, ``save_state``,
    ``save_pretrained(state_dict=...)``) upcast the whole frozen bfloat16 base to a fresh FP32 copy on the model's
    device, 120320 bytes of a 124416-byte state dict here, twice the base's own memory (a 7B base: 28 GB more at every
    save, where the run itself fits), though the base has no masters and the upcast adds no information. Now the
    masters are handed as they are (same storage), the rest as the model holds it: nothing is allocated, the adapter
    entries are the masters bit for bit, and ``save_pretrained`` writes them."""
    accelerator = _accelerator("O2")
    model, opt = _train(accelerator, _lora())
    inner = accelerator.unwrap_model(model)
    state = accelerator.get_state_dict(model)
    masters = {id(m) for m in accelerator.amp.master_params(opt.optimizer)}
    own = inner.state_dict()
    assert _fresh_bytes(state, own, dict(enumerate(accelerator.amp.master_params(opt.optimizer)))) == 0
    adapters = {k: v for k, v in state.items() if ".lora_" in k}
    assert len(adapters) == 4 and all(v.dtype == torch.float32 for v in adapters.values())
    held = {name: p for name, p in inner.named_parameters() if p.requires_grad}
    assert all(accelerator.amp.master_of(held[k]).data_ptr() == v.data_ptr() for k, v in adapters.items())
    assert len(masters) == 4
    base = {k: v for k, v in state.items() if k not in adapters}
    assert all(torch.equal(v, own[k]) and v.dtype == own[k].dtype for k, v in base.items())
