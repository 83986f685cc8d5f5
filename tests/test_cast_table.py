"""The default cast table, entry by entry, and the :class:`CastTable` API.

Every row of ``CastTable.default()`` is called with real tensors under a :class:`CastPolicy`, with arguments built
from the data rows of ``ARGS`` below, and the dtypes the function actually received are checked.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_mpx import BannedOpError, CastTable, dispatchable
from lightning_mpx import CastPolicy as _CastPolicy
from lightning_mpx.casting.lists import CATEGORIES
from lightning_mpx.casting.mode import _NATIVE_PROMOTION


def CastPolicy(*args, **kwargs):  # noqa: N802
    """The Python policy's engine: these tests watch what each function receives, and its cast cache
    (tests/test_autocast_engine.py checks the \"autocast\" engine by the dtypes it computes in)."""
    return _CastPolicy(*args, engine="mode", **kwargs)


HALF_DTYPES = [torch.float16, torch.bfloat16]


def _dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


def _r(*shape):
    """Deterministic FP32 values in [0.1, 0.9]: inside the domain of log, rsqrt, acos, erfinv and the losses."""
    return torch.rand(shape, generator=torch.Generator().manual_seed(len(shape))) * 0.8 + 0.1


def _signs(n):
    return torch.tensor([1.0, -1.0] * (n // 2) + [1.0] * (n % 2))


def _call(*args, **kwargs):
    return args, kwargs


def _spd(n=3):
    """A symmetric positive definite matrix (well conditioned, also after rounding to half)."""
    a = _r(n, n)
    return a @ a.T + n * torch.eye(n)


_GEQRF = torch.geqrf(_r(3, 3))
_LU = torch.linalg.lu_factor(_spd())
_POOLED2D = F.max_pool2d(_r(1, 1, 4, 4), 2, return_indices=True)
_POOLED3D = F.max_pool3d(_r(1, 1, 4, 4, 4), 2, return_indices=True)


# --- argument builders: name -> (x, y) -> (args, kwargs) --------------------------------------------------------
# ``x`` and ``y`` turn an FP32 tensor into an input of the dtype under test. For ``half``, ``float`` and ``banned``
# rows both give the same dtype; for ``promote`` and ``sequence`` rows ``x`` gives the half dtype and ``y`` FP32, so
# each of those rows uses both. Tensors that are not floating (class indices, lengths, masks) are built directly.
# A qualified name (``torch.Tensor.where``) overrides the plain name where the signatures differ.
_UNARY = lambda x, y: _call(x(_r(3, 4)))  # noqa: E731
_BINARY = lambda x, y: _call(x(_r(3, 4)), y(_r(3, 4)))  # noqa: E731
_MATRICES = lambda x, y: _call(x(_r(3, 4)), y(_r(4, 5)))  # noqa: E731
_DIM1 = lambda x, y: _call(x(_r(3, 4)), 1)  # noqa: E731
_SEQUENCE = lambda x, y: _call([x(_r(2, 3)), y(_r(2, 3))])  # noqa: E731
_SIGNED_PAIR = lambda x, y: _call(x(_r(4)), y(_r(4)), y(_signs(4)))  # noqa: E731

ARGS = {
    # half: convolutions and BLAS
    "conv1d": lambda x, y: _call(x(_r(2, 3, 8)), y(_r(4, 3, 3)), y(_r(4))),
    "conv2d": lambda x, y: _call(x(_r(2, 3, 6, 6)), y(_r(4, 3, 3, 3)), y(_r(4))),
    "conv3d": lambda x, y: _call(x(_r(1, 2, 4, 4, 4)), y(_r(3, 2, 2, 2, 2)), y(_r(3))),
    "conv_transpose1d": lambda x, y: _call(x(_r(2, 3, 8)), y(_r(3, 4, 3)), y(_r(4))),
    "conv_transpose2d": lambda x, y: _call(x(_r(2, 3, 5, 5)), y(_r(3, 4, 3, 3)), y(_r(4))),
    "conv_transpose3d": lambda x, y: _call(x(_r(1, 2, 3, 3, 3)), y(_r(2, 3, 2, 2, 2)), y(_r(3))),
    # (time, batch, in) input, (kernel, in, out) weight, (out,) bias, padding
    "conv_tbc": lambda x, y: _call(x(_r(5, 2, 3)), y(_r(3, 3, 4)), y(_r(4)), 1),
    "addbmm": lambda x, y: _call(x(_r(3, 5)), y(_r(2, 3, 4)), y(_r(2, 4, 5))),
    "addmm": lambda x, y: _call(x(_r(3, 5)), y(_r(3, 4)), y(_r(4, 5))),
    "addmv": lambda x, y: _call(x(_r(3)), y(_r(3, 4)), y(_r(4))),
    "addr": lambda x, y: _call(x(_r(3, 4)), y(_r(3)), y(_r(4))),
    "baddbmm": lambda x, y: _call(x(_r(2, 3, 5)), y(_r(2, 3, 4)), y(_r(2, 4, 5))),
    "bmm": lambda x, y: _call(x(_r(2, 3, 4)), y(_r(2, 4, 5))),
    "chain_matmul": lambda x, y: _call(x(_r(3, 4)), y(_r(4, 5)), y(_r(5, 2))),
    "matmul": _MATRICES,
    "mm": _MATRICES,
    "__rmatmul__": lambda x, y: _call(x(_r(4, 5)), y(_r(3, 4))),  # y @ x
    "mv": lambda x, y: _call(x(_r(3, 4)), y(_r(4))),
    "prelu": lambda x, y: _call(x(_r(2, 3, 4)), y(_r(3))),
    "linear": lambda x, y: _call(x(_r(3, 4)), y(_r(5, 4)), y(_r(5))),
    "scaled_dot_product_attention": lambda x, y: _call(x(_r(2, 2, 3, 8)), y(_r(2, 2, 3, 8)), y(_r(2, 2, 3, 8))),
    # (length, batch, embed) query/key/value, embed_dim, num_heads, in_proj weight and bias, bias_k, bias_v,
    # add_zero_attn, dropout_p, out_proj weight and bias
    "multi_head_attention_forward": lambda x, y: _call(
        x(_r(3, 2, 4)), y(_r(3, 2, 4)), y(_r(3, 2, 4)), 4, 2, y(_r(12, 4)), y(_r(12)), None, None, False, 0.0,
        y(_r(4, 4)), y(_r(4)), training=False,
    ),
    # float: pointwise with large range
    **dict.fromkeys(
        ("acos", "asin", "cosh", "sinh", "tan", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p"), _UNARY
    ),
    "reciprocal": _UNARY,
    "rsqrt": _UNARY,
    "pow": _BINARY,
    "__pow__": _BINARY,
    "__rpow__": _BINARY,  # y ** x
    # float: reductions
    "cumprod": _DIM1,
    "cumsum": _DIM1,
    "dist": _BINARY,
    "norm": _UNARY,
    "prod": _UNARY,
    "std": _UNARY,
    "sum": _UNARY,
    "var": _UNARY,
    "renorm": lambda x, y: _call(x(_r(3, 4)), 2, 0, 1.0),
    "logsumexp": _DIM1,
    # float: torch.nn.functional
    "softmax": _DIM1,
    "log_softmax": _DIM1,
    "softmin": _DIM1,
    "softplus": _UNARY,
    "layer_norm": lambda x, y: _call(x(_r(2, 3, 4)), (4,), y(_r(4)), y(_r(4))),
    "group_norm": lambda x, y: _call(x(_r(2, 4, 3)), 2, y(_r(4)), y(_r(4))),
    "local_response_norm": lambda x, y: _call(x(_r(2, 4, 5)), 2),
    "normalize": _UNARY,
    "cosine_similarity": _BINARY,
    "interpolate": lambda x, y: _call(x(_r(1, 2, 4)), scale_factor=2.0),
    "grid_sample": lambda x, y: _call(x(_r(1, 1, 4, 4)), y(_r(1, 2, 2, 2) * 2 - 1), align_corners=False),
    # float: losses
    "binary_cross_entropy_with_logits": _BINARY,
    "cosine_embedding_loss": lambda x, y: _call(x(_r(4, 3)), y(_r(4, 3)), y(_signs(4))),
    "cross_entropy": lambda x, y: _call(x(_r(4, 5)), torch.tensor([0, 4, 2, 1])),
    "linear_cross_entropy": lambda x, y: _call(x(_r(4, 3)), y(_r(5, 3)), torch.tensor([0, 4, 2, 1])),
    # (time, batch, classes) log-probabilities, (batch, target length) classes, input and target lengths
    "ctc_loss": lambda x, y: _call(
        x(_r(6, 2, 4).log_softmax(2)), torch.tensor([[1, 2], [3, 1]]), torch.tensor([6, 5]), torch.tensor([2, 2])
    ),
    "gaussian_nll_loss": lambda x, y: _call(x(_r(3, 4)), y(_r(3, 4)), y(_r(3, 4))),
    "hinge_embedding_loss": lambda x, y: _call(x(_r(4)), y(_signs(4))),
    "huber_loss": _BINARY,
    "kl_div": lambda x, y: _call(x(_r(3, 4).log()), y(_r(3, 4)), reduction="batchmean"),
    "l1_loss": _BINARY,
    "margin_ranking_loss": _SIGNED_PAIR,
    "mse_loss": _BINARY,
    "multi_margin_loss": lambda x, y: _call(x(_r(4, 5)), torch.tensor([0, 4, 2, 1])),
    "multilabel_margin_loss": lambda x, y: _call(x(_r(2, 4)), torch.tensor([[3, 0, -1, 1], [1, 2, 3, -1]])),
    "multilabel_soft_margin_loss": lambda x, y: _call(x(_r(2, 4)), y(torch.tensor([[1.0, 0, 1, 0], [0, 0, 1, 1]]))),
    "nll_loss": lambda x, y: _call(x(_r(4, 5).log()), torch.tensor([0, 4, 2, 1])),
    "poisson_nll_loss": _BINARY,
    "smooth_l1_loss": _BINARY,
    "soft_margin_loss": lambda x, y: _call(x(_r(4)), y(_signs(4))),
    "triplet_margin_loss": lambda x, y: _call(x(_r(4, 3)), y(_r(4, 3)), y(_r(4, 3))),
    "triplet_margin_with_distance_loss": lambda x, y: _call(x(_r(4, 3)), y(_r(4, 3)), y(_r(4, 3))),
    # float: no fast (or no) half kernel
    "cdist": lambda x, y: _call(x(_r(3, 4)), y(_r(5, 4))),
    "pdist": _UNARY,
    "quantile": lambda x, y: _call(x(_r(3, 4)), 0.5),
    "nanquantile": lambda x, y: _call(x(_r(3, 4)), 0.5),
    "stft": lambda x, y: _call(x(_r(64)), 16, window=y(torch.ones(16)), return_complex=True),
    "trace": lambda x, y: _call(x(_r(3, 3))),
    "polar": lambda x, y: _call(x(_r(3)), y(_r(3))),
    "view_as_complex": lambda x, y: _call(x(_r(3, 2))),
    "fake_quantize_per_tensor_affine": lambda x, y: _call(x(_r(3, 4)), 0.1, 0, 0, 255),
    "frobenius_norm": lambda x, y: _call(x(_r(3, 4)), [0, 1]),
    "nuclear_norm": _UNARY,
    "rms_norm": lambda x, y: _call(x(_r(2, 4)), (4,)),
    "avg_pool3d": lambda x, y: _call(x(_r(1, 1, 4, 4, 4)), 2),
    "max_pool3d": lambda x, y: _call(x(_r(1, 1, 4, 4, 4)), 2),
    "adaptive_avg_pool3d": lambda x, y: _call(x(_r(1, 1, 4, 4, 4)), 2),
    "adaptive_max_pool3d": lambda x, y: _call(x(_r(1, 1, 4, 4, 4)), 2),
    "fractional_max_pool2d": lambda x, y: _call(x(_r(1, 1, 8, 8)), 2, output_size=4),
    "fractional_max_pool3d": lambda x, y: _call(x(_r(1, 1, 8, 8, 8)), 2, output_size=4),
    "max_unpool2d": lambda x, y: _call(x(_POOLED2D[0]), _POOLED2D[1], 2),
    "max_unpool3d": lambda x, y: _call(x(_POOLED3D[0]), _POOLED3D[1], 2),
    # (input, grid, interpolation mode, padding mode, align_corners)
    "grid_sampler": lambda x, y: _call(x(_r(1, 1, 4, 4)), y(_r(1, 2, 2, 2) * 2 - 1), 0, 0, False),
    "grid_sampler_2d": lambda x, y: _call(x(_r(1, 1, 4, 4)), y(_r(1, 2, 2, 2) * 2 - 1), 0, 0, False),
    "grid_sampler_3d": lambda x, y: _call(x(_r(1, 1, 4, 4, 4)), y(_r(1, 2, 2, 2, 3) * 2 - 1), 0, 0, False),
    "torch.kl_div": lambda x, y: _call(x(_r(3, 4).log()), y(_r(3, 4)), 1, log_target=False),  # reduction: enum
    "torch.poisson_nll_loss": lambda x, y: _call(x(_r(3, 4)), y(_r(3, 4)), True, False, 1e-8, 1),
    # float: linear algebra (torch.*, Tensor.* and torch.linalg.*)
    **dict.fromkeys(
        ("cholesky", "cholesky_ex", "cond", "det", "eig", "eigh", "eigvals", "eigvalsh", "inverse", "inv", "inv_ex",
         "lu", "lu_factor", "lu_factor_ex", "matrix_norm", "matrix_rank", "pinverse", "pinv", "qr", "slogdet", "svd",
         "svdvals", "geqrf", "vector_norm"),
        lambda x, y: _call(x(_spd())),
    ),  # fmt: skip
    "cholesky_inverse": lambda x, y: _call(x(torch.linalg.cholesky(_spd()))),
    "cholesky_solve": lambda x, y: _call(x(_r(3, 2)), y(torch.linalg.cholesky(_spd()))),
    "orgqr": lambda x, y: _call(x(_GEQRF[0]), y(_GEQRF[1])),
    "householder_product": lambda x, y: _call(x(_GEQRF[0]), y(_GEQRF[1])),
    "ormqr": lambda x, y: _call(x(_GEQRF[0]), y(_GEQRF[1]), y(_r(3, 2))),
    "triangular_solve": lambda x, y: _call(x(_r(3, 2)), y(_spd().triu())),  # (b, A)
    "solve_triangular": lambda x, y: _call(x(_spd().triu()), y(_r(3, 2)), upper=True),  # (A, B)
    **dict.fromkeys(("solve", "solve_ex", "lstsq"), lambda x, y: _call(x(_spd()), y(_r(3, 2)))),
    "tensorinv": lambda x, y: _call(x(_spd(4).reshape(4, 2, 2)), ind=1),
    "tensorsolve": lambda x, y: _call(x(_spd(4).reshape(2, 2, 4)), y(_r(2, 2))),
    "lu_solve": lambda x, y: _call(x(_r(3, 2)), y(_LU[0]), _LU[1]),  # torch.lu_solve(b, LU, pivots)
    "torch.linalg.lu_solve": lambda x, y: _call(x(_LU[0]), _LU[1], y(_r(3, 2))),  # (LU, pivots, B)
    # float: FFTs
    **dict.fromkeys(
        ("fft", "ifft", "fft2", "ifft2", "fftn", "ifftn", "rfft", "irfft", "rfft2", "irfft2", "rfftn", "irfftn",
         "hfft", "ihfft", "hfft2", "ihfft2", "hfftn", "ihfftn"),
        lambda x, y: _call(x(_r(4, 4))),
    ),  # fmt: skip
    # half: more matrix products and recurrent layers
    "einsum": lambda x, y: _call("ij,jk->ik", x(_r(3, 4)), y(_r(4, 5))),
    "convolution": lambda x, y: _call(x(_r(1, 2, 5)), y(_r(3, 2, 3)), y(_r(3)), [1], [0], [1], False, [0], 1),
    "vecdot": _BINARY,
    "multi_dot": lambda x, y: _call([x(_r(3, 4)), y(_r(4, 5)), y(_r(5, 2))]),
    # (input, hx, flat weights, has_biases, num_layers, dropout, train, bidirectional, batch_first); 4, 3 or 1 gates
    "lstm": lambda x, y: _call(
        x(_r(5, 2, 4)), (y(_r(1, 2, 3)), y(_r(1, 2, 3))), [y(_r(12, 4)), y(_r(12, 3)), y(_r(12)), y(_r(12))],
        True, 1, 0.0, False, False, False,
    ),
    "gru": lambda x, y: _call(
        x(_r(5, 2, 4)), y(_r(1, 2, 3)), [y(_r(9, 4)), y(_r(9, 3)), y(_r(9)), y(_r(9))], True, 1, 0.0, False, False,
        False,
    ),
    **dict.fromkeys(
        ("rnn_tanh", "rnn_relu"),
        lambda x, y: _call(
            x(_r(5, 2, 4)), y(_r(1, 2, 3)), [y(_r(3, 4)), y(_r(3, 3)), y(_r(3)), y(_r(3))], True, 1, 0.0, False,
            False, False,
        ),
    ),
    # (input, hx, w_ih, w_hh, b_ih, b_hh)
    "lstm_cell": lambda x, y: _call(
        x(_r(2, 4)), (y(_r(2, 3)), y(_r(2, 3))), y(_r(12, 4)), y(_r(12, 3)), y(_r(12)), y(_r(12))
    ),
    "gru_cell": lambda x, y: _call(x(_r(2, 4)), y(_r(2, 3)), y(_r(9, 4)), y(_r(9, 3)), y(_r(9)), y(_r(9))),
    **dict.fromkeys(
        ("rnn_tanh_cell", "rnn_relu_cell"),
        lambda x, y: _call(x(_r(2, 4)), y(_r(2, 3)), y(_r(3, 4)), y(_r(3, 3)), y(_r(3)), y(_r(3))),
    ),
    # promote: x is half, y is FP32
    "tensordot": lambda x, y: _call(x(_r(3, 4)), y(_r(4, 5)), 1),
    "vdot": lambda x, y: _call(x(_r(4)), y(_r(4))),
    "index_copy": lambda x, y: _call(x(_r(3, 4)), 0, torch.tensor([0, 2]), y(_r(2, 4))),
    "index_put": lambda x, y: _call(x(_r(4)), (torch.tensor([1]),), y(_r(1))),
    "scatter_add": lambda x, y: _call(x(_r(2, 3)), 0, torch.tensor([[0, 1, 0]]), y(_r(1, 3))),
    # banned
    "binary_cross_entropy": _BINARY,
    # promote: x is half, y is FP32
    **dict.fromkeys(
        ("add", "sub", "mul", "div", "true_divide", "atan2", "eq", "ne", "ge", "gt", "le", "lt", "equal"), _BINARY
    ),
    **dict.fromkeys(("__eq__", "__rsub__", "__rtruediv__"), _BINARY),
    "addcdiv": lambda x, y: _call(x(_r(3, 4)), y(_r(3, 4)), y(_r(3, 4))),
    "addcmul": lambda x, y: _call(x(_r(3, 4)), y(_r(3, 4)), y(_r(3, 4))),
    "cross": lambda x, y: _call(x(_r(4, 3)), y(_r(4, 3)), dim=1),
    "dot": lambda x, y: _call(x(_r(4)), y(_r(4))),
    "bilinear": lambda x, y: _call(x(_r(2, 3)), y(_r(2, 4)), y(_r(5, 3, 4)), y(_r(5))),
    "where": lambda x, y: _call(_r(3, 4) > 0.5, x(_r(3, 4)), y(_r(3, 4))),
    "torch.Tensor.where": lambda x, y: _call(x(_r(3, 4)), _r(3, 4) > 0.5, y(_r(3, 4))),  # self.where(cond, other)
    # sequence: a list mixing half and FP32
    "cat": _SEQUENCE,
    "concat": _SEQUENCE,
    "concatenate": _SEQUENCE,
    "stack": _SEQUENCE,
}

# (qualified name, dtype) -> why the op cannot run in that dtype on CPU; such pairs are skipped with the reason.
# Keep this short. Empty with torch 2.13, where every half op of the table has float16 and bfloat16 CPU kernels.
CANNOT_RUN: dict[tuple[str, torch.dtype], str] = {}

DEFAULT_ENTRIES = CastTable.default().entries()


def _arguments(entry):
    return ARGS.get(entry.qualified_name) or ARGS[entry.name]


def _floating_dtypes(value):
    if isinstance(value, torch.Tensor):
        return [value.dtype] if value.is_floating_point() else []
    if isinstance(value, (list, tuple)):
        return [dtype for item in value for dtype in _floating_dtypes(item)]
    if isinstance(value, dict):
        return _floating_dtypes(list(value.values()))
    return []


def _first_tensor(value):
    if isinstance(value, (list, tuple)):
        return next((t for t in map(_first_tensor, value) if t is not None), None)
    return value if isinstance(value, torch.Tensor) else None


class _Received(TorchFunctionMode):
    """Records the floating dtypes that reach ``target``; entered *before* (so below) the policy's mode.

    Torch offers a call to the most recently entered mode first: the policy casts the arguments and calls the
    function again, which then reaches this mode with the arguments exactly as the policy made them. Checking what
    arrived works for every op, also those whose result is not floating (``eq``, ``equal``), and it proves that torch
    dispatches the entry's own function object: a row for a name that torch dispatches as another function would
    never be applied, and ``received`` stays empty.
    """

    def __init__(self, target):
        super().__init__()
        self.target = target
        self.received = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is self.target:
            self.received.append(_floating_dtypes((args, kwargs)))
        return func(*args, **kwargs)


def _inputs_and_expected(category, half_dtype):
    """(dtype of x, dtype of y, dtype every floating input must arrive in)."""
    if category == "half":
        return torch.float32, torch.float32, half_dtype
    if category in ("float", "banned"):
        return half_dtype, half_dtype, torch.float32
    return half_dtype, torch.float32, torch.float32  # promote, sequence: the widest of (half, FP32)


def _run(entry, policy, x_dtype, y_dtype):
    args, kwargs = _arguments(entry)(lambda t: t.to(x_dtype), lambda t: t.to(y_dtype))
    with _Received(entry.function) as received, policy.scope():
        out = entry.function(*args, **kwargs)
    return out, received.received


@pytest.mark.filterwarnings("ignore:.*is deprecated:UserWarning")
@pytest.mark.filterwarnings("ignore:.*deprecated:FutureWarning")
@pytest.mark.parametrize("half_dtype", HALF_DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("entry", [pytest.param(e, id=e.qualified_name) for e in DEFAULT_ENTRIES])
def test_default_entry_casts_its_inputs(entry, half_dtype):
    reason = CANNOT_RUN.get((entry.qualified_name, half_dtype))
    if reason:
        pytest.skip(reason)
    x_dtype, y_dtype, expected = _inputs_and_expected(entry.category, half_dtype)
    if entry.category == "banned":
        with pytest.raises(BannedOpError):
            _run(entry, CastPolicy(half_dtype=half_dtype), x_dtype, y_dtype)

    out, received = _run(entry, CastPolicy(half_dtype=half_dtype, allow_banned=True), x_dtype, y_dtype)

    assert len(received) == 1, f"torch did not dispatch {entry.qualified_name} as itself"
    dtypes = received[0]
    if entry.function in _NATIVE_PROMOTION:
        # Ops whose own type promotion is exact get their operands as given and compute in the widest dtype
        # (tests/test_cast_policy.py checks the bits against casting first); the output below is what matters.
        assert dtypes and set(dtypes) == {x_dtype, y_dtype}
    else:
        assert dtypes and set(dtypes) == {expected}
    out = _first_tensor(out)
    if out is not None and out.is_floating_point():
        assert out.dtype == expected


def test_every_argument_row_is_used():
    used = {name for e in DEFAULT_ENTRIES for name in (e.qualified_name, e.name) if name in ARGS}
    # linear_cross_entropy is only in recent torch; its row is used where the function exists.
    assert set(ARGS) - used <= {"linear_cross_entropy"}


def _loss_functions():
    names = [
        name
        for name in dir(F)
        if not name.startswith("_")
        and callable(getattr(F, name))
        and (name.endswith("_loss") or "entropy" in name or name in ("kl_div", "nll_loss"))
    ]
    return sorted(names)


def test_every_functional_loss_is_float_or_banned():
    # A loss that a future torch adds fails here until the table says how to run it.
    table = CastTable.default()
    names = _loss_functions()
    assert {"cross_entropy", "nll_loss", "kl_div", "binary_cross_entropy", "ctc_loss", "mse_loss"} <= set(names)
    wrong = {name: table.category_of(getattr(F, name)) for name in names}
    wrong = {name: category for name, category in wrong.items() if category not in ("float", "banned")}
    assert wrong == {}


def test_default_table_has_every_category_and_no_unknown_one():
    table = CastTable.default()
    assert {e.category for e in table} == set(CATEGORIES)
    assert table.category_of(F.binary_cross_entropy) == "banned"
    assert table.category_of(torch.Tensor.add_) is None  # in-place ops are never promoted


# --- the CastTable API ------------------------------------------------------------------------------------------
def test_register_changes_category_and_a_live_policy_sees_it_at_the_next_scope():
    table = CastTable.default()
    policy = CastPolicy(table, torch.float16)
    x = torch.randn(3, 4)
    with policy.scope():
        assert torch.exp(x).dtype == torch.float32
    table.register(torch.exp, "half")
    assert table.category_of(torch.exp) == "half"
    with policy.scope():
        assert torch.exp(x).dtype == torch.float16


def test_copies_are_independent():
    original = CastTable.default()
    copy = original.copy()
    copy.register(torch.relu, "half")
    copy.register(torch.exp, "banned")
    assert torch.relu not in original and original.category_of(torch.exp) == "float"
    assert torch.relu not in CastTable.default() and CastTable.default().category_of(torch.exp) == "float"
    original.register(torch.sigmoid, "float")
    assert torch.sigmoid not in copy
    assert len(copy) == len(original) == len(CastTable.default()) + 1


def test_policy_follows_a_swapped_table():
    table = CastTable.default()
    policy = CastPolicy(table, torch.float16)
    with policy.scope():
        torch.exp(torch.randn(2, dtype=torch.float16))  # memoises exp as "float"
    policy.table = table.copy()
    policy.table.register(torch.exp, "half")
    with policy.scope():
        assert torch.exp(torch.randn(2)).dtype == torch.float16
    # Another table that happens to have seen as many changes is still another table.
    policy.table = CastTable.from_data({"torch": {"float": ("exp",)}})
    with policy.scope():
        assert torch.exp(torch.randn(2, dtype=torch.float16)).dtype == torch.float32
    policy.table = CastTable.from_data({"torch": {"half": ("exp",)}})
    with policy.scope():
        assert torch.exp(torch.randn(2)).dtype == torch.float16


@pytest.mark.parametrize("half_dtype", HALF_DTYPES, ids=_dtype_id)
def test_register_half_function_outer(half_dtype):
    a, b = torch.randn(3), torch.randn(4)
    with CastPolicy(CastTable.default(), half_dtype).scope():
        assert torch.outer(a, b).dtype == torch.float32  # not in the default table
    table = CastTable.default()
    table.register_half_function(torch, "outer")
    with CastPolicy(table, half_dtype).scope():
        out = torch.outer(a, b)
    assert out.dtype == half_dtype
    torch.testing.assert_close(out.float(), torch.outer(a, b), rtol=2e-2, atol=2e-2)


def test_register_float_and_promote_function():
    table = CastTable()
    table.register_float_function(F, "silu")
    table.register_promote_function(torch, "maximum")
    h, f = torch.randn(4, dtype=torch.float16), torch.randn(4)
    with CastPolicy(table).scope():
        assert F.silu(h).dtype == torch.float32
        assert torch.maximum(h, f).dtype == torch.float32
    table.register(torch.Tensor.addmm, "half")
    assert [e.qualified_name for e in table] == ["torch.nn.functional.silu", "torch.maximum", "torch.Tensor.addmm"]


def test_register_function_names_a_missing_attribute():
    with pytest.raises(ValueError, match="no_such_op"):
        CastTable().register_half_function(torch, "no_such_op")


def test_registering_a_plain_python_function_raises():
    def my_op(x):
        return x * 2

    with pytest.raises(TypeError, match="dispatchable"):
        CastTable().register(my_op, "half")
    with pytest.raises(TypeError, match="not callable"):
        CastTable().register(42, "half")


def test_dispatchable_user_function_receives_half_inputs():
    seen = []

    @dispatchable
    def scaled_matmul(x, weight, *, scale):
        seen.append((x.dtype, weight.dtype, scale.dtype))
        return (x @ weight) * scale

    table = CastTable.default()
    table.register(scaled_matmul, "half")
    x, w, s = torch.randn(2, 3), torch.randn(3, 4), torch.tensor(2.0)
    with CastPolicy(table, torch.bfloat16).scope():
        out = scaled_matmul(x, w, scale=s)
        scaled_matmul(x=x, weight=w, scale=s)  # tensors passed only by keyword are seen too
    assert seen == [(torch.bfloat16,) * 3] * 2
    assert out.dtype == torch.bfloat16
    # Outside a scope it is the plain function.
    assert scaled_matmul(x, w, scale=s).dtype == torch.float32
    assert seen[-1] == (torch.float32,) * 3


def test_bad_category_names_value_and_choices():
    table = CastTable()
    for call in (
        lambda: table.register(torch.exp, "fp16"),
        lambda: table.register_function(torch, "exp", "fp16"),
        lambda: table.entries("fp16"),
        lambda: CastTable.from_data({"torch": {"fp16": ("exp",)}}),
    ):
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert "'fp16'" in message and all(c in message for c in CATEGORIES)


def test_unknown_namespace_names_value_and_choices():
    with pytest.raises(ValueError, match=r"namespace='numpy'.*torch\.nn\.functional"):
        CastTable.from_data({"numpy": {"half": ("dot",)}})


def test_unregister():
    table = CastTable.default()
    policy = CastPolicy(table, torch.float16)
    with policy.scope():
        assert torch.matmul(torch.randn(2, 3), torch.randn(3, 2)).dtype == torch.float16
    table.unregister(torch.matmul)
    assert torch.matmul not in table and table.category_of(torch.matmul) is None
    with policy.scope():
        assert torch.matmul(torch.randn(2, 3), torch.randn(3, 2)).dtype == torch.float32
    with pytest.raises(KeyError, match="not in this table"):
        table.unregister(torch.matmul)


def test_from_data_skips_names_this_torch_lacks():
    table = CastTable.from_data({"torch": {"half": ("mm", "no_such_op")}})
    assert [e.qualified_name for e in table] == ["torch.mm"]


def test_entries_by_category_and_repr():
    table = CastTable.default()
    assert all(e.category == "sequence" for e in table.entries("sequence"))
    assert {e.name for e in table.entries("sequence")} >= {"cat", "stack"}
    assert sum(len(table.entries(c)) for c in CATEGORIES) == len(table) == len(table.entries())
    assert repr(CastTable.from_data({"torch": {"half": ("mm",)}})) == (
        "CastTable(half=1, float=0, promote=0, sequence=0, banned=0)"
    )
