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
                "half": _CONV + _BLAS + ("prelu",),
                "float": _POINTWISE_FLOAT + _REDUCTIONS + ("softmax", "log_softmax", "layer_norm", "group_norm"),
                "promote": _PROMOTE,
                "sequence": ("cat", "concat", "concatenate", "stack"),
                "banned": (),
            }
        ),
        "torch.nn.functional": MappingProxyType(
            {
                # multi_head_attention_forward is Python: torch hands it to the policy as one call, so it is listed
                # whole (its projections are the matmuls that matter) rather than op by op.
                "half": _CONV + ("linear", "prelu", "scaled_dot_product_attention", "multi_head_attention_forward"),
                "float": _FUNCTIONAL_FLOAT + _LOSSES,
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
                + ("__pow__", "__rpow__", "softmax", "log_softmax"),
                "promote": tuple(name for name in _PROMOTE if name not in ("bilinear",)) + _TENSOR_OPERATORS_PROMOTE,
                "sequence": (),
                "banned": (),
            }
        ),
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
