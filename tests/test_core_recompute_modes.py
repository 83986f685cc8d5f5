"""Attacks from a user's side on issue 41's features: backward passes that enter a recompute mode only after a
checkpointed forward, cast modes set aside around FSDP2's hooks, and fused Adam/AdamW skipping on the device.

The defects found (the Fabric GAN loop, nested reentrant checkpoints) are fixed; the other tests are attacks that
held."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_mpx import Amp, FabricMixedPrecisionPlugin
from tests.test_checkpointing import Block, _tokens


class _LM(nn.Module):
    """Embedding, two blocks run by ``run(self, x)`` (plain when ``None``), a head."""

    def __init__(self, run=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(16, 32)
        self.run = run

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        return self.head(self.blocks(x) if self.run is None else self.run(self, x))


def _o1_grads(run=None, prepare=None, **backward_kwargs) -> list[torch.Tensor]:
    amp = Amp("O1", half_dtype="bfloat16", loss_scale=1.0)
    model = _LM(run)
    if prepare is not None:
        prepare(model)
    model = amp.prepare_model(model)
    tokens = _tokens()
    with amp.forward_context():
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1))
    if backward_kwargs.get("retain_graph"):
        amp.backward(loss, retain_graph=True)
    amp.backward(loss)
    return [p.grad.clone() for p in model.parameters()]


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=0, atol=0)


# --- 1. a backward pass enters the recompute mode only after a checkpointed forward -------------------------------
def _nested(reentrant: bool):
    def run(model: _LM, x: torch.Tensor) -> torch.Tensor:
        def outer(x: torch.Tensor) -> torch.Tensor:
            return model.blocks[1](checkpoint(model.blocks[0], x, use_reentrant=reentrant))

        return checkpoint(outer, x, use_reentrant=reentrant)

    return run


def _selective(model: _LM, x: torch.Tensor) -> torch.Tensor:
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
    return checkpoint(model.blocks, x, use_reentrant=False, context_fn=context_fn)


def _sequential(reentrant: bool):
    def run(model: _LM, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint_sequential(model.blocks, 2, x, use_reentrant=reentrant)

    return run


def _composable(model: _LM) -> None:
    from torch.distributed._composable import checkpoint as composable_checkpoint

    for block in model.blocks:
        composable_checkpoint(block)


def _wrapped(model: _LM) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))


@pytest.mark.parametrize(
    ("run", "prepare"),
    [
        (_nested(False), None),
        (_selective, None),
        (_sequential(False), None),
        (_sequential(True), None),
        (None, _composable),
        (None, _wrapped),
    ],
    ids=["nested-non-reentrant", "selective", "sequential", "sequential-reentrant", "composable", "wrapper"],
)
@pytest.mark.parametrize("retain_graph", [False, True], ids=["once", "twice"])
def test_checkpoint_variants_are_detected_and_match_plain_o1(run, prepare, retain_graph):
    if prepare is _composable and retain_graph:
        pytest.skip("torch's composable checkpoint fails a second backward of a retained graph without mpx too")
    _assert_same(_o1_grads(run, prepare, retain_graph=retain_graph), _o1_grads(retain_graph=retain_graph))


def test_nested_reentrant_checkpoints_match_plain_o1():
    """Recomputing the outer reentrant checkpoint runs the inner one's forward under no_grad, inside the outer's
    backward node: the recompute mode casts it there (before the fix: FP32 where the forward had bf16, silently
    different gradients; the mode took any gradients-off call for a backward function)."""
    _assert_same(_o1_grads(_nested(True)), _o1_grads())


class _Generator(nn.Module):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.reentrant = reentrant

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        def body(x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)))

        return body(z) if self.reentrant is None else checkpoint(body, z, use_reentrant=self.reentrant)


def _fabric_gan(reentrant: bool | None) -> list[torch.Tensor]:
    """The usual GAN loop in Fabric: G's forward, D's step on the detached fake, then G's backward through D."""
    from lightning.fabric import Fabric

    plugin = FabricMixedPrecisionPlugin("O1", half_dtype=torch.bfloat16, loss_scale=1.0)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[plugin])
    generator, discriminator = _Generator(reentrant), nn.Linear(8, 1)
    generator, opt_g = fabric.setup(generator, torch.optim.SGD(generator.parameters(), lr=0.1))
    discriminator, opt_d = fabric.setup(discriminator, torch.optim.SGD(discriminator.parameters(), lr=0.1))
    z = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()  # reentrant needs one
    for _ in range(2):
        fake = generator(z)
        opt_d.zero_grad()
        fabric.backward(discriminator(fake.detach()).float().mean())
        opt_d.step()
        # D's forward starts work: Fabric's plugin ends the iteration (Amp.update -> CastPolicy.clear_cache) while
        # G's checkpointed graph is still to be differentiated.
        opt_g.zero_grad()
        fabric.backward(discriminator(fake).float().mean())
        opt_g.step()
    return [p.detach().clone() for p in generator.parameters()]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_fabric_gan_loop_with_a_checkpointed_generator_matches_plain_o1(reentrant):
    """Fabric ends the iteration at D's forward (Amp.update -> CastPolicy.clear_cache) while G's checkpointed graph
    is still to be differentiated: what G's forward noted is kept across that one boundary, so G's backward still
    recomputes with the casts (before the fix: CheckpointError, or an FP32 recomputation and other weights)."""
    _assert_same(_fabric_gan(reentrant), _fabric_gan(None))


# --- 2. cast modes set aside around FSDP2's hooks (shard_model) ---------------------------------------------------
class _Reused(nn.Module):
    """A sharded block called twice per forward around a batch-norm island (FP32 at O1)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.bn, self.l2 = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.l1(torch.relu(self.bn(self.l1(x)))))


def _cast_modes() -> int:
    from lightning_mpx.casting.mode import _CastMode

    return sum(type(m) is _CastMode for m in torch.overrides._get_current_function_mode_stack())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_shard_model_o1_matches_unsharded_with_a_reused_block_an_island_and_a_raising_forward(one_rank, compiled):
    from lightning_mpx.integrations.fsdp import shard_model

    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    results = []
    for sharded in (False, True):
        amp = Amp("O1", half_dtype="bfloat16")
        net = _Reused()
        if sharded:
            shard_model(net, amp, blocks=[net.l1])
        run = torch.compile(net, backend="aot_eager") if compiled and sharded else net
        with amp.forward_context():
            if sharded:
                with pytest.raises(RuntimeError):
                    run(torch.randn(4, 7))  # a shape error inside the forward, between FSDP's hooks
                assert _cast_modes() == 1
            outputs = [run(x), run(x)]  # called twice per step
            assert _cast_modes() == 1
        assert _cast_modes() == 0
        outputs[0].float().sum().backward()
        grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in net.parameters()]
        results.append((outputs, grads))
    (want_out, want_grads), (got_out, got_grads) = results
    for got, want in zip(got_out + got_grads, want_out + want_grads):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)
