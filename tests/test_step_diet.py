"""The usual step's short paths (fewer Python calls per step, ``benchmarks/habit_census.py``) against the general
ones they stand for: the same values, flags and lifetimes."""

import gc
import weakref

import pytest
import torch
from torch import nn

from lightning_mpx import Amp
from lightning_mpx.common.containers import _cast_collection
from lightning_mpx.scaling.unscale import plain_unscale_, unscale_grads_


def _grads(dtypes, bad=None):
    torch.manual_seed(0)
    grads = [torch.randn(5, 3).to(dtype) * 1024 for dtype in dtypes]
    grads.append(torch.empty(0, dtype=dtypes[0]))  # an empty gradient (a zero-size parameter)
    if bad is not None:
        grads[0][1, 2] = bad
    return grads


@pytest.mark.parametrize(
    "dtypes", [(torch.float32,), (torch.bfloat16,), (torch.float32, torch.bfloat16, torch.float16)]
)
@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")])
@pytest.mark.parametrize("scale_shape", [(), (1,)])
def test_plain_unscale_matches_the_general_route(dtypes, bad, scale_shape):
    inv_scale = torch.full(scale_shape, 1 / 1024, dtype=torch.float32)
    fast, general = _grads(dtypes, bad), _grads(dtypes, bad)
    fast_flag, general_flag = torch.zeros(()), torch.zeros(())
    plain_unscale_(fast, inv_scale, fast_flag)
    unscale_grads_(general, inv_scale, general_flag)  # backend="auto", in place, no norm: the same kernel
    assert fast_flag.item() == general_flag.item() == (0.0 if bad is None else 1.0)
    for a, b in zip(fast, general, strict=True):
        assert a.dtype == b.dtype and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_plain_unscale_of_no_gradients_leaves_the_flag():
    flag = torch.zeros(())
    plain_unscale_([], torch.ones(()), flag)
    assert flag.item() == 0.0


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_the_engine_forgets_a_dropped_model_and_optimizer(level):
    """The iteration's outcomes and the forward's dtype marks are kept by id with weak references: an optimizer or
    a model the user drops is not kept alive, and its entries go with it."""
    amp = Amp(level, half_dtype=torch.bfloat16)
    model = amp.prepare_model(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    opt = amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    for _ in range(2):
        with amp.forward_context():
            loss = amp.cast_outputs(model(amp.cast_inputs(torch.randn(3, 4)))).float().sum()
        amp.backward(loss)
        assert amp.step(opt)
        assert amp.iteration.stepped(opt) and not amp.iteration.skipped(opt)
        amp.update()
        opt.zero_grad(set_to_none=True)
    assert not amp.iteration.stepped(opt) and not amp.iteration.skipped(opt)
    model_ref, opt_ref = weakref.ref(model), weakref.ref(opt)
    amp.read_step_outcomes()
    del model, opt, loss
    gc.collect()
    assert model_ref() is None and opt_ref() is None
    assert amp.iteration._last == {} and amp.iteration._refs == {} and not amp.iteration._current
    assert amp._models._half_marks == {}
    other = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)  # may take a dropped one's id: not its outcome
    assert not amp.iteration.stepped(other) and not amp.iteration.skipped(other)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64])
def test_a_tensor_input_and_output_cast_as_a_collection_casts_it(dtype):
    amp = Amp("O2", half_dtype=torch.bfloat16)
    data = torch.arange(6).reshape(2, 3).to(dtype)
    expected_in = _cast_collection(data, torch.bfloat16, (torch.float32, torch.float64))
    expected_out = _cast_collection(data, torch.float32, (torch.bfloat16,))
    got_in, got_out = amp.cast_inputs(data), amp.cast_outputs(data)
    assert got_in.dtype == expected_in.dtype and torch.equal(got_in, expected_in)
    assert got_out.dtype == expected_out.dtype and torch.equal(got_out, expected_out)
    assert (got_in is data) == (expected_in is data) and (got_out is data) == (expected_out is data)
