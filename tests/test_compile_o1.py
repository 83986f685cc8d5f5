"""O1 under ``torch.compile``: the policy is traced into one graph, with the table's dtypes, and never recompiles.

The compiled runs use the ``aot_eager`` backend (tests/compile_helpers.py says why).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from lightning_mpx import CastPolicy, CastTable, dispatchable
from lightning_mpx.casting.policy import disable_casts
from tests.compile_helpers import HALF, HookCounter, assert_one_graph, o1_accelerator

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class Block(nn.Module):
    """A tiny pre-norm transformer block written with plain ops, ending in a loss."""

    def __init__(self, dim: int = 16, heads: int = 2, vocab: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads = heads
        self.tok = nn.Embedding(vocab, dim)
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        att = ((q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 32, (2, 8), generator=g)
    return idx, torch.roll(idx, -1, 1)


def _train(model: nn.Module, run: Callable[..., torch.Tensor], policy: CastPolicy, steps: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        loss = run(*_data(step))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        policy.clear_cache()
        losses.append(loss.item())
    return losses


def _assert_no_breaks(backend: CompileCounterWithBackend) -> None:
    assert_one_graph()
    assert backend.frame_count == 1, f"{backend.frame_count} compilations: a recompile"


def _scope_outside(model: Callable[..., torch.Tensor], policy: CastPolicy) -> Callable[..., torch.Tensor]:
    """``model``'s call (compiled or not) inside the policy's scope, entered outside any compiled code."""

    def run(*data: torch.Tensor) -> torch.Tensor:
        with policy.scope():
            return model(*data)

    return run


def _scope_inside(model: nn.Module, policy: CastPolicy, backend: Any = "aot_eager") -> Callable[..., torch.Tensor]:
    """``model``'s call with the policy's scope entered inside one compiled (fullgraph) function."""

    @torch.compile(backend=backend, fullgraph=True)
    def run(*data: torch.Tensor) -> torch.Tensor:
        with policy.scope():
            return model(*data)

    return run


@pytest.mark.parametrize("fullgraph", [False, True])
def test_policy_entered_outside_compiled_model_has_no_graph_break_or_recompile(fullgraph):
    model, policy, backend = Block(), CastPolicy(half_dtype=HALF), CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=backend, fullgraph=fullgraph)
    _train(model, _scope_outside(compiled, policy), policy, steps=10)
    _assert_no_breaks(backend)


def test_policy_entered_inside_compiled_region_has_no_graph_break_or_recompile():
    model, policy, backend = Block(), CastPolicy(half_dtype=HALF), CompileCounterWithBackend("aot_eager")
    _train(model, _scope_inside(model, policy, backend), policy, steps=10)
    _assert_no_breaks(backend)


def test_compiled_training_matches_eager():
    eager_model, compiled_model = Block(), Block()
    compiled_model.load_state_dict(eager_model.state_dict())
    policy_e, policy_c = CastPolicy(half_dtype=HALF), CastPolicy(half_dtype=HALF)
    compiled = torch.compile(compiled_model, backend="aot_eager")
    eager = _train(eager_model, _scope_outside(eager_model, policy_e), policy_e, steps=4)
    comp = _train(compiled_model, _scope_outside(compiled, policy_c), policy_c, steps=4)
    torch.testing.assert_close(torch.tensor(comp), torch.tensor(eager), rtol=2e-2, atol=2e-2)


# (call, args) whose output dtype must be the same eager and compiled; FP32 and half inputs mixed where it matters.
def _x(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)


DTYPE_ROWS: list[tuple[str, Callable[..., Any], tuple[Any, ...]]] = [
    ("mm", torch.mm, (_x(3, 4), _x(4, 5))),
    ("matmul", torch.matmul, (_x(3, 4), _x(4, 5))),
    ("linear", F.linear, (_x(3, 4), _x(5, 4), _x(5))),
    ("addmm", torch.addmm, (_x(3, 5), _x(3, 4), _x(4, 5))),
    ("conv1d", F.conv1d, (_x(1, 2, 8), _x(3, 2, 3))),
    ("bmm", torch.bmm, (_x(2, 3, 4), _x(2, 4, 5))),
    ("softmax", torch.softmax, (_x(3, 4, dtype=HALF), -1)),
    ("log_softmax", F.log_softmax, (_x(3, 4, dtype=HALF), -1)),
    ("layer_norm", F.layer_norm, (_x(3, 4, dtype=HALF), (4,))),
    ("exp", torch.exp, (_x(3, 4, dtype=HALF),)),
    ("sum", torch.sum, (_x(3, 4, dtype=HALF),)),
    ("mse_loss", F.mse_loss, (_x(3, 4, dtype=HALF), _x(3, 4, dtype=HALF))),
    ("cross_entropy", F.cross_entropy, (_x(3, 4, dtype=HALF), torch.tensor([0, 1, 3]))),
    ("add", torch.add, (_x(3, 4, dtype=HALF), _x(3, 4))),
    ("cat", torch.cat, ([_x(3, 4, dtype=HALF), _x(3, 4)],)),
    ("stack", torch.stack, ([_x(3, 4, dtype=HALF), _x(3, 4)],)),
    ("relu", F.relu, (_x(3, 4),)),
    ("Tensor.matmul", torch.Tensor.matmul, (_x(3, 4), _x(4, 5))),
    ("Tensor.softmax", torch.Tensor.softmax, (_x(3, 4, dtype=HALF), -1)),
]


@pytest.mark.parametrize("call,args", [row[1:] for row in DTYPE_ROWS], ids=[row[0] for row in DTYPE_ROWS])
def test_table_op_dtype_is_the_same_eager_and_compiled(call, args):
    policy = CastPolicy(half_dtype=HALF)
    with policy.scope():
        eager = call(*args)
    compiled_call = torch.compile(lambda *a: call(*a), backend="aot_eager", fullgraph=True)
    with policy.scope():
        compiled = compiled_call(*args)
    assert compiled.dtype == eager.dtype
    torch.testing.assert_close(compiled, eager)


def test_every_table_op_of_the_model_is_in_one_graph_with_the_tables_dtype():
    model = Block()
    policy = CastPolicy(half_dtype=HALF)
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with policy.scope():
        compiled(*_data())
    assert len(graphs) == 1
    # Each linear's weight reaches the graph's linear in the half dtype, and layer norm sees FP32.
    seen: dict[str, set[torch.dtype]] = {}
    for node in graphs[0].graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", "") in ("linear", "layer_norm"):
            seen.setdefault(node.target.__name__, set()).add(node.meta["example_value"].dtype)
    assert seen == {"linear": {HALF}, "layer_norm": {torch.float32}}


@dispatchable
def _user_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


@pytest.mark.parametrize("fullgraph", [False, True])
def test_dispatchable_user_function_keeps_its_cast_under_compile(fullgraph):
    table = CastTable.default()
    table.register(_user_matmul, "float")
    policy = CastPolicy(table, half_dtype=HALF)

    def f(a, b):
        return _user_matmul(a.to(HALF), b.to(HALF))

    a, b = _x(3, 4), _x(4, 5)
    with policy.scope():
        eager = f(a, b)
    with policy.scope():
        compiled = torch.compile(f, backend="aot_eager", fullgraph=fullgraph)(a, b)
    assert eager.dtype == compiled.dtype == torch.float32
    assert not counters["graph_break"]


def test_table_registration_after_compiling_takes_effect():
    table = CastTable.default()
    policy = CastPolicy(table, half_dtype=HALF)
    compiled = torch.compile(lambda a, b: torch.outer(a, b), backend="aot_eager", fullgraph=True)
    a, b = _x(3), _x(4)
    with policy.scope():
        assert compiled(a, b).dtype == torch.float32
    table.register(torch.outer, "half")
    with policy.scope():
        assert compiled(a, b).dtype == HALF
    table.unregister(torch.outer)
    with policy.scope():
        assert compiled(a, b).dtype == torch.float32


def test_disable_casts_and_nested_scopes_inside_compiled_code_behave_as_in_eager():
    policy = CastPolicy(half_dtype=HALF)
    inner = CastPolicy(half_dtype=torch.float16)

    def f(a, b):
        with disable_casts():
            plain = a @ b
        with inner.scope():
            nested = a @ b
        return plain, nested, a @ b

    a, b = _x(3, 4), _x(4, 5)
    with policy.scope():
        eager = f(a, b)
    with policy.scope():
        compiled = torch.compile(f, backend="aot_eager")(a, b)
    assert [t.dtype for t in compiled] == [t.dtype for t in eager] == [torch.float32, torch.float16, HALF]


def test_exception_inside_compiled_scope_leaves_no_mode_behind():
    policy = CastPolicy(half_dtype=HALF)

    @torch.compile(backend="aot_eager")
    def f(a):
        with policy.scope():
            y = a @ a
            if y.dtype == HALF:
                raise ValueError("boom")
            return y

    with pytest.raises(ValueError, match="boom"):
        f(_x(3, 3))
    assert not torch.overrides._get_current_function_mode_stack()
    assert (_x(3, 3) @ _x(3, 3)).dtype == torch.float32


# -- through the plugins ------------------------------------------------------------------------------------------


def _trainer_losses(compiled: bool) -> list[float]:
    pytest.importorskip("lightning")
    from lightning_mpx.integrations.lightning import MixedPrecisionPlugin
    from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer

    model = Classifier()
    model.net[0]._forward_hooks.clear()  # the helper's dtype recorder writes to a dict: a recompile per new key
    if compiled:
        model.net = torch.compile(model.net, backend="aot_eager")
    trainer = make_trainer(MixedPrecisionPlugin("O1", half_dtype="bfloat16"))
    trainer.fit(model, loader(classification_data()))
    return model.losses


def test_trainer_with_a_compiled_network_at_o1_matches_eager_without_graph_breaks():
    eager = _trainer_losses(compiled=False)
    compiled = _trainer_losses(compiled=True)
    assert_one_graph()  # no recompile over the steps
    assert len(compiled) == len(eager) == 4  # 64 samples, batches of 16, one epoch
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=2e-2, atol=1e-2)


def _accelerate_losses(compile_after_prepare: bool) -> tuple[list[float], list[int]]:
    pytest.importorskip("accelerate")
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 3))
    with o1_accelerator(net, "after_prepare" if compile_after_prepare else None) as (accelerator, model, opt):
        losses, forward_hook_calls = [], []
        for step in range(6):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
            x, y = x.to(accelerator.device), y.to(accelerator.device)  # where the Accelerator put the model (a GPU)
            with HookCounter() as counter:
                output = model(x)
            forward_hook_calls.append(counter.calls)
            loss = F.cross_entropy(output, y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses, forward_hook_calls


def test_accelerator_with_a_compiled_model_at_o1_matches_eager_without_graph_breaks():
    eager, eager_calls = _accelerate_losses(compile_after_prepare=False)
    compiled, compiled_calls = _accelerate_losses(compile_after_prepare=True)
    assert_one_graph()
    # The prepared forward enters the policy, so compiling the prepared model puts the policy inside the compiled
    # region: the steady-state forward makes no call into the hook (eager makes one per table op).
    assert eager_calls[-1] > 0 and compiled_calls[1:] == [0] * 5
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-2, atol=1e-3)


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.ln, self.fc2 = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.ln(self.fc1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self._inner, x, use_reentrant=False)
        return self.fc2(h).float().pow(2).mean()


def test_activation_checkpointing_under_compile_gives_eager_gradients():
    x = _x(4, 8)
    grads = []
    for compiled in (False, True):
        model = _Checkpointed()
        policy = CastPolicy(half_dtype=HALF)
        run = torch.compile(model, backend="aot_eager") if compiled else model
        with policy.scope():
            loss = run(x)
        with policy.recompute_scope():
            loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    assert not counters["graph_break"], dict(counters["graph_break"])
    for name, grad in grads[0].items():
        assert grads[1][name].dtype == torch.float32
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=0, msg=name)  # eager casts, traced


def test_policy_entered_inside_compiled_region_makes_no_hook_calls_in_the_forward():
    model, policy = Block(), CastPolicy(half_dtype=HALF)
    run = _scope_inside(model, policy)
    _train(model, run, policy, steps=2)
    with HookCounter() as counter:
        loss = run(*_data(5))
    assert counter.calls == 0
    with policy.scope():
        eager = model(*_data(5))
    torch.testing.assert_close(loss, eager, rtol=1e-2, atol=1e-2)
