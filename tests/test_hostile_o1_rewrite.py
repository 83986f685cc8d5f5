"""The O1 cast mode's inline hot path decides as the general path it short-cuts, for every op of the default table.

``_CastMode.__torch_function__`` casts half/FP32 calls and the binary promotions that cast nothing inline; before
that rewrite every call the table lists went to ``_CastMode._apply``. ``_General`` below is that dispatch: each case
runs once in a user's scope (``policy.scope()``, ``policy.recompute_scope(create_graph=True)``) and once under
``_General``, on fresh tensors, and must give the same output dtypes and bits, the same gradients, the same
parameter-cast cache and the same recompute note, or the same error.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from lightning_mpx import CastPolicy, CastTable
from lightning_mpx.casting.mode import _CastMode
from lightning_mpx.casting.scopes import disable_casts, fp32_scope

bf16, f32, f64 = torch.bfloat16, torch.float32, torch.float64
TABLE = CastTable.default()


class _General(_CastMode):
    """The mode's dispatch before its hot path was inlined: every call the table lists goes to ``_apply``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        action = self.policy._action_lookup(func, self.policy._actions_stamp)
        if not action or self.disabled:
            return func(*args, **(kwargs or {}))
        return self._apply(func, action, args, kwargs)


def _general(policy: CastPolicy, recompute: bool) -> _General:
    """``_General`` for ``policy``, entered as a scope enters its mode (the table resolved again, no evaluation casts
    kept)."""
    policy._refresh_actions()
    policy._no_grad_cache.clear()
    return _General(policy, recompute_only=recompute)


_SIZES = {"m": (3, 3), "v": (3,), "b": (2, 3, 3), "img": (1, 2, 4, 4), "w": (3, 2, 3, 3), "seq": (1, 2, 6),
          "cw": (3, 2, 3), "pos": (3, 3), "prob": (3, 3)}
# Argument shapes tried in turn for each op (the first that runs in FP32 outside a scope is kept).
_SHAPES = (("m",), ("m", "m"), ("m", "v"), ("v", "v"), ("m", "m", "m"), ("v", "m", "m"), ("m", "v", "v"),
           ("b", "b"), ("m", "b", "b"), ("b", "b", "b"), ("img", "w"), ("seq", "cw"), ("pos",), ("prob", "prob"),
           ("m", "lbl"), ("m", -1), ("m", 2.0), ("m", [3, 3]), ("seqlist",), ("eqn", "m", "m"))


def _value(kind: Any, dtype: torch.dtype, leaf: str, seed: int) -> Any:
    if kind == "lbl":
        return torch.tensor([0, 1, 2])
    if kind == "seqlist":
        return [_value("m", dtype, leaf, seed), _value("m", f32, "plain", seed + 1)]
    if kind == "eqn":
        return "ij,jk->ik"
    if kind not in _SIZES:
        return kind
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(*_SIZES[kind], generator=g) * 0.8 + 0.1 if kind in ("pos", "prob") else torch.randn(
        *_SIZES[kind], generator=g)
    x = x.to(dtype)
    if leaf == "param":
        return torch.nn.Parameter(x)
    if leaf == "view":  # a view of a parameter: cast, not cached
        return torch.nn.Parameter(x).view(x.shape)
    return x


def _args(shape: tuple[Any, ...], dtype: torch.dtype, leaf: str, mixed: bool) -> list[Any]:
    args = [_value(kind, dtype, leaf, seed) for seed, kind in enumerate(shape)]
    if mixed:  # the last floating tensor in the other precision
        for i in reversed(range(len(args))):
            if isinstance(args[i], torch.Tensor) and args[i].is_floating_point():
                args[i] = args[i].detach().to(bf16 if dtype == f32 else f32)
                break
    return args


def _call(function: Callable[..., Any], method: bool, args: list[Any]) -> Any:
    return getattr(args[0], function.__name__)(*args[1:]) if method else function(*args)


def _shape_of(function: Callable[..., Any], method: bool) -> tuple[Any, ...] | None:
    for shape in _SHAPES:
        try:
            _call(function, method, _args(shape, f32, "plain", False))
            return shape
        except Exception:  # noqa: BLE001 - the next shape
            continue
    return None


def _summary(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        bits = value.detach().contiguous().reshape(-1)
        return (value.dtype, tuple(value.shape), bits.view(torch.uint8).tolist() if bits.dtype != torch.bool
                else bits.tolist())
    if isinstance(value, (list, tuple)):
        return [_summary(v) for v in value]
    return value if isinstance(value, (int, float, bool, str, type(None))) else type(value).__name__


_CONTEXTS = {
    "grad": contextlib.nullcontext,
    "recompute": contextlib.nullcontext,  # inside a backward's recompute mode: what a checkpoint recomputes
    "recompute_no_grad": torch.no_grad,  # there, with gradients off: a backward function, left alone
    "no_grad": torch.no_grad,
    "fp32_module": fp32_scope,
    "disabled": disable_casts,
}


def _outcome(run: Callable[[], Any]) -> Any:
    try:
        return run()
    except Exception as error:  # noqa: BLE001 - the same error on both paths
        return type(error).__name__


def _run(function, method, shape, dtype, leaf, mixed, context, general: bool, backward: bool = True) -> Any:
    policy = CastPolicy(TABLE, bf16, engine="mode")
    args = _args(shape, dtype, leaf, mixed)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    recompute = context.startswith("recompute")

    def run() -> Any:
        scope = _general(policy, recompute) if general else (
            policy.recompute_scope(create_graph=True) if recompute else policy.scope())
        with scope, _CONTEXTS[context]():
            out = [_call(function, method, args)]
            if leaves:
                out.append(_call(function, method, args))  # the parameter's cached cast
        floats = [t for t in torch.utils._pytree.tree_leaves(out)
                  if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
        if floats and backward:
            sum(t.float().sum() for t in floats).backward()
        return (_summary(out), [_summary(a.grad) for a in leaves], policy.cache_size, policy._recomputes_seen)

    return _outcome(run)


# (dtype, leaf, mixed, context) of each op: a half tensor beside an FP32 one; a half parameter in a backward
# function (gradients off in a recompute mode); a parameter (the cache) recomputed; a parameter beside a half tensor
# without gradients; a parameter's view; an FP32 module; FP64.
_CASES = ((bf16, "plain", True, "grad"), (bf16, "param", False, "recompute_no_grad"),
          (f32, "param", False, "recompute"),
          (f32, "param", True, "no_grad"), (f32, "view", True, "grad"), (f32, "param", False, "fp32_module"),
          (f64, "plain", False, "grad"))
_NONDETERMINISTIC = {"lstsq"}  # torch.linalg.lstsq's results differ from one call to the next on CPU


@pytest.mark.parametrize("category", ["half", "float", "promote", "sequence"])
def test_every_table_op_is_cast_as_the_general_path_casts_it(category):
    # The float list is long (~200 functions, FFTs and decompositions among them): its ops take the first two cases,
    # forward only; the others take all of them, with the backward pass.
    cases = _CASES[:2] if category == "float" else _CASES
    checked = 0
    for entry in TABLE.entries(category):
        method = entry.namespace == "torch.Tensor"
        shape = _shape_of(entry.function, method)
        if shape is None or entry.name in _NONDETERMINISTIC:
            continue
        for dtype, leaf, mixed, context in cases:
            case = (entry.function, method, shape, dtype, leaf, mixed, context)
            backward = category != "float"
            reference = _run(*case, general=True, backward=backward)
            assert _run(*case, general=False, backward=backward) == reference, (entry.qualified_name, shape, dtype,
                                                                                 leaf, mixed, context)
            checked += 1
    assert checked >= {"half": 100, "float": 250, "promote": 100, "sequence": 20}[category]


# Forms the table sweep does not make: keywords, out=, sequences, 0-dim tensors, integers, in-place methods.
_FORMS: dict[str, Callable[[Callable[..., Any]], Any]] = {
    "linear_keywords": lambda p: F.linear(torch.randn(2, 3), weight=p(4, 3), bias=p(4)),
    "mm_keyword": lambda p: torch.mm(torch.randn(2, 3), mat2=p(3, 2)),
    "addmm_keywords": lambda p: torch.addmm(input=p(2), mat1=torch.randn(3, 4), mat2=p(4, 2).to(bf16), beta=0.5),
    "softmax_keyword": lambda p: p(2, 3, dtype=bf16).softmax(dim=-1),
    "softmax_dtype": lambda p: F.softmax(p(2, 3, dtype=bf16), -1, dtype=f64),
    "sum_dtype": lambda p: torch.sum(p(2, 3, dtype=bf16), dim=0, dtype=f64),
    "cat_keyword": lambda p: torch.cat(tensors=[p(2, 2), p(2, 2, dtype=bf16)], dim=1),
    "cat_tuple_int": lambda p: torch.cat((torch.ones(2, 2, dtype=torch.int64), p(2, 2, dtype=bf16))),
    "stack_out": lambda p: torch.stack([torch.randn(2), torch.randn(2).to(bf16)], out=torch.empty(2, 2, dtype=bf16)),
    "einsum_list": lambda p: torch.einsum("ij,jk->ik", [p(2, 3), torch.randn(3, 2)]),
    "mm_out": lambda p: torch.mm(torch.randn(2, 2), p(2, 2).detach(), out=torch.empty(2, 2)),
    "mm_out_none": lambda p: torch.mm(torch.randn(2, 2), p(2, 2), out=None),
    "exp_out": lambda p: torch.exp(torch.randn(3).to(bf16), out=torch.empty(3, dtype=bf16)),
    "mm_same_parameter": lambda p: (lambda w: torch.mm(w, w))(p(2, 2)),
    "add_0dim": lambda p: p(3, dtype=bf16) + torch.tensor(2.5),
    "add_0dim_first": lambda p: torch.tensor(2.5) * p(3, dtype=bf16),
    "add_alpha": lambda p: torch.add(p(3), p(3, dtype=bf16), alpha=2),
    "div_mixed": lambda p: p(3, dtype=bf16) / p(3),
    "rsub_number": lambda p: 1.0 - p(3, dtype=bf16),
    "add_integer": lambda p: p(3, dtype=bf16) + torch.ones(3, dtype=torch.int64),
    "where": lambda p: torch.where(torch.tensor([True, False, True]), p(3, dtype=bf16), p(3)),
    "exp_inplace_half": lambda p: torch.randn(3).to(bf16).exp_(),
    "add_inplace_mixed": lambda p: torch.randn(3).add_(p(3, dtype=bf16)),
    "layer_norm_keywords": lambda p: F.layer_norm(p(2, 4, dtype=bf16), (4,), weight=p(4), bias=p(4)),
    "cross_entropy_keywords": lambda p: F.cross_entropy(input=p(3, 4, dtype=bf16), target=torch.tensor([0, 1, 2])),
    "matmul_operator": lambda p: torch.randn(2, 3) @ p(3, 2),
    "mm_after_an_update": lambda p: _after_update(p(2, 2), lambda w: torch.mm(torch.ones(2, 2), w)),
    "softmax_after_an_update": lambda p: _after_update(p(2, 2, dtype=bf16), lambda w: w.softmax(-1)),
    "cat_after_new_data": lambda p: _after_update(p(2, 2), lambda w: torch.cat([w, torch.ones(2, 2, dtype=bf16)]),
                                                  new_data=True),
}


def _after_update(param: torch.nn.Parameter, use: Callable[[torch.Tensor], Any], new_data: bool = False) -> Any:
    """``use(param)`` before and after an optimizer-like update of ``param``: the cached cast must not be served."""
    before = use(param)
    if new_data:
        param.data = param.data * 2
    else:
        with torch.no_grad():
            param.mul_(2)
    return before, use(param)


def _parameters(general: bool) -> Callable[..., torch.nn.Parameter]:
    seeds = iter(range(100))
    return lambda *size, dtype=f32: torch.nn.Parameter(
        torch.randn(*size, generator=torch.Generator().manual_seed(next(seeds))).to(dtype))


@pytest.mark.parametrize("name", list(_FORMS))
def test_keyword_sequence_and_out_forms_are_cast_as_the_general_path_casts_them(name):
    for context in _CONTEXTS:
        outcomes = []
        for general in (True, False):
            policy = CastPolicy(TABLE, bf16, engine="mode")
            policy.refuse_inplace_float = context == "grad"  # the Apex layer's O1 refuses x.half().exp_()
            make = _parameters(general)
            torch.manual_seed(0)
            recompute = context.startswith("recompute")

            def run() -> Any:
                scope = _general(policy, recompute) if general else (
                    policy.recompute_scope(create_graph=True) if recompute else policy.scope())
                with scope, _CONTEXTS[context]():
                    out = [_FORMS[name](make), _FORMS[name](make)]
                return _summary(out), policy.cache_size, policy._recomputes_seen

            outcomes.append(_outcome(run))
        assert outcomes[1] == outcomes[0], context
