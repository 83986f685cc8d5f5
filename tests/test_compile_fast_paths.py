"""The cast hook's short paths give what its general path gives: the same dtypes, values and gradients, eager and
compiled, and a compiled call does not guard on the whole table."""

from __future__ import annotations

import collections

import pytest
import torch

from lightning_mpx import CastPolicy, CastTable, dispatchable
from tests.compile_helpers import HALF

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _leaf(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).requires_grad_()


def _explicit_promote(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    widest = torch.promote_types(a.dtype, b.dtype)
    return torch.add(a.to(widest), b.to(widest))


@pytest.mark.parametrize(
    "shape_a,dtype_a,shape_b,dtype_b",
    [
        ((3, 4), torch.float32, (3, 4), HALF),  # same dimension category: torch's own promotion
        ((3, 4), HALF, (4,), torch.float16),  # float16 with bfloat16: float32 either way
        ((3, 4), HALF, (), torch.float32),  # zero-dim FP32 with a bf16 matrix: torch would stay bf16; the table casts
        ((), HALF, (), torch.float32),
    ],
)
def test_binary_promotion_matches_explicit_casts(shape_a, dtype_a, shape_b, dtype_b):
    policy = CastPolicy(half_dtype=HALF, engine="mode")  # the table's rule for 0-dim operands is the Python policy's
    a, b = _leaf(*shape_a, dtype=dtype_a), _leaf(*shape_b, dtype=dtype_b, seed=1)
    ref_a, ref_b = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    with policy.scope():
        out = a + b
        out_method = a.add(b)
    expected = _explicit_promote(ref_a, ref_b)
    assert out.dtype == out_method.dtype == expected.dtype == torch.promote_types(dtype_a, dtype_b)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.float().sum().backward()
    expected.float().sum().backward()
    for got, want in ((a.grad, ref_a.grad), (b.grad, ref_b.grad)):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    compiled = torch.compile(lambda x, y: x + y, backend="aot_eager", fullgraph=True)
    with policy.scope():
        assert compiled(a.detach(), b.detach()).dtype == out.dtype


def test_scalar_and_same_dtype_binary_calls_run_as_given():
    policy = CastPolicy(half_dtype=HALF)
    x = _leaf(3, 4, dtype=HALF)
    with policy.scope():
        assert (x * 2.0).dtype == HALF
        assert (2.0 - x).dtype == HALF
        assert (x + x).dtype == HALF
        assert torch.add(x, x, alpha=2).dtype == HALF  # keywords: the general path, no promotion either


def test_casts_leave_untouched_containers_as_given_and_cast_nested_ones():
    table = CastTable.default()
    seen = []

    @dispatchable
    def fn(pair, *rest, **kwargs):
        seen.append((pair, rest, kwargs))
        return pair

    Pair = collections.namedtuple("Pair", "first second")
    table.register(fn, "half")
    policy = CastPolicy(table, half_dtype=HALF)
    ints, x = (1, 2), _leaf(2, dtype=torch.float32)
    with policy.scope():
        fn(Pair(x, ints), ints, [[x]], key=(x,))
    pair, rest, kwargs = seen[0]
    assert type(pair) is Pair and pair.first.dtype == HALF and pair.second is ints
    assert rest[0] is ints and rest[1][0][0].dtype == HALF
    assert kwargs["key"][0].dtype == HALF


def test_compiled_call_guards_on_the_table_stamp_not_on_its_keys():
    # Guards are checked at every call of compiled code: one per table key would cost more than the ops of a small
    # model. The action lookup is a constant for dynamo, guarded by the table's stamp.
    policy = CastPolicy(half_dtype=HALF)
    guards: list[str] = []

    def backend(gm, example_inputs):
        return gm.forward

    compiled = torch.compile(lambda a, b: (a @ b).softmax(-1) + a.sum(), backend=backend, fullgraph=True)
    a, b = _leaf(4, 4).detach(), _leaf(4, 4, seed=1).detach()
    with policy.scope():
        compiled(a, b)
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    code = compiled._torchdynamo_orig_callable.__code__
    for entry in _debug_get_cache_entry_list(code):
        guards.append(str(entry.guard_manager))
    text = "\n".join(guards)
    assert "_actions_stamp" in text
    assert "dict.keys" not in text and "_actions[" not in text
    assert text.count("\n") < 200  # the few guards of the call, not the ~330 entries of the table
