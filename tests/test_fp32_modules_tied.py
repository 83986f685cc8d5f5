"""``fp32_modules`` naming a module whose weight is tied to another module's (Hugging Face ``lm_head`` and ``wte``).

At O2/O3 a tied weight is one tensor: pinning the head to FP32 makes the embedding's weight FP32 too. The module that
shares it runs in FP32 with it (its floating inputs cast to FP32, its outputs cast back to half for the half layers
after it); the parameter stays one FP32 tensor with no master. A tie that cannot run so (the root model's own
parameter) is refused when the model is prepared, naming both names.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp
from lightning_mpx.health.promotion import _Fp32Boundary

transformers = pytest.importorskip("transformers")

HALF = torch.bfloat16
STEPS = 6
LR = 3e-3


def gpt2() -> nn.Module:
    """A tiny GPT-2 (tied ``transformer.wte`` / ``lm_head``), the same weights at every call, nothing downloaded."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=32, n_inner=64, vocab_size=64, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 64, (4, 12), generator=g)
    return [base] * STEPS  # one batch again and again: the loss must fall


def fp32_losses() -> list[float]:
    model = gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for ids in batches():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def check_tie(model: nn.Module, master_of: Any) -> None:
    """The tie holds, the tied weight is FP32 and its own master; the blocks stay half."""
    head, embedding = model.lm_head.weight, model.transformer.wte.weight
    assert head is embedding and head.dtype == torch.float32
    assert master_of(head) is head
    assert model.transformer.h[0].attn.c_attn.weight.dtype == HALF


def check_trains_like_fp32(losses: list[float]) -> None:
    reference = fp32_losses()
    # bfloat16 blocks: the losses agree to bfloat16's precision, and fall as the FP32 run's do.
    assert losses == pytest.approx(reference, rel=2e-2), (losses, reference)
    assert losses[-1] < losses[0] - 0.3


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_amp_runs_a_tied_gpt2_head_in_fp32(level: str) -> None:
    amp = Amp(level, half_dtype=HALF, fp32_modules=["lm_head"])
    model = amp.prepare_model(gpt2())
    optimizer = amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=LR))
    check_tie(model, amp.master_of)
    assert amp.fp32_modules == ["lm_head"]
    losses = []
    for ids in batches():
        with amp.forward_context():
            loss = model(input_ids=ids, labels=ids).loss
        amp.backward(loss)
        assert amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()
        losses.append(loss.item())
    check_tie(model, amp.master_of)
    if level == "O2":
        check_trains_like_fp32(losses)
        halves = [param for weights in amp.master_weights for param, _ in weights.half_pairs]
        assert len(halves) == len(list(model.parameters())) - 1  # one FP32 parameter, no master: the tied one
        assert all(param is not model.lm_head.weight for param in halves)
    else:  # O3: half weights and no masters: it trains, less closely
        assert losses[-1] < losses[0] - 0.3


def test_accelerator_o2_runs_a_tied_gpt2_head_in_fp32() -> None:
    pytest.importorskip("accelerate")
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    handler = MixedPrecisionKwargs(half_dtype="bfloat16", fp32_modules=["lm_head"])
    accelerator = Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=[handler])
    model = gpt2()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    check_tie(accelerator.unwrap_model(model), accelerator.amp.master_of)
    losses = []
    for ids in batches():
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    check_trains_like_fp32(losses)
    # The FP32 export holds the tied weight once, as it was trained.
    exported = accelerator.amp.fp32_state_dict(accelerator.unwrap_model(model))
    assert exported["lm_head.weight"].dtype == torch.float32


class TiedLinears(nn.Module):
    """An input projection and a head sharing one square weight; the input projection has a bias of its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 16, bias=False)
        self.head.weight = self.inp.weight
        self.seen: dict[str, torch.dtype] = {}
        self.body[0].register_forward_pre_hook(lambda m, args: self.seen.__setitem__("body", args[0].dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.inp(x)))


def test_a_tied_module_with_parameters_of_its_own_runs_wholly_in_fp32() -> None:
    """The module sharing the pinned weight takes half inputs (the model's boundary casts them) and has a bias of its
    own: it runs in FP32 with its inputs cast to FP32, its bias FP32 with its exact values, its output back to half."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    reference = TiedLinears()
    expected = reference(x)
    amp = Amp("O2", half_dtype=HALF, fp32_modules=["head"])
    model = amp.prepare_model(TiedLinears())
    amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert model.inp.weight is model.head.weight and model.inp.weight.dtype == torch.float32
    assert model.inp.bias.dtype == torch.float32 and torch.equal(model.inp.bias, reference.inp.bias)
    assert model.body[0].weight.dtype == HALF
    with amp.forward_context():
        out = amp.cast_outputs(model(amp.cast_inputs(x)))
    assert model.seen["body"] == HALF
    torch.testing.assert_close(out, expected, rtol=3e-2, atol=3e-2)


def test_a_model_prepared_again_is_hooked_once() -> None:
    amp = Amp("O2", half_dtype=HALF, fp32_modules=["head"])
    model = amp.prepare_model(TiedLinears(), train=False)
    amp.prepare_model(model, train=True)
    for hooks in (model.inp._forward_hooks, model.inp._forward_pre_hooks):
        assert sum(isinstance(getattr(hook, "__self__", None), _Fp32Boundary) for hook in hooks.values()) == 1


class RootTied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 4)
        self.scale = self.head.weight  # the root's own parameter, the head's weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x @ self.scale)


def test_a_tie_to_the_root_model_is_refused_when_prepared_naming_both() -> None:
    amp = Amp("O2", half_dtype=HALF, fp32_modules=["head"])
    with pytest.raises(ValueError, match=r"'head'.*'head\.weight'.*the root model.*'scale'.*tied weights"):
        amp.prepare_model(RootTied())


def test_o1_needs_nothing_for_a_tie() -> None:
    """O1 keeps the model FP32: the tied embedding was never the problem; it trains as before."""
    amp = Amp("O1", half_dtype=HALF, fp32_modules=["lm_head"])
    model = amp.prepare_model(gpt2())
    optimizer = amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=LR))
    ids = batches()[0]
    with amp.forward_context():
        loss = F.cross_entropy(model(input_ids=ids).logits[:, :-1].reshape(-1, 64).float(), ids[:, 1:].reshape(-1))
    amp.backward(loss)
    assert amp.step(optimizer)
