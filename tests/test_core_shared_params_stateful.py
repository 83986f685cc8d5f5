"""stateful68: random sequences of stop 67's habits with two prepared optimizers sharing parameters, side by side with
an FP32 run of the same sequence (plain torch, the same optimizers, the same calls).

The core ``Amp`` over Linear-BatchNorm-Tanh-Linear, three set-ups (drawn): O1 float16 (a dynamic loss scale: every
gradient unscaled in place) with a second optimizer over the head; O2 float16 with a second optimizer over the batch
norm (FP32, no master: unscaled in place); O2 float16 with the head in ``fp32_modules`` and in a second optimizer. The
second optimizer starts with the shared module's weight only; its bias comes by ``add_param_group`` at a random point
(before or after an unscale or a clip). Rules, each a user habit: a backward (accumulated while no step comes), a clip
of either optimizer (``amp.clip_grad_norm_``), a step of both or of one only (the other skipped this iteration), a
``zero_grad`` of either optimizer or of the model, a hand write between backwards either undone before the step
(restored from a copy) or kept (a weight decay ``mul_``, a clamp).

Invariant: what the optimizers train (the FP32 masters at O2, the parameters at O1) tracks the FP32 run's weights.
Sequences the machine found are written out below it.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch import nn

from lightning_mpx import Amp
from tests.stateful_helpers import AmpOrFp32Run, optimizer_params, seeded_batch, stateful_settings

# Per tensor, |ours - FP32| <= RTOL * |FP32 - start| + ATOL: float16 forwards against FP32's, a few ulps per step. A
# gradient unscaled twice (the shared gradient divided by 65536 once more), a step lost or applied twice, a group
# whose parameters do not train, a clip ignored: each moves a weight by a whole update (>= 10% of the travel).
RTOL, ATOL = 0.03, 3e-3
SETUPS = ("O1-head", "O2-norm", "O2-fp32-head")


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))


_batch, _params = seeded_batch, optimizer_params


class _Run(AmpOrFp32Run):
    """One run of ``setup`` (one of :data:`SETUPS`): the engine's, or (``fp32``) the FP32 reference's. ``whole`` holds
    every parameter, ``own`` the shared module's weight (its bias comes by ``add_group``)."""

    def __init__(self, setup: str, fp32: bool = False) -> None:
        self.model = _net()
        self.shared = self.model[1] if setup == "O2-norm" else self.model[3]
        whole = torch.optim.SGD(self.model.parameters(), lr=0.05)
        own = torch.optim.SGD([self.shared.weight], lr=0.2, momentum=0.9)
        self.amp: Amp | None = None
        if not fp32:
            level = setup.split("-")[0]
            # A scale that a few accumulated float16 backwards do not overflow (at 65536 three of them did: a real
            # overflow, skipped as it should be, which this machine does not model)
            fp32_modules = ["3"] if setup == "O2-fp32-head" else ()
            self.amp = Amp(level, half_dtype="float16", fp32_modules=fp32_modules, init_scale=2.0**8)
            self.model = self.amp.prepare_model(self.model)
            whole, own = self.amp.prepare_optimizer(whole), self.amp.prepare_optimizer(own)
        self.opts = {"whole": whole, "own": own}

    def step(self, which: tuple[str, ...]) -> None:
        for name in which:
            if self.amp is None:
                self.opts[name].step()
            else:
                assert self.amp.step(self.opts[name]) is not False, f"a step of {name} skipped (no overflow here)"
        if self.amp is not None:
            self.amp.update()

    def trained(self) -> list[torch.Tensor]:
        params = list(self.model.parameters())
        if self.amp is None:
            return [p.detach().clone() for p in params]
        return [self.amp.master_of(p).detach().float().clone() for p in params]


class SharedOptimizers(RuleBasedStateMachine):
    @initialize(setup=st.sampled_from(SETUPS), data=st.data())
    def start(self, setup: str, data: Any = None) -> None:
        """With ``data``, one iteration first (a backward and both steps), so that every sequence trains."""
        self.setup = setup
        self.ours, self.ref = _Run(setup), _Run(setup, fp32=True)
        self.start_values = self.ref.trained()
        self.added = False
        self.pending = False  # a backward since the last step
        # engine/raw_steps.py: after a backward with no step since, a hand write and a clear of the gradients (to
        # None), in either order, look as a raw optimizer's step: may be refused at the next backward (documented, an
        # undone write too: its error names refresh_masters(force=True) and load_state_dict as the ways; a backward
        # after an unscale notes the versions again without looking), never refused otherwise.
        self.noted = self.written = self.cleared = False
        if data is not None:
            self.backward(seed=data.draw(st.integers(0, 20)))
            self.step(which=("whole", "own"))

    def _both(self, call: Any) -> list[Any]:
        return [call(self.ours), call(self.ref)]

    @rule(seed=st.integers(0, 20))
    def backward(self, seed: int) -> None:
        if self.noted and self.written and self.cleared:  # may be refused (never otherwise)
            try:
                ours = self.ours.backward(seed)
            except RuntimeError as error:
                assert "did not prepare" in str(error), error
                self.start(self.setup)  # the user fixes the script and starts again
                return
            ref = self.ref.backward(seed)
        else:
            ours, ref = self._both(lambda run: run.backward(seed))
        assert abs(ours - ref) <= 0.02 * abs(ref) + 2e-3, (ours, ref)
        self.pending = self.noted = True
        self.written = self.cleared = False

    @precondition(lambda self: self.pending)
    @rule(which=st.sampled_from(["whole", "own"]), max_norm=st.sampled_from([0.1, 1.0]))
    def clip(self, which: str, max_norm: float) -> None:
        ours, ref = self._both(lambda run: run.clip(which, max_norm))
        assert abs(ours - ref) <= 0.03 * ref + 1e-3, (which, ours, ref)

    @precondition(lambda self: self.pending)
    @rule(which=st.sampled_from([("whole", "own"), ("own", "whole"), ("whole",), ("own",)]))
    def step(self, which: tuple[str, ...]) -> None:
        """Both optimizers stepped (either order), or one only: the other skipped this iteration."""
        self._both(lambda run: run.step(which))
        self.pending = self.noted = False

    @rule(which=st.sampled_from(["whole", "own", "model"]), set_to_none=st.booleans())
    def zero_grad(self, which: str, set_to_none: bool) -> None:
        self._both(lambda run: (run.model if which == "model" else run.opts[which]).zero_grad(set_to_none=set_to_none))
        self.cleared = self.cleared or set_to_none

    @rule()
    def add_group(self) -> None:
        """The shared module's bias added to its own optimizer (once), at whatever point the sequence is."""
        if self.added:
            return
        self._both(lambda run: run.opts["own"].add_param_group({"params": [run.shared.bias]}))
        self.added = True

    @rule(kind=st.sampled_from(["undone", "decay", "clamp"]))
    def hand_write(self, kind: str) -> None:
        """A write into every parameter by hand: undone before anything else (restored from a copy: what the
        optimizers train is as it was, bit for bit), or kept (the FP32 run takes our change, which is the write's
        within a half rounding at O2: no FP32 value is kept of a write the engine never saw)."""
        before = self.ours.trained()
        params = list(self.ours.model.parameters())
        with torch.no_grad():
            copies = [p.detach().clone() for p in params]
            for p in params:
                p.mul_(0.5 if kind == "undone" else 1 - 1e-2) if kind != "clamp" else p.clamp_(-0.2, 0.2)
            if kind == "undone":
                for p, copy in zip(params, copies, strict=True):
                    p.copy_(copy)
        after = self.ours.trained()
        for index, (now, was) in enumerate(zip(after, before, strict=True)):
            want = was if kind == "undone" else was * (1 - 1e-2) if kind == "decay" else was.clamp(-0.2, 0.2)
            ulp = (want.abs() + was.abs()) * 2.0**-10 + 1e-6  # float16's unit in the last place
            assert ((now - want).abs() <= ulp).all(), f"tensor {index}: the {kind} write not taken"
        with torch.no_grad():
            for p, now, was in zip(self.ref.model.parameters(), after, before, strict=True):
                p.add_(now - was)
        self.written = True

    @invariant()
    def what_is_trained_tracks_fp32(self) -> None:
        for index, (mine, ref, first) in enumerate(
            zip(self.ours.trained(), self.ref.trained(), self.start_values, strict=True)
        ):
            error = (mine - ref).abs().max().item()
            travelled = (ref - first).abs().max().item()
            assert error <= RTOL * travelled + ATOL, f"tensor {index} off by {error:.3g} (travelled {travelled:.3g})"


# S68_EXAMPLES: more sequences for a search under HYPOTHESIS_PROFILE=explore (docs/testing.md).
SharedOptimizers.TestCase.settings = stateful_settings(max_examples=int(os.environ.get("S68_EXAMPLES", "6")), steps=12)
test_two_optimizers_sharing_parameters_against_fp32 = SharedOptimizers.TestCase


# -- what the sequences found, written out ---------------------------------------------------------------------------
def test_a_clip_after_every_gradient_was_cleared_is_torchs_zero_norm_with_a_shared_head() -> None:
    """O1 float16, the whole model's optimizer and the head's own, a backward, ``whole.zero_grad()`` (every gradient
    to None: a batch dropped), then ``amp.clip_grad_norm_(whole, c)``. Before: an ``AssertionError`` from the engine's
    clip (the shared unscale measured no gradient and left no norm); FP32's ``clip_grad_norm_`` returns 0, as the
    engine does with one optimizer."""
    run = _Run("O1-head")
    run.backward(0)
    run.opts["whole"].zero_grad(set_to_none=True)
    assert float(run.amp.clip_grad_norm_(run.opts["whole"], 0.1)) == 0.0
    assert float(run.amp.clip_grad_norm_(run.opts["own"], 0.1)) == 0.0


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_clamp_between_backwards_after_a_clip_is_no_raw_step(level: str) -> None:
    """One optimizer (float16, a dynamic scale): a backward, ``amp.clip_grad_norm_`` (the gradients unscaled), a
    clamp of the weights by hand (a WGAN critic's), a backward, ``zero_grad(set_to_none=True)`` (the batch dropped),
    a backward. Before: refused at the last backward as "written and their gradients cleared after a backward of
    lightning_mpx with no step": a backward after an unscale did not note the parameters' versions again, so the
    clamp before it counted against the clear after it. Without the clip it was let through, as it is now."""
    net = _net()
    amp = Amp(level, half_dtype="float16", init_scale=2.0**8)
    net = amp.prepare_model(net)
    opt = amp.prepare_optimizer(torch.optim.SGD(net.parameters(), lr=0.05))
    before = [p.detach().float().clone() for p in net.parameters()]

    def backward(seed: int) -> None:
        x, y = _batch(seed)
        with amp.forward_context():
            loss = F.cross_entropy(net(amp.cast_inputs(x)).float(), y)
        amp.backward(loss)

    backward(0)
    amp.clip_grad_norm_(opt, 1.0)
    with torch.no_grad():
        for p in net.parameters():
            p.clamp_(-0.2, 0.2)
    backward(1)
    opt.zero_grad(set_to_none=True)
    backward(2)
    amp.step(opt)
    amp.update()
    moved = [p.detach().float() for p in net.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(moved, before, strict=True))
