"""O1's parameter-cast cache with tensors that have no version counter or no storage: ``torch.func`` transforms
(``grad``, ``vjp``: their wrappers have no storage) and parameters made under ``torch.inference_mode`` (no version
counter). Plain torch runs both; the O1 forward failed on the cache's bookkeeping ("Cannot access data pointer of
Tensor that doesn't have storage", "Inference tensors do not track version counter"). The reference is the same
forward with the cache off (``cache_casts=False``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp, CastPolicy


def _forward_context(cache: bool):
    """The core loop's O1 forward (the cache on, its default), or the same table's policy without the cache."""
    amp = Amp("O1", half_dtype="bfloat16")
    if cache:
        return amp.forward_context()
    return CastPolicy(amp.policy.table, torch.bfloat16, cache_casts=False, engine=amp.policy.engine).scope()


def test_torch_func_grad_and_vjp_through_an_o1_forward_as_without_the_cache():
    torch.manual_seed(0)
    layer, x = nn.Linear(8, 4), torch.randn(5, 8)
    results = {}
    for cache in (True, False):
        with _forward_context(cache):
            grad = torch.func.grad(lambda w: F.linear(x, w, layer.bias).float().square().sum())(layer.weight)
            out, pull = torch.func.vjp(lambda w: F.linear(x, w).float(), layer.weight)
            (pulled,) = pull(torch.ones_like(out))
        results[cache] = (grad, out, pulled)
    for got, want in zip(results[True], results[False]):
        assert got.dtype == want.dtype and torch.equal(got, want)
    assert results[True][1].dtype == torch.float32  # cast to bfloat16 for the matmul, then .float()


def test_a_model_made_under_inference_mode_runs_an_o1_forward_as_without_the_cache():
    torch.manual_seed(0)
    with torch.inference_mode():  # e.g. an evaluation helper that builds and loads its model inside the mode
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        x = torch.randn(3, 8)
    outputs = {}
    for cache in (True, False):
        with torch.inference_mode(), _forward_context(cache):
            outputs[cache] = (model(x), model(x))  # twice: a cache would serve the second
    assert outputs[True][0].dtype == torch.bfloat16
    for got, want in zip(outputs[True], outputs[False]):
        assert torch.equal(got, want)
