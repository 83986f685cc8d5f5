"""The default table covers torch's own autocast op lists, derived from the installed torch.

``torch.autocast`` registers a kernel for each operator it casts (``AutocastCPU``, ``AutocastCUDA``; the registry is
readable on a CPU-only build too), and ``torch/testing/_internal/autocast_test_lists.py`` says which category each
operator of its test lists has. Every such operator must reach a cast policy through a function with the same
category here (``half`` for lower precision, ``float`` for FP32, ``promote``/``sequence`` for promotion), or be
listed in ``cast_lists.AUTOCAST_EXCEPTIONS`` with the reason. One row per operator: a torch upgrade that adds one
shows up as a failing row.
"""

from __future__ import annotations

import builtins
import importlib.util
import types
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from lightning_mpx import CastPolicy, CastTable
from lightning_mpx.casting.lists import AUTOCAST_CUDA_BUILD_ONLY, AUTOCAST_ENTRY_POINTS, AUTOCAST_EXCEPTIONS
from lightning_mpx.casting.table import _NAMESPACES

TABLE = CastTable.default()
DEVICES = {"AutocastCPU": "cpu", "AutocastCUDA": "cuda"}


def _autocast_test_lists() -> tuple[Any, Any]:
    """``AutocastTestLists`` and ``AutocastCPUTestLists``, built on CPU.

    The module imports ``torch.testing._internal.common_utils`` for two names; that module needs ``expecttest`` and
    changes process-wide torch flags when imported, so the file is run here with a stand-in for that one import.
    """
    path = importlib.util.find_spec("torch.testing._internal.autocast_test_lists").origin
    stand_in = types.SimpleNamespace(TEST_WITH_ROCM=False, TestCase=object)

    def _import(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "torch.testing._internal.common_utils":
            return stand_in
        return builtins.__import__(name, *args, **kwargs)

    namespace: dict[str, Any] = {"__builtins__": {**vars(builtins), "__import__": _import}, "__name__": "lists"}
    with open(path) as source:
        exec(compile(source.read(), path, "exec"), namespace)  # noqa: S102
    return namespace["AutocastTestLists"]("cpu"), namespace["AutocastCPUTestLists"]("cpu")


# (list attribute, torch's category) for the CUDA lists and the CPU lists.
_CUDA_LISTS = (
    ("torch_fp16", "half"),
    ("nn_fp16", "half"),
    ("linalg_fp16", "half"),
    ("methods_fp16", "half"),
    ("torch_fp32", "float"),
    ("nn_fp32", "float"),
    ("methods_fp32", "float"),
    ("torch_need_autocast_promote", "promote"),
    ("banned", "banned"),
)
_CPU_LISTS = (
    ("torch_16", "half"),
    ("nn_16", "half"),
    ("torch_fp32", "float"),
    ("nn_fp32", "float"),
    ("torch_need_autocast_promote", "promote"),
)

# Registered operators that the test lists leave out and that are not FP32: their category in torch's
# aten/src/ATen/autocast_mode.cpp. The CPU ones are checked against torch.autocast below.
NOT_FP32_OUTSIDE_TEST_LISTS = {
    "linalg_vecdot": "half",
    "scaled_dot_product_attention": "half",
    "_scaled_dot_product_flash_attention": "half",
    "mkldnn_rnn_layer": "half",
    "_convolution": "half",
    "convolution": "half",
    "_thnn_fused_lstm_cell": "half",
    "_thnn_fused_gru_cell": "half",
    "index_copy": "promote",
    # CUDA builds only: the cuDNN RNN kernel behind torch.lstm/gru/rnn_tanh/rnn_relu, cast to float16
    "_cudnn_rnn": "half",
}
# Operators registered in CUDA builds only, by the public functions that reach them (a CPU build, CI's, lacks them).
CUDA_BUILD_ENTRY_POINTS = {"_cudnn_rnn": tuple(AUTOCAST_CUDA_BUILD_ONLY)}


def _torch_categories() -> dict[str, dict[str, str]]:
    """operator -> {device: torch's category}."""
    found: dict[str, dict[str, str]] = {}
    cuda_lists, cpu_lists = _autocast_test_lists()
    for lists, device, names in ((cuda_lists, "cuda", _CUDA_LISTS), (cpu_lists, "cpu", _CPU_LISTS)):
        for attribute, category in names:
            for row in getattr(lists, attribute):
                found.setdefault(row[0], {})[device] = category
    for key, device in DEVICES.items():
        for name in torch._C._dispatch_get_registrations_for_dispatch_key(key):
            namespace, _, op = name.partition("::")
            if namespace == "aten":
                op = op.split(".")[0]
                found.setdefault(op, {}).setdefault(device, NOT_FP32_OUTSIDE_TEST_LISTS.get(op, "float"))
    return found


TORCH_CATEGORIES = _torch_categories()
# Which of this table's categories follow each of torch's.
COMPATIBLE = {
    "half": {"half"},
    "float": {"float", "banned"},  # banned ops run in FP32 with allow_banned=True
    "promote": {"promote", "sequence"},
    "banned": {"banned"},
}


def _resolve(qualified: str) -> Callable[..., Any]:
    namespace, _, name = qualified.rpartition(".")
    return getattr(_NAMESPACES[namespace], name)


def _entry_points(op: str) -> dict[str, Callable[..., Any]]:
    """The public functions through which ``op`` reaches a cast policy."""
    if op in AUTOCAST_ENTRY_POINTS or op in CUDA_BUILD_ENTRY_POINTS:
        return {name: _resolve(name) for name in AUTOCAST_ENTRY_POINTS.get(op) or CUDA_BUILD_ENTRY_POINTS[op]}
    for prefix, namespace in (("fft_", "torch.fft"), ("linalg_", "torch.linalg"), ("special_", "torch.special")):
        if op.startswith(prefix):
            function = getattr(_NAMESPACES[namespace], op.removeprefix(prefix), None)
            return {} if function is None else {f"{namespace}.{op.removeprefix(prefix)}": function}
    found = {}
    for namespace in ("torch", "torch.nn.functional", "torch.Tensor"):
        function = getattr(_NAMESPACES[namespace], op, None)
        if callable(function):
            found[f"{namespace}.{op}"] = function
    return found


@pytest.mark.parametrize("op", sorted(TORCH_CATEGORIES))
def test_the_table_follows_torch_autocast(op):
    if op in AUTOCAST_EXCEPTIONS:
        assert AUTOCAST_EXCEPTIONS[op].strip()
        return
    categories = TORCH_CATEGORIES[op]
    # Where CPU and CUDA autocast disagree (grid_sampler, binary_cross_entropy), following either is right.
    allowed = set().union(*(COMPATIBLE[category] for category in categories.values()))
    functions = _entry_points(op)
    assert functions, (
        f"torch's autocast casts aten::{op} ({categories}), and no public function of that name was found: add its "
        "entry points to cast_lists.AUTOCAST_ENTRY_POINTS, or the operator to cast_lists.AUTOCAST_EXCEPTIONS with "
        "the reason."
    )
    wrong = {name: TABLE.category_of(f) for name, f in functions.items() if TABLE.category_of(f) not in allowed}
    assert not wrong, f"torch's autocast: aten::{op} is {categories}; this table has {wrong}"


def test_exceptions_and_entry_points_name_known_operators():
    assert set(AUTOCAST_EXCEPTIONS) <= set(TORCH_CATEGORIES)
    assert set(AUTOCAST_ENTRY_POINTS) <= set(TORCH_CATEGORIES)
    assert not set(AUTOCAST_EXCEPTIONS) & set(AUTOCAST_ENTRY_POINTS)


@pytest.mark.parametrize(
    ("op", "run", "expected"),
    [
        ("linalg_vecdot", lambda x: torch.linalg.vecdot(x, x), torch.bfloat16),
        ("scaled_dot_product_attention", lambda x: F.scaled_dot_product_attention(x[None], x[None], x[None]),
         torch.bfloat16),
        ("mkldnn_rnn_layer", lambda x: torch.nn.LSTM(8, 8)(x[None])[0], torch.bfloat16),
        ("_convolution", lambda x: torch._convolution(x[None], torch.randn(3, 4, 3), None, [1], [0], [1], False,
                                                      [0], 1, False, False, True), torch.bfloat16),
        ("index_copy", lambda x: x.bfloat16().index_copy(0, torch.tensor([0]), x[:1]), torch.float32),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)  # fmt: skip
def test_the_categories_outside_the_test_lists_are_torch_autocasts(op, run, expected):
    assert NOT_FP32_OUTSIDE_TEST_LISTS[op] == ("half" if expected == torch.bfloat16 else "promote")
    if op == "mkldnn_rnn_layer" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        # torch's own autocast LSTM fails there ("could not create a primitive descriptor"): nothing to compare with
        pytest.skip("this CPU has no oneDNN bfloat16 support (seen on AMD EPYC without AVX-512)")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert run(torch.randn(4, 8)).dtype == expected


# --- ops without half kernels run at O1 on half activations --------------------------------------------------------
NO_HALF_KERNEL = {
    "cdist": lambda h: torch.cdist(h, h),
    "fft.rfft": lambda h: torch.fft.rfft(h),
    "stft": lambda h: torch.stft(h.reshape(-1), 16, window=torch.ones(16, dtype=h.dtype), return_complex=True),
    "quantile": lambda h: torch.quantile(h, 0.5, dim=1),
    "avg_pool3d": lambda h: F.avg_pool3d(h.reshape(1, 1, 4, 4, 4), 2),
}


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("op", NO_HALF_KERNEL)
def test_ops_without_half_kernels_run_in_fp32_at_o1(op, half):
    activation = torch.randn(8, 8).to(half)  # what a half matmul before them produces
    with pytest.raises(RuntimeError):
        NO_HALF_KERNEL[op](activation)  # torch has no such kernel: the reason the table sends them to FP32
    with CastPolicy(half_dtype=half).scope():
        out = NO_HALF_KERNEL[op](activation)
    assert out.dtype in (torch.float32, torch.complex64)
    torch.testing.assert_close(out, NO_HALF_KERNEL[op](activation.float()))
