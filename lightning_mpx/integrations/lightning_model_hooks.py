"""The hooks the Trainer plugin puts on the LightningModule: the casts at the model's boundary (O2/O3) and the
cast policy's hand-off to compiled regions (O1, and O2's loss functions), removable as a whole; and, at O2, the
state-dict hook that gives the FP32 masters as the model's weights
(:class:`~lightning_mpx.integrations.fp32_export.MastersInStateDict`, which the Fabric plugin installs too), which
stays after the fit (a weights-only checkpoint saved then) until the plugin installs its hooks again."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_mpx.casting.boundary import BoundaryCast
from lightning_mpx.engine.amp import Amp
from lightning_mpx.engine.surgery import replaced_data_note
from lightning_mpx.integrations.fp32_export import MastersInStateDict

__all__ = ["MastersInStateDict", "ModelHooks", "note_replaced_data", "note_uncast_input"]

#: The LightningModule's steps that ``trainer.fit(torch.compile(model))`` compiles.
_STEPS = ("training_step", "validation_step", "test_step", "predict_step")


class ModelHooks:
    """The removable hooks on one LightningModule at a time."""

    def __init__(self) -> None:
        self._handles: list[Any] = []
        self._state_hook: Any = None  # kept by remove(): replaced by the next install
        # The model and engine whose loss regions' hooks remove() took off (the fit's end), put back by install().
        self._regions: tuple[weakref.ref[nn.Module], weakref.ref[Amp]] | None = None
        self._unhooked = False

    def install(self, module: nn.Module, amp: Amp, *, fsdp1: bool = False) -> None:
        """Put ``amp``'s hooks on ``module`` (after :meth:`remove` of the previous ones). ``fsdp1``: Lightning's
        ``FSDPStrategy`` wraps the model, whose FP32 parameters FSDP1 gathers in half for the forward (O2)."""
        if self._state_hook is not None:
            self._state_hook.remove()
            self._state_hook = None
        if amp.properties.master_weights:
            self._state_hook = MastersInStateDict.install(module, amp)  # in place of another engine's
        if amp.properties.casts_model:
            # Under FSDP too: at O2/O3 FSDP1 does not cast the root's inputs for the Trainer (fsdp1_config: they are the
            # whole batch there, targets too) nor any output, and at O3 FSDP has no policy.
            self._add_boundary_casts(module, amp, fsdp1)
        self._hand_off_compiled(module, amp)
        if self._unhooked and self._regions is not None and self._regions[0]() is module and self._regions[1]() is amp:
            amp._models.hook_regions(module)  # a new stage of the model the last one ended with
        self._regions, self._unhooked = (weakref.ref(module), weakref.ref(amp)), False

    def remove(self) -> None:
        """Take the hooks off (the boundary casts, and the engine's O2 loss regions' hooks: a fitted model carries none,
        so ``to_torchscript()`` compiles it); the state-dict hook stays."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        module, amp = (ref() for ref in self._regions) if self._regions is not None else (None, None)
        if module is not None and amp is not None and not self._unhooked:
            self._unhooked = amp._models.unhook_regions(module)

    def _add_boundary_casts(self, module: nn.Module, amp: Amp, fsdp1: bool) -> None:
        # Apex casts a half model's inputs to half and its outputs to FP32. Here the casts sit on the
        # LightningModule and on its direct children that hold half parameters (``self.generator(z)`` in a GAN), as
        # removable forward hooks of this model only. Children without parameters (a loss module) are left alone so
        # that losses see FP32. A child called from inside another hooked module's forward is inside the boundary
        # (BoundaryCast). The hooks hold no reference to the plugin: a deep copy of the model (an EMA model,
        # AveragedModel) carries copies that follow the copy's own dtype, not the plugin and its engine.
        half = amp.half_dtype

        def computes_in_half(child: nn.Module) -> bool:
            params = list(child.parameters(recurse=True))
            if any(p.dtype == half for p in params):
                return True
            # O2 under FSDP1: FP32 parameters that FSDP gathers in half for the forward (batch norm kept FP32 apart)
            return fsdp1 and not isinstance(child, _BatchNorm) and any(p.is_floating_point() for p in params)

        targets = [module] + [child for child in module.children() if computes_in_half(child)]
        boundaries = BoundaryCast.for_model(targets, half)
        boundaries[0] = _PastRedirection(boundaries[0])  # the LightningModule's: see _PastRedirection
        for target, boundary in zip(targets, boundaries):
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
                if (original := ctx.get(f"original_{name}")) is not None:
                    # A second fit of the same compiled model: Lightning's "original" is the step its first fit
                    # compiled (left on the module); its uncompiled method, as dynamo itself unwraps a compiled
                    # function it is asked to compile (else our wrapper hides it: a recompile at every new fit).
                    methods[name] = getattr(original, "_torchdynamo_orig_callable", original)
        compile_fn = ctx["dynamo_ctx"] if methods else None
        self._handles.extend(policy.hand_off_compiled(module, methods=methods, compile_fn=compile_fn))


class _PastRedirection:
    """The LightningModule's boundary casts, left out of Lightning's forward redirection.

    Under a wrapper (DDP, FSDP1) the Trainer calls ``training_step`` through the wrapper's ``forward``, which calls the
    LightningModule with its ``forward`` swapped for the step (``_ForwardRedirection``): the module's hooks then fire
    around the whole step. The step is not the model's forward: casting there would cast the batch (float targets
    too) to half and leave every call in the step (``self.generator(torch.randn(...))``, ``self(x)``) inside the
    boundary, uncast, so the step would fail or differ from the same step without the wrapper. Such a call passes
    through without a cast or a depth count, as on a single device where the step is called directly.
    """

    def __init__(self, boundary: BoundaryCast) -> None:
        self._boundary = boundary  # its per-thread state holds, per call in progress on this thread, whether the
        # call was a redirection (post cannot tell)

    def pre(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        # The redirection sets the step as the instance's forward until the call reaches it (Lightning's
        # strategy.py, _ForwardRedirection.__call__.<locals>.wrapped_forward). It runs eagerly, in the strategy's
        # wrapper: a call traced by torch.compile (``self(x)`` in a step of ``trainer.fit(torch.compile(model))``) is
        # the model's own, and Dynamo cannot read the compiled forward that Lightning set on the instance.
        forward = None if torch.compiler.is_compiling() else vars(module).get("forward")
        redirected = forward is not None and getattr(forward, "__qualname__", "").startswith("_ForwardRedirection.")
        self._boundary._depth.passed.append(redirected)
        return None if redirected else self._boundary.pre(module, args, kwargs)

    def post(self, module: nn.Module, args: Any, output: Any) -> Any:
        passed = self._boundary._depth.passed
        if passed and passed.pop():
            return None
        return self._boundary.post(module, args, output)


def note_uncast_input(error: BaseException | None, amp: Amp) -> None:
    """Add a note to ``error``, a run's exception, when it is torch's refusal of an FP32 input to a half module at
    O2/O3 ("mat1 and mat2 must have the same dtype, but got Float and BFloat16"): the boundary casts stop at the
    LightningModule's direct children, where Lightning's "bf16-true" casts the whole batch (targets too), so a deeper
    module called from a step (``self.backbone.layer1(x)``) gets the batch's FP32 input. Read once, as the run ends
    with the exception (the plugin's teardown): nothing per step."""
    if not _half_fp32_mismatch(error, amp):
        return
    half = amp.half_dtype
    # The words alone also fit a step's own op on a half tensor and an FP32 one (torch.lerp(output, target) with a
    # target made in self.dtype, the outputs being FP32): the note is for a module holding half weights of its own
    # that was called on an FP32 tensor, the innermost module call the exception went through.
    if not _half_module_got_fp32(error.__traceback__, half):
        return
    note = (
        f"lightning_mpx: at {amp.opt_level} the plugin casts floating-point inputs to {half} at the LightningModule's "
        "forward and at its direct children that hold half parameters (Apex's boundary, which leaves FP32 targets "
        "as they are); a module deeper in the model called from a step (self.backbone.layer1(x)) gets the input as "
        "the batch holds it, in FP32. Call it through self(...) or a direct child, or cast the input: x.to(self.dtype)."
    )
    if note not in getattr(error, "__notes__", ()):
        error.add_note(note)


def note_replaced_data(error: BaseException | None, amp: Amp) -> None:
    """Add a note to ``error``, a run's exception, when it is torch's refusal of a half tensor with an FP32 one at
    O2/O3 ("self and mat2 must have the same dtype, but got BFloat16 and Float") while a parameter the plugin made half
    is FP32 now: its data was replaced with an FP32 tensor after set-up (``param.data = copy``, Lightning's
    ``ModelPruning`` lottery-ticket reset). The engine's dtype check at each forward reads one parameter per model,
    which names this cause when it is that one. Read once, as the run ends with the exception: nothing per step."""
    if not _half_fp32_mismatch(error, amp):
        return
    note = replaced_data_note(amp._models)  # the forward scope's note too (engine.surgery): added once
    if note is None:
        return
    if note not in getattr(error, "__notes__", ()):
        error.add_note(note)


def _half_fp32_mismatch(error: BaseException | None, amp: Amp) -> bool:
    """Whether ``error`` is torch's refusal of two tensors, one in the run's half dtype and one in another floating
    dtype, that must match, at an opt level that casts the model (O2/O3)."""
    if not isinstance(error, RuntimeError) or not amp.properties.casts_model or not hasattr(error, "add_note"):
        return False
    message = str(error).lower()
    name = "bfloat16" if amp.half_dtype == torch.bfloat16 else "half"
    if "float" not in message.replace(name, "") or name not in message or "type" not in message:
        return False
    return "same" in message or "expected" in message  # torch's words for two dtypes that must match


#: The frame of a module call (``module(x)``) in a traceback: its locals are the module and its inputs after the
#: forward pre-hooks.
_MODULE_CALL = nn.Module._call_impl.__code__


def _half_module_got_fp32(traceback: Any, half: torch.dtype) -> bool:
    """Whether the innermost module call in ``traceback`` is of a module with parameters of its own in ``half`` and
    a floating-point input in another dtype."""
    call = None
    while traceback is not None:
        if traceback.tb_frame.f_code is _MODULE_CALL:
            call = traceback.tb_frame.f_locals
        traceback = traceback.tb_next
    module = call.get("self") if call is not None else None
    if not isinstance(module, nn.Module) or not any(p.dtype == half for p in module.parameters(recurse=False)):
        return False
    inputs = _tensors((call.get("args"), call.get("kwargs")))
    return any(t.is_floating_point() and t.dtype != half for t in inputs)


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` and its tuples, lists and dicts."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []
