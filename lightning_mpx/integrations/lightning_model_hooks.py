"""The hooks the Trainer plugin puts on the LightningModule: the casts at the model's boundary (O2/O3) and the
cast policy's hand-off to compiled regions (O1, and O2's loss functions), removable as a whole."""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_mpx.casting.boundary import BoundaryCast
from lightning_mpx.engine.amp import Amp

__all__ = ["ModelHooks"]

#: The LightningModule's steps that ``trainer.fit(torch.compile(model))`` compiles.
_STEPS = ("training_step", "validation_step", "test_step", "predict_step")


class ModelHooks:
    """The removable hooks on one LightningModule at a time."""

    def __init__(self) -> None:
        self._handles: list[Any] = []

    def install(self, module: nn.Module, amp: Amp) -> None:
        """Put ``amp``'s hooks on ``module`` (after :meth:`remove` of the previous ones)."""
        if amp.properties.casts_model:
            # Under FSDP too: FSDP1 casts the root's inputs but not its outputs, and at O3 FSDP has no policy.
            # Where FSDP's root policy already cast, these casts find the dtype they want and do nothing.
            self._add_boundary_casts(module, amp)
        self._hand_off_compiled(module, amp)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _add_boundary_casts(self, module: nn.Module, amp: Amp) -> None:
        # Apex casts a half model's inputs to half and its outputs to FP32. Here the casts sit on the
        # LightningModule and on its direct children that hold half parameters (``self.generator(z)`` in a GAN), as
        # removable forward hooks of this model only. Children without parameters (a loss module) are left alone so
        # that losses see FP32. A child called from inside another hooked module's forward is inside the boundary
        # (BoundaryCast). The hooks hold no reference to the plugin: a deep copy of the model (an EMA model,
        # AveragedModel) carries copies that follow the copy's own dtype, not the plugin and its engine.
        half = amp.half_dtype
        targets = [module] + [
            child for child in module.children() if any(p.dtype == half for p in child.parameters(recurse=True))
        ]
        for target, boundary in zip(targets, BoundaryCast.for_model(targets, half)):
            self._handles.append(target.register_forward_pre_hook(boundary.pre, with_kwargs=True))
            # always_call: the depth is restored also when the forward raises.
            self._handles.append(target.register_forward_hook(boundary.post, always_call=True))

    def _hand_off_compiled(self, module: nn.Module, amp: Amp) -> None:
        # torch.compile'd submodules, and the steps that trainer.fit(torch.compile(model)) compiles, enter the cast
        # policy inside their compiled region (CastPolicy.hand_off_compiled): no call into its hook while they run.
        policy = amp.policy
        if policy is None:
            return
        ctx = getattr(module, "_compiler_ctx", None)
        methods = {}
        if isinstance(ctx, dict) and ctx.get("compiler") == "dynamo" and ctx.get("dynamo_ctx") is not None:
            for name in _STEPS:
                if ctx.get(f"original_{name}") is not None:
                    methods[name] = ctx[f"original_{name}"]
        compile_fn = ctx["dynamo_ctx"] if methods else None
        self._handles.extend(policy.hand_off_compiled(module, methods=methods, compile_fn=compile_fn))
