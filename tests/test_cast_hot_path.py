"""The O1 hook's short paths (two-tensor promotion, inline argument casts, the parameter-cast cache) give what the
general path gives, and the explicit-cast twin of ``benchmarks/cast_overhead.py`` applies exactly the table's casts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_mpx import CastPolicy, CastTable, dispatchable

ROOT = Path(__file__).resolve().parents[1]
f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


@dispatchable
def _probe(*args, **kwargs):
    return args + tuple(kwargs.values())


def _policy(category="promote"):
    table = CastTable.default()
    table.register(_probe, category)
    return CastPolicy(table, bf16)


@pytest.mark.parametrize(
    ("first", "second"),
    [(torch.int64, bf16), (bf16, torch.int64), (torch.bool, f16), (f16, f32), (f64, bf16), (bf16, bf16)],
    ids=str,
)
def test_two_tensor_promotion_agrees_with_the_general_path(first, second):
    # Two tensors take the hook's short path, three the general one (_widest): the same dtypes come out, and an
    # integer or bool tensor takes no part in the promotion and is passed as given.
    a, b = torch.ones(3, dtype=first), torch.ones(3, dtype=second)
    with _policy().scope():
        pair = _probe(a, b)
        triple = _probe(a, b, b)
    assert [t.dtype for t in pair] == [t.dtype for t in triple[:2]]
    floating = [d for d in (first, second) if d.is_floating_point]
    widest = torch.promote_types(*floating) if len(floating) == 2 else None
    for given, got in zip((a, b), pair):
        if widest is None or given.dtype in (widest, torch.int64, torch.bool):
            assert got is given
        else:
            assert got.dtype == widest


def test_two_tensor_promotion_caches_a_parameter_cast_until_it_changes():
    param = torch.nn.Parameter(torch.randn(3, dtype=bf16))
    x = torch.randn(3)
    policy = _policy()
    with policy.scope():
        first, second = _probe(param, x)[0], _probe(x, param)[1]
        assert first.dtype == f32 and first is second  # one cast, from the cache
        with torch.no_grad():
            param.add_(1)
        third = _probe(param, x)[0]
    assert third is not first
    torch.testing.assert_close(third, param.detach().to(f32), rtol=0, atol=0)
    third.sum().backward()
    assert param.grad is not None and param.grad.dtype == bf16


def test_parameters_inside_a_list_and_a_keyword_are_cast_and_cached():
    param = torch.nn.Parameter(torch.randn(3))
    policy = _policy("half")
    with policy.scope():
        (listed,), keyword = _probe([param], w=param)
    assert listed.dtype == bf16 and keyword is listed  # the same cached cast for both places
    assert policy.cache_size == 1


@pytest.mark.parametrize(("category", "given", "expected"), [("half", f32, bf16), ("float", bf16, f32)])
def test_a_half_or_float_call_of_two_arguments_is_cast_in_every_mode(category, given, expected):
    # A tensor and a number (x.softmax(-1)) take no promotion short cut whatever the mode: a forward scope's inline
    # casts, a backward's recompute mode (what recomputes an activation checkpoint) and an FP32 module's scope.
    from lightning_mpx.casting.scopes import fp32_scope

    x = torch.ones(3, dtype=given, requires_grad=True)
    policy = _policy(category)
    with policy.scope():
        assert _probe(x, -1)[0].dtype == expected
        with fp32_scope():
            assert _probe(x, -1)[0].dtype == f32
    with policy.recompute_scope(create_graph=True):  # a recompute mode: it casts what runs with gradients on
        assert _probe(x, -1)[0].dtype == expected
        assert _probe(x, x, w=x)[2].dtype == expected


# The compute kernels of the twin test: where the casts decide a dtype. Residual additions are left out: the policy
# adds an FP32 and a half tensor (aten promotes inside the kernel), the twin casts first; the same exact arithmetic.
_COMPUTE_OPS = ("mm", "bmm", "addmm", "native_layer_norm", "_softmax", "gelu", "_log_softmax", "nll_loss")


class _ComputeDtypes(TorchDispatchMode):
    """Records each compute kernel that runs (forward and backward) with the dtypes of its tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name.removesuffix("_backward") in _COMPUTE_OPS:
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            self.calls.append((name, tuple(t.dtype for t in leaves if isinstance(t, torch.Tensor))))
        return func(*args, **kwargs)


@pytest.mark.parametrize("model", ["tiny", "mid"])
@pytest.mark.parametrize("half", [bf16, f16], ids=["bf16", "fp16"])
def test_benchmark_twin_applies_the_tables_casts(model, half):
    """The twin is the reference of cast_overhead.py's /twin ratio: it must do the policy's casts, no more, no fewer.

    Checked exactly on what the casts decide: every compute kernel of the forward and the backward runs in the same
    dtypes, in the same order. The values are then compared to a tolerance, values first: the two paths reach those
    kernels through different code (the policy's cached casts, a mixed-dtype addition against cast-then-add), and a
    CPU may pick another vectorized kernel for one of them (measured on an AMD EPYC with AVX-512 bfloat16 but not
    float16: gradients 1.7378e-05 against 1.7367e-05 in float16, 0.65 of its eps). Such a difference is a rounding
    of a half result (eps/2 relative), carried through the few layers after it: two eps relative to each tensor's
    largest value bounds it, while a cast too many or too few shows in the kernel dtypes above.
    """
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from cast_overhead import MODELS, TinyLM
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    torch.manual_seed(0)
    net = TinyLM(**MODELS[model])
    idx = torch.randint(0, 64, (2, 32))
    targets = torch.roll(idx, -1, 1)
    policy = CastPolicy(half_dtype=half)
    with _ComputeDtypes() as by_policy:
        with policy.scope():
            loss = net(idx, targets)
        policy.backward(loss)
    grads = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    with _ComputeDtypes() as by_twin:
        twin = net.twin(idx, targets, half)
        twin.backward()
    assert by_policy.calls and by_twin.calls == by_policy.calls

    eps = torch.finfo(half).eps
    torch.testing.assert_close(twin, loss, rtol=2 * eps, atol=0)
    for (name, p), g in zip(net.named_parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=2 * eps, atol=2 * eps * float(g.abs().max()),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_the_scope_resolves_the_table_again_whenever_its_key_changes():
    # Eager scopes and backward passes compare the policy with what its actions were resolved from (a C-level read,
    # mode._actions_key) instead of calling _refresh_actions: the read must be the key _refresh_actions records.
    from lightning_mpx.casting.mode import _actions_key

    x = torch.ones(3)
    policy = _policy("float")
    changes = [lambda: policy.table.register(_probe, "half"), lambda: setattr(policy, "half_dtype", f16),
               lambda: setattr(policy, "table", _policy("float").table), lambda: setattr(policy, "engine", "autocast")]
    expected = [bf16, f16, f32, f32]
    for change, dtype in zip(changes, expected):
        with policy.scope():
            pass
        assert _actions_key(policy) == policy._actions_of
        change()
        with policy.scope():
            assert _probe(x)[0].dtype == dtype
        assert _actions_key(policy) == policy._actions_of


@pytest.mark.parametrize("change", ["row", "half_dtype", "table", "engine", "allow_banned", "refuse_inplace_float"])
def test_the_forward_scope_on_autocast_alone_resolves_the_table_again_whenever_its_key_changes(change):
    # CastPolicy.forward_scope reads the key attribute by attribute (dynamo traces it) before it takes autocast alone:
    # each field of the key _refresh_actions records must send it back to a resolution.
    from lightning_mpx.casting.mode import _actions_key

    policy = CastPolicy(CastTable.autocast_aligned("cpu"), half_dtype=bf16, device_type="cpu")
    for _ in range(2):  # the first scope constructs torch.autocast, the next one switches it on
        with policy.forward_scope():
            pass
    if change == "row":
        policy.table.register(_probe, "half")
    elif change == "table":
        policy.table = CastTable.autocast_aligned("cpu")
    else:
        setattr(policy, change, {"half_dtype": f16, "engine": "mode"}.get(change, True))
    with policy.forward_scope():
        pass
    assert _actions_key(policy) == policy._actions_of
