"""O2's masters through random sequences of what fine-tuning code does with frozen parameters.

A user freezes and unfreezes layers in place (``requires_grad_``), adds a layer's parameters to the optimizer later
(``add_param_group``, as Lightning's ``BackboneFinetuning``), trains, and at any point saves a checkpoint and resumes
from it in a fresh process (a new model, optimizer and ``Amp`` built the way the code builds them, then the
layers frozen or unfrozen as they were, then the state dicts loaded).

The reference is the run that was never interrupted: a run resumed from any checkpoint, at any point, must then
go on bit for bit like it (losses, half parameters and FP32 masters). The optimizer steps FP32 masters only (a half
parameter it holds that requires a gradient has one), and the memory promise: a half parameter frozen before the
model was prepared (no FP32 value kept for it) that never required a gradient while an optimizer held it has no
master. Layers frozen after preparing keep their FP32 values, which become their masters when an optimizer holds
them (at no cost: the value is the master), so the initial freeze is drawn before or after ``prepare_model``.
"""

from __future__ import annotations

import copy

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from torch import nn

from lightning_mpx import Amp
from lightning_mpx.masters.state_keys import has_own_key
from tests.stateful_helpers import stateful_settings

LAYERS = 3  # layers 0 and 1 are in the optimizer from the start, layer 2 joins with add_param_group


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))


def _layer(model: nn.Sequential, index: int) -> nn.Linear:
    return model[2 * index]  # type: ignore[return-value]


class _Run:
    """One training run: the model, its optimizer and Amp, built as the user's code builds them."""

    def __init__(self, frozen: tuple[bool, ...], added: bool, before_prepare: bool) -> None:
        self.amp = Amp("O2", half_dtype="bfloat16")
        self.model = _model()
        if not before_prepare:
            self.amp.prepare_model(self.model)
        for index, is_frozen in enumerate(frozen):
            _layer(self.model, index).requires_grad_(not is_frozen)
        if before_prepare:
            self.amp.prepare_model(self.model)
        params = [p for index in (0, 1) for p in _layer(self.model, index).parameters()]
        self.opt = self.amp.prepare_optimizer(torch.optim.AdamW(params, lr=1e-2))
        if added:
            self.opt.add_param_group({"params": list(_layer(self.model, 2).parameters())})

    def step(self, seed: int) -> float:
        g = torch.Generator().manual_seed(seed)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        with self.amp.forward_context():
            loss = nn.functional.mse_loss(self.model(x.to(torch.bfloat16)).float(), y)
        self.amp.backward(loss)
        self.amp.step(self.opt)
        self.amp.update()
        # The whole model's gradients: a trainable layer no optimizer holds yet would keep (and add to) its own,
        # which no checkpoint saves, in any precision.
        self.model.zero_grad(set_to_none=True)
        return loss.item()


class FrozenParameters(RuleBasedStateMachine):
    @initialize(frozen=st.tuples(st.booleans(), st.booleans(), st.booleans()), before_prepare=st.booleans())
    def start(self, frozen: tuple[bool, bool, bool], before_prepare: bool) -> None:
        self.frozen = list(frozen)
        self.added = False
        self.before_prepare = before_prepare
        self.straight = _Run(frozen, added=False, before_prepare=before_prepare)
        self.resumed = _Run(frozen, added=False, before_prepare=before_prepare)
        self.ever_trainable_held = {i for i in (0, 1) if not frozen[i]}
        # Layers whose FP32 value is kept from preparing (trainable then): held by an optimizer, they have masters.
        self.kept = {i for i in range(LAYERS) if not (before_prepare and frozen[i])}

    @rule(index=st.integers(0, LAYERS - 1), frozen=st.booleans())
    def set_frozen(self, index: int, frozen: bool) -> None:
        self.frozen[index] = frozen
        for run in (self.straight, self.resumed):
            _layer(run.model, index).requires_grad_(not frozen)
        if not frozen and (index < 2 or self.added):
            self.ever_trainable_held.add(index)

    @rule()
    def add_last_layer(self) -> None:
        if self.added:
            return
        self.added = True
        for run in (self.straight, self.resumed):
            run.opt.add_param_group({"params": list(_layer(run.model, 2).parameters())})
        if not self.frozen[2]:
            self.ever_trainable_held.add(2)

    @rule(seed=st.integers(0, 3))
    def step(self, seed: int) -> None:
        if all(self.frozen[i] for i in range(LAYERS)):
            return  # nothing to train: no backward possible
        assert self.straight.step(seed) == self.resumed.step(seed)

    @rule()
    def checkpoint_and_resume(self) -> None:
        run = self.resumed
        saved = copy.deepcopy({"model": run.model.state_dict(), "opt": run.opt.state_dict(),
                               "amp": run.amp.state_dict()})  # fmt: skip
        fresh = _Run(tuple(self.frozen), self.added, self.before_prepare)
        fresh.model.load_state_dict(saved["model"])
        fresh.opt.load_state_dict(saved["opt"])
        fresh.amp.load_state_dict(saved["amp"])
        self.resumed = fresh

    @invariant()
    def the_resumed_run_is_the_straight_one(self) -> None:
        for a, b in zip(self.straight.model.parameters(), self.resumed.model.parameters()):
            assert torch.equal(a, b)
            assert torch.equal(self.straight.amp.master_of(a), self.resumed.amp.master_of(b))

    @invariant()
    def the_optimizer_steps_fp32_masters_only(self) -> None:
        for run in (self.straight, self.resumed):
            for param in run.model.parameters():
                assert not has_own_key(run.opt.state, param), "the optimizer stepped a half parameter itself"
                if param.requires_grad and any(param is p for g in run.opt.param_groups for p in g["params"]):
                    master = run.amp.master_of(param)
                    assert master is not param and master.dtype == torch.float32

    @invariant()
    def no_master_for_a_parameter_that_never_trained(self) -> None:
        for index in range(LAYERS):
            for param in _layer(self.straight.model, index).parameters():
                has_master = self.straight.amp.master_of(param) is not param
                if index not in self.ever_trainable_held and index not in self.kept:
                    assert not has_master, index
                held = index < 2 or self.added
                if held and index in self.kept:
                    assert has_master, f"{index}: frozen after preparing and held, its kept FP32 value is no master"


FrozenParameters.TestCase.settings = stateful_settings(max_examples=80, steps=10)
test_frozen_parameters = FrozenParameters.TestCase
