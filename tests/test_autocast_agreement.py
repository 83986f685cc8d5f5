"""Where the default cast table and ``torch.autocast`` disagree, per device: pinned, checked against the installed
torch.

The ``"autocast"`` engine of :class:`~lightning_mpx.CastPolicy` (what O1 runs on) leaves every call to
``torch.autocast``'s C++ dispatch except the functions where the table's category differs from autocast's on the
device: those go through the Python policy, and any one of them makes the scope push a torch-function mode, which
every torch call in the scope then pays (3-5 us of Python each). So the list below is the O1 speed story:

* ``cast_lists.AUTOCAST_ACTIONS`` (what autocast does per public function) must match what the installed torch
  registers and lists (a torch upgrade that changes autocast's lists fails ``test_autocast_actions_are_torchs``);
* on CPU, every row of the default table is run under ``torch.autocast("cpu")`` and computes in the dtype that data
  predicts (``test_cpu_autocast_does_what_the_data_says``);
* ``DISAGREEMENTS`` pins the resulting list: a table change or a torch change that moves an op in or out fails
  ``test_the_disagreements_are_the_pinned_ones`` until the list (and the decision beside it) is updated.

The decisions, by group (the reasons are also in ``cast_lists``):

* followed (rows changed or counted as agreeing): ``gelu`` (``AUTOCAST_DECISIONS``); the binary ops, comparisons,
  ``where``, ``cat``/``stack`` whose own type promotion gives the table's widest dtype (``AUTOCAST_EQUIVALENT``: they
  differ only for a 0-dim operand beside a dimensioned one of another dtype, where torch's rule applies).
* kept on CUDA (cost the Python path): ``std``/``var`` (FP32 in Apex; in float16 a variance above 65504 overflows);
  FFTs (cuFFT's float16 sums overflow, and it has no bfloat16); linear algebra, ``quantile``, ``stft``, ``polar``,
  ``ctc_loss`` (no half kernels: autocast would raise where the table runs them in FP32); 3-d and fractional pooling,
  ``grid_sample`` (the table's FP32, from torch's CPU list); ``index_copy`` (autocast promotes it on CPU only; mixed
  dtypes raise on CUDA); loss and norm compositions that autocast casts only in part (``gaussian_nll_loss``,
  ``normalize``...).
* kept on CPU: CPU autocast's FP32 list is narrow (no softmax, norms, exp/log, sums), and its half list lacks
  ``mv``/``addmv``/``addr``/``einsum`` and the RNN cells; the table keeps Apex's choices, so the default table on CPU
  runs with the Python policy for those.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_mpx import CastTable
from lightning_mpx.casting.lists import AUTOCAST_ACTIONS, AUTOCAST_CUDA_BUILD_ONLY, AUTOCAST_EXCEPTIONS
from lightning_mpx.casting.policy import autocast_differences
from lightning_mpx.casting.table import _AUTOCAST_CATEGORIES, _NAMESPACES, _autocast_categories, _base_names, _resolve
from tests import test_cast_table as rows
from tests.test_cast_coverage import CUDA_BUILD_ENTRY_POINTS, TORCH_CATEGORIES, _entry_points

TABLE = CastTable.default()

#: (table's category, autocast's) -> functions, per device. "as given": no category (runs with its inputs as given).
DISAGREEMENTS = {
    "cpu": {
        ("banned", "float"): (
            "torch.nn.functional.binary_cross_entropy",
        ),
        ("float", "as given"): (
            "torch.Tensor.__pow__", "torch.Tensor.__rpow__", "torch.Tensor.acos", "torch.Tensor.asin",
            "torch.Tensor.cosh", "torch.Tensor.cumprod", "torch.Tensor.cumsum", "torch.Tensor.dist",
            "torch.Tensor.erfinv", "torch.Tensor.exp", "torch.Tensor.expm1", "torch.Tensor.log",
            "torch.Tensor.log10", "torch.Tensor.log1p", "torch.Tensor.log2", "torch.Tensor.log_softmax",
            "torch.Tensor.logsumexp", "torch.Tensor.norm", "torch.Tensor.pow", "torch.Tensor.reciprocal",
            "torch.Tensor.renorm", "torch.Tensor.rsqrt", "torch.Tensor.sinh", "torch.Tensor.softmax",
            "torch.Tensor.std", "torch.Tensor.sum", "torch.Tensor.tan", "torch.Tensor.var", "torch.acos",
            "torch.asin", "torch.cosh", "torch.cumprod", "torch.cumsum", "torch.dist", "torch.erfinv", "torch.exp",
            "torch.expm1", "torch.fft.hfft2", "torch.fft.hfftn", "torch.fft.ihfft2", "torch.fft.ihfftn",
            "torch.frobenius_norm", "torch.group_norm", "torch.layer_norm", "torch.linalg.det", "torch.linalg.lu",
            "torch.linalg.lu_factor", "torch.linalg.lu_factor_ex", "torch.linalg.lu_solve",
            "torch.linalg.matrix_norm", "torch.linalg.norm", "torch.linalg.pinv", "torch.linalg.slogdet",
            "torch.linalg.solve_ex", "torch.linalg.solve_triangular", "torch.linalg.vector_norm", "torch.log",
            "torch.log10", "torch.log1p", "torch.log2", "torch.log_softmax", "torch.logsumexp",
            "torch.nn.functional.cosine_similarity", "torch.nn.functional.gaussian_nll_loss",
            "torch.nn.functional.group_norm", "torch.nn.functional.interpolate", "torch.nn.functional.layer_norm",
            "torch.nn.functional.linear_cross_entropy", "torch.nn.functional.local_response_norm",
            "torch.nn.functional.log_softmax", "torch.nn.functional.multilabel_soft_margin_loss",
            "torch.nn.functional.normalize", "torch.nn.functional.pdist", "torch.nn.functional.rms_norm",
            "torch.nn.functional.softmax", "torch.nn.functional.softmin", "torch.nn.functional.softplus",
            "torch.nn.functional.triplet_margin_with_distance_loss", "torch.norm", "torch.nuclear_norm", "torch.pow",
            "torch.reciprocal", "torch.renorm", "torch.rms_norm", "torch.rsqrt", "torch.sinh", "torch.softmax",
            "torch.std", "torch.sum", "torch.tan", "torch.var",
        ),
        ("half", "as given"): (
            "torch.Tensor.addmv", "torch.Tensor.addr", "torch.Tensor.mv", "torch.addmv", "torch.addr",
            "torch.convolution", "torch.gru", "torch.gru_cell", "torch.lstm_cell", "torch.mv",
        ),
        ("promote", "as given"): (
            "torch.Tensor.cross", "torch.Tensor.dot", "torch.Tensor.index_put", "torch.Tensor.scatter_add",
            "torch.Tensor.vdot", "torch.cross", "torch.dot", "torch.index_put", "torch.nn.functional.bilinear",
            "torch.scatter_add", "torch.vdot",
        ),
        ("promote", "half"): (
            "torch.tensordot",
        ),
    },
    "cuda": {
        ("float", "as given"): (
            "torch.Tensor.cholesky", "torch.Tensor.cholesky_inverse", "torch.Tensor.cholesky_solve",
            "torch.Tensor.geqrf", "torch.Tensor.inverse", "torch.Tensor.lu", "torch.Tensor.lu_solve",
            "torch.Tensor.nanquantile", "torch.Tensor.orgqr", "torch.Tensor.ormqr", "torch.Tensor.pinverse",
            "torch.Tensor.qr", "torch.Tensor.quantile", "torch.Tensor.std", "torch.Tensor.stft", "torch.Tensor.svd",
            "torch.Tensor.trace", "torch.Tensor.triangular_solve", "torch.Tensor.var", "torch.cholesky",
            "torch.cholesky_inverse", "torch.cholesky_solve", "torch.ctc_loss",
            "torch.fake_quantize_per_tensor_affine", "torch.fft.fft", "torch.fft.fft2", "torch.fft.fftn",
            "torch.fft.hfft", "torch.fft.hfft2", "torch.fft.hfftn", "torch.fft.ifft", "torch.fft.ifft2",
            "torch.fft.ifftn", "torch.fft.ihfft", "torch.fft.ihfft2", "torch.fft.ihfftn", "torch.fft.irfft",
            "torch.fft.irfft2", "torch.fft.irfftn", "torch.fft.rfft", "torch.fft.rfft2", "torch.fft.rfftn",
            "torch.geqrf", "torch.grid_sampler_2d", "torch.grid_sampler_3d", "torch.inverse",
            "torch.linalg.cholesky", "torch.linalg.cholesky_ex", "torch.linalg.cond", "torch.linalg.det",
            "torch.linalg.eig", "torch.linalg.eigh", "torch.linalg.eigvals", "torch.linalg.eigvalsh",
            "torch.linalg.householder_product", "torch.linalg.inv", "torch.linalg.inv_ex", "torch.linalg.lstsq",
            "torch.linalg.lu", "torch.linalg.lu_factor", "torch.linalg.lu_factor_ex", "torch.linalg.lu_solve",
            "torch.linalg.matrix_rank", "torch.linalg.pinv", "torch.linalg.qr", "torch.linalg.slogdet",
            "torch.linalg.solve", "torch.linalg.solve_ex", "torch.linalg.solve_triangular", "torch.linalg.svd",
            "torch.linalg.svdvals", "torch.linalg.tensorinv", "torch.linalg.tensorsolve", "torch.lu",
            "torch.lu_solve", "torch.max_pool3d", "torch.nanquantile", "torch.nn.functional.adaptive_avg_pool3d",
            "torch.nn.functional.adaptive_max_pool3d", "torch.nn.functional.avg_pool3d",
            "torch.nn.functional.ctc_loss", "torch.nn.functional.fractional_max_pool2d",
            "torch.nn.functional.fractional_max_pool3d", "torch.nn.functional.gaussian_nll_loss",
            "torch.nn.functional.linear_cross_entropy", "torch.nn.functional.local_response_norm",
            "torch.nn.functional.max_pool3d", "torch.nn.functional.max_unpool2d", "torch.nn.functional.max_unpool3d",
            "torch.nn.functional.multilabel_soft_margin_loss", "torch.nn.functional.normalize",
            "torch.nn.functional.triplet_margin_with_distance_loss", "torch.orgqr", "torch.ormqr", "torch.pinverse",
            "torch.polar", "torch.qr", "torch.quantile", "torch.std", "torch.stft", "torch.svd", "torch.trace",
            "torch.triangular_solve", "torch.var", "torch.view_as_complex",
        ),
        ("float", "promote"): (
            "torch.grid_sampler", "torch.nn.functional.grid_sample",
        ),
        ("promote", "as given"): (
            "torch.Tensor.index_copy", "torch.index_copy",
        ),
    },
}


def _qualified(function):
    entry = TABLE.entry(function)
    if entry is not None:
        return entry.qualified_name
    name = getattr(function, "__name__", None)
    return next(f"{ns}.{name}" for ns, owner in _NAMESPACES.items() if getattr(owner, name, None) is function)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_disagreements_are_the_pinned_ones(device):
    found = {}
    for function, (mine, theirs) in autocast_differences(TABLE, device).items():
        found.setdefault((mine or "as given", theirs or "as given"), set()).add(_qualified(function))
    # (A function this torch does not have, such as torch 2.11's missing F.linear_cross_entropy, cannot differ.)
    expected = {key: {name for name in names if _resolve(name) is not None}
                for key, names in DISAGREEMENTS[device].items()}
    # Rows of the pinned data that this torch's autocast does not cast (an older torch): the table's category
    # against "as given" (test_autocast_actions_are_torchs checks that they are the only change).
    for name in _not_cast_here(device):
        entry = TABLE.entry(_resolve(name))
        if entry is not None:
            expected.setdefault((entry.category, "as given"), set()).add(name)
    assert found == expected


def _pinned(device):
    return {name: category for category, names in AUTOCAST_ACTIONS[device].items() for name in names}


def _derived(device):
    """What the installed torch's autocast casts, by public function: its registry and its test lists."""
    derived = {}
    for op, categories in TORCH_CATEGORIES.items():
        # The CUDA-build-only operators (a CUDA build's aten::_cudnn_rnn) are AUTOCAST_CUDA_BUILD_ONLY's, not the pinned
        # data's: a CPU build, CI's, cannot derive them.
        if device in categories and op not in AUTOCAST_EXCEPTIONS and op not in CUDA_BUILD_ENTRY_POINTS:
            for name in _entry_points(op):
                if not name.startswith("torch._"):  # private entry points (a CUDA build's torch._cudnn_rnn)
                    derived[name] = categories[device]
    return derived


def _not_cast_here(device):
    return set(_pinned(device)) - set(_derived(device))


def test_a_row_this_torchs_autocast_does_not_register_is_not_trusted():
    """The pinned data describes the torch it was derived from; on an older torch (torch 2.11's CUDA autocast has no
    ``rms_norm`` kernel) the engine must not count on autocast to cast it: the default table's FP32 row then runs
    through the Python policy, and the aligned table takes autocast's "as given"."""
    installed = _base_names(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))
    rms_norms = {torch.rms_norm, torch.nn.functional.rms_norm}
    if "rms_norm" not in installed:  # this torch is such an older one (2.11): its own rows leave rms_norm out
        assert not rms_norms & set(_AUTOCAST_CATEGORIES["cuda"])
    older = _autocast_categories("cuda", installed - {"rms_norm"})
    assert not rms_norms & set(older)
    assert {f: c for f, c in _AUTOCAST_CATEGORIES["cuda"].items() if f not in rms_norms} == dict(older)
    if "rms_norm" in installed:
        assert rms_norms <= set(_AUTOCAST_CATEGORIES["cuda"])
    # With no kernel registered, every row reaching autocast through operators of this torch is dropped; a row
    # reached through a name that is no operator (Tensor.matmul's ``__matmul__``) is kept, as are the CUDA-build RNNs.
    none = _autocast_categories("cuda", frozenset())
    assert torch.mm not in none and torch.softmax not in none and torch.Tensor.matmul in none
    assert torch.lstm in none


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_autocast_actions_are_torchs(device):
    """The data the engine decides with is what the installed torch's autocast registers, by public function."""
    derived, pinned = _derived(device), _pinned(device)
    dropped = _not_cast_here(device)
    # Nothing that this torch casts is missing or different; what it does not cast (an older torch) the engine
    # does not count on.
    assert {name: category for name, category in pinned.items() if name not in dropped} == derived
    assert not {_resolve(name) for name in dropped} & set(_AUTOCAST_CATEGORIES[device])
    # The CUDA-build-only rows are the cuDNN RNNs, which a CPU build's registry cannot show; a CUDA build's can.
    assert set(AUTOCAST_CUDA_BUILD_ONLY) == {"torch.lstm", "torch.gru", "torch.rnn_tanh", "torch.rnn_relu"}
    for op, names in CUDA_BUILD_ENTRY_POINTS.items():
        if device in TORCH_CATEGORIES.get(op, {}):
            assert {name: TORCH_CATEGORIES[op][device] for name in names} == dict(AUTOCAST_CUDA_BUILD_ONLY)


# Rows that CPU autocast casts only in part, so no one category predicts their output (they are in the pinned
# disagreements, left to the Python policy): the fused loss's projection is half and its loss FP32; pinv's SVD is
# FP32 and its products half. oneDNN's bfloat16 LSTM is missing on some CPUs (torch.autocast itself fails there).
PARTLY_CAST = {"torch.nn.functional.linear_cross_entropy", "torch.linalg.pinv", "torch.lstm"}


def _floating_out(value):
    tensor = rows._first_tensor(value)
    return tensor.dtype if tensor is not None and tensor.is_floating_point() else None


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_cpu_autocast_does_what_the_data_says(half):
    """Every default-table row, run under torch.autocast("cpu"): FP32 inputs come out half only where autocast's
    category is half, half inputs come out FP32 only where it is float."""
    autocast = _AUTOCAST_CATEGORIES["cpu"]
    wrong = {}
    for entry in rows.DEFAULT_ENTRIES:
        category = autocast.get(entry.function)
        if entry.category == "banned" or entry.qualified_name in PARTLY_CAST:
            continue
        for given in (torch.float32, half):
            args, kwargs = rows._arguments(entry)(lambda t, g=given: t.to(g), lambda t, g=given: t.to(g))
            try:
                with warnings.catch_warnings(), torch.autocast("cpu", dtype=half):
                    warnings.simplefilter("ignore")
                    out = _floating_out(entry.function(*args, **kwargs))
            except (RuntimeError, NotImplementedError):
                # No kernel for the dtype it got: only where autocast leaves the op alone (or casts it down).
                if category in (None, "half", "promote") and given == half or category == "half":
                    continue
                wrong[(entry.qualified_name, given)] = "raised"
                continue
            if out is None:
                continue
            if given == torch.float32:
                expected = half if category == "half" else torch.float32
            else:
                expected = torch.float32 if category == "float" else half
            if out != expected:
                wrong[(entry.qualified_name, given)] = (category, out)
    assert not wrong, "\n".join(f"{k}: {v}" for k, v in wrong.items())
