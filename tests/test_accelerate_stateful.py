"""Random sequences of what Accelerate users do, through ``lightning_mpx.integrations.accelerate.Accelerator`` at O1 and
O2, against the same loop in plain FP32 PyTorch.

Rules: a training step (optionally accumulated over two backward passes, clipped by norm or value through the
accelerator, with a bad batch whose loss is infinite, zeroing with or without ``set_to_none``), loading pretrained
weights into the prepared model, a write through ``p.data`` (a weight clamp), an evaluation forward pass, and
``save_state`` followed later by ``load_state``. After every step what the optimizer trains (the FP32 masters at O2)
matches the FP32 loop within half-precision rounding, and the reference then takes those values, so that each step is
compared from the same point; a bad batch leaves everything as it was, bit for bit; a resume restores the trained
values, the model's half weights and the loss scale exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
from torch import nn

pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402

from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs  # noqa: E402

# Per step, against FP32 from the same starting point: the half forward and backward's rounding.
TOLERANCE = {torch.float16: dict(rtol=2e-3, atol=1e-3), torch.bfloat16: dict(rtol=2e-2, atol=8e-3)}


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)


def _fresh_state() -> None:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


class AdapterAgainstFP32(RuleBasedStateMachine):
    @initialize(level=st.sampled_from(["O1", "O2"]), half=st.sampled_from([torch.float16, torch.bfloat16]),
                seed=st.integers(0, 3))
    def setup(self, level, half, seed):
        _fresh_state()
        torch.manual_seed(seed)
        net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        self.ref = copy.deepcopy(net)
        self.ref_opt = torch.optim.SGD(self.ref.parameters(), lr=0.1, momentum=0.5)
        settings_ = dict(half_dtype=half, init_scale=2.0**10)
        if half == torch.bfloat16:
            settings_["loss_scale"] = "dynamic"  # so that a bad batch is skipped (bfloat16's default is static 1.0)
        self.accelerator = Accelerator(mixed_precision=level, kwargs_handlers=[MixedPrecisionKwargs(**settings_)])
        self.model, self.opt = self.accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5))
        self.half, self.level = half, level
        self.saved = None  # (directory, trained values, half weights, scale) of the last save_state

    def teardown(self):
        _fresh_state()

    # -- helpers ----------------------------------------------------------------------------------------------
    def _trained(self) -> list[torch.Tensor]:
        amp = getattr(self.opt, "amp", None)
        if amp is not None and self.level == "O2":
            return list(amp.master_params(self.opt.optimizer))
        return [p for group in self.opt.param_groups for p in group["params"]]

    def _model_params(self) -> list[torch.Tensor]:
        return list(self.accelerator.unwrap_model(self.model).parameters())

    def _snapshot(self) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
        return ([t.detach().clone() for t in self._trained()], [p.detach().clone() for p in self._model_params()],
                float(self.opt.amp.scalers[0].scale_tensor) if hasattr(self.opt, "amp") else 1.0)

    def _sync_reference(self) -> None:
        with torch.no_grad():
            for mine, ref in zip(self._trained(), self.ref.parameters()):
                ref.copy_(mine.float())

    # -- rules ------------------------------------------------------------------------------------------------
    @rule(seed=st.integers(0, 100), clip=st.sampled_from([None, "norm", "value"]), bad=st.booleans(),
          parts=st.integers(1, 2), set_to_none=st.booleans())
    def train_step(self, seed, clip, bad, parts, set_to_none):
        """A step; with ``parts=2`` the batch's gradients are accumulated over two backward passes."""
        self._step(seed, clip, bad, parts, set_to_none)

    def _step(self, seed, clip, bad, parts=1, set_to_none=True):
        x, y = _batch(seed)
        before = self._snapshot()
        for part in range(parts):
            rows = slice(part * 16 // parts, (part + 1) * 16 // parts)
            loss = F.cross_entropy(self.model(x[rows]), y[rows]) / parts
            self.accelerator.backward(loss * float("inf") if bad and part == 0 else loss)
        if clip == "norm":
            self.accelerator.clip_grad_norm_(self.model.parameters(), 0.5)
        elif clip == "value":
            self.accelerator.clip_grad_value_(self.model.parameters(), 0.05)
        self.opt.step()
        self.opt.zero_grad(set_to_none=set_to_none)
        if bad:
            assert self.accelerator.optimizer_step_was_skipped
            after = self._snapshot()
            for got, want in zip(after[0] + after[1], before[0] + before[1]):
                assert torch.equal(got, want)  # a skipped step changes no weight
            assert after[2] == before[2] / 2  # and backs the scale off
            return
        assert not self.accelerator.optimizer_step_was_skipped
        ref_loss = F.cross_entropy(self.ref(x), y)
        ref_loss.backward()
        if clip == "norm":
            torch.nn.utils.clip_grad_norm_(self.ref.parameters(), 0.5)
        elif clip == "value":
            torch.nn.utils.clip_grad_value_(self.ref.parameters(), 0.05)
        self.ref_opt.step()
        self.ref_opt.zero_grad()
        for got, want in zip(self._trained(), self.ref.parameters()):
            torch.testing.assert_close(got.detach().float(), want.detach(), **TOLERANCE[self.half])
        # The model's half weights are the trained values rounded (O2), or the trained values themselves (O1).
        for weight, trained in zip(self._model_params(), self._trained()):
            assert torch.equal(weight.detach(), trained.detach().to(weight.dtype))
        self._sync_reference()

    @rule(seed=st.integers(0, 100))
    def load_pretrained_weights(self, seed):
        """``model.load_state_dict(...)`` after ``prepare`` (FP32 weights from a file, say)."""
        g = torch.Generator().manual_seed(seed)
        state = {k: torch.randn(v.shape, generator=g) * 0.3 for k, v in self.ref.state_dict().items()}
        self.accelerator.unwrap_model(self.model).load_state_dict(state)
        self.ref.load_state_dict(state)
        # What the optimizer trains follows, as the half values of the weights loaded (at O2 the masters take the
        # half weights' values at the next step; here they are checked through a step's result).
        for weight, value in zip(self._model_params(), self.ref.parameters()):
            assert torch.equal(weight.detach(), value.detach().to(weight.dtype))
        with torch.no_grad():  # the reference trains from what the half model holds
            for weight, ref in zip(self._model_params(), self.ref.parameters()):
                ref.copy_(weight.float())
        self._step(seed, None, False)  # trains from the loaded weights (at O2: the masters took them)

    @rule(bound=st.sampled_from([0.05, 0.2]), seed=st.integers(0, 100))
    def clamp_weights_through_data(self, bound, seed):
        """WGAN's weight clipping, written the old way, then a step from the clamped weights."""
        for p in self._model_params():
            p.data.clamp_(-bound, bound)
        with torch.no_grad():
            for weight, ref in zip(self._model_params(), self.ref.parameters()):
                ref.copy_(weight.float())
        self._step(seed, None, False)

    @rule(seed=st.integers(0, 100), event=st.sampled_from(["decay", "clamp", "save", "load"]),
          through_model=st.booleans())  # fmt: skip
    def window_with_an_event(self, seed, event, through_model):
        """An accumulation window of two backwards with, between them, a hand write into every weight (``p.mul_(1 -
        wd)``, a clamp: never refused), a ``save_state``, or a ``load_state_dict(strict=False)`` of part of the model;
        then the step and ``zero_grad`` through the optimizer or the model. The step is the FP32 loop's from the same
        point: after a write, from what ours trained took (``amp.master_of``: at O2 the write's half rounding, within
        a unit in the last place of the write done in FP32); after a load, the loaded values exactly (the missing
        ones keep theirs)."""
        x, y = _batch(seed)
        inner = self.accelerator.unwrap_model(self.model)
        amp = getattr(self.opt, "amp", None)
        for part, rows in enumerate((slice(0, 8), slice(8, 16))):
            self.accelerator.backward(F.cross_entropy(self.model(x[rows]), y[rows]) / 2)
            (F.cross_entropy(self.ref(x[rows]), y[rows]) / 2).backward()
            if part == 1:
                break
            before = [t.detach().clone() for t in self._trained()]
            if event == "save":
                self.accelerator.save_state(str(self._tmp / "window"))
                continue
            if event == "load":
                g = torch.Generator().manual_seed(seed)
                want = [0.3 * torch.randn(v.shape, generator=g) if i % 3 == 0 else v for i, v in enumerate(before)]
                state = {k: v for i, (k, v) in enumerate(zip(self.ref.state_dict(), want)) if i % 3 == 0}
                result = inner.load_state_dict(state, strict=False)
                assert sorted(result.missing_keys) == sorted(set(self.ref.state_dict()) - set(state))
            else:
                with torch.no_grad():
                    for p in inner.parameters():
                        p.mul_(1 - 1e-2) if event == "decay" else p.clamp_(-0.2, 0.2)
                want = [v * (1 - 1e-2) if event == "decay" else v.clamp(-0.2, 0.2) for v in before]
            got = [amp.master_of(p).detach() if amp is not None else p.detach() for p in inner.parameters()]
            for mine, value, was in zip(got, want, before, strict=True):
                if event == "load" or mine.dtype == torch.float32 and self.level == "O1":
                    assert torch.equal(mine.float(), value), "not the values written"
                else:
                    ulp = (value.abs() + was.abs()) * 2.0**-7 + 1e-6  # the half rounding of the write
                    assert ((mine.float() - value).abs() <= ulp).all(), "a hand write not taken"
            with torch.no_grad():
                for ref, mine in zip(self.ref.parameters(), got, strict=True):
                    ref.copy_(mine.float())
        self.opt.step()
        (self.model if through_model else self.opt).zero_grad()
        self.ref_opt.step()
        self.ref_opt.zero_grad()
        assert not self.accelerator.optimizer_step_was_skipped
        for got, want in zip(self._trained(), self.ref.parameters()):
            torch.testing.assert_close(got.detach().float(), want.detach(), **TOLERANCE[self.half])
        self._sync_reference()

    @rule(seed=st.integers(0, 100))
    def evaluate(self, seed):
        x, _ = _batch(seed)
        self.model.eval()
        with torch.no_grad():
            out = self.model(x)
        self.model.train()
        with torch.no_grad():
            want = self.ref(x)
        torch.testing.assert_close(out.float(), want, **{k: 4 * v for k, v in TOLERANCE[self.half].items()})

    @rule(data=st.data())
    def save_state(self, data):
        directory = data.draw(st.sampled_from(["a", "b"]))
        path = self._tmp / directory
        self.accelerator.save_state(str(path))
        self.saved = (path, *self._snapshot(), copy.deepcopy(self.ref.state_dict()),
                      copy.deepcopy(self.ref_opt.state_dict()))

    @precondition(lambda self: self.saved is not None)
    @rule()
    def load_state(self):
        path, trained, weights, scale, ref_state, ref_opt_state = self.saved
        self.accelerator.load_state(str(path))
        got_trained, got_weights, got_scale = self._snapshot()
        for got, want in zip(got_trained + got_weights, trained + weights):
            assert got.dtype == want.dtype and torch.equal(got, want)
        assert got_scale == scale
        self.ref.load_state_dict(ref_state)
        # A copy: torch's load_state_dict keeps the given tensors as the momentum buffers, which steps then change.
        self.ref_opt.load_state_dict(copy.deepcopy(ref_opt_state))


@pytest.fixture
def _machine(tmp_path):
    AdapterAgainstFP32._tmp = tmp_path
    yield
    _fresh_state()


AdapterAgainstFP32.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def test_accelerate_adapter_against_fp32(_machine):
    AdapterAgainstFP32.TestCase().runTest()
