"""Random sequences of an Accelerate GAN-style loop with two optimizers, through
``lightning_mpx.integrations.accelerate.Accelerator`` at O1 and O2, against the same loop in plain FP32 PyTorch.

The set-up (drawn): O1 or O2; bfloat16 under a dynamic scale, or float16; ``gradient_accumulation_steps`` 1 or 2; a body
optimizer (SGD with momentum over the first Linear, a StepLR on it) and a head optimizer (Nesterov SGD with weight decay
over the last Linear), all passed through ``accelerator.prepare``. Rules, each a user habit: a window of Accelerate's
documented loop (``with accelerator.accumulate(model):`` a backward, then on the synchronising micro-step an optional
``accelerator.unscale_gradients`` of one optimizer or all, an optional ``accelerator.clip_grad_norm_`` of one
optimizer's parameters or the whole model's, or ``clip_grad_value_``; then on every micro-step the steps of both
optimizers or of one (the scheduler's step with the body's), both ``zero_grad``), optionally with a bad batch (an
infinite loss in one micro-step); ``accelerator.save_state`` to one of two directories, and later ``load_state`` of one.

After every window what the optimizers train (the FP32 masters at O2) matches the FP32 loop within half-precision
rounding, and the reference then takes those values, so that each window is compared from the same point; a bad window
leaves everything (weights, masters, the learning rate) as it was, bit for bit, and halves the scale (at once when both
optimizers stepped, else at the next backward: docs/accelerate.md); a resume restores the trained values, the model's
weights, the learning rate and the loss scale exactly.

CI runs a few derandomized examples (tests/conftest.py's profile). To explore, run by hand: ``HYPOTHESIS_PROFILE=explore
ACCEL2_EXAMPLES=200 PYTHONPATH=$PWD python -m pytest -q -p no:cacheprovider
tests/test_accelerate_two_optimizers_stateful.py --hypothesis-seed=N`` for a few seeds N.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
from torch import nn

from tests.stateful_helpers import stateful_settings

pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs  # noqa: E402

# Per window, against FP32 from the same starting point: the half forward and backward's rounding.
TOLERANCE = {torch.float16: dict(rtol=2e-3, atol=1e-3), torch.bfloat16: dict(rtol=2e-2, atol=8e-3)}


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)


def _fresh_state() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _optimizers(net: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer, Any]:
    body = torch.optim.SGD(net[0].parameters(), lr=0.1, momentum=0.5)
    # Not Adam: its first step is lr * sign(g), which half precision's noise in a near-zero gradient flips (off by
    # 2 * lr against FP32, found at stop 71); Adam's state through a checkpoint is
    # tests/test_checkpoint_roundtrip_stateful.py's
    head = torch.optim.SGD(net[2].parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
    return body, head, torch.optim.lr_scheduler.StepLR(body, step_size=2, gamma=0.5)


class TwoOptimizersAgainstFP32(RuleBasedStateMachine):
    @initialize(level=st.sampled_from(["O1", "O2"]), half=st.sampled_from([torch.bfloat16, torch.float16]),
                accumulation=st.sampled_from([1, 2]), seed=st.integers(0, 3))  # fmt: skip
    def setup(self, level: str, half: torch.dtype, accumulation: int, seed: int) -> None:
        _fresh_state()
        torch.manual_seed(seed)
        net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        self.ref = copy.deepcopy(net)
        self.ref_body, self.ref_head, self.ref_sched = _optimizers(self.ref)
        handler = MixedPrecisionKwargs(half_dtype=half, init_scale=2.0**10, loss_scale="dynamic")
        self.accelerator = Accelerator(mixed_precision=level, gradient_accumulation_steps=accumulation,
                                       kwargs_handlers=[handler])  # fmt: skip
        self.model, self.body, self.head, self.sched = self.accelerator.prepare(net, *_optimizers(net))
        self.level, self.half, self.accumulation = level, half, accumulation
        self.saved: dict[str, Any] = {}
        self.pending = 0  # a halving of the scale the next backward or save_state applies

    def teardown(self) -> None:
        _fresh_state()

    # -- helpers ----------------------------------------------------------------------------------------------
    def _params(self) -> list[torch.Tensor]:
        return list(self.accelerator.unwrap_model(self.model).parameters())

    def _trained(self) -> list[torch.Tensor]:
        return [self.accelerator.amp.master_of(p).detach().clone() for p in self._params()]

    def _snapshot(self) -> dict[str, Any]:
        weights = [p.detach().clone() for p in self._params()]
        scale, lr = self.accelerator.amp.scalers[0].get_scale(), self.body.param_groups[0]["lr"]
        return {"trained": self._trained(), "weights": weights, "scale": scale, "lr": lr}

    def _sync_reference(self) -> None:
        with torch.no_grad():
            for mine, ref in zip(self._trained(), self.ref.parameters(), strict=True):
                ref.copy_(mine.float())

    def _clip(self, clip: str | None, ref: bool) -> None:
        model = self.ref if ref else self.accelerator.unwrap_model(self.model)
        params = {"body": model[0].parameters, "head": model[2].parameters, "model": model.parameters}
        if clip in params:
            max_norm = 0.5 if clip == "model" else 0.3
            if ref:
                torch.nn.utils.clip_grad_norm_(params[clip](), max_norm)
            else:
                self.accelerator.clip_grad_norm_(params[clip](), max_norm)
        elif clip == "value":
            if ref:
                torch.nn.utils.clip_grad_value_(model.parameters(), 0.05)
            else:
                self.accelerator.clip_grad_value_(model.parameters(), 0.05)

    # -- rules ------------------------------------------------------------------------------------------------
    @rule(seed=st.integers(0, 100), clip=st.sampled_from([None, "body", "head", "model", "value"]),
          unscale=st.sampled_from([None, "body", "head", "all"]), steps=st.sampled_from(["both", "body", "head"]),
          bad=st.sampled_from([None, None, None, 0, 1]), set_to_none=st.booleans())  # fmt: skip
    def window(self, seed: int, clip: str | None, unscale: str | None, steps: str, bad: int | None,
               set_to_none: bool) -> None:  # fmt: skip
        bad = None if bad is not None and bad >= self.accumulation else bad
        x, y = _batch(seed)
        parts = self.accumulation
        before = self._snapshot()
        for part in range(parts):
            rows = slice(part * 8 // parts, (part + 1) * 8 // parts)
            with self.accelerator.accumulate(self.model):
                loss = F.cross_entropy(self.model(x[rows]), y[rows])
                self.accelerator.backward(loss * float("inf") if bad == part else loss)
                assert self.accelerator.sync_gradients == (part == parts - 1)
                if self.accelerator.sync_gradients:
                    if unscale is not None:
                        chosen = {"body": self.body, "head": self.head, "all": None}[unscale]
                        self.accelerator.unscale_gradients(optimizer=chosen)
                    self._clip(clip, ref=False)
                if steps in ("both", "body"):
                    self.body.step()
                    self.sched.step()  # the body's scheduler, stepped with it
                if steps in ("both", "head"):
                    self.head.step()
                self.body.zero_grad(set_to_none=set_to_none)
                self.head.zero_grad(set_to_none=set_to_none)
        # Accelerate's optimizer_step_was_skipped is any prepared optimizer's last step's: its own after each step
        stepped = [opt for name, opt in (("body", self.body), ("head", self.head)) if steps in ("both", name)]
        assert [opt.step_was_skipped for opt in stepped] == [bad is not None] * len(stepped)
        if bad is not None:
            after = self._snapshot()
            for got, want in zip(after["trained"] + after["weights"], before["trained"] + before["weights"]):
                assert torch.equal(got, want), "a skipped window changed a weight"
            assert after["lr"] == before["lr"], "the scheduler stepped on a skipped window"
            # docs/accelerate.md: the scale is updated once every prepared optimizer stepped (or skipped), else at
            # the next backward (this window's first: a halving left pending by the last window) or save_state
            halvings = self.pending + (steps == "both")
            assert after["scale"] == before["scale"] / 2**halvings, f"{halvings} halvings expected"
            self.pending = int(steps != "both")
            return
        self.pending = 0
        for part in range(parts):
            rows = slice(part * 8 // parts, (part + 1) * 8 // parts)
            (F.cross_entropy(self.ref(x[rows]), y[rows]) / parts).backward()
        self._clip(clip, ref=True)
        if steps in ("both", "body"):
            self.ref_body.step()
            self.ref_sched.step()
        if steps in ("both", "head"):
            self.ref_head.step()
        self.ref_body.zero_grad()
        self.ref_head.zero_grad()
        assert self.body.param_groups[0]["lr"] == self.ref_body.param_groups[0]["lr"]
        for index, (got, want) in enumerate(zip(self._trained(), self.ref.parameters(), strict=True)):
            torch.testing.assert_close(got.float(), want.detach(), **TOLERANCE[self.half],
                                       msg=lambda m, i=index: f"tensor {i}: {m}")  # fmt: skip
        for weight, trained in zip(self._params(), self._trained(), strict=True):
            assert torch.equal(weight.detach(), trained.to(weight.dtype)), "the weights are not the trained values"
        self._sync_reference()

    @rule(slot=st.sampled_from(["a", "b"]))
    def save_state(self, slot: str) -> None:
        path = self._tmp / slot
        self.accelerator.save_state(str(path))
        self.pending = 0  # applied by save_state
        refs = (self.ref, self.ref_body, self.ref_head, self.ref_sched)
        self.saved[slot] = (path, self._snapshot(), [copy.deepcopy(r.state_dict()) for r in refs])

    @precondition(lambda self: bool(self.saved))
    @rule(data=st.data())
    def load_state(self, data: st.DataObject) -> None:
        path, want, refs = self.saved[data.draw(st.sampled_from(sorted(self.saved)))]
        self.accelerator.load_state(str(path))
        self.pending = 0  # the loaded scale is the one the run goes on with
        got = self._snapshot()
        for mine, value in zip(got["trained"] + got["weights"], want["trained"] + want["weights"], strict=True):
            assert mine.dtype == value.dtype and torch.equal(mine, value), "not resumed bit for bit"
        assert got["scale"] == want["scale"] and got["lr"] == want["lr"]
        # Copies: torch's load_state_dict keeps the given tensors as the optimizer's buffers, which steps change.
        for obj, state in zip((self.ref, self.ref_body, self.ref_head, self.ref_sched), refs, strict=True):
            obj.load_state_dict(copy.deepcopy(state))


@pytest.fixture
def _machine(tmp_path):
    TwoOptimizersAgainstFP32._tmp = tmp_path
    yield
    _fresh_state()


# The fixture is per test, not per example: the machine's directories are overwritten by each example.
TwoOptimizersAgainstFP32.TestCase.settings = settings(
    stateful_settings(max_examples=int(os.environ.get("ACCEL2_EXAMPLES", "8")), steps=10),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_two_optimizers_against_fp32(_machine):
    TwoOptimizersAgainstFP32.TestCase().runTest()
