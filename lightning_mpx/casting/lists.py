"""The default cast table, as plain data.

Each namespace (``torch``, ``torch.nn.functional``, ``torch.Tensor``) maps a category to the names of the functions
in it. The categories:

* ``half``: matrix multiplies and convolutions, which are fast and safe in half precision;
* ``float``: ops whose range or accumulated rounding needs FP32 (softmax, norms, exp/log, reductions, losses);
* ``promote``: ops with several inputs that run in the widest input type;
* ``sequence``: ops over a sequence of tensors (``cat``, ``stack``) that cast the whole sequence to the widest type;
* ``banned``: ops that are unsafe in half; an error suggests the safe alternative unless the user allows them.

Names that a given torch build lacks are skipped when the table is built. Nothing here is mutable: a
:class:`~lightning_mpx.casting.table.CastTable` copies this data and users extend their copy.

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


# --- what torch.autocast itself does, per device: the O1 engine runs on it where the table agrees ---------------------
#: torch.autocast's category for each public function that reaches an operator it casts, by device (derived from the
#: registry and torch's test lists as tests/test_cast_coverage.py reads them; tests/test_autocast_agreement.py fails
#: when the installed torch says otherwise). A function missing here runs as given under autocast. ``torch.lstm`` and
#: the other RNNs are half on CUDA through ``aten::_cudnn_rnn``, whose autocast kernel exists in CUDA builds only.
AUTOCAST_ACTIONS: Mapping[str, Mapping[str, tuple[str, ...]]] = MappingProxyType(
    {
        "cpu": MappingProxyType(
            {
                "half": (
                    "torch.Tensor.addbmm", "torch.Tensor.addmm", "torch.Tensor.baddbmm", "torch.Tensor.bmm",
                    "torch.Tensor.matmul", "torch.Tensor.mm", "torch.Tensor.prelu", "torch.addbmm", "torch.addmm",
                    "torch.baddbmm", "torch.bmm", "torch.conv1d", "torch.conv2d", "torch.conv3d", "torch.conv_tbc",
                    "torch.conv_transpose1d", "torch.conv_transpose2d", "torch.conv_transpose3d",
                    "torch.convolution", "torch.linalg.vecdot", "torch.lstm", "torch.matmul", "torch.mm",
                    "torch.nn.functional.conv1d", "torch.nn.functional.conv2d", "torch.nn.functional.conv3d",
                    "torch.nn.functional.conv_tbc", "torch.nn.functional.conv_transpose1d",
                    "torch.nn.functional.conv_transpose2d", "torch.nn.functional.conv_transpose3d",
                    "torch.nn.functional.linear", "torch.nn.functional.multi_head_attention_forward",
                    "torch.nn.functional.prelu", "torch.nn.functional.scaled_dot_product_attention", "torch.prelu",
                ),
                "float": (
                    "torch.Tensor.cholesky", "torch.Tensor.cholesky_inverse", "torch.Tensor.cholesky_solve",
                    "torch.Tensor.geqrf", "torch.Tensor.inverse", "torch.Tensor.lu", "torch.Tensor.lu_solve",
                    "torch.Tensor.nanquantile", "torch.Tensor.orgqr", "torch.Tensor.ormqr", "torch.Tensor.pinverse",
                    "torch.Tensor.prod", "torch.Tensor.qr", "torch.Tensor.quantile", "torch.Tensor.stft",
                    "torch.Tensor.svd", "torch.Tensor.trace", "torch.Tensor.triangular_solve",
                    "torch.binary_cross_entropy_with_logits", "torch.cdist", "torch.cholesky",
                    "torch.cholesky_inverse", "torch.cholesky_solve", "torch.cosine_embedding_loss",
                    "torch.ctc_loss", "torch.fake_quantize_per_tensor_affine", "torch.fft.fft", "torch.fft.fft2",
                    "torch.fft.fftn", "torch.fft.hfft", "torch.fft.ifft", "torch.fft.ifft2", "torch.fft.ifftn",
                    "torch.fft.ihfft", "torch.fft.irfft", "torch.fft.irfft2", "torch.fft.irfftn", "torch.fft.rfft",
                    "torch.fft.rfft2", "torch.fft.rfftn", "torch.geqrf", "torch.grid_sampler",
                    "torch.grid_sampler_2d", "torch.grid_sampler_3d", "torch.hinge_embedding_loss", "torch.inverse",
                    "torch.kl_div", "torch.linalg.cholesky", "torch.linalg.cholesky_ex", "torch.linalg.cond",
                    "torch.linalg.eig", "torch.linalg.eigh", "torch.linalg.eigvals", "torch.linalg.eigvalsh",
                    "torch.linalg.householder_product", "torch.linalg.inv", "torch.linalg.inv_ex",
                    "torch.linalg.lstsq", "torch.linalg.matrix_rank", "torch.linalg.qr", "torch.linalg.solve",
                    "torch.linalg.svd", "torch.linalg.svdvals", "torch.linalg.tensorinv", "torch.linalg.tensorsolve",
                    "torch.lu", "torch.lu_solve", "torch.margin_ranking_loss", "torch.max_pool3d",
                    "torch.nanquantile", "torch.nn.functional.adaptive_avg_pool3d",
                    "torch.nn.functional.adaptive_max_pool3d", "torch.nn.functional.avg_pool3d",
                    "torch.nn.functional.binary_cross_entropy",
                    "torch.nn.functional.binary_cross_entropy_with_logits",
                    "torch.nn.functional.cosine_embedding_loss", "torch.nn.functional.cross_entropy",
                    "torch.nn.functional.ctc_loss", "torch.nn.functional.fractional_max_pool2d",
                    "torch.nn.functional.fractional_max_pool3d", "torch.nn.functional.grid_sample",
                    "torch.nn.functional.hinge_embedding_loss", "torch.nn.functional.huber_loss",
                    "torch.nn.functional.kl_div", "torch.nn.functional.l1_loss",
                    "torch.nn.functional.margin_ranking_loss", "torch.nn.functional.max_pool3d",
                    "torch.nn.functional.max_unpool2d", "torch.nn.functional.max_unpool3d",
                    "torch.nn.functional.mse_loss", "torch.nn.functional.multi_margin_loss",
                    "torch.nn.functional.multilabel_margin_loss", "torch.nn.functional.nll_loss",
                    "torch.nn.functional.poisson_nll_loss", "torch.nn.functional.smooth_l1_loss",
                    "torch.nn.functional.soft_margin_loss", "torch.nn.functional.triplet_margin_loss", "torch.orgqr",
                    "torch.ormqr", "torch.pinverse", "torch.poisson_nll_loss", "torch.polar", "torch.prod",
                    "torch.qr", "torch.quantile", "torch.stft", "torch.svd", "torch.trace", "torch.triangular_solve",
                    "torch.triplet_margin_loss", "torch.view_as_complex",
                ),
                "promote": (
                    "torch.Tensor.index_copy", "torch.cat", "torch.index_copy", "torch.stack",
                ),
                "banned": (

                ),
            }
        ),
        "cuda": MappingProxyType(
            {
                "half": (
                    "torch.Tensor.addbmm", "torch.Tensor.addmm", "torch.Tensor.addmv", "torch.Tensor.addr",
                    "torch.Tensor.baddbmm", "torch.Tensor.bmm", "torch.Tensor.matmul", "torch.Tensor.mm",
                    "torch.Tensor.mv", "torch.Tensor.prelu", "torch.addbmm", "torch.addmm", "torch.addmv",
                    "torch.addr", "torch.baddbmm", "torch.bmm", "torch.chain_matmul", "torch.conv1d", "torch.conv2d",
                    "torch.conv3d", "torch.conv_tbc", "torch.conv_transpose1d", "torch.conv_transpose2d",
                    "torch.conv_transpose3d", "torch.convolution", "torch.einsum", "torch.gru_cell",
                    "torch.linalg.multi_dot", "torch.linalg.vecdot", "torch.lstm_cell", "torch.matmul", "torch.mm",
                    "torch.mv", "torch.nn.functional.conv1d", "torch.nn.functional.conv2d",
                    "torch.nn.functional.conv3d", "torch.nn.functional.conv_tbc",
                    "torch.nn.functional.conv_transpose1d", "torch.nn.functional.conv_transpose2d",
                    "torch.nn.functional.conv_transpose3d", "torch.nn.functional.linear",
                    "torch.nn.functional.prelu", "torch.nn.functional.scaled_dot_product_attention", "torch.prelu",
                    "torch.rnn_relu_cell", "torch.rnn_tanh_cell",
                ),
                "float": (
                    "torch.Tensor.__pow__", "torch.Tensor.acos", "torch.Tensor.asin", "torch.Tensor.cosh",
                    "torch.Tensor.cumprod", "torch.Tensor.cumsum", "torch.Tensor.dist", "torch.Tensor.erfinv",
                    "torch.Tensor.exp", "torch.Tensor.expm1", "torch.Tensor.log", "torch.Tensor.log10",
                    "torch.Tensor.log1p", "torch.Tensor.log2", "torch.Tensor.log_softmax", "torch.Tensor.logsumexp",
                    "torch.Tensor.norm", "torch.Tensor.pow", "torch.Tensor.prod", "torch.Tensor.reciprocal",
                    "torch.Tensor.renorm", "torch.Tensor.rsqrt", "torch.Tensor.sinh", "torch.Tensor.softmax",
                    "torch.Tensor.sum", "torch.Tensor.tan", "torch.acos", "torch.asin",
                    "torch.binary_cross_entropy_with_logits", "torch.cdist", "torch.cosh",
                    "torch.cosine_embedding_loss", "torch.cosine_similarity", "torch.cumprod", "torch.cumsum",
                    "torch.dist", "torch.erfinv", "torch.exp", "torch.expm1", "torch.frobenius_norm",
                    "torch.group_norm", "torch.hinge_embedding_loss", "torch.kl_div", "torch.layer_norm",
                    "torch.linalg.matrix_norm", "torch.linalg.vector_norm", "torch.log", "torch.log10",
                    "torch.log1p", "torch.log2", "torch.log_softmax", "torch.logsumexp", "torch.margin_ranking_loss",
                    "torch.nn.functional.binary_cross_entropy_with_logits",
                    "torch.nn.functional.cosine_embedding_loss", "torch.nn.functional.cosine_similarity",
                    "torch.nn.functional.group_norm", "torch.nn.functional.hinge_embedding_loss",
                    "torch.nn.functional.huber_loss", "torch.nn.functional.interpolate",
                    "torch.nn.functional.kl_div", "torch.nn.functional.l1_loss", "torch.nn.functional.layer_norm",
                    "torch.nn.functional.log_softmax", "torch.nn.functional.margin_ranking_loss",
                    "torch.nn.functional.mse_loss", "torch.nn.functional.multi_margin_loss",
                    "torch.nn.functional.multilabel_margin_loss", "torch.nn.functional.nll_loss",
                    "torch.nn.functional.pdist", "torch.nn.functional.poisson_nll_loss",
                    "torch.nn.functional.rms_norm", "torch.nn.functional.smooth_l1_loss",
                    "torch.nn.functional.soft_margin_loss", "torch.nn.functional.softmax",
                    "torch.nn.functional.softplus", "torch.nn.functional.triplet_margin_loss", "torch.norm",
                    "torch.nuclear_norm", "torch.pdist", "torch.poisson_nll_loss", "torch.pow", "torch.prod",
                    "torch.reciprocal", "torch.renorm", "torch.rms_norm", "torch.rsqrt", "torch.sinh",
                    "torch.softmax", "torch.sum", "torch.tan", "torch.triplet_margin_loss",
                ),
                "promote": (
                    "torch.Tensor.addcdiv", "torch.Tensor.addcmul", "torch.Tensor.atan2", "torch.Tensor.cross",
                    "torch.Tensor.dot", "torch.Tensor.index_put", "torch.Tensor.scatter_add", "torch.Tensor.vdot",
                    "torch.addcdiv", "torch.addcmul", "torch.atan2", "torch.bilinear", "torch.cross", "torch.dot",
                    "torch.grid_sampler", "torch.index_put", "torch.nn.functional.bilinear",
                    "torch.nn.functional.grid_sample", "torch.scatter_add", "torch.tensordot", "torch.vdot",
                ),
                "banned": (
                    "torch.nn.functional.binary_cross_entropy",
                ),
            }
        ),

    }
)
#: Corrections to the registry-derived data above, measured by running each function under torch.autocast("cpu")
#: (tests/test_autocast_agreement.py): Python compositions that reach an operator autocast casts (``None``: a
#: function named after a registered operator that the device's autocast does not reach).
AUTOCAST_COMPOSITES: Mapping[str, Mapping[str, str | None]] = MappingProxyType(
    {
        "cpu": MappingProxyType(
            {
                **dict.fromkeys(
                    ("torch.chain_matmul", "torch.einsum", "torch.tensordot", "torch.linalg.multi_dot",
                     "torch.Tensor.__rmatmul__", "torch.rnn_tanh", "torch.rnn_relu", "torch.rnn_tanh_cell",
                     "torch.rnn_relu_cell"),
                    "half",
                ),
                "torch.convolution": None,  # CPU autocast registers aten::_convolution, not aten::convolution
            }
        ),
    }
)
#: Functions that CUDA builds of torch cast (their kernels are not in a CPU build's registry, which the test reads).
AUTOCAST_CUDA_BUILD_ONLY: Mapping[str, str] = MappingProxyType(
    dict.fromkeys(("torch.lstm", "torch.gru", "torch.rnn_tanh", "torch.rnn_relu"), "half")
)

#: Functions whose CUDA autocast kernel runs in float16 whatever autocast's dtype: torch's ``_cudnn_rnn`` autocast
#: wrapper casts the input, the state and the flattened weights to float16 (``at::kHalf``), under
#: ``torch.autocast("cuda", dtype=torch.bfloat16)`` too. Under bfloat16 these "half" rows therefore differ from autocast
#: (a float16 RNN has bfloat16's precision loss and float16's range, with no loss scaling at bfloat16), except in a
#: table that takes autocast's choices (:meth:`~lightning_mpx.CastTable.autocast_aligned`).
AUTOCAST_CUDA_FLOAT16_ONLY: tuple[str, ...] = ("torch.lstm", "torch.gru", "torch.rnn_tanh", "torch.rnn_relu")

_NATIVE = (
    "torch's own type promotion runs it in the widest floating dtype of its tensor operands, which is what the "
    "table's promotion gives; they differ only when one operand is a 0-dim tensor and the other a dimensioned tensor "
    "of another floating dtype, where torch keeps the dimensioned operand's dtype (as without autocast)."
)
#: Rows of the default table that give the dtype torch.autocast gives although autocast's lists say otherwise (or
#: nothing): the O1 engine leaves them to torch on every device. Qualified name -> why.
AUTOCAST_EQUIVALENT: Mapping[str, str] = MappingProxyType(
    {
        **dict.fromkeys(
            tuple(f"{owner}.{name}" for owner in ("torch", "torch.Tensor") for name in (
                "add", "sub", "mul", "div", "true_divide", "eq", "ne", "ge", "gt", "le", "lt", "where", "equal",
                "atan2", "addcmul", "addcdiv"))
            + ("torch.Tensor.__eq__", "torch.Tensor.__rsub__", "torch.Tensor.__rtruediv__")
            + ("torch.cat", "torch.concat", "torch.concatenate", "torch.stack"),
            _NATIVE,
        ),
        "torch.Tensor.__rmatmul__": "torch runs it as matmul, which autocast casts to half on both devices.",
        "torch.nn.functional.multi_head_attention_forward": (
            "its projections and batched matmuls are half under autocast (on CUDA its softmax in FP32, which is "
            "safer than the table's whole-function half); its output is half as the table's."
        ),
    }
)
#: The same, on CUDA only: Python functions that run operators which CUDA autocast (not CPU autocast) lists.
AUTOCAST_EQUIVALENT_CUDA: Mapping[str, str] = MappingProxyType(
    {
        "torch.Tensor.__rpow__": "torch runs it as pow, which CUDA autocast runs in FP32.",
        "torch.nn.functional.softmin": "softmax of the negated input: CUDA autocast runs softmax in FP32.",
        "torch.nn.functional.cross_entropy": "log_softmax and nll_loss, both FP32 under CUDA autocast.",
        "torch.linalg.norm": "linalg.vector_norm or linalg.matrix_norm, both FP32 under CUDA autocast.",
    }
)

#: Default-table rows changed on purpose to follow torch.autocast, and why (decided on range and rounding).
AUTOCAST_DECISIONS: Mapping[str, str] = MappingProxyType(
    {
        "torch.nn.functional.gelu": (
            "no longer FP32: neither CPU nor CUDA autocast lists it, its half kernels compute in FP32 internally "
            "(opmath) and round once, and |gelu(x)| <= |x| cannot overflow; Apex's lists did not have it either."
        ),
    }
)
