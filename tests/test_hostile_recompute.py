"""Attacks from a user's side on activation checkpointing and ``torch.compile`` under the cast table: the recomputation
must run with the forward's casts, in eager mode and in a compiled graph.

Found and fixed: under ``torch.compile`` dynamo hands a checkpoint call to the cast mode and traces the checkpointed
function while the mode is set aside, so at O1 a compiled model's checkpointed blocks ran in FP32, forward and
recompute, silently (the loss was neither the eager O1 loss nor the FP32 one). Held: the table's dtypes in the eager
recomputation (matmuls in half, softmax and layer norm in FP32), dropout under ``preserve_rng_state`` at O1-O3, a
block checkpointed twice in one forward, a Hugging Face LLaMA's default ``gradient_checkpointing_enable()`` through
the Accelerate adapter, one graph over the steps for a compiled checkpointed model.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from lightning_mpx import Amp
from tests.compile_helpers import assert_one_graph
from tests.test_checkpointing import REENTRANT

aten = torch.ops.aten
_WATCHED = {aten.mm: "mm", aten.addmm: "mm", aten._softmax: "softmax", aten.native_layer_norm: "layer_norm"}


class _Dtypes(TorchDispatchMode):
    """Records ``(op, first tensor argument's dtype)`` for the matmuls, softmaxes and layer norms that run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, torch.dtype]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = _WATCHED.get(func.overloadpacket)
        if name is not None:
            self.seen.add((name, next(a for a in args if isinstance(a, torch.Tensor)).dtype))
        return func(*args, **(kwargs or {}))


class _Net(nn.Module):
    """Linear -> layer norm -> softmax -> linear, the middle checkpointed (``reentrant`` None: not), optionally
    twice, with dropout."""

    def __init__(self, reentrant: bool | None, twice: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.ln, self.fc2, self.head = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.reentrant, self.twice, self.dropout = reentrant, twice, dropout

    def _block(self, h: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.fc2(self.ln(h).softmax(-1)), self.dropout, self.training)
        return h + torch.relu(self.fc1.weight.new_ones(()) * h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        for _ in range(2 if self.twice else 1):
            h = self._block(h) if self.reentrant is None else checkpoint(self._block, h, use_reentrant=self.reentrant)
        return self.head(h)


def _batch(step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


def _graph_dtypes(forward: set[tuple[str, torch.dtype]], backward: set[tuple[str, torch.dtype]]) -> Any:
    """A ``torch.compile`` backend that runs AOT autograd's graphs as they are (as ``aot_eager``) and notes the
    dtypes of their watched ops: the forward graph's, and the backward graph's (where checkpointed code is
    recomputed)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def compiler(seen: set[tuple[str, torch.dtype]]) -> Any:
        def compile_graph(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            for node in gm.graph.nodes:
                name = _WATCHED.get(getattr(node.target, "overloadpacket", None))
                if name is not None:
                    seen.add((name, next(a for a in node.args if isinstance(a, torch.fx.Node)).meta["val"].dtype))
            return make_boxed_func(gm.forward)

        return compile_graph

    return aot_autograd(fw_compiler=compiler(forward), bw_compiler=compiler(backward))


def _steps(level: str, model: nn.Module, steps: int = 1, compile_at: str | None = None, hand_off: bool = False,
           record: tuple[_Dtypes, _Dtypes] | None = None, backend: Any = "aot_eager"
           ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and last gradients of ``steps`` SGD steps through the core at ``level`` (bfloat16, scale 1);
    ``record``: the dispatch modes that see the first step's forward and backward (eager); ``compile_at``: compile
    with ``backend`` "before" or "after" ``prepare_model``."""
    amp = Amp(level, half_dtype="bfloat16", loss_scale=1.0)
    run = torch.compile(model, backend=backend) if compile_at == "before" else model
    run = amp.prepare_model(run)
    if compile_at == "after":
        run = torch.compile(run, backend=backend)
    if hand_off:
        amp.policy.hand_off_compiled(run)
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    losses = []
    for step in range(steps):
        x, y = _batch(step)
        torch.manual_seed(step + 1)  # dropout
        forward, backward = record if record is not None and step == 0 else (nullcontext(), nullcontext())
        with forward, amp.forward_context():
            loss = F.cross_entropy(run(amp.cast_inputs(x)).float(), y)
        with backward:
            amp.backward(loss)
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        amp.step(optimizer)
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and got
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


# --- the finding: a compiled model's checkpointed blocks ran without casts ----------------------------------------
@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize(
    ("reentrant", "compile_at", "hand_off"), [(True, "before", False), (False, "after", True)],
    ids=["reentrant-outside", "non_reentrant-handed_off"],
)
def test_compiled_checkpoint_runs_the_table_in_forward_and_recompute(reentrant, compile_at, hand_off):
    """Compiled (aot_eager) before or after ``prepare_model``, with the scope entered around the compiled model or
    handed off inside it: the losses are eager O1's bit for bit, one graph without a break over the steps (no
    recompile per step), and the graph's matmuls run in bfloat16, its softmax and layer norm in FP32, in the forward
    and in the backward's recomputation (before the fix: all FP32, and the losses off by ~5e-4)."""
    eager, _ = _steps("O1", _Net(reentrant), steps=2)
    counters.clear()
    forward: set[tuple[str, torch.dtype]] = set()
    backward: set[tuple[str, torch.dtype]] = set()
    compiled, _ = _steps("O1", _Net(reentrant), steps=2, compile_at=compile_at, hand_off=hand_off,
                         backend=_graph_dtypes(forward, backward))
    assert compiled == eager
    assert_one_graph()
    assert forward == {("mm", torch.bfloat16), ("softmax", torch.float32), ("layer_norm", torch.float32)}
    assert backward >= {("softmax", torch.float32), ("layer_norm", torch.float32)}  # the recomputation
    assert ("mm", torch.float32) not in backward


# --- what held -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reentrant", REENTRANT.values(), ids=REENTRANT.keys())
def test_eager_recompute_runs_the_table(reentrant):
    """The backward pass of a checkpointed O1 forward recomputes its matmuls in bfloat16 and its softmax and layer
    norm in FP32, as the forward ran them."""
    forward, backward = _Dtypes(), _Dtypes()
    _steps("O1", _Net(reentrant), record=(forward, backward))
    assert forward.seen == {("mm", torch.bfloat16), ("softmax", torch.float32), ("layer_norm", torch.float32)}
    assert forward.seen <= backward.seen and ("softmax", torch.bfloat16) not in backward.seen


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_dropout_and_a_block_checkpointed_twice_match_the_plain_run(level):
    """Dropout in a block checkpointed twice in one forward (``preserve_rng_state``, torch's default): the
    non-reentrant gradients are those of the plain run bit for bit; the reentrant ones too at O2/O3, and within
    bfloat16 rounding at O1 (a reentrant recomputation sums a reused weight's gradients in FP32 where the forward's
    shared cast sums them in half, as ``torch.autocast`` does), and both stay near the FP32 twin's."""
    _, plain = _steps(level, _Net(None, twice=True, dropout=0.3))
    _, fp32 = _steps("O0", _Net(None, twice=True, dropout=0.3))
    for reentrant in (False, True):
        _, grads = _steps(level, _Net(reentrant, twice=True, dropout=0.3))
        if reentrant and level == "O1":
            for name, grad in plain.items():
                torch.testing.assert_close(grads[name], grad, rtol=2e-2, atol=2e-3, msg=name)
        else:
            _same(grads, plain)
        for name, grad in fp32.items():  # within 5% of the largest FP32 gradient (bfloat16 at O2/O3)
            assert (grads[name].float() - grad).abs().max() <= 5e-2 * grad.abs().max(), name


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_accelerate_llama_default_gradient_checkpointing_matches_plain_o1():
    """A LLaMA-like model from a config with ``gradient_checkpointing_enable()`` (transformers' default: non-reentrant)
    through the Accelerate adapter at O1: two steps give the losses and gradients of the same model without it."""
    transformers = pytest.importorskip("transformers")
    from lightning_mpx.accelerate import Accelerator

    def run(checkpointing: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        from tests.accelerate_helpers import accelerate_state_reset

        with accelerate_state_reset():
            torch.manual_seed(0)
            config = transformers.LlamaConfig(
                vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=32, use_cache=False,
            )
            net = transformers.LlamaForCausalLM(config)
            if checkpointing:
                net.gradient_checkpointing_enable()
            accelerator = Accelerator(mixed_precision="O1")
            model, optimizer = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
            ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
            losses = []
            for _ in range(2):
                loss = model(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
                grads = {name: p.grad.clone() for name, p in model.named_parameters()}
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
            return losses, grads

    (plain_losses, plain), (losses, grads) = run(False), run(True)
    assert losses == plain_losses
    _same(grads, plain)
