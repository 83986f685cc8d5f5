"""The forward of :class:`~lightning_mpx.engine.amp.Amp`: its scope (:meth:`AmpForward.forward_context`: the cast
policy at O1, FP32 loss functions inside the model at O2, and what a forward must find done first: FP32 values a
state dict lent out taken back, a model's pending moves, an optimizer's groups added since prepared, a schedule-free
optimizer's mode redone on the masters) and the casts of what goes in and comes out of the model
(:meth:`AmpForward.cast_inputs`, :meth:`AmpForward.cast_outputs`).

:class:`AmpForward` is the base of :class:`~lightning_mpx.engine.amp.Amp` over the forward, between its masters' base
(:class:`~lightning_mpx.engine.amp_masters.AmpMasters`) and the training calls that stay on :class:`Amp` (prepare,
backward, step, update). The Lightning and Fabric plugins and the Accelerate adapter (the HF Trainer's door too)
enter :meth:`~AmpForward.forward_context` around each forward, as a plain loop does (the module's docstring of
engine.amp).
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

from lightning_mpx.casting.targets import (
    _COMPILER,
    _dynamo_compiling,
    _no_torch_function,
    _stack_at,
    _stack_length,
    cast_model_inputs,
)
from lightning_mpx.common.containers import _cast_collection
from lightning_mpx.engine.amp_masters import AmpMasters
from lightning_mpx.masters.swap import follow_modes


class AmpForward(AmpMasters):
    """The base of :class:`~lightning_mpx.engine.amp.Amp` over the forward: :meth:`forward_context`,
    :meth:`cast_inputs` and :meth:`cast_outputs`. A registered optimizer whose groups changed since its pairs were made
    is prepared again by :meth:`Amp._groups_changed <lightning_mpx.engine.amp.Amp._groups_changed>`."""

    def forward_context(self) -> ContextManager[Any]:
        """The scope of a forward pass: the cast policy at O1; at O2, a policy that runs loss functions called inside
        the model in FP32; nothing otherwise."""
        models = self._models
        if self._masters.lent:  # FP32 values a model's state_dict() handed out: written since, they go to the model
            self._masters.take_lent()
        if models._device_pending or models._half_marks or models.loss_regions is not None:  # else nothing to do
            models.before_forward()  # (O1 after its first forward: a call saved per step)
        # O2: a registered optimizer given a group since its pairs were made (torch's add_param_group calls no hook;
        # a head added with it is still FP32): its new parameters are prepared now, before this forward. Attribute
        # reads and C calls per optimizer (pairs_key is None without masters). A group added in place of one removed
        # (a head replaced: the same count) has a new list as the last group's. A schedule-free optimizer (train_modes
        # noted at registration, else None) whose eval()/train() ran on the half parameters since: redone on the
        # masters, so this forward runs at the point it asked for. Traced by dynamo (a model compiled after the
        # Accelerate adapter's prepare), the groups guard on their count and the last group's list only: read from the
        # optimizer's __dict__ (an attribute read of a torch optimizer's param_groups guards on every value of every
        # group, as does a list's truth value: a scheduler's lr, a schedule-free step count was a recompile).
        for state in self._machine.optimizers.values():
            key = state.pairs_key
            if key is not None and (opt := state.optimizer_ref()) is not None:
                if (groups := opt.__dict__.get("param_groups")) is None:
                    groups = opt.param_groups  # (a property: a wrapper's)
                if len(groups) != len(key) or (
                    len(groups) and groups[-1]["params"] is not state.last_params  # (none: Lightning's mock optimizer)
                ):
                    self._groups_changed(opt)
            if state.train_modes is not None:
                follow_modes(state, self._machine.masters.weights)
        if models._other_marks:  # O1: a model made the other half dtype since prepare_model (model.half())
            other = models.other_half
            for _, param in models._other_marks.values():
                if param.dtype is other:
                    models.other_half_met()
                    break
        return self.policy.forward_scope() if self.policy is not None else contextlib.nullcontext()

    def cast_inputs(self, data: Any) -> Any:
        """Floating-point tensors in ``data`` (nested in lists, tuples, dicts) cast to half when the model is (not
        under FSDP, whose root policy casts)."""
        if not self.properties.casts_model or self._models.sharded:  # the part: dynamo cannot trace the property
            return data
        return cast_model_inputs(self.policy, data, self.properties.half_dtype)  # sources noted: casting.targets

    def cast_outputs(self, data: Any) -> Any:
        """Half tensors in ``data`` cast to FP32 when the model is half, so the loss is computed in FP32 (Apex); not
        under FSDP, whose root policy casts."""
        if not self.properties.casts_model or self._models.sharded:  # the part: dynamo cannot trace the property
            return data
        half = self.properties.half_dtype
        if type(data) is torch.Tensor:  # _cast_collection's usual case, without its call
            # Inside forward_context with only the policy's mode on (eager), the dtype read and the cast run with
            # torch-function handling off, as in cast_inputs: the mode passes both through, a call each.
            if (
                _stack_length() == 1
                and getattr(_stack_at(0), "policy", None) is self.policy
                and not (_dynamo_compiling() or _COMPILER._is_compiling_flag)
            ):
                with _no_torch_function():
                    return data.to(torch.float32) if data.dtype == half else data
            return data.to(torch.float32) if data.dtype == half else data
        return _cast_collection(data, torch.float32, (half,))
