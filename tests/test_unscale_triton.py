"""The fused Triton backend against the reference backend: values, flags, norms, clipping, the table cache, the copy.

On CPU the kernels run in triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py when there is no GPU);
on a GPU the same tests run on CUDA tensors with compiled kernels. Small chunks (16 elements, blocks of 8) keep the
interpreter fast and put chunk and block boundaries inside the tensors; the interpreter's cost is per block of each
chunk (about a second a case), so there the tests of a cube of settings take a subset that meets every pair of
settings (``_pairs``, ``_non_finite_cases``); CUDA runs the whole cube.
"""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_mpx import Amp, MasterWeights
from lightning_mpx.scaling.unscale import UnscaleWorkspace, cast_copy_, resolve_backend, unscale_grads_

triton = pytest.importorskip("triton")
from lightning_mpx.scaling import triton_unscale as kernels  # noqa: E402  (needs triton)

# numpy, under triton's interpreter, warns on inf * 0 and on casts that overflow: the tests make both on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

ROOT = Path(__file__).resolve().parents[1]
INTERPRETED = kernels.interpreting()
CHUNK, BLOCK = 16, 8
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Empty, one element, odd sizes, one short of / exactly / one past a chunk, several chunks with a ragged end.
SHAPES = [(0,), (1,), (7,), (CHUNK - 1,), (CHUNK,), (CHUNK + 1,), (3, 5, 7), (2 * CHUNK + 3,), (0, 4), (5, 11)]
DEVICES = [
    pytest.param(
        "cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="CPU tensors need TRITON_INTERPRET=1 (unset here)")
    ),
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available() or INTERPRETED,
            reason="no CUDA device" if not torch.cuda.is_available() else "kernels run in the interpreter",
        ),
    ),
]


def _workspace(**kwargs):
    return UnscaleWorkspace(chunk_size=CHUNK, block_size=BLOCK, num_warps=1, **kwargs)


def _grads(dtype, device, seed=0, scale=1024.0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g) * scale).to(dtype).to(device) for shape in shapes]


def _inv(scale, device="cpu"):
    return torch.tensor(scale, dtype=torch.float64).reciprocal().float().to(device)


def _run(backend, dtype, device, *, master=False, norm=False, max_norm=None, scale=1024.0, poison=None, ws=None):
    grads = _grads(dtype, device)
    if poison is not None:
        poison(grads)
    out = [torch.full(g.shape, -7.0, device=device) for g in grads] if master else None
    found = torch.zeros((), device=device)
    result = unscale_grads_(
        grads,
        _inv(scale, device),
        found,
        out=out,
        compute_norm=norm,
        max_norm=max_norm,
        backend=backend,
        workspace=ws if ws is not None else _workspace(),
    )
    return (out if master else grads), found, result, grads


def _assert_within_ulps(got, want, dtype, ulps):
    """|got - want| <= ulps units in the last place of ``dtype`` at ``want`` (NaN where NaN)."""
    assert torch.equal(got.isnan(), want.isnan())
    got, want = got.double()[~want.isnan()], want.double()[~want.isnan()]
    mantissa = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}[dtype]
    tiny = {torch.float32: 2.0**-149, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}[dtype]
    ulp = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(tiny))) - mantissa).clamp_min(tiny)
    assert ((got - want).abs() <= ulps * ulp).all(), (got - want).abs().max()


def _pairs(first: dict[str, object], second: dict[str, object]) -> list:
    """(dtype, first, second, device): on CUDA the whole cube (12 cases); in the interpreter the 6 in which every
    dtype meets both values of each switch and the two switches meet in all four pairs (ids as the cube's)."""
    cases = []
    for device in DEVICES:
        for k, dtype in enumerate(DTYPES):
            for i, (a_id, a) in enumerate(first.items()):
                for j, (b_id, b) in enumerate(second.items()):
                    if device.values[0] == "cuda" or (i ^ j) == k % 2:
                        cases.append(pytest.param(dtype, a, b, device.values[0], marks=device.marks,
                                                  id=f"{b_id}-{a_id}-{dtype}-{device.values[0]}"))  # fmt: skip
    return cases


MASTER = {"in-place": False, "into-fp32-master": True}


@pytest.mark.parametrize("dtype,master,norm,device", _pairs(MASTER, {"no-norm": False, "norm": True}))
def test_triton_matches_reference(device, dtype, master, norm):
    values, found, result, _ = _run("triton", dtype, device, master=master, norm=norm)
    ref_values, ref_found, ref_result, _ = _run("reference", dtype, device, master=master, norm=norm)
    for got, want in zip(values, ref_values):
        assert got.dtype == want.dtype and torch.equal(got, want)  # one FP32 multiply, one rounding: bit-exact
    assert found.item() == ref_found.item() == 0.0
    if norm:
        torch.testing.assert_close(result, ref_result, rtol=2e-6, atol=0)
    else:
        assert result is None and ref_result is None


@pytest.mark.parametrize("dtype,master,max_norm,device", _pairs(MASTER, {"clips": 0.5, "no-op": 1e9}))
def test_triton_clip_matches_reference(device, dtype, master, max_norm):
    values, found, result, sources = _run("triton", dtype, device, master=master, max_norm=max_norm)
    ref_values, _, ref_result, _ = _run("reference", dtype, device, master=master, max_norm=max_norm)
    torch.testing.assert_close(result, ref_result, rtol=2e-6, atol=0)
    assert found.item() == 0.0
    for got, want in zip(values, ref_values):
        # The reference rounds twice (unscale, then clip), the fused pass once (by clip_coef / scale), and the two
        # norms differ by float32 rounding: at most one unit in the last place of the gradient's dtype.
        _assert_within_ulps(got, want, got.dtype, ulps=1)
    if master:  # the half gradients were only read
        for src, fresh in zip(sources, _grads(dtype, device)):
            assert torch.equal(src, fresh)
    if max_norm == 1e9:  # coefficient clamped to 1: exactly the unscaled values
        plain, *_ = _run("reference", dtype, device, master=master)
        for got, want in zip(values, plain):
            assert torch.equal(got, want)
    else:
        total = torch.linalg.vector_norm(torch.cat([v.double().flatten() for v in values]))
        assert abs(total.item() - max_norm) < 1e-2 * max_norm


def _non_finite_cases() -> list:
    """Position x value x dtype: on CUDA the whole cube (27 cases); in the interpreter (seconds a case) a Latin
    square, 9 cases with every pair of a position, a value and a dtype once."""
    positions, bads = ["first", "middle", "last"], {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}
    cases = []
    for device in DEVICES:
        for i, where in enumerate(positions):
            for j, (name, bad) in enumerate(bads.items()):
                for k, dtype in enumerate(DTYPES):
                    if device.values[0] == "cuda" or k == (i + j) % 3:
                        cases.append(pytest.param(where, bad, dtype, device.values[0], marks=device.marks,
                                                  id=f"{where}-{name}-{dtype}-{device.values[0]}"))  # fmt: skip
    return cases


@pytest.mark.parametrize("where,bad,dtype,device", _non_finite_cases())
def test_triton_non_finite_values_set_the_flag(device, dtype, bad, where):
    def poison(grads):
        # First element of the first non-empty tensor, the middle of a multi-chunk tensor, the last of the last.
        index, position = {"first": (1, 0), "middle": (7, SHAPES[7][0] // 2), "last": (9, -1)}[where]
        grads[index].view(-1)[position] = bad

    for master in (False, True):
        values, found, norm, _ = _run("triton", dtype, device, master=master, norm=True, poison=poison)
        ref_values, ref_found, ref_norm, _ = _run("reference", dtype, device, master=master, norm=True, poison=poison)
        assert found.item() == ref_found.item() == 1.0
        for got, want in zip(values, ref_values):
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
        assert not torch.isfinite(norm) and torch.equal(norm.isnan(), ref_norm.isnan())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_triton_clip_with_non_finite_gradients_matches_reference(device, bad):
    def poison(grads):
        grads[5][3] = bad

    values, found, norm, _ = _run("triton", torch.float16, device, max_norm=1.0, poison=poison)
    ref_values, ref_found, ref_norm, _ = _run("reference", torch.float16, device, max_norm=1.0, poison=poison)
    assert found.item() == ref_found.item() == 1.0
    assert torch.equal(norm.isnan(), ref_norm.isnan()) and not torch.isfinite(norm)
    for got, want in zip(values, ref_values):  # a non-finite norm: left unclipped, as the reference
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("device", DEVICES)
def test_triton_unscaled_value_overflowing_its_dtype_is_an_overflow(device):
    # A scale below one (rescaling pending gradients to a larger scale) can push a half value past its range.
    grads = [torch.tensor([60000.0, 1.0], dtype=torch.float16, device=device)]
    ref = [g.clone() for g in grads]
    found, ref_found = torch.zeros((), device=device), torch.zeros((), device=device)
    unscale_grads_(grads, torch.tensor(4.0, device=device), found, backend="triton", workspace=_workspace())
    unscale_grads_(ref, torch.tensor(4.0, device=device), ref_found, backend="reference")
    assert found.item() == ref_found.item() == 1.0
    assert torch.equal(grads[0], ref[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_triton_non_power_of_two_scale_matches_foreach(device, dtype):
    # 1/3 is not exact: torch's kernels multiply in FP32 and round once to the gradient's dtype, and so does this.
    grads = _grads(dtype, device)
    ref = [g.clone() for g in grads]
    found, ref_found = torch.zeros((), device=device), torch.zeros((), device=device)
    inv = torch.tensor(1 / 3, device=device)
    unscale_grads_(grads, inv, found, backend="triton", workspace=_workspace())
    unscale_grads_(ref, inv, ref_found, backend="foreach" if device == "cuda" else "reference")
    for got, want in zip(grads, ref):
        assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("start", [0.0, 1.0])
def test_triton_flag_is_only_ever_raised(device, start):
    found = torch.full((1,), start, device=device)  # a one-element flag works as well as a 0-d one
    unscale_grads_(_grads(torch.float32, device), _inv(2.0, device), found, backend="triton", workspace=_workspace())
    assert found.item() == start


@pytest.mark.parametrize("device", DEVICES)
def test_triton_norm_is_deterministic(device):
    norms = [_run("triton", torch.float32, device, norm=True)[2] for _ in range(3)]
    assert all(torch.equal(n, norms[0]) for n in norms)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_only_empty_tensors(device):
    found = torch.zeros((), device=device)
    empty = [torch.empty(0, device=device), torch.empty(3, 0, device=device)]
    norm = unscale_grads_(empty, _inv(2.0, device), found, compute_norm=True, backend="triton", workspace=_workspace())
    assert norm.item() == 0.0 and found.item() == 0.0
    assert unscale_grads_([], _inv(2.0, device), found, max_norm=1.0, backend="triton").item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_triton_unaligned_views_and_non_dense_layouts(device):
    # Views one element into a flat buffer (addresses not 16-byte aligned: no vector hint), and a transposed
    # gradient whose master is contiguous (layouts differ: the foreach twin takes the call). Same answers.
    flat = torch.randn(1 + 40 + 21, device=device) * 64
    views = [flat[1:41].view(5, 8), flat[41:]]
    transposed = (torch.randn(6, 5, device=device) * 64).t()
    for grads, master in (([*views], False), ([transposed], True)):
        ref = [g.clone() for g in grads]
        out = [torch.empty(g.shape, device=device) for g in grads] if master else None
        ref_out = [torch.empty(g.shape, device=device) for g in grads] if master else None
        found = torch.zeros((), device=device)
        norm = unscale_grads_(grads, _inv(64.0, device), found, out=out, max_norm=2.0, backend="triton")
        ref_norm = unscale_grads_(ref, _inv(64.0, device), torch.zeros((), device=device), out=ref_out, max_norm=2.0,
                                  backend="reference")
        torch.testing.assert_close(norm, ref_norm, rtol=2e-6, atol=0)
        for got, want in zip(out or grads, ref_out or ref):
            torch.testing.assert_close(got, want, rtol=3e-7, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_tables_are_cached_and_rebuilt_when_storage_changes(device):
    ws = _workspace(max_plans=2)
    grads = _grads(torch.float32, device)
    found = torch.zeros((), device=device)
    for scale in (2.0, 4.0, 8.0):  # a new scale is read from device memory: same table, nothing rebuilt
        expected = [g / scale for g in grads]
        unscale_grads_(grads, _inv(scale, device), found, backend="triton", workspace=ws)
        assert all(torch.equal(g, e) for g, e in zip(grads, expected))
    assert ws.builds == 1

    old = grads[5]
    grads[5] = old.clone()  # new storage for one gradient: the table is kept, the new address is taken
    before = old.clone()
    expected = [g / 2.0 for g in grads]
    unscale_grads_(grads, _inv(2.0, device), found, backend="triton", workspace=ws)
    assert ws.builds == 1 and all(torch.equal(g, e) for g, e in zip(grads, expected))
    assert torch.equal(old, before)  # the old buffer is never written

    grads.append(torch.ones(3, device=device))  # one more parameter
    unscale_grads_(grads, _inv(2.0, device), found, backend="triton", workspace=ws)
    assert ws.builds == 2 and torch.equal(grads[-1], torch.full((3,), 0.5, device=device))

    half = [g.half() for g in grads]  # another dtype: another table; the LRU keeps max_plans of them
    unscale_grads_(half, _inv(2.0, device), found, backend="triton", workspace=ws)
    assert ws.builds == 3 and len(ws._plans) == 2
    ws.clear()
    unscale_grads_(half, _inv(2.0, device), found, backend="triton", workspace=ws)
    assert ws.builds == 4


@pytest.mark.parametrize("device", DEVICES)
def test_triton_new_gradient_buffers_every_step_reuse_the_table(device):
    # What zero_grad(set_to_none=True), torch's default, does: every step's gradients are new tensors of the same
    # shapes, at addresses the allocator may or may not reuse. Each step must write exactly the new buffers, without
    # rebuilding the table, in place and into FP32 masters, with clipping.
    ws = _workspace()
    masters = [torch.empty(g.shape, device=device) for g in _grads(torch.float32, device)]
    kept = []  # holding the old gradients forces new addresses
    for step in range(4):
        grads = [g * (step + 1) for g in _grads(torch.float32, device)]
        ref = [g.clone() for g in grads]
        ref_out = [torch.empty_like(m) for m in masters]
        found = torch.zeros((), device=device)
        norm = unscale_grads_(grads, _inv(64.0, device), found, out=masters, max_norm=1.0, backend="triton",
                              workspace=ws)
        ref_norm = unscale_grads_(ref, _inv(64.0, device), torch.zeros((), device=device), out=ref_out, max_norm=1.0,
                                  backend="reference")
        torch.testing.assert_close(norm, ref_norm, rtol=2e-6, atol=0)
        for got, want in zip(masters, ref_out):
            torch.testing.assert_close(got, want, rtol=3e-7, atol=0)
        in_place = [g.clone() for g in grads]
        unscale_grads_(in_place, _inv(4.0, device), found, backend="triton", workspace=ws)
        assert all(torch.equal(g, r / 4.0) for g, r in zip(in_place, grads))
        kept.append((grads, in_place))
    assert ws.builds == 2  # one table for into-masters, one for in place; addresses re-uploaded, never rebuilt


@pytest.mark.parametrize("device", DEVICES)
def test_triton_cached_table_is_not_reused_for_a_new_layout_at_the_same_address(device):
    # Same storage, same sizes, same dtype, other strides: a transposed view of a square gradient. A table found by
    # address alone would copy it into its master untransposed; the key's layout part sends it to the foreach twin.
    ws = _workspace()
    square = torch.randn(6, 6, device=device) * 64
    grads = [square, torch.randn(5, device=device) * 64]
    found = torch.zeros((), device=device)
    out = [torch.empty(g.shape, device=device) for g in grads]  # the same FP32 masters on every call
    for grads_now in (grads, [square.t(), grads[1]], [square.t(), grads[1]]):
        unscale_grads_(grads_now, _inv(64.0, device), found, out=out, backend="triton", workspace=ws)
        for got, g in zip(out, grads_now):
            assert torch.equal(got, g / 64.0)
    # One table for the contiguous list; the transposed list's "not supported" verdict is cached too.
    assert ws.builds == 1 and len(ws._plans) == 2


@pytest.mark.parametrize("device", DEVICES)
def test_triton_destination_of_another_shape_is_never_written_by_a_table(device):
    # Channels-last tensors of batch 2 and batch 1 have the same strides; a kernel walking the source's storage
    # would write past the end of the smaller destination.
    src = torch.randn(2, 3, 4, 4, device=device).contiguous(memory_format=torch.channels_last)
    small = torch.empty(1, 3, 4, 4, device=device).contiguous(memory_format=torch.channels_last)
    assert src.stride() == small.stride()
    assert not kernels.supports([src], [small])
    assert kernels.supports([src], [torch.empty_like(src)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_triton_master_to_model_copy_rounds_like_torch(device, dtype):
    g = torch.Generator().manual_seed(1)
    masters = [torch.randn(shape, generator=g).to(device) for shape in SHAPES]
    edge = torch.tensor([1e5, -1e39, float("nan"), 1e-8, 1e-40, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8, 0.0])
    masters.append(edge.to(device))  # overflow, subnormals, ties to even, NaN
    params = [torch.full(m.shape, 3.0, dtype=dtype, device=device) for m in masters]
    ws = _workspace()
    cast_copy_(params, masters, backend="triton", workspace=ws)
    cast_copy_(params, masters, backend="triton", workspace=ws)
    assert ws.builds == 1
    for p, m in zip(params, masters):
        want = m.to(dtype)
        assert p.dtype == dtype and torch.equal(p.isnan(), want.isnan())
        assert torch.equal(p.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("device", DEVICES)
def test_triton_master_weights_copy_to_model(device):
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 3)).to(device)
    model.half()
    other = copy.deepcopy(model)  # a second model: masters over the same one would take them over (a second stage)
    fused = MasterWeights(model.named_parameters(), copy_backend="triton")
    fused.workspace = _workspace()
    twin = MasterWeights(other.named_parameters(), copy_backend="foreach")
    with torch.no_grad():
        for _, m in fused.half_pairs:
            m.add_(torch.randn(m.shape, device=device) * 0.01)
    fused.copy_to_model()
    fused.copy_to_model()
    for (_, m), (_, t) in zip(fused.half_pairs, twin.half_pairs):
        t.data.copy_(m)
    twin.copy_to_model()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    assert fused.workspace.builds == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_triton_amp_training_matches_foreach(device, opt_level):
    def train(backend):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).to(device)
        amp = Amp(opt_level, half_dtype="bfloat16", unscale_backend=backend, loss_scale="dynamic", init_scale=256.0)
        model = amp.prepare_model(model)
        optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        state = amp._state(optimizer)
        if backend == "triton":
            state.workspace = _workspace()
        x, y = torch.randn(8, 6, device=device), torch.randn(8, 2, device=device)
        norms = []
        for _ in range(3):
            with amp.forward_context():
                loss = torch.nn.functional.mse_loss(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y)
            amp.backward(loss)
            norms.append(amp.clip_grad_norm_(optimizer, 0.05))
            assert amp.step(optimizer)
            amp.update()
            optimizer.zero_grad()
        return [p.detach().float() for p in model.parameters()], torch.stack(norms), state.workspace

    params, norms, ws = train("triton")
    ref_params, ref_norms, _ = train("foreach")
    torch.testing.assert_close(norms, ref_norms, rtol=1e-5, atol=0)
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-2 if opt_level == "O2" else 1e-5, atol=1e-4)
    # zero_grad(set_to_none=True) hands back the same blocks from torch's allocator, usually: at most one table
    # per gradient layout seen, not one per step.
    assert ws.builds <= 3


def test_triton_auto_picks_foreach_for_cpu_tensors():
    cpu = [torch.ones(3), torch.ones(2, dtype=torch.float16)]
    assert resolve_backend(cpu) == "foreach"
    ws = _workspace()
    found = torch.zeros(())
    unscale_grads_(cpu, _inv(2.0), found, compute_norm=True, workspace=ws)
    assert ws.builds == 0 and torch.equal(cpu[0], torch.full((3,), 0.5))
    assert resolve_backend([]) == "foreach"


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="no CUDA device, or kernels interpreted")
def test_triton_auto_picks_triton_for_cuda_tensors():
    assert resolve_backend([torch.ones(3, device="cuda")]) == "triton"
    assert resolve_backend([torch.ones(3, device="cuda"), torch.ones(3)]) == "foreach"


def test_triton_errors_name_the_argument_and_the_choices(monkeypatch):
    device = "cuda" if not INTERPRETED else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device and kernels compiled: nothing to misplace")
    # A tensor on the device the kernels cannot read.
    monkeypatch.setattr(kernels, "interpreting", lambda: not INTERPRETED)
    with pytest.raises(ValueError, match=r"backend='triton' .*valid choices .*auto, foreach, reference"):
        unscale_grads_([torch.ones(2, device=device)], _inv(2.0, device), torch.zeros((), device=device),
                       backend="triton")
    monkeypatch.undo()
    # triton missing: ImportError naming the extra.
    monkeypatch.setitem(sys.modules, "triton", None)
    with pytest.raises(ImportError, match=r"unscale_grads_\(backend='triton'\) needs the 'triton' package.*\[triton\]"):
        unscale_grads_([torch.ones(2)], _inv(2.0), torch.zeros(()), backend="triton")
    with pytest.raises(ValueError, match=r"backend='cuda' is not a copy backend; valid choices: auto, foreach, "
                                         r"reference, triton"):
        cast_copy_([torch.ones(1)], [torch.ones(1)], backend="cuda")
    with pytest.raises(ValueError, match=r"copy_backend='fused' is not valid; valid choices: auto, foreach"):
        MasterWeights([], copy_backend="fused")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"chunk_size": 24}, r"chunk_size=24 must be a positive power of two"),
        ({"block_size": 0}, r"block_size=0 must be a positive power of two"),
        ({"chunk_size": 4, "block_size": 8}, r"chunk_size=4 must be at least block_size=8"),
        ({"num_warps": 3}, r"num_warps=3 is not valid; valid choices: 1, 2, 4, 8, 16, 32"),
        ({"max_plans": 0}, r"max_plans=0 must be a positive integer"),
    ],
)
def test_triton_workspace_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        UnscaleWorkspace(**kwargs)


# benchmarks/unscale.py --check (its case in triton's interpreter): run by the GPU suite's ``--check`` in
# tests/test_gpu_suite.py, test_all_check_writes_every_part_with_environment_and_commands.


_COMPILE_FOR_GPU = r"""
import re, sys
import triton, triton.language as tl
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from lightning_mpx.scaling import triton_unscale as K

def compile(fn, signature, constexprs, cc):
    # Every argument named: triton 3.6 compiled a left-out one as None, triton 3.7 fails on it ('_unflatten_ir').
    missing = [name for name in fn.arg_names if name not in signature and name not in constexprs]
    assert not missing, (fn.__name__, "arguments not in the signature", missing)
    source = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", cc, 32), options={"num_warps": 4}).asm["ptx"]

pointers = {"table_ptr": "*i64", "src_base_ptr": "*i64", "dst_base_ptr": "*i64", "scale_ptr": "*fp32", "found_ptr": "*fp32", "partials_ptr": "*fp32",
            "under_ptr": "*i32", "zero_ptr": "*i32", "peak_ptr": "*fp32", "tiny": "fp32"}
for cc in (80, 90):
    for src, dst, store, check, norm, stats in [
        (tl.float32, tl.float32, True, True, True, False), (tl.float16, tl.float32, False, True, True, False),
        (tl.bfloat16, tl.float32, True, False, False, False), (tl.float32, tl.bfloat16, True, False, False, False),
        (tl.float16, tl.float16, True, True, False, False), (tl.bfloat16, tl.float32, True, True, True, True),
    ]:
        flags = dict(SRC=src, DST=dst, HAS_SCALE=True, STORE=store, CHECK=check, NORM=norm, STATS=stats, CHUNK=16384, BLOCK=1024)
        aligned = compile(K._chunk_kernel, pointers, {**flags, "ALIGNED": True}, cc)
        assert "ld.global.v4" in aligned and (not store or "st.global.v4" in aligned), (cc, flags)
        assert "atom" not in aligned, (cc, flags)
        if not stats:  # the statistics do not depend on the alignment: two compiles fewer
            compile(K._chunk_kernel, pointers, {**flags, "ALIGNED": False}, cc)
    final = compile(K._finalize_kernel, {"partials_ptr": "*fp32", "n": "i32", "norm_ptr": "*fp32", "coef_ptr": "*fp32",
                    "scale_ptr": "*fp32", "found_ptr": "*fp32", "max_norm": "fp32"}, {"CLIP": True, "BLOCK": 1024}, cc)
    assert "sqrt.rn.f32" in final and "div.rn.f32" in final and "atom" not in final
print("compiled")
"""  # noqa: E501 (a script run as a subprocess: its text is kept as it is)


def test_triton_kernels_compile_for_the_gpu_with_vector_loads():
    # No GPU needed: triton compiles to PTX and runs its bundled ptxas. This catches what the interpreter accepts but
    # the compiler does not, and checks that full blocks use 16-byte loads and stores and that nothing uses atomics,
    # with and without the statistics (STATS). One ASTSource form serves triton 3.6 and 3.7 when the signature names
    # every kernel argument (the script asserts it).
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_GPU], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env
    )
    if result.returncode != 0 and "ptxas" in result.stderr and "not found" in result.stderr.lower():
        pytest.skip("triton's ptxas is not available: cannot compile for the GPU here")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compiled" in result.stdout


def test_auto_leaves_a_plain_unscale_to_torchs_kernels(monkeypatch):
    """``"auto"`` on CUDA tensors (pretended here: the choice is made from the call, not by running anything): the
    fused kernels for norms, clipping, statistics and bfloat16 gradients unscaled in place; torch's own kernels for
    a plain unscale of FP32/FP16 gradients in place (O1's step without a clip) and for a plain unscale of half
    gradients into FP32 masters (O2's), which they serve with less host work."""
    import lightning_mpx.scaling.unscale as unscale

    monkeypatch.setattr(unscale, "_IS_CUDA", lambda t: True)
    monkeypatch.setattr(unscale, "_interpreter_requested", lambda: False)
    fp32, fp16, bf16 = torch.ones(3), torch.ones(3, dtype=torch.float16), torch.ones(3, dtype=torch.bfloat16)
    masters = [torch.zeros(3), torch.zeros(3)]
    assert unscale.auto_backend([fp32, fp16]) == "foreach"
    assert unscale.auto_backend([fp32, fp16], [fp32, fp16]) == "foreach"  # out naming the gradients: in place
    assert unscale.auto_backend([fp32, fp16], norm=True) == "triton"
    assert unscale.auto_backend([fp32, fp16], stats=True) == "triton"
    assert unscale.auto_backend([fp16, fp16], masters) == "foreach"
    assert unscale.auto_backend([bf16, bf16], masters) == "foreach"
    assert unscale.auto_backend([fp16, fp16], masters, norm=True) == "triton"
    assert unscale.auto_backend([fp16, bf16], masters, stats=True) == "triton"
    assert unscale.auto_backend([fp32, bf16]) == "triton"


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="no CUDA device, or kernels interpreted")
def test_cuda_auto_runs_torchs_kernels_for_a_plain_unscale_and_copy_and_the_fused_one_otherwise():
    grads = [torch.full((5,), 8.0, device="cuda"), torch.full((3,), 8.0, device="cuda", dtype=torch.float16)]
    ws, found = UnscaleWorkspace(), torch.zeros((), device="cuda")
    half = [torch.full((4,), 8.0, device="cuda", dtype=dtype) for dtype in (torch.float16, torch.bfloat16)]
    masters = [torch.zeros(4, device="cuda") for _ in half]
    unscale_grads_(half, torch.tensor(0.5, device="cuda"), found, out=masters, workspace=ws)  # O2's, no clip
    cast_copy_(half, [torch.full((4,), 3.0, device="cuda") for _ in half], workspace=ws)  # the masters into the model
    assert ws.builds == 0 and all(torch.equal(m, torch.full_like(m, 4.0)) for m in masters)
    assert all(torch.equal(h, torch.full_like(h, 3.0)) for h in half)
    unscale_grads_(grads, torch.tensor(0.5, device="cuda"), found, workspace=ws)
    assert ws.builds == 0 and all(torch.equal(g, torch.full_like(g, 4.0)) for g in grads)
    norm = unscale_grads_(grads, torch.tensor(0.5, device="cuda"), found, max_norm=100.0, workspace=ws)
    assert ws.builds == 1 and all(torch.equal(g, torch.full_like(g, 2.0)) for g in grads)
    torch.testing.assert_close(norm, torch.tensor(2.0 * 8**0.5, device="cuda"))
    assert found.item() == 0.0


@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED, reason="no CUDA device, or kernels interpreted")
def test_cuda_o2_on_auto_steps_on_torchs_kernels_until_it_clips():
    """O2's step without a clip unscales into the masters and copies them back with torch's kernels (no fused table
    is built); a clip takes the fused kernels."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).cuda()
    amp = Amp("O2", loss_scale="dynamic", init_scale=256.0)
    model = amp.prepare_model(model)
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    state = amp._state(optimizer)
    x, y = torch.randn(8, 6, device="cuda"), torch.randn(8, 2, device="cuda")

    def one(clip: bool) -> None:
        with amp.forward_context():
            loss = torch.nn.functional.mse_loss(amp.cast_outputs(model(amp.cast_inputs(x))).float(), y)
        amp.backward(loss)
        if clip:
            amp.clip_grad_norm_(optimizer, 0.05)
        assert amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()

    before = [p.detach().clone() for p in model.parameters()]
    one(False)
    one(False)
    assert state.workspace.builds == 0
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    one(True)
    assert state.workspace.builds == 1
