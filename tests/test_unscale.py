"""The unscale entry point: the foreach backend against the per-tensor reference and against torch."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_mpx.scaling.unscale import BACKENDS, unscale_grads_

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(0,), (1,), (7,), (33, 5), (1024,), (3, 4, 5)]


def _grads(dtype, seed=0, scale=1024.0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g) * scale).to(dtype) for shape in SHAPES]


def _inv(scale):
    return torch.tensor(scale, dtype=torch.float64).reciprocal().float()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("master", [False, True], ids=["in-place", "into-fp32-master"])
def test_foreach_matches_reference(dtype, master):
    results = {}
    for backend in ("foreach", "reference"):
        grads = _grads(dtype)
        out = [torch.empty(g.shape, dtype=torch.float32) for g in grads] if master else None
        found = torch.zeros(())
        norm = unscale_grads_(grads, _inv(1024.0), found, out=out, compute_norm=True, backend=backend)
        results[backend] = (out if master else grads, found, norm)
    (a, fa, na), (b, fb, nb) = results["foreach"], results["reference"]
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert fa.item() == fb.item() == 0.0
    torch.testing.assert_close(na, nb, rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", ["foreach", "reference"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_values_norm_and_untouched_sources(backend, dtype):
    grads = _grads(dtype)
    sources = [g.clone() for g in grads]
    out = [torch.empty(g.shape) for g in grads]
    norm = unscale_grads_(grads, _inv(1024.0), torch.zeros(()), out=out, compute_norm=True, backend=backend)
    expected = [s.float() / 1024.0 for s in sources]
    for got, want, src, g in zip(out, expected, sources, grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert torch.equal(src, g)  # out= leaves the half gradients as they were
    want_norm = torch.linalg.vector_norm(torch.cat([e.flatten() for e in expected]))
    torch.testing.assert_close(norm, want_norm, rtol=1e-5, atol=0)


@pytest.mark.parametrize("backend", ["foreach", "reference"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_non_finite_values_set_the_flag(backend, bad, where):
    grads = _grads(torch.float16)
    target = grads[-1] if where == "last" else grads[2] if where == "middle" else grads[1]
    flat = target.view(-1)
    flat[{"first": 0, "middle": flat.numel() // 2, "last": -1}[where]] = bad
    found = torch.zeros(())
    unscale_grads_(grads, _inv(8.0), found, backend=backend)
    assert found.item() == 1.0


def test_flag_collects_several_calls_and_is_never_cleared():
    found = torch.zeros(())
    unscale_grads_([torch.tensor([float("inf")])], _inv(2.0), found)
    unscale_grads_([torch.ones(3)], _inv(2.0), found)
    assert found.item() == 1.0


@pytest.mark.parametrize("backend", ["foreach", "reference"])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clipping_matches_torch_on_unscaled_gradients(backend, max_norm):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(10, 3), (3,), (40,)]]
    true_grads = [torch.randn(p.shape) for p in params]
    for p, g in zip(params, true_grads):
        p.grad = g.clone()
    want_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    want = [p.grad.clone() for p in params]

    scaled = [g * 4096.0 for g in true_grads]
    found = torch.zeros(())
    norm = unscale_grads_(scaled, _inv(4096.0), found, max_norm=max_norm, backend=backend)
    torch.testing.assert_close(norm, want_norm)
    for got, w in zip(scaled, want):
        torch.testing.assert_close(got, w)
    assert found.item() == 0.0


def test_no_norm_unless_asked():
    assert unscale_grads_([torch.ones(2)], _inv(2.0), torch.zeros(())) is None


def test_empty_list_gives_zero_norm():
    assert unscale_grads_([], _inv(2.0), torch.zeros(()), compute_norm=True).item() == 0.0


def test_bad_arguments():
    with pytest.raises(
        ValueError, match=r"backend='cuda' is not an unscale backend; valid choices: auto, foreach, reference"
    ):
        unscale_grads_([torch.ones(1)], _inv(1.0), torch.zeros(()), backend="cuda")
    with pytest.raises(ValueError, match=r"out has 2 tensors but grads has 1"):
        unscale_grads_([torch.ones(1)], _inv(1.0), torch.zeros(()), out=[torch.ones(1)] * 2)
    with pytest.raises(ValueError, match=r"max_norm=-1.0 must be a positive number"):
        unscale_grads_([torch.ones(1)], _inv(1.0), torch.zeros(()), max_norm=-1.0)
    assert set(BACKENDS) >= {"auto", "foreach", "reference"}


@pytest.mark.parametrize("aliased", ["all", "some"])
def test_out_naming_the_gradients_themselves_matches_reference(aliased):
    """``out`` holding the gradients themselves (O1, no masters: all of them; O2 with FP32 parameters: some),
    across two dtypes: the foreach backend gives the reference's values and flag bit for bit, and its norm."""
    results = {}
    for backend in ("foreach", "reference"):
        grads = _grads(torch.float32) + _grads(torch.bfloat16, seed=1)
        grads[2][1] = float("inf") if aliased == "some" else grads[2][1]
        if aliased == "all":
            out = list(grads)
        else:  # the half gradients go to FP32 masters, the FP32 ones stay in place
            out = [g if g.dtype == torch.float32 else torch.empty(g.shape) for g in grads]
        found = torch.zeros(())
        norm = unscale_grads_(grads, _inv(1024.0), found, out=out, compute_norm=True, backend=backend)
        results[backend] = (out, found.item(), norm)
    (a, fa, na), (b, fb, nb) = results["foreach"], results["reference"]
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert fa == fb == (1.0 if aliased == "some" else 0.0)
    torch.testing.assert_close(na, nb, rtol=1e-6, atol=0, equal_nan=True)


@settings(max_examples=40, deadline=None)
@given(dtypes=st.lists(st.sampled_from(DTYPES), min_size=1, max_size=9),
       masters=st.lists(st.sampled_from(DTYPES), min_size=9, max_size=9), max_norm=st.sampled_from([None, 0.5]),
       own=st.lists(st.booleans(), min_size=9, max_size=9))
def test_mixed_dtypes_each_go_to_their_own_destination(dtypes, masters, max_norm, own):
    """O2 with FP32 batch norms beside half layers: gradients of several dtypes, interleaved, unscaled into
    destinations of several dtypes and copied back; every tensor lands in its own destination, as the per-tensor
    reference puts it (distinct sizes: a pairing out of order would fail or misplace values). Some destinations
    are the gradients themselves (``own``: a parameter that is its own master), unscaled in place among the others."""
    from lightning_mpx.scaling.unscale import cast_copy_

    results = {}
    for backend in ("foreach", "reference"):
        g = torch.Generator().manual_seed(len(dtypes))
        grads = [(torch.randn(i + 2, generator=g) * 64).to(dtype) for i, dtype in enumerate(dtypes)]
        out = [grads[i] if own[i] else torch.zeros(i + 2, dtype=masters[i]) for i in range(len(dtypes))]
        found = torch.zeros(())
        norm = unscale_grads_(grads, _inv(64.0), found, out=out, max_norm=max_norm, backend=backend)
        copies = [torch.zeros(i + 2, dtype=dtype) for i, dtype in enumerate(dtypes)]
        cast_copy_(copies, out, backend=backend)
        results[backend] = (out, copies, norm)
    (out_f, copies_f, norm_f), (out_r, copies_r, norm_r) = results["foreach"], results["reference"]
    for a, b in zip(out_f + copies_f, out_r + copies_r):
        assert a.dtype == b.dtype
        if max_norm is None:
            assert torch.equal(a, b)
        else:  # the norms are summed in another order: the clip coefficient may differ in its last bit
            torch.testing.assert_close(a, b, rtol=2e-6 if a.dtype == torch.float32 else 1e-2, atol=0)
    if max_norm is not None:
        torch.testing.assert_close(norm_f, norm_r, rtol=1e-6, atol=0)
