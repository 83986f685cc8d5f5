"""The O1 parameter-cast cache against no cache, over random sequences of what training code does.

The cache (half copies of the parameters, reused across forward passes) is the piece of state on O1's hot path: a
stale entry would train on old weights without a word. Two identical models run every step side by side, one through
a caching policy and one through a policy with ``cache_casts=False`` (every cast made afresh); both share one table.
Whatever the sequence (forward passes with and without gradients, several before one backward pass, backward passes
through the policy, inside a scope or outside it, optimizer steps, in-place writes, ``p.data = ...``,
``load_state_dict``, freezing and unfreezing, nested scopes, a table change, activation checkpointing), the outputs
and the gradients must be the same bits, and so must the parameters.

Gradients are compared within half-precision rounding, not bit for bit: a cached cast is one autograd node shared by
every use of the parameter, so the uses' gradients are summed in half before they reach the FP32 parameter, as with
``torch.autocast``'s cache and Apex's (``test_a_reused_parameter_sums_its_gradients_as_autocast_does`` in
``test_cast_policy.py`` pins that against ``torch.autocast``); without the cache each use's gradient reaches it in
FP32. The forward outputs and the parameters must be the same bits.

The one write the cache is documented not to see, ``p.data.copy_`` between two forward passes of one iteration
(nothing on ``p`` records it), is done here where training code does it: at the iteration boundary, after the loop's
``clear_cache()`` (an EMA or SWA swap, a weight reload).
"""

import copy

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_mpx import CastPolicy, CastTable
from tests.stateful_helpers import stateful_settings


class _Net(nn.Module):
    """Each linear is used twice per forward pass (a cache hit inside one pass); a residual mixes FP32 and half."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        self.a, self.norm, self.b = nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 4)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.gelu(self.norm(self.a(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.block, x, use_reentrant=False) if self.checkpointed else self.block(x)
        return self.block(h) + x


PARAMS = ("a.weight", "a.bias", "norm.weight", "b.weight", "b.bias")


def _close(got, want, uses, half, what):
    """Equal up to the rounding of ``uses`` gradient contributions summed in ``half``."""
    if want is None or got is None:
        assert got is None and want is None, what
        return
    assert got.dtype == want.dtype, what
    tol = uses * torch.finfo(half).eps
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()), msg=what)


def _same(got, want, what):
    if want is None:
        assert got is None, what
        return
    assert got is not None and got.dtype == want.dtype, (what, got, want)
    assert torch.equal(got, want), what


class CacheAgainstNoCache(RuleBasedStateMachine):
    @initialize(half=st.sampled_from([torch.float16, torch.bfloat16]), checkpointed=st.booleans(),
                seed=st.integers(0, 3))
    def setup(self, half, checkpointed, seed):
        torch.manual_seed(seed)
        self.table = CastTable.default()
        cached_model = _Net(checkpointed)
        self.runs = [  # (policy, model): the cached run first
            (CastPolicy(self.table, half), cached_model),
            (CastPolicy(self.table, half, cache_casts=False), copy.deepcopy(cached_model)),
        ]
        self.pending = [[], []]  # losses with a graph, not backpropagated yet
        self.half = half

    def _both(self, action):
        """``action(index, policy, model)`` for both runs: the results, or the type of what each raised."""
        results = []
        for index, (policy, model) in enumerate(self.runs):
            try:
                results.append(action(index, policy, model))
            except Exception as error:  # both must fail alike (e.g. a checkpoint recomputed without the policy)
                results.append(type(error))
        if isinstance(results[1], type):
            assert results[0] is results[1], results
        return results

    # -- rules ------------------------------------------------------------------------------------------------
    @rule(grad=st.booleans(), nested=st.booleans(), seed=st.integers(0, 1000))
    def forward(self, grad, nested, seed):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))

        def run(index, policy, model):
            with torch.set_grad_enabled(grad), policy.scope():
                if nested:
                    with policy.scope():
                        out = model(x)
                else:
                    out = model(x)
                loss = out.float().square().mean()
            if grad:
                self.pending[index].append(loss)
            return out.detach()

        got, want = self._both(run)
        _same(got, want, "forward output")

    @precondition(lambda self: self.pending[0])
    @rule(how=st.sampled_from(["policy", "inside a scope", "outside"]))
    def backward(self, how):
        def run(index, policy, model):
            losses, self.pending[index] = self.pending[index], []
            total = torch.stack(losses).sum()
            # Each backward pass's gradients alone, so that the tolerance below bounds them (accumulation across
            # backward passes does not touch the cache).
            model.zero_grad(set_to_none=True)
            if how == "policy":
                policy.backward(total)
            elif how == "inside a scope":
                with policy.scope():
                    total.backward()
            else:
                total.backward()
            return [p.grad for p in model.parameters()]

        uses = 2 * len(self.pending[0])  # each linear is used twice per forward pass
        got, want = self._both(run)
        if not isinstance(want, type):
            for name, g, w in zip(PARAMS, got, want):
                _close(g, w, uses, self.half, f"{name}.grad after backward {how}")

    @rule(lr=st.sampled_from([0.5, 0.01]), set_to_none=st.booleans())
    def optimizer_step(self, lr, set_to_none):
        """What a loop does at the iteration boundary: step (in place), zero the gradients, clear the cache."""
        def run(index, policy, model):
            self.pending[index] = []
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.sub_(lr * p.grad)
            model.zero_grad(set_to_none=set_to_none)
            policy.clear_cache()

        self._both(run)
        # The steps differ by the gradients' rounding (checked by the backward rule): the uncached run takes the
        # cached run's values, written into the reference so that the cached model sees only what a loop does.
        cached, reference = (model for _, model in self.runs)
        with torch.no_grad():
            for got, want in zip(cached.parameters(), reference.parameters()):
                want.copy_(got)

    @rule(seed=st.integers(0, 1000))
    def swap_weights_through_data_at_the_boundary(self, seed):
        """An EMA/SWA swap or a reload written as ``p.data.copy_(...)``, after the loop's ``clear_cache()``."""
        new = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed))

        def run(index, policy, model):
            self.pending[index] = []
            model.zero_grad()
            policy.clear_cache()
            model.a.weight.data.copy_(new)

        self._both(run)

    @rule(kind=st.sampled_from(["in place", "assign data", "load_state_dict"]), seed=st.integers(0, 1000))
    def write_weights(self, kind, seed):
        """Writes at any point, also between forward passes of one iteration."""
        generator = torch.Generator().manual_seed(seed)
        new_b = torch.randn(4, 8, generator=generator)
        new_bias = torch.randn(4, generator=generator)

        def run(index, policy, model):
            if kind == "in place":
                with torch.no_grad():
                    model.b.weight.mul_(0.5)
            elif kind == "assign data":
                model.b.weight.data = new_b.clone()
            else:
                state = model.state_dict()
                state["b.weight"], state["b.bias"] = new_b.clone(), new_bias.clone()
                model.load_state_dict(state)

        self._both(run)

    @rule(name=st.sampled_from(PARAMS), trainable=st.booleans())
    def freeze_or_unfreeze(self, name, trainable):
        self._both(lambda index, policy, model: model.get_parameter(name).requires_grad_(trainable))

    @rule(category=st.sampled_from(["half", "float", None]))
    def change_the_table(self, category):
        """The GELU entry moved (both policies share the table; it applies at the next scope)."""
        if category is None:
            if F.gelu in self.table:
                self.table.unregister(F.gelu)
        else:
            self.table.register(F.gelu, category)

    @invariant()
    def parameters_agree(self):
        if not hasattr(self, "runs"):
            return
        for (name, got), want in zip(self.runs[0][1].named_parameters(), self.runs[1][1].parameters()):
            _same(got.detach(), want.detach(), name)
            assert got.requires_grad == want.requires_grad


CacheAgainstNoCache.TestCase.settings = stateful_settings(max_examples=60, steps=25)
test_cache_against_no_cache = CacheAgainstNoCache.TestCase
