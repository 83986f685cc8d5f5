"""The default cast table, as plain data.

Each namespace (``torch``, ``torch.nn.functional``, ``torch.Tensor``) maps a category to the names of the functions
in it. The categories:

* ``half``: matrix multiplies and convolutions, which are fast and safe in half precision;
* ``float``: ops whose range or accumulated rounding needs FP32 (softmax, norms, exp/log, reductions, losses);
* ``promote``: ops with several inputs that run in the widest input type;
* ``sequence``: ops over a sequence of tensors (``cat``, ``stack``) that cast the whole sequence to the widest type;
* ``banned``: ops that are unsafe in half; an error suggests the safe alternative unless the user allows them.

Names that a given torch build lacks are skipped when the table is built. Nothing here is mutable: a
:class:`~lightning_mpx.cast_table.CastTable` copies this data and users extend their copy.

In-place ops (``add_``, ``__iadd__``, ...) are deliberately absent from ``promote``: casting ``self`` would make a
copy, and the in-place update would be lost.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping

CATEGORIES: tuple[str, ...] = ("half", "float", "promote", "sequence", "banned")

# --- half: BLAS and convolutions -------------------------------------------------------------------------------
_CONV = (
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "conv_tbc",
)
_BLAS = ("addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul", "matmul", "mm", "mv")

# --- float: pointwise ops with large range, reductions -----------------------------------------------------------
_POINTWISE_FLOAT = (
    "acos",
    "asin",
    "cosh",
    "sinh",
    "tan",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "pow",
)
_REDUCTIONS = ("cumprod", "cumsum", "dist", "norm", "prod", "std", "sum", "var", "renorm", "logsumexp")

# --- float: torch.nn.functional -----------------------------------------------------------------------------------
_FUNCTIONAL_FLOAT = (
    "softmax",
    "log_softmax",
    "softmin",
    "softplus",
    "gelu",
    "layer_norm",
    "group_norm",
    "local_response_norm",
    "normalize",
    "cosine_similarity",
    "interpolate",
    "grid_sample",
)
#: Every loss function in ``torch.nn.functional`` except the banned ``binary_cross_entropy``.
_LOSSES = (
    "binary_cross_entropy_with_logits",
    "cosine_embedding_loss",
    "cross_entropy",
    "ctc_loss",
    "gaussian_nll_loss",
    "hinge_embedding_loss",
    "huber_loss",
    "kl_div",
    "l1_loss",
    # linear + cross entropy fused (torch >= 2.13): the loss needs FP32, so the projection runs in FP32 too.
    "linear_cross_entropy",
    "margin_ranking_loss",
    "mse_loss",
    "multi_margin_loss",
    "multilabel_margin_loss",
    "multilabel_soft_margin_loss",
    "nll_loss",
    "poisson_nll_loss",
    "smooth_l1_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "triplet_margin_with_distance_loss",
)

# --- half: more matrix products, and recurrent layers (their gate matmuls) --------------------------------------
_HALF_MORE = ("convolution", "einsum")
_RNN = ("lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell")

# --- float: ops that torch's autocast also runs in FP32, most of them because they have no half kernel (cdist,
# quantile, stft, FFTs, linear algebra, 3-d pooling on CPU) or accumulate over many elements (trace, pdist) -------
_NO_FAST_HALF = (
    "cdist",
    "pdist",
    "quantile",
    "nanquantile",
    "stft",
    "trace",
    "polar",
    "view_as_complex",
    "fake_quantize_per_tensor_affine",
    "frobenius_norm",
    "nuclear_norm",
    "rms_norm",
)
#: torch.* and Tensor.* linear algebra (the torch.linalg namespace is listed below).
_LINALG = (
    "cholesky",
    "cholesky_inverse",
    "cholesky_solve",
    "inverse",
    "lu",
    "lu_solve",
    "orgqr",
    "ormqr",
    "pinverse",
    "geqrf",
    "qr",
    "svd",
    "triangular_solve",
)
#: Losses that torch also exposes as torch.* functions (distinct objects from their torch.nn.functional twins).
_TORCH_LOSSES = (
    "binary_cross_entropy_with_logits",
    "cosine_embedding_loss",
    "ctc_loss",
    "hinge_embedding_loss",
    "kl_div",
    "margin_ranking_loss",
    "poisson_nll_loss",
    "triplet_margin_loss",
)
_POOLING_FLOAT = (
    "avg_pool3d",
    "max_pool3d",
    "adaptive_avg_pool3d",
    "adaptive_max_pool3d",
    "fractional_max_pool2d",
    "fractional_max_pool3d",
    "max_unpool2d",
    "max_unpool3d",
)
_FFT = (
    "fft",
    "ifft",
    "fft2",
    "ifft2",
    "fftn",
    "ifftn",
    "rfft",
    "irfft",
    "rfft2",
    "irfft2",
    "rfftn",
    "irfftn",
    "hfft",
    "ihfft",
    "hfft2",
    "ihfft2",
    "hfftn",
    "ihfftn",
)
_LINALG_FLOAT = (
    "cholesky",
    "cholesky_ex",
    "cond",
    "det",
    "eig",
    "eigh",
    "eigvals",
    "eigvalsh",
    "householder_product",
    "inv",
    "inv_ex",
    "lstsq",
    "lu",
    "lu_factor",
    "lu_factor_ex",
    "lu_solve",
    "matrix_norm",
    "matrix_rank",
    "norm",
    "pinv",
    "qr",
    "slogdet",
    "solve",
    "solve_ex",
    "solve_triangular",
    "svd",
    "svdvals",
    "tensorinv",
    "tensorsolve",
    "vector_norm",
)

# --- promote ---------------------------------------------------------------------------------------------------
_PROMOTE = (
    "add",
    "sub",
    "mul",
    "div",
    "true_divide",
    "addcdiv",
    "addcmul",
    "atan2",
    "cross",
    "dot",
    "bilinear",
    "eq",
    "ne",
    "ge",
    "gt",
    "le",
    "lt",
    "equal",
    "where",
    "vdot",
    # out-of-place scatters and index writes: self and the source run in the wider type (torch's autocast)
    "index_copy",
    "index_put",
    "scatter_add",
)
# Only the operators that torch dispatches to a policy as themselves. ``a + b``, ``a - b``, ``a * b``, ``a / b``,
# ``a != b``, ``a < b``... (and their reflected forms) reach a TorchFunctionMode as ``Tensor.add``, ``Tensor.sub``,
# ``Tensor.mul``, ``Tensor.div``, ``Tensor.ne``, ``Tensor.lt``..., which are listed above; rows for ``__add__`` and
# the like would never match. ``__rdiv__`` is the same function as ``__rtruediv__``.
_TENSOR_OPERATORS_PROMOTE = (
    "__eq__",
    "__rsub__",
    "__rtruediv__",
)

DEFAULT_TABLE: Mapping[str, Mapping[str, tuple[str, ...]]] = MappingProxyType(
    {
        "torch": MappingProxyType(
            {
                "half": _CONV + _BLAS + ("prelu",) + _HALF_MORE + _RNN,
                "float": _POINTWISE_FLOAT
                + _REDUCTIONS
                + ("softmax", "log_softmax", "layer_norm", "group_norm")
                + _NO_FAST_HALF
                + _LINALG
                + _TORCH_LOSSES
                + ("max_pool3d", "grid_sampler", "grid_sampler_2d", "grid_sampler_3d"),
                "promote": _PROMOTE + ("tensordot",),
                "sequence": ("cat", "concat", "concatenate", "stack"),
                "banned": (),
            }
        ),
        "torch.nn.functional": MappingProxyType(
            {
                # multi_head_attention_forward is Python: torch hands it to the policy as one call, so it is listed
                # whole (its projections are the matmuls that matter) rather than op by op.
                "half": _CONV + ("linear", "prelu", "scaled_dot_product_attention", "multi_head_attention_forward"),
                "float": _FUNCTIONAL_FLOAT + _LOSSES + _POOLING_FLOAT + ("pdist", "rms_norm"),
                "promote": ("bilinear",),
                "sequence": (),
                "banned": ("binary_cross_entropy",),
            }
        ),
        "torch.Tensor": MappingProxyType(
            {
                # ``a @ b`` reaches the policy as ``Tensor.matmul``, so ``__matmul__`` is not listed; ``__rmatmul__``
                # is a Python method that reaches it as itself. Tensor has no ``chain_matmul``.
                "half": ("__rmatmul__",) + tuple(name for name in _BLAS if name != "chain_matmul") + ("prelu",),
                "float": _POINTWISE_FLOAT
                + _REDUCTIONS
                + ("__pow__", "__rpow__", "softmax", "log_softmax")
                + ("quantile", "nanquantile", "stft", "trace")
                + _LINALG,
                "promote": tuple(name for name in _PROMOTE if name not in ("bilinear",)) + _TENSOR_OPERATORS_PROMOTE,
                "sequence": (),
                "banned": (),
            }
        ),
        "torch.fft": MappingProxyType({"float": _FFT}),
        # vecdot and multi_dot are matrix products; the decompositions and solvers have no half kernels.
        "torch.linalg": MappingProxyType({"half": ("vecdot", "multi_dot"), "float": _LINALG_FLOAT}),
    }
)

#: The table of an O2 forward pass. The model is already half; a loss that it computes inside its own forward (every
#: Hugging Face ``...ForSequenceClassification`` and ``...ForCausalLM``) runs in FP32 and returns FP32, as a loss
#: computed on the FP32 outputs does. Softmax, norms and reductions are left in half: their output feeds half layers
#: (an FP32 output would meet half weights), and torch's half kernels already accumulate in FP32.
O2_TABLE: Mapping[str, Mapping[str, tuple[str, ...]]] = MappingProxyType(
    {
        "torch.nn.functional": MappingProxyType({"float": _LOSSES + ("binary_cross_entropy",)}),
        "torch": MappingProxyType({"float": _TORCH_LOSSES}),
    }
)

#: What the error for a banned op suggests instead, by function name.
BANNED_ADVICE: Mapping[str, str] = MappingProxyType(
    {
        "binary_cross_entropy": (
            "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast: in half precision "
            "the log of a probability near 0 or 1 overflows. Compute logits and use "
            "torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss, which fuse the "
            "sigmoid and the loss and are safe. If you know your inputs are FP32, pass allow_banned=True and the op "
            "will run in FP32."
        ),
    }
)

# --- how torch's own autocast lists map onto this table -----------------------------------------------------------
# torch.autocast casts aten operators: those it registers a kernel for (``torch._C.
# _dispatch_get_registrations_for_dispatch_key("AutocastCPU")`` and ``"AutocastCUDA"``), with the categories of
# ``torch/testing/_internal/autocast_test_lists.py``. A cast policy sees Python functions instead, so every such
# operator's Python function must have the same category here (tests/test_cast_coverage.py checks it against the
# installed torch: an operator that a new torch adds shows up as a failing row). Most operators are reached through
# the function of the same name in torch, torch.nn.functional, torch.Tensor, torch.fft or torch.linalg; the others
# are named below, and the few that this table deliberately does not follow are listed with the reason.

#: Operators that reach a cast policy through functions of other names (qualified names).
AUTOCAST_ENTRY_POINTS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "__matmul__": ("torch.Tensor.matmul",),  # ``a @ b`` reaches a mode as Tensor.matmul
        "_convolution": ("torch.nn.functional.conv2d", "torch.convolution"),
        "cudnn_convolution": ("torch.nn.functional.conv2d",),
        "cudnn_convolution_transpose": ("torch.nn.functional.conv_transpose2d",),
        "_scaled_dot_product_flash_attention": ("torch.nn.functional.scaled_dot_product_attention",),
        # nn.MultiheadAttention leaves its fast path (this operator) while a torch-function mode is active.
        "_native_multi_head_attention": ("torch.nn.functional.multi_head_attention_forward",),
        "_thnn_fused_lstm_cell": ("torch.lstm_cell",),
        "_thnn_fused_gru_cell": ("torch.gru_cell",),
        "mkldnn_rnn_layer": ("torch.lstm",),  # nn.LSTM on CPU
        "_lu_with_info": ("torch.lu", "torch.Tensor.lu"),
        "_grid_sampler_2d_cpu_fallback": ("torch.nn.functional.grid_sample",),
        "grid_sampler": ("torch.nn.functional.grid_sample", "torch.grid_sampler"),
        "cross_entropy_loss": ("torch.nn.functional.cross_entropy",),
        "nll_loss2d": ("torch.nn.functional.nll_loss",),
        "multilabel_margin_loss_forward": ("torch.nn.functional.multilabel_margin_loss",),
        "native_layer_norm": ("torch.nn.functional.layer_norm",),
        **dict.fromkeys(
            (
                "upsample_nearest1d",
                "upsample_nearest2d",
                "upsample_nearest3d",
                "upsample_linear1d",
                "upsample_bilinear2d",
                "upsample_bicubic2d",
                "upsample_trilinear3d",
                "_upsample_nearest_exact1d",
                "_upsample_nearest_exact2d",
                "_upsample_nearest_exact3d",
                "_upsample_bilinear2d_aa",
                "_upsample_bicubic2d_aa",
            ),
            ("torch.nn.functional.interpolate",),
        ),
    }
)

_PAD = (
    "left as given: torch.nn.functional.pad is one function for every mode, and casting every constant pad (conv "
    "nets, attention masks) to FP32 would upcast half activations; torch's autocast casts only its reflect and "
    "replicate kernels, which take float16 and bfloat16 on CPU and CUDA."
)
#: Operators of torch's autocast lists that this table does not follow, and why.
AUTOCAST_EXCEPTIONS: Mapping[str, str] = MappingProxyType(
    {
        **dict.fromkeys(
            ("reflection_pad1d", "reflection_pad2d", "replication_pad1d", "replication_pad2d", "replication_pad3d"),
            _PAD,
        ),
        "_addmm_activation": (
            "not listed: an internal fused matmul and activation that eager modules do not call; torch.addmm is half."
        ),
    }
)
