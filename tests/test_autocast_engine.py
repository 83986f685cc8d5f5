"""The ``"autocast"`` engine of :class:`CastPolicy` (what O1 runs on): ``torch.autocast`` as a scope, and the Python
policy only for the functions where the table differs from autocast on the device.

Every row of the default table computes in the table's dtype (CPU here; ``gpu_suite.py tests`` runs this file on
CUDA), user entries and nested scopes included; a table that agrees with autocast pushes no torch-function mode;
``disable_casts``, FP32 modules, checkpoint recomputation and the per-scope cast cache keep their meaning.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from lightning_mpx import Amp, BannedOpError, CastPolicy, CastTable, checkpoint_contexts, disable_casts, dispatchable
from lightning_mpx.casting.policy import fp32_scope
from tests import test_cast_table as rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF_DTYPES = [torch.float16, torch.bfloat16]


def _dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


def _aligned_table(device: str = DEVICE) -> CastTable:
    return CastTable.autocast_aligned(device)


def _onednn_lstm_runs(dtype: torch.dtype) -> bool:
    try:
        with torch.autocast("cpu", dtype=dtype):
            torch.nn.LSTM(2, 2)(torch.randn(1, 1, 2))
    except RuntimeError:
        return False
    return True


def _row_dtype(entry, half_dtype, device):
    """(the dtype the row computed in under the autocast engine, the table's dtype); None: no floating output."""
    policy = CastPolicy(half_dtype=half_dtype, device_type=device, engine="autocast", allow_banned=True)
    x_dtype, y_dtype, expected = rows._inputs_and_expected(entry.category, half_dtype)
    args, kwargs = rows._arguments(entry)(lambda t: t.to(x_dtype), lambda t: t.to(y_dtype))
    args, kwargs = _on(args, device), {k: _on(v, device) for k, v in kwargs.items()}
    if entry.category == "banned":
        with pytest.raises(BannedOpError), CastPolicy(half_dtype=half_dtype, device_type=device).scope():
            entry.function(*args, **kwargs)
    with warnings.catch_warnings(), policy.scope():
        warnings.simplefilter("ignore")
        out = rows._first_tensor(entry.function(*args, **kwargs))
    if out is not None and out.is_floating_point():
        return out.dtype, expected
    if out is not None and out.is_complex() and expected == torch.float32:
        return out.dtype, torch.complex64
    return None, expected


def _on(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_on(v, device) for v in value)
    return value


@pytest.mark.parametrize("half_dtype", HALF_DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("entry", [pytest.param(e, id=e.qualified_name) for e in rows.DEFAULT_ENTRIES])
def test_every_default_row_computes_in_the_table_dtype(entry, half_dtype):
    reason = rows.CANNOT_RUN.get((entry.qualified_name, half_dtype))
    if reason:
        pytest.skip(reason)
    if entry.qualified_name == "torch.lstm" and not _onednn_lstm_runs(half_dtype):
        pytest.skip("torch.autocast's own CPU LSTM fails here: oneDNN has no LSTM primitive in this dtype on this CPU")
    got, expected = _row_dtype(entry, half_dtype, "cpu")
    assert got in (None, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (gpu_suite.py tests runs it)")
@pytest.mark.parametrize("half_dtype", HALF_DTYPES, ids=_dtype_id)
def test_cuda_every_default_row_computes_in_the_table_dtype(half_dtype):
    wrong = {}
    for entry in rows.DEFAULT_ENTRIES:
        try:
            got, expected = _row_dtype(entry, half_dtype, "cuda")
        except (RuntimeError, NotImplementedError) as error:  # a kernel CUDA lacks for the dtype the table gives
            wrong[entry.qualified_name] = f"raised {error!s:.120}"
            continue
        if got not in (None, expected):
            wrong[entry.qualified_name] = (got, expected)
    assert not wrong, "\n".join(f"{k}: {v}" for k, v in wrong.items())


def test_a_table_that_agrees_with_autocast_pushes_no_mode():
    policy = CastPolicy(_aligned_table(), half_dtype=torch.bfloat16, device_type=DEVICE)
    lin = torch.nn.Linear(4, 4).to(DEVICE)
    with policy.scope():
        assert not torch.overrides._get_current_function_mode_stack()
        assert torch.is_autocast_enabled(DEVICE)
        assert lin(torch.randn(2, 4, device=DEVICE)).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled(DEVICE)
    # The default table differs from autocast (the pinned list): a mode is pushed for those functions only.
    with CastPolicy(half_dtype=torch.bfloat16, device_type=DEVICE).scope():
        assert len(torch.overrides._get_current_function_mode_stack()) == 1


def test_the_policy_says_which_functions_pay_python_dispatch():
    aligned = CastPolicy(_aligned_table(), half_dtype=torch.bfloat16, device_type=DEVICE)
    assert aligned.engine_in_use == f"autocast:{DEVICE}" and aligned.python_functions == ()
    aligned.table.register(torch.outer, "half")  # a user entry autocast does not have: "auto" goes back to the mode
    assert aligned.engine_in_use == "mode"
    forced = CastPolicy(aligned.table, half_dtype=torch.bfloat16, device_type=DEVICE, engine="autocast")
    assert forced.engine_in_use == f"autocast:{DEVICE}" and forced.python_functions == (torch.outer,)
    with forced.scope():
        assert len(torch.overrides._get_current_function_mode_stack()) == 1
    default = CastPolicy(half_dtype=torch.bfloat16, device_type=DEVICE)
    assert default.engine_in_use == "mode"  # the default table differs from autocast: today's engine, unchanged
    forced = CastPolicy(half_dtype=torch.bfloat16, device_type=DEVICE, engine="autocast")
    assert set(forced.python_functions) == set(CastTable.default().autocast_differences(DEVICE))
    assert CastPolicy(CastTable.default_o2(), device_type=DEVICE).engine_in_use == "mode"


def test_user_entries_run_in_their_category():
    @dispatchable
    def scaled_product(a, b):
        return a * b

    table = _aligned_table()
    table.register(torch.outer, "half")  # autocast leaves outer alone
    table.register(scaled_product, "float")
    table.register(F.linear, "float")  # autocast would cast it to half
    table.unregister(torch.matmul)  # autocast would cast it: runs as given
    a = torch.randn(3, device=DEVICE)
    h = a.to(torch.bfloat16)
    with CastPolicy(table, half_dtype=torch.bfloat16, device_type=DEVICE).scope():
        assert torch.outer(a, a).dtype == torch.bfloat16
        assert scaled_product(h, h).dtype == torch.float32
        assert F.linear(h[None], torch.randn(2, 3, device=DEVICE)).dtype == torch.float32
        assert torch.matmul(a[None], a[:, None]).dtype == torch.float32
        assert (a[None] @ a[:, None]).dtype == torch.bfloat16  # Tensor.matmul is still autocast's


def test_nested_scopes_and_threads():
    outer = CastPolicy(_aligned_table(), half_dtype=torch.bfloat16, device_type=DEVICE)
    inner = CastPolicy(half_dtype=torch.float16, device_type=DEVICE)
    a = torch.randn(2, 2, device=DEVICE)
    seen = []
    with outer.scope():
        assert (a @ a).dtype == torch.bfloat16
        with inner.scope():
            assert (a @ a).dtype == torch.float16
            assert torch.softmax(a.half(), 0).dtype == torch.float32  # the inner table's own row
        assert (a @ a).dtype == torch.bfloat16
        worker = threading.Thread(target=lambda: seen.append((a @ a).dtype))
        worker.start()
        worker.join(timeout=30)
    assert seen == [torch.float32]  # autocast is thread-local: another thread is not cast
    assert (a @ a).dtype == torch.float32


@pytest.mark.parametrize("aligned", [True, False], ids=["autocast-only", "with-mode"])
def test_disable_casts_and_fp32_scope(aligned):
    table = _aligned_table() if aligned else None
    a = torch.randn(2, 2, device=DEVICE)
    with CastPolicy(table, half_dtype=torch.bfloat16, device_type=DEVICE).scope():
        with disable_casts():
            assert (a @ a).dtype == torch.float32
        with fp32_scope():
            assert (a @ a).dtype == torch.float32
        assert (a @ a).dtype == torch.bfloat16
        with pytest.raises(ValueError), disable_casts():
            raise ValueError("state is restored")
        assert (a @ a).dtype == torch.bfloat16


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.head, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        g = self.head(h)
        return h.dtype, g.dtype, self.b(g)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fp32_modules_run_in_fp32_under_autocast(compiled):
    amp = Amp("O1", half_dtype="bfloat16", fp32_modules=["head"])
    model = amp.prepare_model(_Net().to(DEVICE))
    if compiled:  # the boundary turns autocast off and on between graphs (dynamo refuses the global setter)
        model = torch.compile(model, backend="aot_eager")
    with amp.forward_context():
        h, g, out = model(torch.randn(3, 4, device=DEVICE))
    assert (h, g, out.dtype) == (torch.bfloat16, torch.float32, torch.bfloat16)


def _block(x, w):
    return torch.tanh(x @ w) @ w


@pytest.mark.parametrize("how", ["reentrant", "non-reentrant", "context_fn"])
def test_checkpoint_recomputes_with_the_forward_dtypes_without_a_mode(how):
    policy = CastPolicy(_aligned_table(), half_dtype=torch.bfloat16, device_type=DEVICE)
    x = torch.randn(3, 4, device=DEVICE)
    grads = []
    for checkpointed in (False, True):
        w = torch.nn.Parameter(torch.linspace(-1, 1, 16, device=DEVICE).reshape(4, 4))
        with policy.scope():
            if not checkpointed:
                out = _block(x, w)
            elif how == "context_fn":
                out = checkpoint(_block, x, w, use_reentrant=False, context_fn=checkpoint_contexts)
            else:
                out = checkpoint(_block, x, w, use_reentrant=how == "reentrant")
        assert out.dtype == torch.bfloat16
        out.float().sum().backward()  # a bare backward, outside the scope
        grads.append(w.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_a_parameter_written_between_scopes_is_cast_again():
    policy = CastPolicy(_aligned_table(), half_dtype=torch.bfloat16, device_type=DEVICE)
    lin = torch.nn.Linear(4, 4, bias=False).to(DEVICE)
    x = torch.eye(4, device=DEVICE)
    with policy.scope():
        before = lin(x)
    with torch.no_grad():
        lin.weight.add_(1.0)  # an optimizer step
    with policy.scope():
        after = lin(x)
    torch.testing.assert_close(after.float(), lin.weight.detach().bfloat16().float().T, rtol=0, atol=0)
    assert not torch.equal(before, after)


def test_a_reused_parameter_gets_its_fp32_gradient():
    policy = CastPolicy(_aligned_table(), half_dtype=torch.bfloat16, device_type=DEVICE)
    w = torch.nn.Parameter(torch.randn(4, 4, device=DEVICE))
    x = torch.randn(2, 4, device=DEVICE)
    with policy.scope():
        loss = ((x @ w) @ w).float().sum()
    loss.backward()
    assert w.grad is not None and w.grad.dtype == torch.float32
    w32 = w.detach().clone().requires_grad_()
    ((x @ w32) @ w32).sum().backward()
    torch.testing.assert_close(w.grad, w32.grad, rtol=0.05, atol=0.05)


def test_engine_and_device_arguments_are_checked():
    with pytest.raises(ValueError, match="engine='fast'.*'auto', 'autocast', 'mode'"):
        CastPolicy(engine="fast")
    with pytest.raises(ValueError, match="device_type='tpu'.*'cpu', 'cuda'"):
        CastPolicy(device_type="tpu")
    with pytest.raises(ValueError, match="device_type='tpu'.*'cpu', 'cuda'"):
        CastTable.autocast_aligned("tpu")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_aligned_table_differs_from_autocast_nowhere_and_leaves_the_default_alone(device):
    default = CastTable.default()
    aligned = CastTable.autocast_aligned(device, default)
    assert aligned.autocast_differences(device) == {}
    assert default.autocast_differences(device)  # the copy was changed, not the table given
    assert aligned.category_of(F.linear) == default.category_of(F.linear) == "half"


def test_the_o2_table_keeps_the_python_policy():
    # Autocast would cast every matmul of a half model's FP32 inputs: the O2 table is far from autocast's lists.
    policy = CastPolicy(CastTable.default_o2(), half_dtype=torch.bfloat16, device_type=DEVICE)
    with warnings.catch_warnings(), policy.scope():
        assert not torch.is_autocast_enabled(DEVICE)
        assert (torch.randn(2, 2, device=DEVICE) @ torch.randn(2, 2, device=DEVICE)).dtype == torch.float32


@pytest.mark.parametrize("how", ["reentrant", "non-reentrant", "context_fn"])
def test_checkpoint_recomputes_the_python_policys_functions_with_autocast_off(how):
    # F.linear left out of the table: autocast would cast it, the table runs it as given (FP32), in the forward and
    # in the recomputation that policy.backward (Amp.backward) runs.
    table = CastTable.default()
    table.unregister(F.linear)
    policy = CastPolicy(table, half_dtype=torch.bfloat16, device_type=DEVICE, engine="autocast")
    x = torch.randn(3, 4, device=DEVICE)

    def block(h, w):
        return torch.tanh(F.linear(h, w))

    grads = []
    for checkpointed in (False, True):
        w = torch.nn.Parameter(torch.linspace(-1, 1, 16, device=DEVICE).reshape(4, 4))
        with policy.scope():
            if not checkpointed:
                out = block(x, w)
            elif how == "context_fn":
                out = checkpoint(block, x, w, use_reentrant=False, context_fn=checkpoint_contexts)
            else:
                out = checkpoint(block, x, w, use_reentrant=how == "reentrant")
        assert out.dtype == torch.float32
        policy.backward(out.sum())
        grads.append(w.grad)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


@pytest.mark.parametrize("engine", ["mode", "autocast-alone", "autocast-and-mode", "mode-in-user-autocast"])
def test_every_scope_entry_restores_the_mode_stack_and_autocast_also_when_it_raises(engine):
    # The scope's four ways in (the mode engine's mode pushed by hand, torch.autocast alone, torch.autocast with the
    # mode for the table's differences, the mode engine inside the user's own autocast, turned off inside): each
    # casts inside, nests, and leaves the stack and autocast's state as they were, also when the block raises.
    table = {"autocast-alone": _aligned_table()}.get(engine)
    policy = CastPolicy(table, half_dtype=torch.bfloat16, device_type=DEVICE,
                        engine="autocast" if engine.startswith("autocast") else "mode")
    outer = torch.autocast(DEVICE, dtype=torch.float16 if DEVICE == "cuda" else torch.bfloat16,
                           enabled=engine == "mode-in-user-autocast")
    modes = torch.overrides._get_current_function_mode_stack
    lin = torch.nn.Linear(4, 4).to(DEVICE)
    with outer:
        before = (len(modes()), torch.is_autocast_enabled(DEVICE), torch.get_autocast_dtype(DEVICE))
        for _ in range(2):
            with pytest.raises(ValueError, match="restored"), policy.scope() as entered:
                assert entered is policy and lin(torch.randn(2, 4, device=DEVICE)).dtype == torch.bfloat16
                assert len(modes()) == (0 if engine == "autocast-alone" else 1)
                # on: the autocast engine's, or the mode engine's marker of an O1 table (casting.scopes.policy_scope)
                assert torch.is_autocast_enabled(DEVICE) and torch.get_autocast_dtype(DEVICE) == torch.bfloat16
                with policy.scope():
                    assert len(modes()) == (0 if engine == "autocast-alone" else 2)
                raise ValueError("state is restored")
            assert (len(modes()), torch.is_autocast_enabled(DEVICE), torch.get_autocast_dtype(DEVICE)) == before


def test_amp_forward_context_on_autocast_alone_restores_state_and_follows_a_table_changed_since():
    # Where torch.autocast is the whole policy (the GPU's default O1), Amp's forward scope is torch.autocast's own
    # context (no generator): it casts, nests and restores autocast also when the block raises; a row registered into
    # the table since the last scope is resolved at the next one (the mode is pushed for it, not autocast alone).
    # The first scope constructs torch.autocast (its arguments checked), the next ones switch autocast on as its
    # own __enter__ does; inside the user's autocast of another dtype and cache setting, both restore it.
    amp = Amp("O1", half_dtype=torch.bfloat16, cast_table=_aligned_table())
    lin = amp.prepare_model(torch.nn.Linear(4, 4).to(DEVICE))
    modes = torch.overrides._get_current_function_mode_stack
    x = torch.randn(2, 4, device=DEVICE)

    def autocast_state() -> tuple:
        return torch.is_autocast_enabled(DEVICE), torch.get_autocast_dtype(DEVICE), torch.is_autocast_cache_enabled()

    for outer in (False, True):
        with torch.autocast(DEVICE, dtype=torch.float16, enabled=outer, cache_enabled=False):
            before = autocast_state()
            for _ in range(2):
                with pytest.raises(ValueError, match="restored"), amp.forward_context():
                    assert len(modes()) == 0 and lin(x).dtype == torch.bfloat16
                    with amp.forward_context():
                        assert autocast_state() == (True, torch.bfloat16, True) and len(modes()) == 0
                    assert autocast_state() == (True, torch.bfloat16, True)
                    raise ValueError("state is restored")
                assert autocast_state() == before and len(modes()) == 0
    assert amp.policy.engine_in_use == f"autocast:{DEVICE}"
    amp.policy.table.register(torch.outer, "half")  # a row autocast does not have: "auto" goes back to the mode
    with amp.forward_context():
        assert len(modes()) == 1 and torch.outer(x[0], x[1]).dtype == torch.bfloat16
    assert len(modes()) == 0 and not torch.is_autocast_enabled(DEVICE)
