"""Model surgery after ``prepare_model`` at O2, met where it can be: a new optimizer prepared, or a forward that
failed.

A module added after the model was prepared (a new head for a second stage) holds FP32 parameters no master covers:
when an optimizer that holds them is prepared (``Amp.prepare_optimizer``, and every front door that calls it:
``fabric.setup_optimizers``, the Trainer's ``strategy.setup_optimizers``, ``accelerator.prepare(optimizer)``), the
model is prepared again, so that the new module is made half with FP32 masters from its FP32 values, as
``prepare_model`` would have done (batch norm and ``fp32_modules`` stay FP32). A half parameter set on the model
after preparing whose values are exactly the rounding of an existing master (an untie's
``nn.Parameter(w.detach().clone())``) gets a master of its own from that master's FP32 value; any other is refused
(:meth:`PreparedModels.name_stray <lightning_mpx.engine.preparation.PreparedModels.name_stray>`). A forward that
fails on such a module before that (torch's "mat1 and mat2 must have the same dtype") is named by
:func:`forward_error`, on that error's path only (Fabric registers an optimizer at its first step, after that
forward: the error names the call that registers it now; torch's ``add_param_group`` calls
no hook, so a group added to a registered optimizer is met at the engine's next ``forward_context`` (``Amp`` compares
each registered optimizer's number of groups with the one its pairs were made from, and prepares it again: every
front door's forward enters it) or its next ``prepare_optimizer``; the Trainer plugin registers an optimizer made
mid-fit by ``strategy.setup_optimizers`` when the next training step starts).
Plain functions over the engine's ``PreparedModels``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from lightning_mpx.engine.sharding import refuse_unfrozen_half

_HALF = (torch.float16, torch.bfloat16)


def _unmastered(models: Any, module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module``'s floating parameters no master covers (set on it after it was prepared), by name."""
    covered = models.masters.covered
    return [
        (name, p)
        for name, p in module.named_parameters()
        if p.is_floating_point() and not p.is_complex() and not covered(p)
    ]


def adopt_new_parameters(models: Any, optimizer: torch.optim.Optimizer) -> None:
    """Before ``optimizer`` is registered (O2): the parameters it holds that were set on a prepared model after
    preparing get masters. FP32 ones (a module added since) have the model prepared again; a half one whose values
    are the rounding of an existing master gets a master from that master's FP32 value. Others are left to the
    registration, which refuses them. Only at an optimizer's preparation: nothing runs per step."""
    if models.sharded or not models.properties.master_weights:
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    half = models.properties.half_dtype
    for module in list(models._releases.keys()):
        new = [(name, p) for name, p in _unmastered(models, module) if id(p) in held]
        if any(p.dtype != half for _, p in new):
            models.prepare(module, train=True)  # the new module made half, its masters from its FP32 values
            new = [(name, p) for name, p in _unmastered(models, module) if id(p) in held]
        prefix = models.masters.prefix_of(module, "")  # the names of the model's masters ("model1." for a second)
        for name, param in new:
            if param.dtype == half and param.requires_grad:
                _adopt_rounding(models, prefix + name, param)


def _adopt_rounding(models: Any, name: str, param: torch.Tensor) -> None:
    """Give ``param`` a master from the FP32 value of the master whose rounding it holds exactly, if any."""
    for weights in models.masters.prune():
        for _, master in weights.half_pairs:
            if (
                master.shape == param.shape
                and master.device == param.device
                and torch.equal(master.detach().to(param.dtype), param.detach())
            ):
                weights.adopt(models.names.setdefault(id(param), name), param, master.detach())
                return


def forward_error(models: Any, error: RuntimeError) -> None:
    """On a forward's RuntimeError only: raise an error naming the FP32 modules set on a prepared model after
    preparing (their FP32 weights met the half activations), ``from`` torch's; return when there are none."""
    message = str(error)
    mismatch = "dtype" in message or "should be the same" in message or "scalar type" in message
    if not mismatch or "prepare_model()" in message or not models.properties.casts_model:
        return  # not torch's dtype mismatch: the engine's own errors name their cause (e.g. model.float() after)
    note = replaced_data_note(models)  # a parameter's data replaced by an FP32 tensor: named on torch's error
    if note is not None and note not in getattr(error, "__notes__", ()):
        error.add_note(note)
    half = models.properties.half_dtype
    for module in list(models._releases.keys()):
        if not any(p.dtype == half for p in module.parameters()):
            continue  # the whole model converted since: the engine's own check names that
        prepared = set(models._unsharded.get(module, ()))  # the parameters it held when it was prepared
        new = [(n, p) for n, p in _unmastered(models, module) if p.dtype not in _HALF and id(p) not in prepared]
        if new:
            owners = sorted({name.rpartition(".")[0] or name for name, _ in new})
            modules = dict(module.named_modules())
            named = ", ".join(f"{type(modules[o]).__name__} {o!r}" if o in modules else repr(o) for o in owners)
            raise RuntimeError(
                f"{named} of the model prepared at O2 was set after prepare_model() and is still FP32 "
                f"({new[0][0]!r}: {new[0][1].dtype}), so its weights met the {models.properties.half_dtype} "
                "activations. Register an optimizer that holds its parameters before its first forward (a group "
                "added by opt.add_param_group to a registered optimizer is prepared at the next forward_context: "
                "forward under it): amp.prepare_optimizer(opt); "
                "accelerator.prepare(opt); Fabric: plugin.setup_optimizers(opt) after fabric.setup_optimizers; "
                "Trainer: trainer.strategy.setup_optimizers(trainer) in a callback before the training step, or "
                "trainer.precision_plugin.amp.prepare_optimizer(opt). It is then made half with FP32 masters; "
                "or add it before prepare_model() (Trainer: before fit; Fabric: before fabric.setup; Accelerate: "
                "before prepare)."
            ) from error


def replaced_data_note(models: Any) -> str | None:
    """The note naming the parameters the conversion made half whose data was replaced by an FP32 tensor since
    (``param.data = fp32_tensor``, Lightning's ``ModelPruning`` lottery-ticket reset), which torch's dtype error in
    the forward does not name; ``None`` when there are none. Read on an error's path only."""
    names = models.replaced_in_fp32()
    if not names:
        return None
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    props = models.properties
    return (
        f"lightning_mpx: at {props.opt_level} set-up made these parameters {props.half_dtype} and they are "
        f"torch.float32 now: {shown}. Their data was replaced with an FP32 tensor after set-up (param.data = "
        "fp32_tensor), as Lightning's ModelPruning does with its default use_lottery_ticket_hypothesis=True (its "
        "reset copies the FP32 weights it kept at setup); the forward then mixes them with half tensors. Pass "
        "ModelPruning(..., use_lottery_ticket_hypothesis=False), or write the values with param.data.copy_(tensor), "
        "which keeps the dtype (at O2 the masters take the values written)."
    )


class ForwardErrors:
    """The cast policy's hook for a forward's ``RuntimeError`` or ``AssertionError`` (on that error's path only):
    torch's FSDP failing to set a unit up on half parameters unfrozen before the first forward
    (:func:`~lightning_mpx.engine.sharding.refuse_unfrozen_half`), else :func:`forward_error` over the engine's
    ``PreparedModels``, held weakly: the policy lives as long as the model's hooks, the engine's masters must not."""

    __slots__ = ("_models",)

    def __init__(self, models: Any) -> None:
        self._models = weakref.ref(models)

    def __call__(self, error: RuntimeError | AssertionError) -> None:
        models = self._models()
        if models is not None:
            refuse_unfrozen_half(models.machine.sharding, error, forward=True)
            if isinstance(error, RuntimeError):
                forward_error(models, error)
