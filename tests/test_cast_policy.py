"""The cast policy: the rules of each category, banned ops, gradients, the parameter cache, scopes and threads."""

import threading

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_mpx import BannedOpError, CastTable, disable_casts, dispatchable
from lightning_mpx import CastPolicy as _CastPolicy


def CastPolicy(*args, **kwargs):  # noqa: N802
    """The Python policy's engine: these tests watch what each function receives, and its cast cache
    (tests/test_autocast_engine.py checks the \"autocast\" engine by the dtypes it computes in)."""
    return _CastPolicy(*args, engine="mode", **kwargs)


f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
HALF_DTYPES = [f16, bf16]


def _dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


@dispatchable
def _probe(*args, **kwargs):
    """Returns its arguments as received: registered in a category, it shows exactly what the policy handed over."""
    return args + tuple(kwargs.values())


def _policy_with_probe(category, half_dtype=f16):
    table = CastTable.default()
    table.register(_probe, category)
    return CastPolicy(table, half_dtype)


class _Calls(TorchFunctionMode):
    """Records the arguments ``target`` receives. Enter it before (so below) the policy's scope: the policy casts,
    then calls the function again, which reaches this mode with the arguments the policy made."""

    def __init__(self, target):
        super().__init__()
        self.target = target
        self.args = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is self.target:
            self.args.append(args)
        return func(*args, **kwargs)


# --- promote and sequence -----------------------------------------------------------------------------------------
PROMOTIONS = [
    # (input dtypes, dtype they all run in)
    ((f16, f32), f32),
    ((bf16, f32), f32),
    ((f32, bf16), f32),
    ((f16, bf16), f32),  # neither half type holds the other: FP32 holds both
    ((f16, f64), f64),
    ((f32, f64), f64),  # FP64 wins
    ((f16, f32, f64), f64),
]


@pytest.mark.parametrize("category", ["promote", "sequence"])
@pytest.mark.parametrize(
    ("dtypes", "expected"),
    [pytest.param(d, e, id="+".join(map(_dtype_id, d)) + "->" + _dtype_id(e)) for d, e in PROMOTIONS],
)
def test_mixed_inputs_run_in_the_widest_type(category, dtypes, expected):
    tensors = [torch.randn(3).to(dtype) for dtype in dtypes]
    with _policy_with_probe(category).scope():
        received = _probe(*tensors) if category == "promote" else _probe(tensors)[0]
    assert [t.dtype for t in received] == [expected] * len(dtypes)
    for got, given in zip(received, tensors):
        torch.testing.assert_close(got, given.to(expected), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [f16, bf16, f32, f64], ids=_dtype_id)
def test_agreeing_inputs_are_untouched(dtype):
    a, b = torch.randn(3).to(dtype), torch.randn(3).to(dtype)
    with _policy_with_probe("promote").scope():
        received = _probe(a, b, torch.arange(3))  # integer tensors take no part in promotion
    assert received[0] is a and received[1] is b
    assert received[2].dtype == torch.int64


@pytest.mark.parametrize("half_dtype", HALF_DTYPES, ids=_dtype_id)
def test_real_promote_and_sequence_ops(half_dtype):
    h, f = torch.randn(2, 3).to(half_dtype), torch.randn(2, 3)
    assert (h + f).dtype == f32 and (h * f).dtype == f32  # torch's own promotion agrees
    with CastPolicy(half_dtype=half_dtype).scope():
        assert (h + f).dtype == f32
        assert torch.where(h > 0, h, f).dtype == f32
        assert torch.cat([h, f]).dtype == f32
        assert torch.stack((f, h)).dtype == f32
        assert torch.cat([h, h]).dtype == half_dtype
        assert (h - h.double()).dtype == f64
    # An op that torch itself refuses for mixed dtypes runs under the policy, in FP32 for float16 with bfloat16.
    a, b = torch.randn(4, 3, dtype=f16), torch.randn(4, 3, dtype=bf16)
    with pytest.raises(RuntimeError):
        torch.cross(a, b, dim=1)
    with CastPolicy().scope():
        assert torch.cross(a, b, dim=1).dtype == f32


def test_in_place_ops_are_not_promoted():
    # In-place ops are not in the table on purpose: promoting would cast ``self`` to FP32, which makes a copy, and
    # the update would land in that copy while the caller's tensor stayed as it was.
    h, f = torch.zeros(3, dtype=f16), torch.ones(3)
    with CastPolicy().scope():
        out = h.add_(f)
        h += f
        h.mul_(f)
    assert out is h and h.dtype == f16
    torch.testing.assert_close(h, torch.full((3,), 2.0, dtype=f16))


def test_zero_dim_tensors():
    h = torch.randn(3, dtype=f16)
    scale = torch.tensor(2.0)
    # Torch's own rule lets a 0-dim tensor adopt the dtype of the dimensioned one; the policy, like Apex, counts
    # every floating tensor, so a 0-dim FP32 tensor makes the op run in FP32.
    assert (h * scale).dtype == f16
    with CastPolicy().scope():
        assert (h * scale).dtype == f32
        assert torch.add(torch.tensor(1.0, dtype=f16), torch.tensor(1.0, dtype=bf16)).dtype == f32
        assert torch.add(torch.tensor(1.0, dtype=f16), torch.tensor(1.0, dtype=f16)).dtype == f16
        # Python numbers are not tensors and take no part.
        assert (h * 2.0).dtype == f16 and torch.add(h, 1).dtype == f16
        # A 0-dim FP32 input of a half op is cast like any other.
        assert torch.addmv(torch.tensor(1.0), torch.randn(2, 3), torch.randn(3)).dtype == f16


# --- half and float ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("half_dtype", HALF_DTYPES, ids=_dtype_id)
def test_half_casts_fp32_only(half_dtype):
    f, d, h, i = torch.randn(2), torch.randn(2, dtype=f64), torch.randn(2, dtype=f16), torch.arange(2)
    with _policy_with_probe("half", half_dtype).scope():
        received = _probe(f, d, h, i, [f, 3.0], weight=f)
    assert [t.dtype for t in received[:4]] == [half_dtype, f64, f16, torch.int64]  # FP64 left alone, as autocast
    assert received[1] is d and received[2] is h and received[3] is i
    assert received[4][0].dtype == half_dtype and received[4][1] == 3.0
    assert received[5].dtype == half_dtype  # keyword arguments too


def test_float_casts_half_only():
    h, b, d, f = torch.randn(2, dtype=f16), torch.randn(2, dtype=bf16), torch.randn(2, dtype=f64), torch.randn(2)
    with _policy_with_probe("float").scope():
        received = _probe(h, b, d, f, weight=h)
    assert [t.dtype for t in received] == [f32, f32, f64, f32, f32]
    assert received[2] is d and received[3] is f


def test_containers_keep_their_type():
    from collections import namedtuple

    Pair = namedtuple("Pair", "first second")
    h = torch.randn(2, dtype=f16)
    pair, untouched = Pair(h, 1), (torch.arange(2), "x")
    with _policy_with_probe("float").scope():
        got_pair, got_untouched = _probe(pair, untouched)
    assert type(got_pair) is Pair and got_pair.first.dtype == f32 and got_pair.second == 1
    assert got_untouched is untouched


def test_out_argument_is_written_and_not_cast():
    a, b = torch.randn(2, 3), torch.randn(3, 4)
    out = torch.empty(2, 4)
    with CastPolicy().scope():
        result = torch.mm(a, b, out=out)
        summed = torch.sum(torch.randn(3, dtype=f16), dim=0, out=torch.empty((), dtype=f16))
    assert result is out and out.dtype == f32
    torch.testing.assert_close(out, a @ b)
    assert summed.dtype == f16


def test_ops_not_in_the_table_run_as_given():
    with CastPolicy().scope():
        for dtype in (f16, bf16, f32, f64):
            x = torch.randn(3, 4).to(dtype)
            assert torch.relu(x).dtype == dtype and F.relu(x).dtype == dtype and x.sigmoid().dtype == dtype
        # A Python-level function that is not listed runs as one call: its inner matmul is not cast.
        assert F.silu(torch.randn(3)).dtype == f32


def test_outside_a_scope_nothing_is_cast():
    policy = CastPolicy()
    with policy.scope():
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == f16
    assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == f32


def test_bad_half_dtype_names_argument_and_choices():
    with pytest.raises(ValueError, match=r"half_dtype=torch\.float32.*bfloat16"):
        CastPolicy(half_dtype=f32)


# --- banned ops -------------------------------------------------------------------------------------------------
def test_binary_cross_entropy_is_banned_with_advice():
    p, y = torch.rand(4, dtype=f16), torch.rand(4, dtype=f16)
    with CastPolicy().scope():
        with pytest.raises(BannedOpError, match="binary_cross_entropy_with_logits"):
            F.binary_cross_entropy(p, y)
        with pytest.raises(BannedOpError, match="BCEWithLogitsLoss"):
            torch.nn.BCELoss()(p.float(), y.float())  # banned whatever the dtype: the module calls the function
        # The safe alternative runs, in FP32.
        assert F.binary_cross_entropy_with_logits(p, y).dtype == f32
    assert issubclass(BannedOpError, RuntimeError)


@pytest.mark.parametrize("half_dtype", HALF_DTYPES, ids=_dtype_id)
def test_allow_banned_runs_in_fp32(half_dtype):
    p, y = torch.rand(4) * 0.8 + 0.1, torch.rand(4)
    with CastPolicy(half_dtype=half_dtype, allow_banned=True).scope():
        loss = F.binary_cross_entropy(p.to(half_dtype), y.to(half_dtype))
    assert loss.dtype == f32
    torch.testing.assert_close(loss, F.binary_cross_entropy(p.to(half_dtype).float(), y.to(half_dtype).float()))


def test_a_registered_ban_has_a_generic_message():
    table = CastTable.default()
    table.register(torch.erfinv, "banned")
    with CastPolicy(table).scope(), pytest.raises(BannedOpError, match="erfinv is banned.*allow_banned=True"):
        torch.erfinv(torch.rand(2))


# --- gradients --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("half_dtype", HALF_DTYPES, ids=_dtype_id)
def test_gradients_reach_fp32_parameters(half_dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x, target = torch.randn(5, 8), torch.randint(0, 4, (5,))

    F.cross_entropy(model(x), target).backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    with CastPolicy(half_dtype=half_dtype).scope():
        logits = model(x)
        loss = F.cross_entropy(logits, target)
    assert logits.dtype == half_dtype and loss.dtype == f32
    loss.backward()
    for p, want in zip(model.parameters(), reference):
        assert p.dtype == f32 and p.grad.dtype == f32
        torch.testing.assert_close(p.grad, want, rtol=5e-2, atol=2e-2)


# --- the parameter cache ----------------------------------------------------------------------------------------
def _linear_weights(policy, w, b, x, calls=2):
    """The weight tensors that F.linear received in ``calls`` calls under ``policy``."""
    with _Calls(F.linear) as seen, policy.scope():
        for _ in range(calls):
            F.linear(x, w, b)
    return [args[1] for args in seen.args]


def test_a_parameter_is_cast_once_per_iteration():
    w, b, x = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(4)), torch.randn(2, 3)
    policy = CastPolicy()
    first, second = _linear_weights(policy, w, b, x)
    assert first.dtype == f16 and first is second
    assert policy.cache_size == 2  # w and b; the input is not a parameter
    # Later scopes of the same iteration reuse it too.
    assert _linear_weights(policy, w, b, x, calls=1)[0] is first

    policy.clear_cache()
    assert policy.cache_size == 0
    again = _linear_weights(policy, w, b, x, calls=1)[0]
    assert again is not first
    torch.testing.assert_close(again, first, rtol=0, atol=0)


def test_an_in_place_update_is_cast_again():
    w, b, x = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(4)), torch.randn(2, 3)
    policy = CastPolicy()
    before = _linear_weights(policy, w, b, x, calls=1)[0]
    with torch.no_grad():
        w.add_(1)  # an optimizer step, without clear_cache()
    after = _linear_weights(policy, w, b, x, calls=1)[0]
    assert after is not before
    torch.testing.assert_close(after, w.detach().half(), rtol=0, atol=0)


def test_grad_and_no_grad_casts_are_not_shared():
    w, b, x = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(4)), torch.randn(2, 3)
    policy = CastPolicy()
    with _Calls(F.linear) as seen, policy.scope():
        with torch.no_grad():
            F.linear(x, w, b)
        F.linear(x, w, b)
        with torch.no_grad():
            F.linear(x, w, b)
    no_grad, with_grad, no_grad_again = (args[1] for args in seen.args)
    assert no_grad is not with_grad and no_grad_again is no_grad
    assert not no_grad.requires_grad and with_grad.requires_grad and with_grad.grad_fn is not None


def test_no_grad_casts_last_one_scope_and_grad_casts_one_iteration():
    # Evaluation casts are redone at each scope entry (writes through ``p.data`` leave no trace on ``p``, and an
    # evaluation-only run never calls clear_cache); training casts are kept until the iteration boundary.
    w, b, x = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(4)), torch.randn(2, 3)
    policy = CastPolicy()
    with torch.no_grad():
        first = _linear_weights(policy, w, b, x, calls=1)[0]
        second = _linear_weights(policy, w, b, x, calls=1)[0]
    assert first is not second
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    assert _linear_weights(policy, w, b, x, calls=1)[0] is _linear_weights(policy, w, b, x, calls=1)[0]


# A write through ``p.data.copy_`` between two training scopes of one iteration is not seen (nothing on ``p`` records
# it); training loops call clear_cache() at the iteration boundary.
@pytest.mark.parametrize(
    ("write", "grad"), [("copy_", False), ("assign", False), ("assign", True)], ids=["copy_", "assign", "assign-grad"]
)
def test_writes_through_data_are_cast_again(write, grad):
    w, b, x = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(4)), torch.randn(2, 3)
    policy = CastPolicy()
    new = torch.randn(4, 3)
    with torch.set_grad_enabled(grad):
        _linear_weights(policy, w, b, x, calls=1)
        if write == "copy_":
            w.data.copy_(new)  # p.data has its own version counter: p._version does not change
        else:
            w.data = new.clone()  # new storage
        after = _linear_weights(policy, w, b, x, calls=1)[0]
    torch.testing.assert_close(after, new.half(), rtol=0, atol=0)


def test_cache_can_be_turned_off():
    w, b, x = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(4)), torch.randn(2, 3)
    policy = CastPolicy(cache_casts=False)
    first, second = _linear_weights(policy, w, b, x)
    assert first is not second and policy.cache_size == 0


@pytest.mark.parametrize("half_dtype", HALF_DTYPES, ids=_dtype_id)
def test_a_reused_parameter_sums_its_gradients_as_autocast_does(half_dtype):
    # A weight used twice in one forward pass (an RNN cell, tied or shared layers): the cached cast is one autograd
    # node, so the two uses' gradients are summed in half before reaching the FP32 weight, exactly as torch.autocast's
    # own cast cache does. cache_casts=False casts per use, and the sum happens in FP32.
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(16, 32))
    x1, x2, g1, g2 = torch.randn(8, 32), torch.randn(8, 32) * 3, torch.randn(8, 16), torch.randn(8, 16)

    def grad_of(ctx):
        w.grad = None
        with ctx:
            a, b = F.linear(x1, w), F.linear(x2, w)
        assert a.dtype == b.dtype == half_dtype
        ((a.float() * g1).sum() + (b.float() * g2).sum()).backward()
        return w.grad.clone()

    autocast = grad_of(torch.autocast("cpu", dtype=half_dtype))
    cached = grad_of(CastPolicy(half_dtype=half_dtype).scope())
    per_use = grad_of(CastPolicy(half_dtype=half_dtype, cache_casts=False).scope())
    assert torch.equal(cached, autocast)
    # The explicit per-use casts: each use's gradient reaches the FP32 weight in FP32.
    w.grad = None
    a, b = F.linear(x1.to(half_dtype), w.to(half_dtype)), F.linear(x2.to(half_dtype), w.to(half_dtype))
    ((a.float() * g1).sum() + (b.float() * g2).sum()).backward()
    assert torch.equal(per_use, w.grad)
    assert not torch.equal(per_use, cached)  # the two sums do round differently here


# --- disable_casts and scope state -----------------------------------------------------------------------------
def _mm_dtype():
    return torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype


def test_disable_casts_inside_a_scope():
    with CastPolicy().scope():
        with disable_casts():
            assert _mm_dtype() == f32
            assert (torch.randn(2, dtype=f16) + torch.randn(2)).dtype == f32  # torch's own promotion
            with disable_casts():
                assert _mm_dtype() == f32
            assert _mm_dtype() == f32
        assert _mm_dtype() == f16


def test_disable_casts_restores_state_when_the_block_raises():
    with CastPolicy().scope():
        with pytest.raises(KeyError), disable_casts():
            raise KeyError("boom")
        assert _mm_dtype() == f16


def test_disable_casts_outside_a_scope_is_harmless():
    with disable_casts():
        assert _mm_dtype() == f32
    with CastPolicy().scope():
        assert _mm_dtype() == f16


def test_scope_is_left_when_the_body_raises():
    policy = CastPolicy()
    with pytest.raises(ZeroDivisionError), policy.scope():
        assert _mm_dtype() == f16
        1 / 0  # noqa: B018
    assert _mm_dtype() == f32
    with policy.scope():  # and the policy still works afterwards
        assert _mm_dtype() == f16


def test_nested_scopes():
    outer, inner = CastPolicy(half_dtype=f16), CastPolicy(half_dtype=bf16)
    with outer.scope() as entered:
        assert entered is outer
        with inner.scope():
            assert _mm_dtype() == bf16  # the innermost policy casts first; bf16 inputs are no FP32 for the outer
            with outer.scope():
                assert _mm_dtype() == f16
            assert _mm_dtype() == bf16
        assert _mm_dtype() == f16
    assert _mm_dtype() == f32


# --- threads ----------------------------------------------------------------------------------------------------
def test_a_scope_does_not_reach_other_threads():
    # Torch function modes are thread-local: a scope on one thread leaves the others alone.
    entered, checked = threading.Event(), threading.Event()
    seen = {}

    def worker():
        with CastPolicy().scope():
            seen["worker"] = _mm_dtype()
            entered.set()
            checked.wait(timeout=30)

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        assert entered.wait(timeout=30)
        seen["main"] = _mm_dtype()
    finally:
        checked.set()
        thread.join(timeout=30)
    assert seen == {"worker": f16, "main": f32}


def test_inplace_float_ops_on_half_run_as_written_unless_refused():
    policy = CastPolicy(half_dtype="float16")
    x = torch.full((3,), 0.5, dtype=torch.float16)
    with policy.scope():
        assert x.clone().exp_().dtype == torch.float16  # the default: in place, in half, as written
    policy.refuse_inplace_float = True  # Apex's rule (lightning_mpx.apex turns it on)
    with policy.scope():
        with pytest.raises(NotImplementedError, match="Tensor.exp_ on a torch.float16 tensor"):
            x.clone().exp_()
        assert x.clone().float().exp_().dtype == torch.float32


# -- CastPolicy.backward: the same gradients and errors as Tensor.backward ------------------------------------------
def _backward_case(case, backward):
    """Runs a user's backward call ``case`` through ``backward`` (``torch.Tensor.backward`` or a policy's) on a fresh
    tiny model; returns the gradients (or the error) it leaves."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    out = lin(x)
    try:
        if case == "scalar loss":
            backward(out.square().mean())
        elif case == "non-scalar with gradient":
            backward(out, torch.full_like(out, 0.5))
        elif case == "non-scalar without gradient":
            backward(out)
        elif case == "gradient of the wrong shape":
            backward(out.sum(), torch.ones(3))
        elif case == "retain_graph, twice":
            loss = out.square().mean()
            backward(loss, retain_graph=True)
            backward(loss)
        elif case == "create_graph (gradient penalty)":
            inp = x.clone().requires_grad_(True)
            (g,) = torch.autograd.grad(lin(inp).square().sum(), inp, create_graph=True)
            backward(g.square().sum() + lin(inp).mean(), create_graph=True)
        elif case == "inputs=":
            backward(out.square().mean(), inputs=[lin.weight])
        elif case == "inputs=()":
            backward(out.square().mean(), inputs=())
    except RuntimeError as error:
        return type(error), str(error).split("\n")[0]
    return [None if p.grad is None else p.grad.clone() for p in lin.parameters()]


@pytest.mark.parametrize("case", [
    "scalar loss", "non-scalar with gradient", "non-scalar without gradient", "gradient of the wrong shape",
    "retain_graph, twice", "create_graph (gradient penalty)", "inputs=", "inputs=()",
])  # fmt: skip
def test_policy_backward_leaves_what_tensor_backward_leaves(case):
    """``CastPolicy.backward`` (what ``Amp.backward`` runs) takes a shorter path than ``Tensor.backward`` into the
    autograd engine: every form of the call gives torch's own gradients, or torch's own error."""
    want = _backward_case(case, torch.Tensor.backward)
    got = _backward_case(case, CastPolicy(half_dtype=bf16).backward)
    if isinstance(want, tuple):
        assert got == want
    else:
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert (g is None and w is None) or torch.equal(g, w)


# -- promote ops that torch promotes itself: the same bits as casting first ----------------------------------------
_NATIVE_OPS = {
    "a + b": lambda a, b: a + b, "a - b": lambda a, b: a - b, "a * b": lambda a, b: a * b,
    "torch.add": torch.add, "torch.sub": torch.sub, "torch.mul": torch.mul, "Tensor.mul": torch.Tensor.mul,
    "2 - a (rsub)": lambda a, b: b.__rsub__(a), "a < b": lambda a, b: a < b, "a == b": lambda a, b: a == b,
    "torch.ge": torch.ge, "Tensor.ne": torch.Tensor.ne,
}  # fmt: skip


@pytest.mark.parametrize("op", list(_NATIVE_OPS))
@pytest.mark.parametrize("dtypes", [(bf16, f32), (f32, f16), (f16, bf16), (f16, f64)],
                         ids=lambda d: "+".join(map(_dtype_id, d)))
@pytest.mark.parametrize("shapes", [((3, 4), (3, 4)), ((3, 4), (4,)), ((), ()), ((3, 4), ()), ((), (4,))],
                         ids=["same", "broadcast", "both-0-dim", "0-dim-b", "0-dim-a"])
def test_promote_ops_torch_promotes_itself_give_the_bits_of_casting_first(op, dtypes, shapes):
    """``x + proj(y)`` with an FP32 ``x`` and a half ``proj(y)``: the policy lets the op's own type promotion run
    (no cast kernel) where that is exact. Output, dtype and both gradients must be bit for bit those of the table's
    rule, every floating operand cast to the widest first; a 0-dim operand still counts (the table's rule, not
    torch's)."""
    fn = _NATIVE_OPS[op]
    torch.manual_seed(0)
    values = [torch.randn(shape).to(dtype) for shape, dtype in zip(shapes, dtypes)]
    differentiable = op in ("a + b", "a - b", "a * b", "torch.add", "torch.sub", "torch.mul", "Tensor.mul",
                            "2 - a (rsub)")

    def run(cast_first):
        leaves = [v.clone().requires_grad_(differentiable) for v in values]
        if cast_first:
            widest = torch.promote_types(*dtypes)
            out = fn(*(t.to(widest) for t in leaves))
        else:
            with CastPolicy(half_dtype=bf16).scope():
                out = fn(*leaves)
        grads = []
        if differentiable:
            torch.manual_seed(1)
            out.backward(torch.randn_like(out))
            grads = [t.grad for t in leaves]
        return out, grads

    (want, want_grads), (got, got_grads) = run(True), run(False)
    assert got.dtype == want.dtype
    assert torch.equal(got, want)
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == w.dtype and torch.equal(g, w)


def test_residual_add_of_a_half_branch_makes_no_cast_node():
    """``x + proj(y)`` (FP32 residual stream, half branch): no cast kernel and no cast backward node, and the half
    operand is saved as it is, not as an FP32 copy."""
    x = torch.randn(2, 4, requires_grad=True)
    h = torch.randn(2, 4, dtype=bf16, requires_grad=True)
    with CastPolicy(half_dtype=bf16).scope():
        out = x + h
        prod = x * h
    assert out.dtype == f32 and prod.dtype == f32
    for result in (out, prod):
        inputs = {type(node).__name__ for node, _ in result.grad_fn.next_functions}
        assert inputs == {"AccumulateGrad"}, inputs


@pytest.mark.parametrize("how", ["policy.backward", "backward inside the scope", "recompute_scope"])
def test_the_backward_pass_does_not_keep_the_forward_casts_alive(how):
    """Forward passes before a backward pass share the half copies of the parameters (Apex's cache served one
    ``scale_loss`` block); once the backward pass starts the cache lets them go, so the half bias (which autograd does
    not save for the backward pass) is freed, and the gradients are those of a run without the cache."""
    import weakref

    torch.manual_seed(0)
    lin, x = torch.nn.Linear(3, 4), torch.randn(2, 3)
    policy = CastPolicy(half_dtype=bf16)
    with _Calls(F.linear) as seen, policy.scope():
        loss = lin(x).float().square().sum() + lin(x).float().sum()
    (w1, b1), (w2, b2) = [(args[1], args[2]) for args in seen.args]
    assert w1 is w2 and b1 is b2 and b1.dtype == bf16  # the second forward reused the first one's casts
    bias_cast = weakref.ref(b1)
    del seen, w1, w2, b1, b2
    if how == "policy.backward":
        policy.backward(loss)
    elif how == "backward inside the scope":
        with policy.scope():
            loss.backward()
    else:
        with policy.recompute_scope():
            loss.backward()
    assert policy.cache_size == 0 and bias_cast() is None
    # The same gradients as a backward pass that does not touch the cache (a plain loss.backward() outside scopes).
    want = torch.nn.Linear(3, 4)
    want.load_state_dict(lin.state_dict())
    other = CastPolicy(half_dtype=bf16)
    with other.scope():
        other_loss = want(x).float().square().sum() + want(x).float().sum()
    other_loss.backward()
    assert other.cache_size == 2
    assert torch.equal(lin.weight.grad, want.weight.grad) and torch.equal(lin.bias.grad, want.bias.grad)
