"""Activation checkpointing at O1: the recomputation in the backward pass runs with the forward's casts.

``torch.utils.checkpoint`` re-runs the checkpointed forward during the backward pass, after the forward's cast scope
has ended. Without the policy there, the non-reentrant variant fails (``CheckpointError``: the recomputed tensors
have other dtypes) and the reentrant one silently differentiates an FP32 recomputation. With it, the gradients are
bit-identical to those of the same model without checkpointing, in the core, the Lightning plugin, the Accelerate
adapter and a Hugging Face GPT-2 with ``gradient_checkpointing_enable()``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_mpx import Amp, CastPolicy, checkpoint_contexts

HALVES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
REENTRANT = {"reentrant": True, "non_reentrant": False}


class Block(nn.Module):
    """A pre-norm transformer block (attention with a causal mask, GELU MLP), written with plain ops."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / (d // self.heads) ** 0.5)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    """Two blocks, each optionally checkpointed."""

    def __init__(self, reentrant: bool | None = None, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.reentrant = reentrant  # None: no checkpointing
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim), Block(dim)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x) if self.reentrant is None else checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(seed))


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and got
    for name in want:
        assert got[name].dtype == want[name].dtype == torch.float32, name
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def _core_grads(reentrant: bool | None, half: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    amp = Amp("O1", half_dtype=half, loss_scale=1.0)
    model = amp.prepare_model(TinyLM(reentrant).to(device))
    with amp.forward_context():
        loss = _loss(model, _tokens().to(device))
    amp.backward(loss)
    return _grads(model)


# --- the core ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("reentrant", REENTRANT.values(), ids=REENTRANT.keys())
def test_core_checkpointed_gradients_equal_plain_o1(reentrant, half):
    _assert_same_grads(_core_grads(reentrant, half), _core_grads(None, half))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("reentrant", REENTRANT.values(), ids=REENTRANT.keys())
def test_cuda_checkpointed_gradients_equal_plain_o1(reentrant):
    """On CUDA the autograd engine runs the backward pass on its device thread: the recompute mode goes with it."""
    _assert_same_grads(_core_grads(reentrant, "float16", "cuda"), _core_grads(None, "float16", "cuda"))


@pytest.mark.parametrize("reentrant", REENTRANT.values(), ids=REENTRANT.keys())
def test_the_recomputation_sees_the_forward_dtypes(reentrant):
    """The linear layers inside the checkpointed block compute in half also when they are recomputed."""
    seen: list[tuple[bool, torch.dtype]] = []
    block = Block()
    block.fc1.register_forward_hook(lambda m, a, out: seen.append((torch.is_grad_enabled(), out.dtype)))
    policy = CastPolicy()
    x = torch.randn(2, 4, 16, requires_grad=True)
    with policy.scope():
        y = checkpoint(block, x, use_reentrant=reentrant).float().sum()
    with policy.recompute_scope():
        y.backward()
    assert len(seen) == 2 and {dtype for _, dtype in seen} == {torch.float16}


def test_backward_inside_the_forward_scope_also_recomputes_with_casts():
    policy, model = CastPolicy(), TinyLM(reentrant=False)
    with policy.scope():
        _loss(model, _tokens()).backward()  # no CheckpointError
    assert all(p.grad is not None for p in model.parameters())


def test_autograd_grad_and_torch_errors_pass_through():
    policy, model = CastPolicy(), TinyLM(reentrant=False)
    with policy.scope():
        loss = _loss(model, _tokens())
    with policy.recompute_scope():
        if torch.__version__ >= (2, 13):  # torch 2.13 takes a dict of inputs (and returns one); 2.11 does not
            grads = torch.autograd.grad(loss, {"head": model.head.weight, "embed": model.embed.weight})
            assert set(grads) == {"head", "embed"} and grads["head"].dtype == torch.float32
        else:
            head, embed = torch.autograd.grad(loss, [model.head.weight, model.embed.weight])
            assert head.dtype == embed.dtype == torch.float32
        with pytest.raises(RuntimeError, match="does not require grad"):
            torch.ones(2).sum().backward()
        with pytest.raises(RuntimeError, match="only for scalar outputs"):
            model.head(torch.randn(3, 16)).backward()


def test_backward_functions_themselves_are_not_cast():
    """Only the recomputation (gradients enabled) is cast: a Python ``autograd.Function.backward`` is left alone."""
    received: list[torch.dtype] = []

    class MatmulTwice(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(w)
            return x @ w

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            (w,) = ctx.saved_tensors
            out = grad.float() @ w.float().t()
            received.append(out.dtype)
            return out, None

    policy = CastPolicy()
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 5)
    with policy.recompute_scope():
        MatmulTwice.apply(x, w).sum().backward()
    assert received == [torch.float32]


# --- a backward pass enters a recompute mode only when there is something to recompute ------------------------------
def _modes_during_backward(model: nn.Module) -> list[int]:
    """Register a hook on the head's weight that records how many torch-function modes are on the stack when the
    backward pass reaches it (a mode there is handed every torch call of the backward pass: FSDP's gathers too)."""
    seen: list[int] = []
    model.head.weight.register_hook(lambda g: seen.append(len(torch.overrides._get_current_function_mode_stack())))
    return seen


@pytest.mark.parametrize("reentrant", [None, *REENTRANT.values()], ids=["plain", *REENTRANT.keys()])
def test_a_backward_enters_a_recompute_mode_only_after_a_checkpointed_forward(reentrant):
    amp = Amp("O1", half_dtype="bfloat16", loss_scale=1.0)
    model = amp.prepare_model(TinyLM(reentrant))
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    seen = _modes_during_backward(model)
    with amp.forward_context():
        loss = _loss(model, _tokens())
    amp.backward(loss)
    assert seen == [0 if reentrant is None else 1]
    amp.step(optimizer)
    amp.update()
    optimizer.zero_grad()
    # Plain forwards from now on. What the checkpointed forward noted is kept across one iteration boundary (a graph
    # may outlive it: a GAN's generator) and forgotten at the next: then a backward runs without a mode.
    model.reentrant = None
    for expected in ([0 if reentrant is None else 1], [0], [0]):
        seen.clear()
        with amp.forward_context():
            loss = _loss(model, _tokens(1))
        amp.backward(loss)
        assert seen == expected
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()


def test_a_checkpoint_whose_only_cast_is_a_promotion_recomputes_it():
    """A checkpointed block with no half or FP32 op, only a promotion that casts (atan2 of an FP32 and a bfloat16
    tensor, which autocast's kernels would not widen alike): the backward pass still recomputes it with the cast
    (non-reentrant checkpoints compare the recomputed tensors' dtypes with the forward's)."""
    policy = CastPolicy(half_dtype=torch.bfloat16)
    a = torch.randn(4, requires_grad=True)
    b = torch.randn(4, dtype=torch.bfloat16, requires_grad=True)
    with policy.scope():
        out = checkpoint(torch.atan2, a, b, use_reentrant=False)
    assert out.dtype == torch.float32
    policy.backward(out.sum())  # no CheckpointError
    with policy.scope():
        plain = torch.atan2(a, b)
    grads = (a.grad.clone(), b.grad.clone())
    a.grad = b.grad = None
    policy.backward(plain.sum())
    torch.testing.assert_close(grads, (a.grad, b.grad), rtol=0, atol=0)


@pytest.mark.parametrize("reentrant", REENTRANT.values(), ids=REENTRANT.keys())
def test_two_losses_of_one_checkpointed_forward_both_recompute_with_casts(reentrant):
    """Two backward passes over one checkpointed graph (``retain_graph=True``): the second one recomputes with the
    forward's casts too (the first one does not use up what the forward recorded)."""

    def grads(reentrant_or_none: bool | None) -> dict[str, torch.Tensor]:
        amp = Amp("O1", half_dtype="bfloat16", loss_scale=1.0)
        model = amp.prepare_model(TinyLM(reentrant_or_none))
        with amp.forward_context():
            logits = model(_tokens()[:, :-1])
            first = logits.float().pow(2).mean()
            second = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), _tokens()[:, 1:].reshape(-1))
        amp.backward(first, retain_graph=True)
        amp.backward(second)
        return _grads(model)

    _assert_same_grads(grads(reentrant), grads(None))


@pytest.mark.parametrize("reentrant", REENTRANT.values(), ids=REENTRANT.keys())
def test_apex_two_scale_loss_blocks_over_one_checkpointed_forward(reentrant):
    """Apex clears its cast cache at the end of every ``scale_loss`` block; the second block's backward still
    recomputes the checkpointed forward with its casts: the gradients are those of the model without checkpoints."""
    from lightning_mpx.apex import _amp_state, amp

    def grads(reentrant_or_none: bool | None) -> dict[str, torch.Tensor]:
        model = TinyLM(reentrant_or_none)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = amp.initialize(model, optimizer, opt_level="O1", loss_scale=1.0, verbosity=0)
        try:
            logits = model(_tokens()[:, :-1])
            first = logits.float().pow(2).mean()
            second = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), _tokens()[:, 1:].reshape(-1))
            with amp.scale_loss(first, optimizer) as scaled:
                scaled.backward(retain_graph=True)
            with amp.scale_loss(second, optimizer) as scaled:
                scaled.backward()
            return _grads(model)
        finally:
            _amp_state.reset()

    _assert_same_grads(grads(reentrant), grads(None))


# --- a bare loss.backward(): the checkpoint call records the casts (context_fn) -------------------------------------
class RecordedLM(TinyLM):
    """TinyLM whose blocks are checkpointed with ``context_fn=checkpoint_contexts`` (non-reentrant)."""

    def __init__(self) -> None:
        super().__init__(reentrant=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False, context_fn=checkpoint_contexts)
        return self.head(x)


@pytest.mark.parametrize("half", HALVES)
def test_bare_backward_recomputes_with_the_casts_recorded_at_the_forward(half):
    """A plain ``loss.backward()`` after an O1 forward (no ``amp.backward``, no recompute scope): the gradients are
    those of the engine's backward, with and without checkpointing, bit for bit, and those of ``torch.autocast``
    within its own rounding; twice over one graph (``retain_graph=True``) they add up exactly."""
    amp = Amp("O1", half_dtype=half, loss_scale=1.0)
    model = amp.prepare_model(RecordedLM())
    with amp.forward_context():
        loss = _loss(model, _tokens())
    loss.backward(retain_graph=True)  # without context_fn: CheckpointError (the recomputed tensors are FP32)
    bare = _grads(model)
    _assert_same_grads(bare, _core_grads(None, half))
    _assert_same_grads(bare, _core_grads(False, half))  # the engine's backward, checkpointed blocks
    loss.backward()  # recomputes again, with the casts again
    _assert_same_grads(_grads(model), {name: 2 * grad for name, grad in bare.items()})

    reference = TinyLM(reentrant=False)  # the same weights (seeded)
    with torch.autocast("cpu", dtype=HALVES[half]):
        _loss(reference, _tokens()).backward()  # autocast's state is recorded by checkpoint itself
    for name, grad in _grads(reference).items():
        torch.testing.assert_close(bare[name], grad, rtol=0, atol=0.02 * float(grad.abs().max()), msg=name)


def test_recorded_contexts_follow_the_forward():
    """Recorded at the forward: an FP32 forward (no policy active) recomputes in FP32, and a block run inside
    ``disable_casts()`` recomputes without casts, whatever is active during the backward."""
    from lightning_mpx import disable_casts

    fp32 = RecordedLM()
    _loss(fp32, _tokens()).backward()
    plain = TinyLM()
    _loss(plain, _tokens()).backward()
    _assert_same_grads(_grads(fp32), _grads(plain))

    seen: list[torch.dtype] = []
    block = Block()
    block.fc1.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
    policy = CastPolicy()
    x = torch.randn(2, 4, 16, requires_grad=True)
    with policy.scope(), disable_casts():
        y = checkpoint(block, x, use_reentrant=False, context_fn=checkpoint_contexts).sum()
    with policy.recompute_scope():  # would cast the recomputation without the recorded state
        y.backward()
    assert seen == [torch.float32, torch.float32]


# --- the Lightning plugin ------------------------------------------------------------------------------------------
pl = pytest.importorskip("lightning.pytorch")


class _LitLM(pl.LightningModule):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.model = TinyLM(reentrant)
        self.grads: dict[str, torch.Tensor] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return _loss(self.model, batch[0])

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.grads = {k.removeprefix("model."): v for k, v in _grads(self).items()}

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _lightning_grads(reentrant: bool | None, half: str) -> dict[str, torch.Tensor]:
    from lightning_mpx import MixedPrecisionPlugin

    from .lightning_helpers import make_trainer

    module = _LitLM(reentrant)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(_tokens()), batch_size=2)
    make_trainer(MixedPrecisionPlugin("O1", half_dtype=half, loss_scale=1.0), max_steps=1).fit(module, data)
    return module.grads


@pytest.mark.parametrize("reentrant", REENTRANT.values(), ids=REENTRANT.keys())
def test_lightning_checkpointed_gradients_equal_plain_o1(reentrant):
    _assert_same_grads(_lightning_grads(reentrant, "float16"), _lightning_grads(None, "float16"))


# --- the Accelerate adapter ----------------------------------------------------------------------------------------
def _accelerate_grads(reentrant: bool | None, half: str) -> dict[str, torch.Tensor]:
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        accelerator = Accelerator(
            mixed_precision="O1", kwargs_handlers=[MixedPrecisionKwargs(half_dtype=half, loss_scale=1.0)]
        )
        model = TinyLM(reentrant)
        model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        accelerator.backward(_loss(model, _tokens()))
        return _grads(accelerator.unwrap_model(model))
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.mark.parametrize("reentrant", REENTRANT.values(), ids=REENTRANT.keys())
def test_accelerate_checkpointed_gradients_equal_plain_o1(reentrant):
    _assert_same_grads(_accelerate_grads(reentrant, "bfloat16"), _accelerate_grads(None, "bfloat16"))


# --- Hugging Face --------------------------------------------------------------------------------------------------
def _tiny_gpt2() -> torch.nn.Module:
    """A two-layer GPT-2 from a config (nothing downloaded), seeded, in training mode, without dropout."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).train()


def _gpt2_grads(checkpointing: bool, half: str) -> dict[str, torch.Tensor]:
    model = _tiny_gpt2()
    if checkpointing:
        model.gradient_checkpointing_enable()
    amp = Amp("O1", half_dtype=half, loss_scale=1.0)
    model = amp.prepare_model(model)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with amp.forward_context():
        loss = model(input_ids=tokens, labels=tokens).loss
    amp.backward(loss)
    return _grads(model)


@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable.*:FutureWarning")
@pytest.mark.parametrize("half", HALVES)
def test_hugging_face_gradient_checkpointing(half):
    _assert_same_grads(_gpt2_grads(True, half), _gpt2_grads(False, half))


@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing_enable.*:FutureWarning")
def test_hugging_face_bare_backward_with_recorded_contexts():
    """``gradient_checkpointing_kwargs`` passes ``context_fn`` to torch's checkpoint: a bare ``loss.backward()`` of a
    GPT-2 at O1 gives the gradients of the same model without checkpointing."""
    model = _tiny_gpt2()
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": checkpoint_contexts}
    )
    amp = Amp("O1", half_dtype="bfloat16", loss_scale=1.0)
    model = amp.prepare_model(model)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with amp.forward_context():
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    _assert_same_grads(_grads(model), _gpt2_grads(False, "bfloat16"))
