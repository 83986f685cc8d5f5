"""The framework-agnostic mixed-precision engine: opt level + cast policy + loss scalers + master weights.

:class:`Amp` is what the Lightning plugin and the Accelerate adapter drive; it also works in a plain loop::

    amp = Amp("O2")
    model = amp.prepare_model(model)
    optimizer = amp.prepare_optimizer(torch.optim.AdamW(model.parameters()))
    for x, y in data:
        with amp.forward_context():
            loss = loss_fn(amp.cast_outputs(model(amp.cast_inputs(x))), y)
        amp.backward(loss)
        amp.clip_grad_norm_(optimizer, 1.0)   # optional: clips the unscaled gradients
        amp.step(optimizer)                   # skipped (returns False) when gradients overflowed
        amp.update()                          # once per iteration: adjusts the scale(s)
        optimizer.zero_grad()
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Any, Callable, ContextManager, Iterable, Sequence

import torch
from torch import nn

from lightning_mpx.common.containers import _cast_collection
from lightning_mpx.engine.outcome import PendingStep, PendingSteps, StepOutcome, device_skip_refusal
from lightning_mpx.common.dtypes import HALF_DTYPES
from lightning_mpx.masters.level_resume import ExactWeights
from lightning_mpx.casting.loss_regions import LossRegions
from lightning_mpx.masters.swap import param_pairs
from lightning_mpx.masters.store import Masters
from lightning_mpx.engine.overflow import Overflows, floor_hint
from lightning_mpx.engine.sharding import Sharding, is_sharded
from lightning_mpx.engine.stages import _OptimizerState, _Stage, loss_index
from lightning_mpx.engine.step_machine import StepMachine
from lightning_mpx.casting.lists import AUTOCAST_ACTIONS
from lightning_mpx.casting.policy import CastPolicy, casts_off_if_on
from lightning_mpx.casting.table import CastTable
from lightning_mpx.health.forensics import OverflowForensics, OverflowRecord
from lightning_mpx.scaling.scaler import LossScaler
from lightning_mpx.masters.weights import MasterWeights, _multi_process, convert_module
from lightning_mpx.opt_levels import Properties
from lightning_mpx.health.promotion import Promotion, matches
# MODEL_WRITES is defined with the other settings; its old import path here keeps working.
from lightning_mpx.settings import DEFAULTS, MODEL_WRITES, MixedPrecisionSettings, OnFloor  # noqa: F401
from lightning_mpx.settings import SettingsKeywords, keyword_signature
from typing_extensions import Unpack
from lightning_mpx.health.telemetry import GradTelemetry


_D, _S = DEFAULTS, DEFAULTS.scaler  # the defaults of the typed keywords, from the one place that defines them


class Amp:
    """Mixed precision for one training run: a facade over parts that each own their state (the step machine
    :class:`~lightning_mpx.engine.step_machine.StepMachine`, the masters :class:`~lightning_mpx.masters.store.Masters`, the
    overflows :class:`~lightning_mpx.engine.overflow.Overflows`, the scalers, the cast policy, the promotion, the forensics).

    Args:
        opt_level, **settings: The opt level (``"O0"`` to ``"O3"``) and the settings, each documented and checked in
            :class:`~lightning_mpx.settings.MixedPrecisionSettings` and :class:`~lightning_mpx.settings.ScalerSettings`
            (:meth:`from_settings` takes them whole); their keywords and types are
            :class:`~lightning_mpx.settings.SettingsKeywords` (``help(Amp)`` lists each with its default), and an
            unknown keyword raises ``TypeError`` naming it.

    Attributes:
        settings: The validated :class:`~lightning_mpx.settings.MixedPrecisionSettings` the engine was built from.
        found_inf_reducer: Optional callable that reduces an optimizer's overflow flag in place across processes
            (the adapters set it under a distributed strategy) so that every rank makes the same skip decision.
        telemetry: The :class:`~lightning_mpx.health.telemetry.GradTelemetry` behind :meth:`request_telemetry`.
        sharded: Whether the prepared model is sharded by PyTorch FSDP (see :meth:`prepare_model`).
    """

    @keyword_signature()
    def __init__(self, opt_level: str = "O1", **settings: Unpack[SettingsKeywords]) -> None:
        self._configure(MixedPrecisionSettings.from_kwargs(opt_level, **settings))

    @classmethod
    def from_settings(cls, settings: MixedPrecisionSettings) -> Amp:
        """The engine of ``settings``: the same as ``Amp(settings.opt_level, **settings.to_kwargs())``."""
        if not isinstance(settings, MixedPrecisionSettings):
            raise TypeError(f"settings={type(settings).__name__} must be a lightning_mpx.MixedPrecisionSettings.")
        amp = cls.__new__(cls)
        amp._configure(settings)
        return amp

    def _configure(self, settings: MixedPrecisionSettings) -> None:
        self.settings = settings
        self.model_writes = settings.model_writes
        self.properties: Properties = settings.properties
        self.policy: CastPolicy | None = _policy(settings)
        # O1 with no table given: the table of the device of the first model prepared (CastTable.for_device), picked
        # at the first forward (frameworks move the model to its device after converting it), as long as nobody
        # changed the policy's own default table or engine before then.
        self._device_table: tuple[CastTable, int] | None = (
            (self.policy.table, self.policy.table._version) if self.policy is not None
            and settings.cast_table is None and self.properties.patch_torch_functions else None
        )
        self._device_model: weakref.ref[nn.Module] | None = None
        self._device_pending = self.policy is not None and self.properties.patch_torch_functions
        # O2: the loss policy's mode is taken off inside the submodules whose code computes no loss (_loss_regions).
        self._loss_regions = (
            LossRegions(self.policy)
            if self.policy is not None and not self.properties.patch_torch_functions else None
        )
        self._regions_hooks: weakref.WeakKeyDictionary[nn.Module, list[Any]] = weakref.WeakKeyDictionary()
        # O2: each prepared model's load_state_dict pre-hooks (FP32 values loaded go to the masters exactly).
        self._load_hooks: weakref.WeakKeyDictionary[nn.Module, list[Any]] = weakref.WeakKeyDictionary()
        # O2/O3: each prepared model's hooks on the submodules tied to an fp32_modules module (_run_tied_in_fp32).
        self._tied_hooks: weakref.WeakKeyDictionary[nn.Module, list[Any]] = weakref.WeakKeyDictionary()
        self.scalers: list[LossScaler] = [
            LossScaler.from_settings(self.properties.loss_scale, settings.scaler, half_dtype=self.properties.half_dtype)
            for _ in range(settings.num_losses)
        ]
        self.found_inf_reducer: Callable[[torch.Tensor], None] | None = None
        self.forensics = OverflowForensics(settings.diagnose_overflows)
        self._steps = 0  # Amp.step() calls so far, all optimizers (OverflowRecord.step)
        self.promotion = Promotion(self, settings.fp32_modules)  # the modules that run in FP32
        self._exact_weights = ExactWeights()  # O2 masters resumed at O0/O1: kept through a later model load
        self._names: dict[int, str] = {}
        self._overflows = Overflows(self.scalers, self.forensics, self.promotion, settings.overflow_log_interval)
        self.telemetry = GradTelemetry(self.properties.half_dtype)  # underflow/headroom, on request only
        self._masters = Masters(settings.unscale_backend)
        self._machine = StepMachine(
            self.scalers, self._masters, backend=settings.unscale_backend, telemetry=self.telemetry, names=self._names
        )
        self.sharded = False
        # skip_on_device: the steps not settled yet (read on one process at a use of their outcome, settled where
        # every rank is: the next backward or step)
        self._pending = PendingSteps(self._examine, self._settle)
        self._iteration = 0  # update() calls so far: a pending step of an earlier iteration is read at a backward

    @property
    def register_call(self) -> str:
        """What the error for an optimizer this engine does not know tells the user to do (default: ``"call
        prepare_optimizer() on it first"``). A front door whose users never call :meth:`prepare_optimizer` names its
        own call here (the Fabric plugin: ``plugin.setup_optimizers(optimizer)``)."""
        return self._machine.register_call

    @register_call.setter
    def register_call(self, value: str) -> None:
        if not isinstance(value, str) or not value:
            raise TypeError(f"register_call={value!r} must be a non-empty str (the words that end the error).")
        self._machine.register_call = value

    @property
    def _with_masters(self) -> bool:
        """Whether optimizers step FP32 masters of this engine (O2 on an unsharded model; under FSDP, FSDP's own
        sharded FP32 parameters are the masters)."""
        return self.properties.master_weights and not self.sharded

    # -- the parts' state, under the names the adapters and tests use ------------------------------------------
    @property
    def master_weights(self) -> list[MasterWeights]:
        """One :class:`~lightning_mpx.masters.weights.MasterWeights` per model prepared for training (O2)."""
        return self._masters.weights

    @property
    def unscale_backend(self) -> str:
        return self._machine.backend

    @unscale_backend.setter
    def unscale_backend(self, value: str) -> None:  # as the attribute it was: for later unscales and masters
        self._machine.backend = self._masters.backend = value

    @property
    def skipped_steps(self) -> list[int]:
        """Steps skipped on overflow so far, by loss."""
        return self._overflows.skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: list[int]) -> None:
        self._overflows.skipped_steps = value

    @property
    def last_overflow(self) -> OverflowRecord | None:
        """The :class:`~lightning_mpx.health.forensics.OverflowRecord` of the latest overflow step (``None`` before the
        first), merged across ranks when ``found_inf_reducer`` is set."""
        return self._overflows.last

    @property
    def last_overflow_parameters(self) -> list[str]:
        """The names of the parameters with non-finite gradients at that step (this process's)."""
        return self._overflows.last_parameters

    @property
    def _optimizers(self) -> dict[int, _OptimizerState]:
        return self._machine.optimizers

    def _state(self, optimizer: torch.optim.Optimizer) -> _OptimizerState:
        return self._machine.state(optimizer)

    # -- set-up -------------------------------------------------------------------------------------------------
    @property
    def opt_level(self) -> str:
        return self.properties.opt_level

    @property
    def half_dtype(self) -> torch.dtype:
        return self.properties.half_dtype

    @property
    def num_losses(self) -> int:
        return len(self.scalers)

    @property
    def diagnose_overflows(self) -> bool:
        """Whether every forward is watched for non-finite outputs; setting it registers or removes the hooks."""
        return self.forensics.diagnose

    @diagnose_overflows.setter
    def diagnose_overflows(self, value: bool) -> None:
        self.forensics.diagnose = value

    @property
    def log_overflows(self) -> bool:
        """Whether overflow messages are logged (adapters turn it off on ranks other than zero)."""
        return self._overflows.log.enabled

    @log_overflows.setter
    def log_overflows(self, value: bool) -> None:
        self._overflows.log.enabled = value

    @property
    def overflow_log_interval(self) -> float:
        """Minimum seconds between two overflow log messages."""
        return self._overflows.log.interval

    @overflow_log_interval.setter
    def overflow_log_interval(self, value: float) -> None:
        self._overflows.log.interval = value

    @property
    def fp32_modules(self) -> list[str]:
        """Names of the modules that run in FP32: pinned by ``fp32_modules``, then promoted at the floor."""
        return self.promotion.fp32_modules

    @property
    def promoted_modules(self) -> dict[str, dict[str, Any]]:
        """The modules ``on_floor="promote"`` promoted to FP32, each with its evidence (``step``, ``origin``,
        ``region``, ``scale``, ``culprits``, ``parameters``)."""
        return dict(self.promotion.promoted)

    def prepare_model(self, module: nn.Module, *, train: bool = True) -> nn.Module:
        """Convert ``module`` for the opt level (in place) and return it: half at O2/O3 (batch norm FP32 when
        ``keep_batchnorm_fp32``), half parameters FP32 at O0, as it is at O1. At O2 the FP32 masters of the
        parameters an optimizer holds are made by :meth:`prepare_optimizer` (a half submodule no optimizer trains
        gets none). ``train=False``: a model only evaluated, with no masters (an optimizer over its half parameters
        is refused); preparing it again with ``train=True`` adds them (once).

        A model that PyTorch FSDP has already sharded (``fully_shard``, or the FSDP1 wrapper: prepare the wrapped
        model) is not converted and gets no masters: FSDP's mixed-precision policy computes in half and, at O2, its
        sharded FP32 parameters are the masters. Its policies are checked against the opt level
        (:func:`lightning_mpx.integrations.fsdp.check_sharded_model`), and the scaler then works on each rank's shards with one
        all-reduce per step (the overflow flags and the global gradient norm)."""
        if not isinstance(module, nn.Module):
            raise TypeError(f"module={type(module).__name__} is not a torch.nn.Module.")
        if not isinstance(train, bool):
            raise TypeError(f"train={train!r} must be True or False.")
        if self._device_pending and self._device_model is None:
            self._device_model = weakref.ref(module)  # its device is read at the first forward
        if self._loss_regions is not None and module not in self._regions_hooks:
            self._regions_hooks[module] = self._loss_regions.install(module)
        if is_sharded(module):
            self._prepare_sharded(module)
            return module
        if self.sharded:
            raise ValueError(
                f"module={type(module).__name__} is not sharded, but this Amp prepared an FSDP-sharded model: one "
                "engine trains either sharded models or unsharded ones; use one Amp per kind."
            )
        live = self._masters.prune()
        prefix = f"model{len(live)}." if live else ""
        for name, param in module.named_parameters():
            self._names.setdefault(id(param), prefix + name)
        self.forensics.watch.add_model(module, prefix)
        props = self.properties
        # FP32 values held through the cast: the trainable parameters' for their masters (O2, one process) and the
        # fp32_modules' own; not those of the other frozen ones (a LoRA base), which would raise the cast's peak memory.
        masters_from_fp32 = props.master_weights and train and not _multi_process()
        before_cast = {}
        tied: list[nn.Module] = []
        if props.casts_model:
            pinned, tied = _pinned_params(module, prefix, self.promotion.patterns)
            for param in module.parameters():
                if param.dtype == torch.float32 and (id(param) in pinned or masters_from_fp32 and param.requires_grad):
                    before_cast[id(param)] = param.data
        _convert(module, props)
        self.promotion.add_model(module, prefix)  # fp32_modules: back to FP32 before any master is made
        if tied:
            self._run_tied_in_fp32(module, tied)
        initial = _keep_fp32_values(module, before_cast)
        if props.master_weights and not train:
            self._masters.evaluation_only = True
        if props.master_weights and train:
            # The FP32 values are kept until each one's master is made, whenever (and by whichever optimizer) that is.
            self._masters.add_model(module, self._names, prefix, initial if masters_from_fp32 else None)
            if module not in self._load_hooks:
                hook = _LoadIntoMasters(self)
                self._load_hooks[module] = [
                    sub.register_load_state_dict_pre_hook(hook)
                    for sub in module.modules()
                    if any(True for _ in sub.parameters(recurse=False))
                ]
        return module

    def _run_tied_in_fp32(self, module: nn.Module, tied: list[nn.Module]) -> None:
        """O2/O3: the submodules of ``module`` that share a parameter with an ``fp32_modules`` module (a tied input
        embedding of ``lm_head``) run in FP32 as well, with that one FP32 parameter: their floating inputs are cast to
        FP32 and their FP32 outputs to the half dtype, so the half layers after them get half inputs."""
        from lightning_mpx.health.promotion import _Fp32Boundary, _module_to_fp32

        for sub in tied:
            _module_to_fp32(sub)
        if module in self._tied_hooks:  # prepared again (evaluated, then trained): hooked once
            return
        boundary = _Fp32Boundary(policy=False, out_dtype=self.properties.half_dtype)
        # The same order as the pinned modules' hooks: inputs after any other pre-hook, outputs before any other hook.
        self._tied_hooks[module] = [
            handle
            for sub in tied
            for handle in (
                sub.register_forward_pre_hook(boundary.pre, with_kwargs=True),
                sub.register_forward_hook(boundary.post, prepend=True, always_call=True),
            )
        ]

    def _adopt_device(self) -> None:
        """At the first forward: point the O1 policy at the device of the first model prepared, its
        ``torch.autocast`` device and, when no table was given, that device's table (:meth:`CastTable.for_device`:
        on CUDA, autocast's dispatch alone). A table the user changed, or an engine set by hand, is left as it is."""
        policy, module = self.policy, self._device_model() if self._device_model is not None else None
        self._device_pending, self._device_model = False, None
        device = _device_type(module) if module is not None else None
        if policy is None or device not in AUTOCAST_ACTIONS:  # no tensors, or a device autocast is not run on
            return
        if policy.device_type is None:
            policy.device_type = device
        untouched, self._device_table = self._device_table, None
        if (untouched is not None and (policy.table, policy.table._version) == untouched and policy.engine == "auto"
                and policy.device_type == device):
            policy.table = CastTable.for_device(device, policy.half_dtype, module)

    def _hook_regions_again(self) -> None:
        """O2's table changed since the models were hooked (a row registered, a table replaced): find the regions
        of every prepared model again with the table's names as they are now."""
        assert self._loss_regions is not None
        for module, handles in list(self._regions_hooks.items()):
            for handle in handles:
                handle.remove()
            self._regions_hooks[module] = self._loss_regions.install(module)

    def _prepare_sharded(self, module: nn.Module) -> None:
        from lightning_mpx.integrations.fsdp import check_sharded_model

        if self._masters.prune():
            raise ValueError(
                f"module={type(module).__name__} is sharded by FSDP, but this Amp already made FP32 masters for an "
                "unsharded model: one engine trains either sharded models or unsharded ones; use one Amp per kind."
            )
        check_sharded_model(module, self.settings)
        for name, param in module.named_parameters():
            self._names.setdefault(id(param), name)
        self.forensics.watch.add_model(module, "")
        self.sharded = True  # before the promotion: it leaves an FSDP model's dtypes to FSDP's policies
        self.promotion.add_model(module, "")
        if self._machine.sharding is None:
            self._machine.sharding = Sharding(module)
        else:
            self._machine.sharding.add_model(module)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Register ``optimizer`` (prepare its model first); for O2 its parameters become the FP32 masters (those
        that require a gradient, and those frozen since :meth:`prepare_model`, from their kept FP32 values; one
        frozen before it, a LoRA model's base, gets its master at its first gradient if it is unfrozen). A closure
        optimizer (LBFGS), which loss scaling cannot support, is refused with a ValueError."""
        self._machine.validate(optimizer, with_masters=self._with_masters)
        if self.settings.skip_on_device:
            self._refuse_device_skip(optimizer)
        self.promotion.check_patterns_matched()
        self._machine.register(optimizer, with_masters=self._with_masters)
        return optimizer

    def _refuse_device_skip(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise a ValueError when ``optimizer`` cannot skip its step on the device (``skip_on_device``)."""
        refusal = "the model is FSDP-sharded" if self.sharded else device_skip_refusal(optimizer)
        if refusal is not None:
            raise ValueError(
                f"skip_on_device=True needs a step that can be skipped on the device, but {refusal}: use "
                "torch.optim.Adam or AdamW with fused=True on an unsharded model, or skip_on_device=False."
            )

    def release_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Forget ``optimizer`` and remove the hooks put on it (its masters stay with their model); its steps
        pending on the device (``skip_on_device``) are read first."""
        self.read_step_outcomes()
        self._machine.release(optimizer)

    def master_params(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The tensors ``optimizer`` updates: the FP32 masters of its half parameters at O2, its parameters
        otherwise. Their ``.grad`` holds the unscaled gradients between an unscale and the step."""
        return self._machine.master_params(optimizer, with_masters=self._with_masters)

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """The FP32 master of a model parameter at O2 (the parameter itself when it has none: an FP32 parameter, or
        a half one that no prepared optimizer holds)."""
        return self._masters.master_of(param, self._optimizers.values())

    def refresh_masters(self, params: Iterable[torch.Tensor] | None = None, *, force: bool = False) -> list[str]:
        """Take writes made to the half model into the FP32 masters now (done before every step anyway); returns
        the names of the parameters whose masters took one. ``params``: the parameters to check (default: all);
        ``force``: compare values whatever the version counters say (writes through a kept ``p.data`` tensor, or
        through ``.data`` of a user's ``nn.Parameter`` subclass)."""
        return self._masters.refresh(params, force=force)

    def fp32_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """``module.state_dict()`` in FP32, to export what training produced (the model is not changed): each half
        parameter that has an FP32 master as that master (the exact weights the optimizer trains at O2, writes made
        to the model since the last step taken first), or the FP32 value kept for the master it will get (before its
        optimizer's first step; a parameter frozen since it was prepared), every other half tensor upcast (a
        parameter frozen before it was prepared: its half value, exactly), FP32 and integer tensors as they are. The keys are ``module.state_dict()``'s, so
        ``model.save_pretrained(path, state_dict=amp.fp32_state_dict(model))`` (Hugging Face, peft) or
        ``torch.save`` take it as they take the model's own; ``model.state_dict()`` itself holds the half values.

        Raises:
            TypeError: ``module`` is not an ``nn.Module``.
            ValueError: for an FSDP-sharded model: its parameters are FP32 already; use the strategy's own state
                dict (Lightning's, Accelerate's ``get_state_dict``), which gathers the shards.
        """
        if not isinstance(module, nn.Module):
            raise TypeError(f"module={type(module).__name__} is not a torch.nn.Module.")
        if self.sharded:
            raise ValueError(
                f"module={type(module).__name__}: this Amp trains an FSDP-sharded model, whose parameters are FP32 "
                "already; export it with the strategy's own state dict (it gathers the shards), not fp32_state_dict()."
            )
        self._masters.prune()
        self._masters.refresh(None, force=False)  # writes to the model since the last step, as a step takes them
        # A master not made yet (its optimizer has not stepped) is the FP32 value kept for it, as it will be made.
        masters = {key: value for weights in self._masters.weights for key, value in weights.fp32_values().items()}
        out: dict[str, torch.Tensor] = {}
        for key, value in module.state_dict(keep_vars=True).items():
            tensor = masters.get(id(value), value).detach()
            out[key] = tensor.float() if tensor.is_floating_point() and tensor.dtype != torch.float32 else tensor
        return out

    # -- forward ------------------------------------------------------------------------------------------------
    def forward_context(self) -> ContextManager[Any]:
        """The scope of a forward pass: the cast policy at O1; at O2, a policy that runs loss functions called inside
        the model in FP32; nothing otherwise."""
        if self._device_pending and self._device_model is not None and not torch.compiler.is_compiling():
            self._adopt_device()  # (inside a compiled region it would be traced: the first eager forward does it)
        regions = self._loss_regions
        if regions is not None and regions.stale() and not torch.compiler.is_compiling():
            self._hook_regions_again()
        return self.policy.scope() if self.policy is not None else contextlib.nullcontext()

    def cast_inputs(self, data: Any) -> Any:
        """Floating-point tensors in ``data`` (nested in lists, tuples, dicts) cast to half when the model is (not
        under FSDP, whose root policy casts)."""
        if not self.properties.casts_model or self.sharded:
            return data
        return _cast_collection(data, self.properties.half_dtype, (torch.float32, torch.float64))

    def cast_outputs(self, data: Any) -> Any:
        """Half tensors in ``data`` cast to FP32 when the model is half, so the loss is computed in FP32 (Apex); not
        under FSDP, whose root policy casts."""
        if not self.properties.casts_model or self.sharded:
            return data
        return _cast_collection(data, torch.float32, (self.properties.half_dtype,))

    # -- backward -----------------------------------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor, loss_id: int = 0) -> torch.Tensor:
        """``loss`` times the scale of ``loss_id`` (an ``int``, numpy integers included). Every optimizer's pending
        gradients are brought to this scale first (another loss's, from before an :meth:`update` that changed their
        scale, or left unscaled by :meth:`unscale_` or a clip without a :meth:`step`), so one buffer never mixes two
        scales; gradients left after a :meth:`step` are not: zero them before the next backward (as with
        ``torch.amp.GradScaler``). Bringing them over checks them: a non-finite value found then is charged to the
        loss it came from, and the optimizer's next :meth:`step` is skipped even if the gradients are zeroed before it
        (as after :meth:`unscale_`: a check made decides the step)."""
        loss_id = self._loss_index(loss_id)
        if self._pending:  # the steps skipped on the device in earlier iterations, settled before new gradients come
            self._pending.settle(before=self._iteration)  # every rank is here: their records are merged now
        scaled = self.scalers[loss_id].scale(loss)
        if self.forensics.watch.active:  # a device flag, no sync
            self.forensics.watch.observe_loss(loss)
        self._machine.before_backward(loss_id)
        return scaled

    def backward(self, loss: torch.Tensor, loss_id: int = 0, **backward_kwargs: Any) -> None:
        """``scale_loss(loss, loss_id).backward(**backward_kwargs)`` inside :meth:`backward_context`."""
        scaled = self.scale_loss(loss, loss_id)
        if self.policy is None:
            scaled.backward(**backward_kwargs)
            return
        with casts_off_if_on():  # called inside forward_context(): the backward is not the forward's to cast
            self.policy.backward(scaled, **backward_kwargs)  # backward_context(), without a call into the hook

    def backward_context(self) -> ContextManager[Any]:
        """The scope of a backward pass: activation checkpointing recomputes with the forward's casts inside it (the
        cast policy's :meth:`~lightning_mpx.casting.policy.CastPolicy.recompute_scope`); nothing without a policy."""
        return self.policy.recompute_scope() if self.policy is not None else contextlib.nullcontext()

    # -- optimizer step -----------------------------------------------------------------------------------------
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale ``optimizer``'s gradients (into the FP32 masters at O2, with a half copy on the model) and record
        overflow; once per step.

        Raises:
            RuntimeError: if called twice for the same optimizer without a :meth:`step` or :meth:`update` between.
        """
        self._machine.unscale_(optimizer)

    def found_inf(self, optimizer: torch.optim.Optimizer, loss_id: int | None = None) -> torch.Tensor | None:
        """The overflow flag (a device tensor, nonzero on overflow) that the checks of ``optimizer``'s gradients since
        its last step found: all losses together, or those charged to ``loss_id``; ``None`` when nothing was checked.
        Reading it on the host waits for the device."""
        state = self._state(optimizer)
        if loss_id is None:
            return state.found_inf
        return state.found_by_loss.get(self._loss_index(loss_id))

    def is_unscaled(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s gradients have been unscaled since its last :meth:`step` or :meth:`update`."""
        return self._state(optimizer).stage is _Stage.UNSCALED

    def clip_grad_norm_(self, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Clip ``optimizer``'s unscaled gradients (unscaling them first) to a global L2 norm; returns the norm
        before clipping. As ``torch.nn.utils.clip_grad_norm_`` (bit for bit), except that a non-finite norm (an
        overflow: the step is skipped) leaves the gradients as they are, so :attr:`last_overflow` tells inf from NaN."""
        return self._machine.clip_grad_norm_(optimizer, max_norm, with_masters=self._with_masters)

    def clip_grad_value_(self, optimizer: torch.optim.Optimizer, clip_value: float) -> None:
        """Clamp ``optimizer``'s unscaled gradients to ``[-clip_value, clip_value]``."""
        self._machine.clip_grad_value_(optimizer, clip_value, with_masters=self._with_masters)

    def show_unscaled_on_model(self, optimizer: torch.optim.Optimizer) -> None:
        """At O2, copy the unscaled FP32 master gradients into the half model's gradients (rounded), for code that
        reads the model's gradients between the unscale and the step (Lightning's ``on_before_optimizer_step``,
        ``grad_norm(self)``); the masters' FP32 gradients stay what the step uses."""
        self._machine.show_unscaled_on_model(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, **step_kwargs: Any) -> bool | StepOutcome:
        """Step ``optimizer`` unless its gradients overflowed (then nothing changes, and the overflow counts
        against the losses whose gradients held it); returns whether it stepped. Reads the overflow flags on the
        host: one sync per step, as ``torch.amp.GradScaler`` with an optimizer that is not fused.

        With ``skip_on_device=True`` the flag goes to the fused optimizer's own step, which skips on the device,
        and the host does not wait: the return value is then a :class:`~lightning_mpx.StepOutcome`, which behaves
        as the same ``bool``. The overflow is counted, logged and acted on (``on_floor``) when it is read: then, or
        at the latest at the first :meth:`scale_loss` (backward) or :meth:`step` after the next :meth:`update`, at
        :meth:`read_step_outcomes`, :meth:`state_dict` or :meth:`release_optimizer`. Its record names the parameters
        whose gradients are still there when it is read (not after ``zero_grad()``). A read is never a collective:
        under a process group (``found_inf_reducer``) it counts the overflow, and the record is merged across ranks,
        logged and ``on_floor`` applied at that next backward or step (or :meth:`settle_step_outcomes`), where every
        rank is. While the forensics' forward watch runs (``diagnose_overflows``, or after an overflow at the floor
        until a step that does not overflow) it is read and settled at the step, as its record is of the forward
        before it.

        Raises:
            LossScaleFloorError: on overflow at the floor with ``on_floor="raise"`` (the step is skipped first;
                with ``skip_on_device``, raised where the overflow is read, or under a process group where it is
                settled).
        """
        self._state(optimizer)
        if "closure" in step_kwargs and step_kwargs["closure"] is not None:
            raise ValueError(
                "closure: loss scaling cannot re-run a closure inside the optimizer step; run the closure first, "
                "then call step() without it."
            )
        if self._pending:
            self._pending.settle(before=self._iteration)  # every rank is here: their records are merged now
        self._steps += 1
        if self.settings.skip_on_device:
            return self._step_on_device(optimizer, step_kwargs)
        state, overflowed = self._machine.check(optimizer, self.found_inf_reducer)
        try:
            if overflowed:
                gather = self.found_inf_reducer is not None or self.sharded
                self._overflows.record(
                    optimizer, overflowed, names=self._names, master_of=self.master_of, step=self._steps - 1,
                    gather=gather,
                )
                self._machine.finish(state)
                hint = floor_hint(optimizer, self.master_of, self.properties.opt_level)
                self._overflows.at_floor(optimizer, overflowed, hint)
                return False
            if self.forensics.watch.active:
                self.forensics.stepped()  # an automatic watch ends with the first step that does not overflow
            with casts_off_if_on():  # called inside forward_context(): the optimizer runs in its own dtypes
                self._machine.step(state, step_kwargs, compare=self.model_writes == "values")
        except BaseException:
            self._machine.keep_marks(state)  # the step did not finish (an optimizer's error, an interrupt)
            raise
        return True

    def _step_on_device(self, optimizer: torch.optim.Optimizer, step_kwargs: dict[str, Any]) -> StepOutcome:
        """The step of ``skip_on_device``: the flags to the optimizer's step, their host copy queued behind it."""
        groups, registered = len(optimizer.param_groups), self._machine.state(optimizer)
        if registered.fused_groups != groups:  # prepared, or a group added since (add_param_group)
            self._refuse_device_skip(optimizer)  # before anything moves: a group that cannot skip would step anyway
            registered.fused_groups = groups
        state, loss_ids, flags = self._machine.check_on_device(optimizer, self.found_inf_reducer)
        found = flags if flags.dim() == 0 else flags.amax() if len(loss_ids) > 1 else flags.reshape(())
        outcome = StepOutcome(self.read_step_outcomes)
        pending = PendingStep.behind(
            optimizer, loss_ids, flags, [self.scalers[i].scale_tensor for i in loss_ids], step=self._steps - 1,
            iteration=self._iteration, gather=self.found_inf_reducer is not None, outcome=outcome,
        )
        try:
            with casts_off_if_on():  # called inside forward_context(): the optimizer runs in its own dtypes
                self._machine.step(state, step_kwargs, compare=self.model_writes == "values", found_inf=found)
        except BaseException:
            self._machine.keep_marks(state)  # the step did not finish (an optimizer's error, an interrupt)
            raise
        self._pending.add(pending)
        if self.forensics.watch.active:
            # The forward watch's record is of this step's forward, which the next forward replaces: settle it now
            # (every rank is in this step).
            self._pending.settle()
        return outcome

    def read_step_outcomes(self) -> None:
        """Read the steps skipped on the device (``skip_on_device``) that were not read yet, oldest first, on this
        process only (never a collective: rank 0 alone may call it, to log): their outcomes become known and each
        overflow is counted (``skipped_steps``, the module counts of this process's record). Waits for the device
        only up to the last of those steps. Nothing to do otherwise.

        In one process each overflow is also recorded, logged and ``on_floor`` applied here (which may raise
        :class:`LossScaleFloorError`). Under a process group (``found_inf_reducer`` set) that part merges the ranks'
        records, a collective: it is done at the next :meth:`scale_loss` (backward) or :meth:`step` after an
        :meth:`update`, where every rank is, or at :meth:`settle_step_outcomes`."""
        self._pending.read()

    def settle_step_outcomes(self) -> None:
        """Read and settle every step skipped on the device (``skip_on_device``) that is still pending: count,
        record (merged across ranks under a process group) and log each overflow, and apply ``on_floor`` (which may
        raise :class:`LossScaleFloorError`). Under a process group it is a collective: call it on every rank
        together (the plugins do at teardown; the next backward or step does it anyway). Nothing to do otherwise."""
        self._pending.settle()

    def _examine(self, pending: PendingStep) -> None:
        """What :meth:`step` does on the host after its read on this process alone, for a step skipped on the
        device and read now: an overflow is counted and this process's record built (its gradients may still be
        there; none when the optimizer was dropped since)."""
        if pending.overflowed:
            pending.examined = self._overflows.examine(
                pending.optimizer(), pending.overflowed, names=self._names, master_of=self.master_of,
                step=pending.step, scales=pending.scales,
            )

    def _settle(self, pending: PendingStep) -> None:
        """The rest of what :meth:`step` does on the host, for a step skipped on the device, read and examined:
        the record merged across ranks (``pending.gather``: every rank is here, and each takes part, whenever it
        read the step), logged, ``on_floor``."""
        overflowed, scales = pending.overflowed, pending.scales
        assert overflowed is not None and scales is not None  # read before it is settled
        if not overflowed:
            if self.forensics.watch.active:
                self.forensics.stepped()
            return
        assert pending.examined is not None  # examined at its read
        self._overflows.settle(pending.examined, overflowed, gather=pending.gather, scales=scales)
        optimizer = pending.optimizer()
        if optimizer is None:  # dropped since: recorded, no floor to apply to it
            return
        hint = floor_hint(optimizer, self.master_of, self.properties.opt_level)
        self._overflows.at_floor(optimizer, overflowed, hint, scales)

    def update(self) -> None:
        """Close the iteration (once, after the real step; no host sync): update the scale of every loss whose
        optimizers stepped, skipped or were unscaled since the last call, reset every optimizer's stage (as
        ``torch.amp.GradScaler.update()``; one unscaled without a step keeps its gradients as true values), and
        clear the cast cache."""
        self._machine.update()
        self._iteration += 1
        if self.policy is not None:
            self.policy.clear_cache()
        self.telemetry.requested = False  # a request covers one iteration

    # -- metrics and checkpoints --------------------------------------------------------------------------------
    def request_telemetry(self) -> None:
        """Measure underflow and headroom of the scaled gradients in the unscale (on the device, no host sync) until
        the next :meth:`update`: the next :meth:`metrics` holds ``mpx/underflow/<group>``, ``mpx/zeros/<group>`` and
        ``mpx/headroom/<group>`` (see :mod:`lightning_mpx.health.telemetry`)."""
        self.telemetry.requested = True

    def metrics(self) -> dict[str, torch.Tensor | float]:
        """``mpx/loss_scale``, ``mpx/overflows`` (since the last call), ``mpx/skipped_steps`` (total) and
        ``mpx/grad_norm`` (unscaled, when computed), with a ``/loss{id}`` suffix when there are several losses;
        ``mpx/overflow/<module>`` (overflow steps since the last call with non-finite gradients in the module;
        ``_root``: the root module's own parameters); the telemetry after a :meth:`request_telemetry`.
        Device tensors or Python numbers: building them does not wait for the device. With ``skip_on_device``,
        ``mpx/skipped_steps`` and the module counts cover the steps read so far (:meth:`read_step_outcomes` first
        to include the last ones); ``mpx/overflows`` is counted on the device and is always current.
        """
        out = self._overflows.metrics(self._machine.grad_norms)
        out.update(self.forensics.metrics())  # mpx/overflow/<module>, host counters
        out.update(self.promotion.metrics())
        out.update(self.telemetry.metrics())
        return out

    def state_dict(self) -> dict[str, Any]:
        """Scalers, FP32 masters and counters: everything needed, with the optimizer's own state, to resume (steps
        skipped on the device are read first)."""
        self.read_step_outcomes()
        masters = self._masters.state_dict(self._optimizers.values())  # makes the masters the optimizers hold
        kept = self._masters.initial_state()
        return {
            "opt_level": self.properties.opt_level,
            "half_dtype": str(self.properties.half_dtype),
            "scalers": [scaler.state_dict() for scaler in self.scalers],
            "master_weights": masters,
            # The FP32 values kept for masters not made yet (None when none is kept).
            "fp32_values": kept if any(kept) else None,
            "skipped_steps": list(self.skipped_steps),
            "promotion": self.promotion.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (after :meth:`prepare_model`); masters come back bit-exact. A refused
        checkpoint changes nothing. When every model was prepared with ``train=False`` the checkpoint's masters are
        left out (the half weights come from the model's state dict).

        A checkpoint of another opt level resumes (load the model's state dict first, as the frameworks do): into
        FP32 masters (O0/O1/O3 to O2) the masters are the model's weights as loaded (an FP32 checkpoint's exactly);
        out of them (O2 to O0/O1/O3) the checkpoint's masters become the model's parameters (exact where the model is
        FP32, their rounding at O3). A loss scale carries over when both levels scale dynamically; otherwise this
        level's own scaling starts from its settings.
        """
        self.read_step_outcomes()  # steps made before the load are this run's: counted before it replaces them
        self._masters.prune()
        if len(state["scalers"]) != len(self.scalers):
            raise ValueError(
                f"the checkpoint has {len(state['scalers'])} loss scaler(s) but this Amp has num_losses="
                f"{len(self.scalers)}."
            )
        saved_level = state.get("opt_level", self.opt_level)
        if saved_level != self.opt_level:
            self._load_across_levels(state, saved_level)
            return
        saved_masters = self._masters.accept(state["master_weights"])
        promotion = state.get("promotion")
        self.promotion.check_state_dict(promotion)
        # Masters this run made that the saving run had not made yet (their optimizer had not stepped) take the value
        # that run would have made them from.
        saved_masters = self._masters.complete(
            saved_masters, state.get("fp32_values"), fp32=self.promotion.param_names(promotion)
        )
        self._masters.check_state_dict(saved_masters, fp32=self.promotion.param_names(promotion))
        # A checkpoint that keeps none (every master made, several processes, or an older release): masters made
        # later come from the half values, as in that run.
        kept = state.get("fp32_values") if self._masters.weights else None
        if kept is not None:
            self._masters.check_initial_state(kept)
        for scaler, scaler_state in zip(self.scalers, state["scalers"]):
            scaler.load_state_dict(scaler_state)
        self.promotion.load_state_dict(promotion)  # the run that saved it promoted these modules: so does this one
        self._masters.load_state_dict(saved_masters)
        if kept is None:
            self._masters.drop_initial()
        else:
            self._masters.load_initial_state(kept)
        self.promotion.load_weights(promotion)
        for optimizer_state in self._optimizers.values():
            # Loading may have made masters for parameters that had none (frozen since the masters were made): the
            # pairs are made again now, and state the optimizer loaded before for such a parameter moves to its
            # master.
            optimizer_state.mirrors = None
            if self._with_masters and self._masters.weights:
                optimizer_state.pairs_key = None
                param_pairs(optimizer_state, self._masters.weights)
        self.skipped_steps = list(state.get("skipped_steps", self.skipped_steps))

    def _load_across_levels(self, state: dict[str, Any], saved_level: str) -> None:
        """:meth:`load_state_dict` for a checkpoint saved at ``saved_level``, another opt level (checked first,
        changing nothing when refused)."""
        levels = f"the checkpoint was saved at opt_level={saved_level!r} and this run is at {self.opt_level!r}"
        saved_masters = [dict(masters) for masters in state["master_weights"]]
        kept = state.get("fp32_values") or []
        into_model: dict[str, torch.Tensor] = {}
        if self._masters.weights:
            if saved_masters:
                raise ValueError(f"{levels}, and both keep FP32 masters: resume at {saved_level!r}.")
            # Into masters: they come from the model's weights, which the model's state dict loaded (FP32 values
            # exactly, through the load hooks or the values kept from before the cast): nothing here replaces them.
        elif saved_masters or kept:
            # Out of masters: the exact FP32 weights are the checkpoint's masters (and the FP32 values it kept for
            # masters not made yet), which become the model's parameters.
            params = self._prepared_parameters()
            for values in [*saved_masters, *kept]:
                into_model.update(values)
            unexpected = sorted(name for name in into_model if name not in params)
            if unexpected:
                raise KeyError(
                    f"{levels}: its FP32 master weights {unexpected[:10]} match no parameter of the prepared "
                    f"model(s) ({len(params)} parameters); resume the same model, or at {saved_level!r}."
                )
            for name, value in into_model.items():
                if tuple(value.shape) != tuple(params[name].shape):
                    raise ValueError(
                        f"{levels}: master weight {name!r} has shape {tuple(value.shape)} in the checkpoint but the "
                        f"parameter has shape {tuple(params[name].shape)}; nothing was loaded."
                    )
        promotion = state.get("promotion")
        self.promotion.check_state_dict(promotion)
        for scaler, scaler_state in zip(self.scalers, state["scalers"]):
            if scaler.dynamic and scaler_state.get("dynamic", True):  # a dynamic scale is state; a static one a setting
                scaler.load_state_dict(scaler_state)
        self.promotion.load_state_dict(promotion)
        if into_model:
            with torch.no_grad():
                params = self._prepared_parameters()
                for name, value in into_model.items():
                    params[name].copy_(value)
            # The model's own state dict (the masters' rounding) may be loaded after this (Accelerate's load_state,
            # fabric.load of {"mpx": ..., "model": ...}): it must not put the rounding back.
            roots = [model for _, ref in self.promotion._roots if (model := ref()) is not None]
            self._exact_weights.guard(roots, [params[name] for name in into_model])
        self.promotion.load_weights(promotion)
        for optimizer_state in self._optimizers.values():
            optimizer_state.mirrors = None
        self.skipped_steps = list(state.get("skipped_steps", self.skipped_steps))

    def _prepared_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters of the live prepared models by the names the engine's checkpoints use."""
        out: dict[str, nn.Parameter] = {}
        for prefix, ref in self.promotion._roots:
            model = ref()
            if model is not None:
                for name, param in model.named_parameters():
                    out.setdefault(self._names.get(id(param), prefix + name), param)
        return out

    # -- internals ----------------------------------------------------------------------------------------------
    def _loss_index(self, loss_id: int) -> int:
        return loss_index(loss_id, len(self.scalers))


def _policy(settings: MixedPrecisionSettings) -> CastPolicy | None:
    """The cast policy of the opt level: the cast table at O1; at O2, one that runs a loss computed inside the half
    model's own forward in FP32 (:meth:`CastTable.default_o2`); none otherwise."""
    props = settings.properties
    if props.patch_torch_functions:
        return CastPolicy(settings.cast_table, props.half_dtype, allow_banned=settings.allow_banned)
    if props.casts_model and props.master_weights:
        return CastPolicy(CastTable.default_o2(), props.half_dtype, allow_banned=True)
    return None


def _device_type(module: nn.Module) -> str | None:
    """The device type of ``module``'s first floating parameter or buffer (a DTensor's local device), or ``None``."""
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if tensor.is_floating_point():
            return tensor.device.type
    return None


def _pinned_params(module: nn.Module, prefix: str, patterns: Sequence[str]) -> tuple[set[int], list[nn.Module]]:
    """``id`` of the parameters kept FP32 at O2/O3, and the submodules tied to the pinned ones.

    The pinned parameters are those of the submodules that ``fp32_modules`` patterns name, and of every submodule
    that shares a parameter with one of those (a tied input embedding of a pinned ``lm_head``): a shared parameter is
    one tensor, so it cannot be FP32 in one module and half in the other. Such a tied submodule runs in FP32 too
    (see :meth:`Amp._run_tied_in_fp32`), found again for the parameters it adds, until none is left.

    Raises:
        ValueError: when the module that shares a pinned parameter is the root model or holds a pinned module (it
            cannot run in FP32 without running the pinned module's surroundings in FP32), naming the tie.
    """
    if not patterns:
        return set(), []
    modules = list(module.named_modules())
    tops = [name for name, _ in modules if name and any(matches(prefix + name, pattern) for pattern in patterns)]
    params = {id(p): f"{name}.{pname}" for name, sub in modules if name in tops for pname, p in sub.named_parameters()}
    tied: list[nn.Module] = []
    changed = True
    while changed:
        changed = False
        for name, sub in modules:
            if any(name == top or name.startswith(top + ".") for top in tops):
                continue
            shared = [(pname, p) for pname, p in sub.named_parameters(recurse=False) if id(p) in params]
            if not shared:
                continue
            pname, param = shared[0]
            owner = "the root model" if not name else f"{prefix + name!r}"
            holds = [top for top in tops if not name or top.startswith(name + ".")]
            if holds:
                raise ValueError(
                    f"fp32_modules pins {prefix + holds[0]!r}, whose parameter {prefix + params[id(param)]!r} is also "
                    f"{owner}'s own parameter {prefix + (name + '.' if name else '') + pname!r} (tied weights); "
                    f"{owner} holds the pinned module and cannot run in FP32 around it. Pin a module that holds "
                    "both users of the parameter, untie the weights, or use opt_level='O1', whose FP32 modules keep "
                    "every parameter FP32."
                )
            tops.append(name)
            tied.append(sub)
            for sub_pname, p in sub.named_parameters():
                params.setdefault(id(p), f"{name}.{sub_pname}")
            changed = True
    return set(params), tied


def _keep_fp32_values(module: nn.Module, before_cast: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """After the cast to half: parameters FP32 again (``fp32_modules``) take back the exact values they held
    before it, not their rounding; returns the FP32 values of the half parameters, for their masters."""
    initial = {}
    with torch.no_grad():
        for param in module.parameters():
            value = before_cast.get(id(param))
            if value is None or value.shape != param.shape:
                continue
            if param.dtype == torch.float32 and param.data_ptr() != value.data_ptr():
                param.data = value  # pinned FP32 by fp32_modules after the cast: its own values, exactly
            elif param.dtype in HALF_DTYPES and param.requires_grad:
                initial[id(param)] = value
    return initial


class _EngineHook:
    """A model hook that needs its engine: held weakly, and dropped by a copy or a pickle of the model (whose
    parameters have no masters in it). Used by :class:`_LoadIntoMasters` and by ``lightning_mpx.apex``'s hooks."""

    def __init__(self, amp: Amp) -> None:
        self._amp: Callable[[], Amp | None] | None = weakref.ref(amp)

    def engine(self) -> Amp | None:
        return self._amp() if self._amp is not None else None

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._amp = None


class _LoadIntoMasters(_EngineHook):
    """``load_state_dict`` pre-hook on each submodule of a model prepared at O2: an FP32 value loaded into a half
    parameter goes to its master (or to the value its master will be made from) exactly; the model takes its
    rounding. It acts on the module it is called for (a ``copy.deepcopy`` of the model, an EMA copy, has no masters)
    and holds the engine weakly; a copied or pickled hook holds none."""

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        amp = self.engine()
        if amp is None:
            return
        for name, param in module.named_parameters(recurse=False):
            value = state_dict.get(prefix + name)
            if param.dtype in HALF_DTYPES and torch.is_tensor(value) and value.dtype == torch.float32:
                amp._masters.take_loaded(param, value, amp._optimizers.values())


def _convert(module: nn.Module, props: Properties) -> None:
    """Cast ``module`` in place for the opt level: half at O2/O3 (batch norm FP32 when ``keep_batchnorm_fp32``),
    half parameters to FP32 at O0."""
    if props.casts_model:
        convert_module(module, props.half_dtype, keep_batchnorm_fp32=props.keep_batchnorm_fp32 is not False)
    elif props.cast_model_type == torch.float32:
        for param in module.parameters():
            if param.dtype in (torch.float16, torch.bfloat16):
                param.data = param.data.float()
