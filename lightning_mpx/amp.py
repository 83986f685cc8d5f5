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
import operator
from typing import Any, Callable, ContextManager, Iterable, Sequence

import torch
from torch import nn

from lightning_mpx._collections import _cast_collection
from lightning_mpx._masters import Masters
from lightning_mpx._overflow import OverflowLog, floor_hint, named_grads
from lightning_mpx._stages import _OptimizerState, _Stage
from lightning_mpx._step_machine import StepMachine
from lightning_mpx.cast_policy import CastPolicy
from lightning_mpx.cast_table import CastTable
from lightning_mpx.forensics import OverflowForensics, OverflowRecord
from lightning_mpx.loss_scaler import LossScaler
from lightning_mpx.master_weights import MasterWeights, Mirror, convert_module
from lightning_mpx.opt_levels import Properties
from lightning_mpx.promotion import Promotion
# MODEL_WRITES is defined with the other settings; its old import path here keeps working.
from lightning_mpx.settings import DEFAULTS, MODEL_WRITES, MixedPrecisionSettings, OnFloor  # noqa: F401
from lightning_mpx.telemetry import GradTelemetry


_D, _S = DEFAULTS, DEFAULTS.scaler  # the defaults of the typed keywords, from the one place that defines them


class Amp:
    """Mixed precision for one training run: a facade over its parts, each the one owner of its state (the step
    machine :class:`~lightning_mpx._step_machine.StepMachine`, the FP32 masters
    :class:`~lightning_mpx._masters.Masters`, the loss scalers, the cast policy, :class:`Promotion`, the overflow
    forensics and log, the telemetry).

    Args:
        opt_level, **settings: The opt level (``"O0"`` to ``"O3"``) and the keywords of
            :meth:`MixedPrecisionSettings.from_kwargs <lightning_mpx.settings.MixedPrecisionSettings.from_kwargs>`,
            each documented and checked in :class:`~lightning_mpx.settings.MixedPrecisionSettings` and
            :class:`~lightning_mpx.settings.ScalerSettings`; :meth:`from_settings` takes the settings whole.

    Attributes:
        settings: The validated :class:`~lightning_mpx.settings.MixedPrecisionSettings` the engine was built from.
        found_inf_reducer: Optional callable that reduces an optimizer's overflow flag in place across processes
            (the adapters set it under a distributed strategy) so that every rank makes the same skip decision.
        last_overflow: The :class:`~lightning_mpx.forensics.OverflowRecord` of the most recent overflow step
            (``None`` before the first), merged across ranks when ``found_inf_reducer`` is set.
        last_overflow_parameters: The names of the parameters with non-finite gradients at that step (this
            process's).
        telemetry: The :class:`~lightning_mpx.telemetry.GradTelemetry` behind :meth:`request_telemetry`.
    """

    def __init__(
        self,
        opt_level: str = "O1",
        *,
        half_dtype: str | torch.dtype = _D.half_dtype,
        num_losses: int = _D.num_losses,
        cast_table: CastTable | None = _D.cast_table,
        allow_banned: bool = _D.allow_banned,
        unscale_backend: str = _D.unscale_backend,
        init_scale: float = _S.init_scale,
        growth_factor: float = _S.growth_factor,
        backoff_factor: float = _S.backoff_factor,
        growth_interval: int = _S.growth_interval,
        hysteresis: int = _S.hysteresis,
        consecutive_hysteresis: bool = _S.consecutive_hysteresis,
        min_loss_scale: float = _S.min_loss_scale,
        max_loss_scale: float = _S.max_loss_scale,
        on_floor: OnFloor = _S.on_floor,
        overflow_log_interval: float = _D.overflow_log_interval,
        model_writes: str = _D.model_writes,
        diagnose_overflows: bool = _D.diagnose_overflows,
        fp32_modules: Sequence[str] = _D.fp32_modules,
        **overrides: Any,
    ) -> None:
        arguments = dict(locals())
        del arguments["self"], arguments["overrides"]
        self._configure(MixedPrecisionSettings.from_kwargs(**arguments, **overrides))

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
        num_losses = settings.num_losses
        self.policy: CastPolicy | None = None
        if self.properties.patch_torch_functions:
            policy_dtype, allow_banned = self.properties.half_dtype, settings.allow_banned
            self.policy = CastPolicy(settings.cast_table, policy_dtype, allow_banned=allow_banned)
        elif self.properties.casts_model and self.properties.master_weights:
            # O2: a loss computed inside the half model's own forward runs in FP32 (CastTable.default_o2()).
            self.policy = CastPolicy(CastTable.default_o2(), self.properties.half_dtype, allow_banned=True)
        self.scalers: list[LossScaler] = [
            LossScaler.from_settings(self.properties.loss_scale, settings.scaler) for _ in range(num_losses)
        ]
        self.found_inf_reducer: Callable[[torch.Tensor], None] | None = None
        self._overflow_log = OverflowLog(settings.overflow_log_interval)
        self.skipped_steps: list[int] = [0] * num_losses
        self.last_overflow_parameters: list[str] = []
        self.last_overflow: OverflowRecord | None = None
        self.forensics = OverflowForensics(settings.diagnose_overflows)
        self._steps = 0  # Amp.step() calls so far, all optimizers (OverflowRecord.step)
        #: The modules that run in FP32: pinned by ``fp32_modules`` or promoted by ``on_floor="promote"``.
        self.promotion = Promotion(self, settings.fp32_modules)
        self._names: dict[int, str] = {}
        self._overflows_reported: list[torch.Tensor | None] = [None] * num_losses
        self.telemetry = GradTelemetry(self.properties.half_dtype)  # underflow/headroom, on request only
        self._masters = Masters(settings.unscale_backend)
        self._machine = StepMachine(
            self.scalers, self._masters, backend=settings.unscale_backend, telemetry=self.telemetry, names=self._names
        )

    # -- the parts' state, under the names the adapters and tests use ------------------------------------------
    @property
    def master_weights(self) -> list[MasterWeights]:
        """One :class:`~lightning_mpx.master_weights.MasterWeights` per model prepared for training (O2)."""
        return self._masters.weights

    @master_weights.setter
    def master_weights(self, value: list[MasterWeights]) -> None:
        self._masters.weights = value

    @property
    def unscale_backend(self) -> str:
        return self._machine.backend

    @property
    def _optimizers(self) -> dict[int, _OptimizerState]:
        return self._machine.optimizers

    @property
    def _iteration_found(self) -> dict[int, torch.Tensor]:
        return self._machine.iteration_found

    @property
    def _grad_norms(self) -> dict[int, torch.Tensor]:
        return self._machine.grad_norms

    def _state(self, optimizer: torch.optim.Optimizer) -> _OptimizerState:
        return self._machine.state(optimizer)

    def _mirrors(self, state: _OptimizerState) -> list[Mirror]:
        return self._machine.mirrors(state, compare=self.model_writes == "values")

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
        return self._overflow_log.enabled

    @log_overflows.setter
    def log_overflows(self, value: bool) -> None:
        self._overflow_log.enabled = value

    @property
    def overflow_log_interval(self) -> float:
        """Minimum seconds between two overflow log messages."""
        return self._overflow_log.interval

    @overflow_log_interval.setter
    def overflow_log_interval(self, value: float) -> None:
        self._overflow_log.interval = value

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
        """Convert ``module`` for the opt level (in place) and return it.

        O2/O3 cast it to half (batch norm FP32 when ``keep_batchnorm_fp32``); at O2 the FP32 masters of the
        parameters an optimizer holds are made by :meth:`prepare_optimizer` (or a later step), so a half submodule
        no optimizer trains (an EMA copy, a teacher) gets none. O0 makes half parameters FP32; O1 leaves it as is.

        Args:
            module: The model.
            train: ``False`` for a model that is only evaluated: converted the same way, but with no FP32 masters,
                and an optimizer over its half parameters is refused. Preparing it again with ``train=True`` adds
                the masters (once).
        """
        if not isinstance(module, nn.Module):
            raise TypeError(f"module={type(module).__name__} is not a torch.nn.Module.")
        if not isinstance(train, bool):
            raise TypeError(f"train={train!r} must be True or False.")
        live = self._masters.prune()
        prefix = f"model{len(live)}." if live else ""
        for name, param in module.named_parameters():
            self._names.setdefault(id(param), prefix + name)
        self.forensics.watch.add_model(module, prefix)
        props = self.properties
        if props.casts_model:
            convert_module(module, props.half_dtype, keep_batchnorm_fp32=props.keep_batchnorm_fp32 is not False)
        elif props.cast_model_type == torch.float32:
            for param in module.parameters():
                if param.dtype in (torch.float16, torch.bfloat16):
                    param.data = param.data.float()
        self.promotion.add_model(module, prefix)  # fp32_modules: back to FP32 before any master is made
        if props.master_weights and not train:
            self._masters.evaluation_only = True
        if props.master_weights and train:
            self._masters.add_model(module, self._names, prefix)
        return module

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Register ``optimizer`` (prepare its model first); for O2 its parameters become the FP32 masters.

        Raises:
            ValueError: for optimizers that need a closure (LBFGS), which loss scaling cannot support.
        """
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer={type(optimizer).__name__} is not a torch.optim.Optimizer.")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                "optimizer=LBFGS re-evaluates the loss through a closure several times per step, which loss scaling "
                "and step skipping cannot support; use opt_level='O0', or a first-order optimizer."
            )
        if self.properties.master_weights and not self.master_weights:
            raise RuntimeError(
                "prepare_model() must run before prepare_optimizer() with master weights (O2), with train=True: "
                "a model prepared with train=False has no masters for an optimizer to train."
            )
        self.promotion.check_patterns_matched()
        self._machine.register(optimizer, with_masters=self.properties.master_weights)
        return optimizer

    def release_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Forget ``optimizer`` and remove the hooks put on it (its masters stay with their model)."""
        self._machine.release(optimizer)

    def master_params(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The tensors ``optimizer`` updates: the FP32 masters of its half parameters at O2, its parameters
        otherwise. Their ``.grad`` holds the unscaled gradients between an unscale and the step."""
        return self._machine.master_params(optimizer, with_masters=self.properties.master_weights)

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """The FP32 master of a model parameter at O2 (the parameter itself when it has none: an FP32 parameter, or
        a half one that no prepared optimizer holds)."""
        return self._masters.master_of(param, self._optimizers.values())

    def _make_held_masters(self) -> None:
        self._masters.make_held(self._optimizers.values())

    def refresh_masters(self, params: Iterable[torch.Tensor] | None = None, *, force: bool = False) -> list[str]:
        """Take writes made to the half model into the FP32 masters now (done before every step anyway).

        Args:
            params: The model parameters to check (default: every prepared model's).
            force: Compare the values of every parameter checked, whatever its version counter: for writes the
                cheap checks cannot see (through a tensor kept from ``p.data`` after the alias it came from is gone,
                or through ``.data`` of a parameter of a user's own ``nn.Parameter`` subclass).

        Returns:
            The names of the parameters whose masters took a write.
        """
        return self._masters.refresh(params, force=force)

    # -- forward ------------------------------------------------------------------------------------------------
    def forward_context(self) -> ContextManager[Any]:
        """The scope of a forward pass: the cast policy at O1; at O2, a policy that runs loss functions called inside
        the model in FP32; nothing otherwise."""
        return self.policy.scope() if self.policy is not None else contextlib.nullcontext()

    def cast_inputs(self, data: Any) -> Any:
        """Floating-point tensors in ``data`` (nested in lists, tuples, dicts) cast to half when the model is."""
        if not self.properties.casts_model:
            return data
        return _cast_collection(data, self.properties.half_dtype, (torch.float32, torch.float64))

    def cast_outputs(self, data: Any) -> Any:
        """Half tensors in ``data`` cast to FP32 when the model is half, so the loss is computed in FP32 (Apex)."""
        if not self.properties.casts_model:
            return data
        return _cast_collection(data, torch.float32, (self.properties.half_dtype,))

    # -- backward -----------------------------------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor, loss_id: int = 0) -> torch.Tensor:
        """``loss`` times the scale of ``loss_id`` (an ``int``, numpy integers included).

        Before the backward that follows, every optimizer's gradients are made to carry this scale, so that one
        gradient buffer never mixes two scales: gradients of another loss not stepped on yet (or of this loss at a
        scale :meth:`update` has changed since) are rescaled; gradients that :meth:`unscale_` or ``clip_grad_*``
        left unscaled without a :meth:`step` after them are scaled back up (an overflow found there still counts
        toward the next :meth:`update`). Gradients left after a :meth:`step` are not rescaled: zero them before the
        next backward (as with ``torch.amp.GradScaler``).
        """
        loss_id = self._loss_index(loss_id)
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
        else:  # the backward_context() scope, entered without a call into the policy's hook
            self.policy.backward(scaled, **backward_kwargs)

    def backward_context(self) -> ContextManager[Any]:
        """The scope of a backward pass: activation checkpointing recomputes with the forward's casts inside it (the
        cast policy's :meth:`~lightning_mpx.cast_policy.CastPolicy.recompute_scope`); nothing without a policy."""
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
        """Clip ``optimizer``'s unscaled gradients to a global L2 norm (unscaling them first when still scaled);
        returns the norm before clipping.

        As ``torch.nn.utils.clip_grad_norm_`` (bit for bit), except that a non-finite norm (an overflow: the step will
        be skipped) leaves the gradients as they are, so that :attr:`last_overflow` tells inf from NaN.
        """
        return self._machine.clip_grad_norm_(optimizer, max_norm, with_masters=self.properties.master_weights)

    def clip_grad_value_(self, optimizer: torch.optim.Optimizer, clip_value: float) -> None:
        """Clamp ``optimizer``'s unscaled gradients to ``[-clip_value, clip_value]``."""
        self._machine.clip_grad_value_(optimizer, clip_value, with_masters=self.properties.master_weights)

    def show_unscaled_on_model(self, optimizer: torch.optim.Optimizer) -> None:
        """At O2, copy the unscaled FP32 master gradients into the half model's gradients (rounded), for code that
        reads the model's gradients between the unscale and the step (Lightning's ``on_before_optimizer_step``,
        ``grad_norm(self)``); the masters' FP32 gradients stay what the step uses."""
        self._machine.show_unscaled_on_model(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, **step_kwargs: Any) -> bool:
        """Step ``optimizer`` unless its gradients overflowed; returns whether it stepped.

        On overflow nothing is changed (parameters, optimizer state, and the schedule if the caller honours the
        return value); the overflow counts against the losses whose gradients held the non-finite values.

        .. warning:: Reads the overflow flags on the host (one sync per step, as ``torch.amp.GradScaler`` does).

        Raises:
            LossScaleFloorError: on overflow with the scale at its floor and ``on_floor="raise"``; the step is
                skipped first.
        """
        self._state(optimizer)
        self._steps += 1
        if "closure" in step_kwargs and step_kwargs["closure"] is not None:
            raise ValueError(
                "closure: loss scaling cannot re-run a closure inside the optimizer step; run the closure first, "
                "then call step() without it."
            )
        state, overflowed = self._machine.check(optimizer, self.found_inf_reducer)
        if overflowed:
            self._skip(optimizer, state, overflowed)
            return False
        if self.forensics.watch.active:
            self.forensics.stepped()  # an automatic watch ends with the first step that does not overflow
        self._machine.step(state, step_kwargs, compare=self.model_writes == "values")
        return True

    def update(self) -> None:
        """Close the iteration: update the scale of every loss whose optimizers stepped, skipped or were unscaled
        since the last call, reset every optimizer's stage (as ``torch.amp.GradScaler.update()`` does), and clear
        the cast cache. Once per iteration, after the real step (not between accumulated batches). No host sync.
        An optimizer unscaled without a step (a skipped batch) starts afresh: its overflow flag counts here, and the
        gradients it holds are treated as the true values they are.
        """
        self._machine.update()
        if self.policy is not None:
            self.policy.clear_cache()
        self.telemetry.requested = False  # a request covers one iteration

    # -- metrics and checkpoints --------------------------------------------------------------------------------
    def request_telemetry(self) -> None:
        """Measure underflow and headroom of the scaled gradients in the unscale (on the device, no host sync) until
        the next :meth:`update`: the next :meth:`metrics` holds ``mpx/underflow/<group>``, ``mpx/zeros/<group>`` and
        ``mpx/headroom/<group>`` (see :mod:`lightning_mpx.telemetry`)."""
        self.telemetry.requested = True

    def metrics(self) -> dict[str, torch.Tensor | float]:
        """``mpx/loss_scale``, ``mpx/overflows`` (since the last call), ``mpx/skipped_steps`` (total) and
        ``mpx/grad_norm`` (unscaled, when computed), with a ``/loss{id}`` suffix when there are several losses;
        ``mpx/overflow/<module>`` (overflow steps since the last call with non-finite gradients in the module;
        ``_root``: the root module's own parameters); the telemetry after a :meth:`request_telemetry`.
        Device tensors or Python numbers: building them does not wait for the device.
        """
        out: dict[str, torch.Tensor | float] = {}
        for loss_id, scaler in enumerate(self.scalers):
            suffix = f"/loss{loss_id}" if len(self.scalers) > 1 else ""
            total = scaler.overflow_count
            reported = self._overflows_reported[loss_id]
            out["mpx/loss_scale" + suffix] = scaler.scale_tensor.clone()
            out["mpx/overflows" + suffix] = (total - reported) if reported is not None else total.clone()
            self._overflows_reported[loss_id] = total.clone()
            out["mpx/skipped_steps" + suffix] = float(self.skipped_steps[loss_id])
            if loss_id in self._grad_norms:
                out["mpx/grad_norm" + suffix] = self._grad_norms.pop(loss_id)
        out.update(self.forensics.metrics())  # mpx/overflow/<module>, host counters
        out.update(self.promotion.metrics())
        out.update(self.telemetry.metrics())
        return out

    def state_dict(self) -> dict[str, Any]:
        """Scalers, FP32 masters and counters: everything needed, with the optimizer's own state, to resume."""
        return {
            "opt_level": self.properties.opt_level,
            "half_dtype": str(self.properties.half_dtype),
            "scalers": [scaler.state_dict() for scaler in self.scalers],
            "master_weights": self._masters.state_dict(self._optimizers.values()),
            "skipped_steps": list(self.skipped_steps),
            "promotion": self.promotion.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (after :meth:`prepare_model`); masters come back bit-exact. A refused
        checkpoint changes nothing. When every model was prepared with ``train=False`` the checkpoint's masters are
        left out (the half weights come from the model's state dict)."""
        self._masters.prune()
        if len(state["scalers"]) != len(self.scalers):
            raise ValueError(
                f"the checkpoint has {len(state['scalers'])} loss scaler(s) but this Amp has num_losses="
                f"{len(self.scalers)}."
            )
        saved_masters = self._masters.accept(state["master_weights"])
        promotion = state.get("promotion")
        self.promotion.check_state_dict(promotion)
        self._masters.check_state_dict(saved_masters, fp32=self.promotion.param_names(promotion))
        for scaler, scaler_state in zip(self.scalers, state["scalers"]):
            scaler.load_state_dict(scaler_state)
        self.promotion.load_state_dict(promotion)  # the run that saved it promoted these modules: so does this one
        self._masters.load_state_dict(saved_masters)
        self.promotion.load_weights(promotion)
        for optimizer_state in self._optimizers.values():
            optimizer_state.mirrors = None  # loading may have made masters for parameters that had none
        self.skipped_steps = list(state.get("skipped_steps", self.skipped_steps))

    # -- internals ----------------------------------------------------------------------------------------------
    def _loss_index(self, loss_id: int) -> int:
        """``loss_id`` as a Python int (numpy and other integer types accepted; bool refused), checked in range."""
        try:
            index = None if isinstance(loss_id, bool) or _is_bool_tensor(loss_id) else operator.index(loss_id)
        except TypeError:
            index = None
        if index is None or not 0 <= index < len(self.scalers):
            raise ValueError(
                f"loss_id={loss_id!r} is out of range; valid choices: 0 to {len(self.scalers) - 1} "
                f"(num_losses={len(self.scalers)})."
            )
        return index

    def _skip(self, optimizer: torch.optim.Optimizer, state: _OptimizerState, overflowed: list[int]) -> None:
        """An overflow step: record, count and log it, finish the skipped step, then the floor's policy."""
        names = self._record_overflow(optimizer, overflowed)
        for loss_id in overflowed:
            self.skipped_steps[loss_id] += 1
        self._overflow_log.log(names, overflowed, self.scalers, self.last_overflow)
        self._machine.finish(state)
        hint = floor_hint(optimizer, self.master_of, self.properties.opt_level)
        if self.scalers[overflowed[0]].on_floor == "promote" and any(self.scalers[i].at_floor() for i in overflowed):
            why_not = self.promotion.floor_overflow(self.last_overflow)
            if why_not is None:
                return  # promoted (or waiting for the next overflow's evidence): training goes on
            hint = why_not + (f". {hint}" if hint else "")
        for loss_id in overflowed:
            self.scalers[loss_id].handle_overflow(names, hint=hint)

    def _record_overflow(self, optimizer: torch.optim.Optimizer, overflowed: list[int]) -> list[str]:
        """Build :attr:`last_overflow` (gathered to rank 0 under a distributed strategy) and count it; at the floor,
        watch the next forwards. Overflow steps only; returns this process's non-finite parameter names."""
        dist = torch.distributed
        distributed = dist.is_available() and dist.is_initialized()
        local = self.forensics.build(
            named_grads(optimizer, self._names, self.master_of),
            step=self._steps - 1,
            loss_ids=overflowed,
            scales=[self.scalers[i].scale_tensor for i in overflowed],
            rank=dist.get_rank() if distributed else 0,
        )
        # All ranks are here together only when the flags were reduced across them.
        self.last_overflow = self.forensics.gather(local) if self.found_inf_reducer is not None else local
        self.last_overflow_parameters = list(local.parameters)
        self.forensics.overflowed(self.last_overflow, at_floor=any(self.scalers[i].at_floor() for i in overflowed))
        return self.last_overflow_parameters


def _is_bool_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.bool
