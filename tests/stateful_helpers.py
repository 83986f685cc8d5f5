"""The settings every stateful (hypothesis ``RuleBasedStateMachine``) test of the suite runs with, the checks that
two runs' tensors and optimizer states are the same, a run's checkpoint saved and loaded back, and the backward and
clip of a run made with the core ``Amp`` or in FP32 (:class:`AmpOrFp32Run`)."""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, settings


def stateful_settings(max_examples: int, steps: int) -> settings:
    """``max_examples`` sequences of up to ``steps`` rules each; no deadline (a rule trains a model), and models
    built in a rule are slow by hypothesis' measure. The profile (derandomized by default) comes from
    tests/conftest.py."""
    return settings(max_examples=max_examples, stateful_step_count=steps, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])  # fmt: skip


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """The tensors of ``got`` are those of ``want``, one for one, in dtype and bit for bit."""
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def assert_same_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Two optimizer state dicts are the same: the groups, and every state tensor (:func:`assert_same`)."""
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for index, values in want["state"].items():
        assert values.keys() == got["state"][index].keys()
        assert_same([got["state"][index][k] for k in values], list(values.values()))


def saved_and_loaded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, amp: Any = None) -> dict[str, Any]:
    """A run's checkpoint (the model's and the optimizer's state dicts, and the engine's where ``amp`` is given) saved
    with ``torch.save`` and loaded back, as a resumed run reads it (tests/test_core_optimizer_habits_stateful.py,
    test_core_state_by_param_stateful.py)."""
    saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    if amp is not None:
        saved["amp"] = amp.state_dict()
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def seeded_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Eight inputs of width 8 and their labels out of 4 classes, drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def optimizer_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter of ``opt``'s groups, in order."""
    return [p for group in opt.param_groups for p in group["params"]]


class AmpOrFp32Run:
    """A run of the machines that compare the core ``Amp`` with FP32 (tests/test_core_shared_params_stateful.py,
    test_core_gradient_writes_stateful.py): ``model``, ``amp`` (``None``: the FP32 reference) and ``opts`` (by name) are
    set by the subclass."""

    model: torch.nn.Module
    amp: Any
    opts: dict[str, torch.optim.Optimizer]

    def backward(self, seed: int) -> float:
        """A cross-entropy backward of :func:`seeded_batch` ``seed`` (through ``amp.backward``, or FP32's)."""
        x, y = seeded_batch(seed)
        if self.amp is None:
            loss = F.cross_entropy(self.model(x), y)
            loss.backward()
        else:
            with self.amp.forward_context():
                loss = F.cross_entropy(self.model(self.amp.cast_inputs(x)).float(), y)
            self.amp.backward(loss)
        return loss.item()

    def clip(self, which: str, max_norm: float) -> float:
        """The norm clip of optimizer ``which`` (the engine's, or torch's of its parameters): the norm."""
        if self.amp is None:
            return float(torch.nn.utils.clip_grad_norm_(optimizer_params(self.opts[which]), max_norm))
        return float(self.amp.clip_grad_norm_(self.opts[which], max_norm))
