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
import weakref
from typing import Any, Callable, ContextManager, Iterable, Sequence

import torch
from torch import nn

from lightning_mpx._collections import _cast_collection
from lightning_mpx._leftovers import (
    follow_cleared_grads,
    grad_marks,
    rescale_pending,
    rescale_unscaled,
    unscale_state,
)
from lightning_mpx._master_swap import (
    drop_master_grads,
    masters_in,
    mirrors,
    param_pairs,
    swap_in,
    swap_out,
)
from lightning_mpx._overflow import OverflowLog, floor_hint, named_grads
from lightning_mpx._stages import _OptimizerState, _Stage
from lightning_mpx._stages import optimizer_params as _params
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
    """Mixed precision for one training run.

    Args:
        opt_level, **settings: The opt level (``"O0"`` to ``"O3"``) and the keywords of
            :meth:`MixedPrecisionSettings.from_kwargs <lightning_mpx.settings.MixedPrecisionSettings.from_kwargs>`:
            ``half_dtype``, ``num_losses``, ``cast_table``, ``allow_banned``, ``unscale_backend``, the loss-scaler
            settings (``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``hysteresis``,
            ``consecutive_hysteresis``, ``min_loss_scale``, ``max_loss_scale``, ``on_floor``),
            ``overflow_log_interval``, ``diagnose_overflows``, ``model_writes``, ``fp32_modules`` and the opt-level
            overrides (``cast_model_type``, ``patch_torch_functions``, ``keep_batchnorm_fp32``, ``master_weights``,
            ``loss_scale``). Each is documented and checked in :class:`~lightning_mpx.settings.MixedPrecisionSettings`
            and :class:`~lightning_mpx.settings.ScalerSettings`; :meth:`from_settings` takes the settings whole.

    Attributes:
        settings: The validated :class:`~lightning_mpx.settings.MixedPrecisionSettings` the engine was built from.
        found_inf_reducer: Optional callable that reduces an optimizer's overflow flag in place across processes
            (the adapters set it under a distributed strategy) so that every rank makes the same skip decision.
        log_overflows: Whether overflow messages are logged (adapters turn it off on ranks other than zero).
        last_overflow: The :class:`~lightning_mpx.forensics.OverflowRecord` of the most recent overflow step
            (``None`` before the first): the parameters and modules with non-finite gradients, inf or NaN, the
            origin (forward or backward) and the rank(s). Under a distributed strategy with ``found_inf_reducer``
            set, every rank's record is gathered and merged (on every rank; only rank 0 logs).
        last_overflow_parameters: The names of the parameters with non-finite gradients at that step (this
            process's).
        telemetry: The :class:`~lightning_mpx.telemetry.GradTelemetry` behind :meth:`request_telemetry`: the request
            flag and the latest underflow and headroom results.
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
        self.unscale_backend = settings.unscale_backend
        self.found_inf_reducer: Callable[[torch.Tensor], None] | None = None
        self._overflow_log = OverflowLog(settings.overflow_log_interval)
        self.master_weights: list[MasterWeights] = []
        self._evaluation_only = False  # O2 models were prepared with train=False (and none for training)
        self.skipped_steps: list[int] = [0] * num_losses
        self.last_overflow_parameters: list[str] = []
        self.last_overflow: OverflowRecord | None = None
        self.forensics = OverflowForensics(settings.diagnose_overflows)
        self._steps = 0  # Amp.step() calls so far, all optimizers (OverflowRecord.step)
        #: The modules that run in FP32: pinned by ``fp32_modules`` or promoted by ``on_floor="promote"``.
        self.promotion = Promotion(self, settings.fp32_modules)
        self._names: dict[int, str] = {}
        self._optimizers: dict[int, _OptimizerState] = {}
        self._iteration_found: dict[int, torch.Tensor] = {}
        self._grad_norms: dict[int, torch.Tensor] = {}
        self._overflows_reported: list[torch.Tensor | None] = [None] * num_losses
        self.telemetry = GradTelemetry(self.properties.half_dtype)  # underflow/headroom, on request only

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
        """Whether every forward is watched for non-finite outputs (see ``diagnose_overflows`` above); setting it
        registers or removes the hooks."""
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

        O2/O3 cast it to half (batch norm FP32 when ``keep_batchnorm_fp32``), O2 also gets FP32 master weights,
        made by :meth:`prepare_optimizer` (or a later step) for the parameters an optimizer holds: a half submodule
        that no optimizer trains (an EMA copy, a distillation teacher) gets none. O0 makes half parameters FP32; O1
        leaves it as it is.

        Args:
            module: The model.
            train: ``False`` for a model that is only evaluated: it is converted the same way, but no FP32 masters
                are made for it (at O2 they would add 4 bytes per half parameter for nothing), and an optimizer over
                its half parameters is refused. Preparing the same module again with ``train=True`` adds the
                masters; preparing it twice for training makes them once.

        Raises:
            ValueError: for O2/O3 with a module that has no floating-point parameters.
        """
        if not isinstance(module, nn.Module):
            raise TypeError(f"module={type(module).__name__} is not a torch.nn.Module.")
        if not isinstance(train, bool):
            raise TypeError(f"train={train!r} must be True or False.")
        self.master_weights = [masters for masters in self.master_weights if masters.alive]
        prefix = f"model{len(self.master_weights)}." if self.master_weights else ""
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
            self._evaluation_only = True
        if props.master_weights and train and not all(map(self._covered, module.parameters())):
            # Parameters another prepared model already covers (a shared submodule) keep their one master.
            self.master_weights.append(
                MasterWeights(
                    ((self._names.get(id(p), prefix + name), p) for name, p in module.named_parameters()),
                    copy_backend=self.unscale_backend,
                    exclude=self._covered,
                    eager=False,  # made by prepare_optimizer: only for the parameters an optimizer holds, as Apex
                )
            )
        return module

    def _covered(self, param: torch.Tensor) -> bool:
        """Whether ``param`` already belongs to the masters of a model prepared for training."""
        return any(masters.covers(param) for masters in self.master_weights)

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
        if self.properties.master_weights:
            if not self.master_weights:
                raise RuntimeError(
                    "prepare_model() must run before prepare_optimizer() with master weights (O2), with train=True: "
                    "a model prepared with train=False has no masters for an optimizer to train."
                )
        self.promotion.check_patterns_matched()
        key = id(optimizer)
        if key in self._optimizers:
            return optimizer  # registered before (a framework preparing it twice)
        state = _OptimizerState(weakref.ref(optimizer))
        if self.properties.master_weights:
            # Refuses half parameters of unprepared models; makes missing masters.
            param_pairs(state, self.master_weights)
            for param, master in state.pairs:
                if master is not param and param in optimizer.state:  # state made before preparing: now the master's
                    old = optimizer.state.pop(param)
                    optimizer.state[master] = {
                        k: v.float() if torch.is_tensor(v) and v.is_floating_point() and k != "step" else v
                        for k, v in old.items()
                    }
            state.hooks = [
                optimizer.register_step_pre_hook(self._refuse_direct_step),
                optimizer.register_state_dict_pre_hook(self._masters_in_hook),
                optimizer.register_state_dict_post_hook(self._masters_out_hook),
                optimizer.register_load_state_dict_pre_hook(self._masters_in_hook),
                optimizer.register_load_state_dict_post_hook(self._masters_out_hook),
            ]
        self._optimizers[key] = state
        weakref.finalize(optimizer, self._optimizers.pop, key, None)
        return optimizer

    def release_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Forget ``optimizer`` and remove the hooks put on it (its masters stay with their model)."""
        state = self._optimizers.pop(id(optimizer), None)
        if state is not None:
            for handle in state.hooks:
                handle.remove()

    def master_params(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The tensors ``optimizer`` updates: the FP32 masters of its half parameters at O2, its parameters
        otherwise. Their ``.grad`` holds the unscaled gradients between an unscale and the step."""
        state = self._state(optimizer)
        if not self.properties.master_weights:
            return list(_params(optimizer))
        return [master for _, master in param_pairs(state, self.master_weights)]

    def master_of(self, param: torch.Tensor) -> torch.Tensor:
        """The FP32 master of a model parameter at O2 (the parameter itself when it has none: an FP32 parameter, or
        a half one that no prepared optimizer holds)."""
        for masters in self.master_weights:
            if masters.covers(param):
                master = masters.master_of(param)
                if master is param and param.dtype in (torch.float16, torch.bfloat16):
                    self._make_held_masters()  # added to an optimizer since its last step: its master is made now
                    master = masters.master_of(param)
                return master
        return param

    def _make_held_masters(self) -> None:
        """Make the masters of the half parameters the prepared optimizers hold (those added since their last step
        have none yet)."""
        for state in list(self._optimizers.values()):
            param_pairs(state, self.master_weights)

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
        params = None if params is None else list(params)
        return [name for masters in self.master_weights for name in masters.refresh(params, force=force)]

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
        gradient buffer never mixes two scales:

        * gradients of another loss it has not stepped on yet (or of this loss at a scale :meth:`update` has changed
          since) are rescaled to this loss's scale;
        * gradients that :meth:`unscale_` or ``clip_grad_*`` left unscaled without a :meth:`step` after them (a
          skipped batch, or a backward between the clip and the step, as when accumulating after a clip) are scaled
          back up, so they add to this backward's gradients as the FP32 run would (zeroed gradients stay zero). An
          overflow that unscale found there still counts toward the next :meth:`update`.

        Gradients left after a :meth:`step` are not rescaled: zero them before the next backward (as with
        ``torch.amp.GradScaler``).
        """
        loss_id = self._loss_index(loss_id)
        scaled = self.scalers[loss_id].scale(loss)
        if self.forensics.watch.active:  # a device flag, no sync
            self.forensics.watch.observe_loss(loss)
        for state in self._optimizers.values():
            if state.stage is not _Stage.READY:
                if state.stage is _Stage.UNSCALED:
                    self._record_found(state.found_by_loss)  # an overflow seen by unscale_() counts toward update()
                rescale_unscaled(state, loss_id, self.scalers[loss_id], self.master_weights, self.unscale_backend)
            elif state.loss_id is None:
                state.loss_id = loss_id
            elif state.loss_id != loss_id or state.grad_scale is not None:
                rescale_pending(state, loss_id, self.scalers, self.unscale_backend)
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
        """Unscale ``optimizer``'s gradients (into the FP32 masters at O2) and record overflow; once per step.

        Raises:
            RuntimeError: if called twice for the same optimizer without a :meth:`step` or :meth:`update` between.
        """
        state = self._state(optimizer)
        if state.stage is _Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since its last step() or update() (directly or "
                "through clip_grad_norm_()/clip_grad_value_()); call step() (or update()) before unscaling again."
            )
        self._unscale(state)
        if self.master_weights:
            # As after torch.amp.GradScaler.unscale_(): the model's own gradients hold the true values (a half copy;
            # the FP32 ones the step uses stay in the masters), so code that clips or inspects them works. A write
            # to them before the step is taken into the masters.
            self.show_unscaled_on_model(optimizer)

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
        """Clip ``optimizer``'s unscaled gradients to a global L2 norm; returns the norm before clipping.

        When the gradients are still scaled, unscaling, the overflow check, the norm and the clip are done together.
        As ``torch.nn.utils.clip_grad_norm_`` (bit for bit), except that a non-finite norm (an overflow: the step will
        be skipped) leaves the gradients as they are, where torch's clip would turn the finite values into zeros and
        the infinite ones into NaN: the overflow record (:attr:`last_overflow`) then tells inf from NaN.
        """
        state = self._state(optimizer)
        if state.stage is not _Stage.UNSCALED:
            self._unscale(state, max_norm=float(max_norm))
        else:
            if self.master_weights:
                # The model's gradients, written since the unscale, are clipped.
                follow_cleared_grads(state, self.master_weights)
            state.grad_norm = _clip_unscaled(self._unscaled_params(optimizer), float(max_norm))
        assert state.grad_norm is not None
        self._grad_norms[state.loss_id or 0] = state.grad_norm
        return state.grad_norm

    def clip_grad_value_(self, optimizer: torch.optim.Optimizer, clip_value: float) -> None:
        """Clamp ``optimizer``'s unscaled gradients to ``[-clip_value, clip_value]``."""
        state = self._state(optimizer)
        if state.stage is not _Stage.UNSCALED:
            self._unscale(state)
        elif self.master_weights:
            follow_cleared_grads(state, self.master_weights)  # as in clip_grad_norm_
        params = self._unscaled_params(optimizer)
        if params:  # torch's clip refuses an empty list
            torch.nn.utils.clip_grad_value_(params, clip_value)

    def step(self, optimizer: torch.optim.Optimizer, **step_kwargs: Any) -> bool:
        """Step ``optimizer`` unless its gradients overflowed; returns whether it stepped.

        On overflow nothing is changed: parameters, optimizer state and (if the caller honours the return value)
        the learning-rate schedule stay as they were. The overflow counts against the losses whose gradients held
        the non-finite values (see :meth:`scale_loss`), not every loss that reached the optimizer.

        .. warning:: Reads the overflow flags on the host (one sync per step, as ``torch.amp.GradScaler`` does).

        Raises:
            LossScaleFloorError: on overflow with the scale at its floor and ``on_floor="raise"``; the step is
                skipped first.
        """
        state = self._state(optimizer)
        self._steps += 1
        if "closure" in step_kwargs and step_kwargs["closure"] is not None:
            raise ValueError(
                "closure: loss scaling cannot re-run a closure inside the optimizer step; run the closure first, "
                "then call step() without it."
            )
        if state.stage is not _Stage.UNSCALED:
            self._unscale(state)
        elif self.master_weights:
            follow_cleared_grads(state, self.master_weights)
        loss_ids = sorted(state.found_by_loss)
        # One tensor for the reduction across processes and one host read; all ranks then agree loss by loss.
        flags = (
            state.found_by_loss[loss_ids[0]].reshape(1)  # one loss, the usual case: a view, no kernel
            if len(loss_ids) == 1
            else torch.stack([state.found_by_loss[i].reshape(()) for i in loss_ids])
        )
        if self.found_inf_reducer is not None:
            self.found_inf_reducer(flags)
        self._record_found(dict(zip(loss_ids, flags.unbind(0))))
        overflowed = [i for i, flag in zip(loss_ids, flags.tolist()) if flag > 0]
        if overflowed:
            names = self._record_overflow(optimizer, overflowed)
            for loss_id in overflowed:
                self.skipped_steps[loss_id] += 1
            self._overflow_log.log(names, overflowed, self.scalers, self.last_overflow)
            self._finish_step(state)
            hint = floor_hint(optimizer, self.master_of, self.properties.opt_level)
            if self.scalers[overflowed[0]].on_floor == "promote" and any(
                self.scalers[i].at_floor() for i in overflowed
            ):
                why_not = self.promotion.floor_overflow(self.last_overflow)
                if why_not is None:
                    return False  # promoted (or waiting for the next overflow's evidence): training goes on
                hint = why_not + (f". {hint}" if hint else "")
            for loss_id in overflowed:
                self.scalers[loss_id].handle_overflow(names, hint=hint)
            return False
        if self.forensics.watch.active:
            self.forensics.stepped()  # an automatic watch ends with the first step that does not overflow
        if not self.master_weights:
            optimizer.step(**step_kwargs)
        else:
            mirrors = self._mirrors(state)
            for mirror in mirrors:
                mirror.take_writes()  # writes to the model since the last step (loaded weights, SWA, EMA...)
            with masters_in(state, self.master_weights):
                optimizer.step(**step_kwargs)
            for mirror in mirrors:
                mirror.copy_to_model()
        self._finish_step(state)
        return True

    def update(self) -> None:
        """Close the iteration: update the scale of every loss whose optimizers stepped, skipped or were unscaled
        since the last call, reset every optimizer's stage (as ``torch.amp.GradScaler.update()`` does), and clear
        the cast cache. Call it once per iteration, after the optimizer steps; with accumulation, only after the
        real step. No host sync.

        An optimizer that was unscaled (or clipped) but did not step, a skipped batch, starts the next iteration
        afresh: its overflow flag counts toward this update, and gradients it still holds are treated as the true
        values they are (scaled back up by the next backward, or stepped as they are by a step without one).
        """
        for state in self._optimizers.values():
            if state.stage is _Stage.UNSCALED:
                self._record_found(state.found_by_loss)
                state.stage = _Stage.SKIPPED
                state.found_by_loss, state.found_inf, state.grad_norm = {}, None, None
        for state in self._optimizers.values():
            if (
                state.stage is _Stage.READY
                and state.loss_id is not None
                and state.grad_scale is None
                and state.loss_id in self._iteration_found
            ):
                # Gradients pending across the update keep the scale they were computed with.
                state.grad_scale = self.scalers[state.loss_id].scale_tensor.clone()
        for loss_id, found in self._iteration_found.items():
            self.scalers[loss_id].update(found)
        self._iteration_found.clear()
        if self.policy is not None:
            self.policy.clear_cache()
        self.telemetry.requested = False  # a request covers one iteration

    # -- metrics and checkpoints --------------------------------------------------------------------------------
    def request_telemetry(self) -> None:
        """Measure underflow and headroom of the scaled gradients in every optimizer's unscale until the next
        :meth:`update` (call it before the step of an iteration whose metrics will be logged).

        The next :meth:`metrics` call then holds ``mpx/underflow/<group>``, ``mpx/zeros/<group>`` and
        ``mpx/headroom/<group>`` (see :mod:`lightning_mpx.telemetry`). The measurement runs in the unscale pass on the
        device, with no host sync; without a request nothing is measured.
        """
        self.telemetry.requested = True

    def metrics(self) -> dict[str, torch.Tensor | float]:
        """``mpx/loss_scale``, ``mpx/overflows`` (since the last call), ``mpx/skipped_steps`` (total) and
        ``mpx/grad_norm`` (unscaled, when computed), with a ``/loss{id}`` suffix when there are several losses;
        ``mpx/overflow/<module>``: the overflow steps since the last call in which the module had non-finite
        gradients (0 for a module that had some before; ``_root`` stands for the root module's own parameters).
        after a :meth:`request_telemetry`, ``mpx/underflow/<group>``, ``mpx/zeros/<group>`` and
        ``mpx/headroom/<group>`` too.

        Values are device tensors or Python numbers: building them does not wait for the device.
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
        if self.master_weights:
            self._make_held_masters()  # parameters added to an optimizer since its last step are saved too
        return {
            "opt_level": self.properties.opt_level,
            "half_dtype": str(self.properties.half_dtype),
            "scalers": [scaler.state_dict() for scaler in self.scalers],
            "master_weights": [masters.state_dict() for masters in self.master_weights if masters.alive],
            "skipped_steps": list(self.skipped_steps),
            "promotion": self.promotion.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (after :meth:`prepare_model`); masters come back bit-exact.

        When every model was prepared with ``train=False``, the checkpoint's masters are not needed and are left
        out: the half model's own weights come from the model's state dict.
        """
        self.master_weights = [masters for masters in self.master_weights if masters.alive]
        if self._evaluation_only and not self.master_weights:
            state = {**state, "master_weights": []}
        if len(state["scalers"]) != len(self.scalers):
            raise ValueError(
                f"the checkpoint has {len(state['scalers'])} loss scaler(s) but this Amp has num_losses="
                f"{len(self.scalers)}."
            )
        if len(state["master_weights"]) != len(self.master_weights):
            raise ValueError(
                f"the checkpoint has master weights for {len(state['master_weights'])} model(s) but "
                f"{len(self.master_weights)} model(s) were prepared with master weights."
            )
        promotion = state.get("promotion")
        self.promotion.check_state_dict(promotion)
        promoted_params = self.promotion.param_names(promotion)
        for masters, masters_state in zip(self.master_weights, state["master_weights"]):
            # All checks first: a refused checkpoint changes nothing.
            masters.check_state_dict(masters_state, fp32=promoted_params)
        for scaler, scaler_state in zip(self.scalers, state["scalers"]):
            scaler.load_state_dict(scaler_state)
        self.promotion.load_state_dict(promotion)  # the run that saved it promoted these modules: so does this one
        for masters, masters_state in zip(self.master_weights, state["master_weights"]):
            masters.load_state_dict(masters_state)
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

    def _state(self, optimizer: torch.optim.Optimizer) -> _OptimizerState:
        state = self._optimizers.get(id(optimizer))
        if state is None:
            raise RuntimeError(
                f"optimizer={type(optimizer).__name__} was not registered; call prepare_optimizer() on it first."
            )
        return state

    def _unscaled_params(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The tensors whose ``.grad`` holds ``optimizer``'s unscaled gradients (masters at O2), with a gradient."""
        return [p for p in self.master_params(optimizer) if p.grad is not None]

    def _refuse_sparse(self, param: torch.Tensor) -> None:
        name = self._names.get(id(param), "an unnamed parameter")
        raise ValueError(
            f"parameter {name} has a sparse gradient, which lightning_mpx cannot unscale or check for overflow; "
            "it needs dense gradients (for example nn.Embedding(..., sparse=False), the default)."
        )

    def _mirrors(self, state: _OptimizerState) -> list[Mirror]:
        """The optimizer's half parameters and their masters, one :class:`Mirror` per prepared model."""
        return mirrors(state, self.master_weights, compare=self.model_writes == "values")

    def _masters_in_hook(self, optimizer: torch.optim.Optimizer, *args: Any) -> None:
        swap_in(self._state(optimizer), self.master_weights)

    def _masters_out_hook(self, optimizer: torch.optim.Optimizer, *args: Any) -> Any:
        swap_out(self._state(optimizer))
        return args[0] if args else None  # the state_dict post-hook returns the state dict

    def _refuse_direct_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._state(optimizer).swapped is None:
            raise RuntimeError(
                "optimizer.step() was called on an optimizer prepared by lightning_mpx with FP32 master weights, "
                "outside Amp.step(): its groups hold the half model parameters and their gradients are still "
                "scaled. Call amp.step(optimizer) instead (the Lightning plugin and the Accelerate adapter do)."
            )

    def _unscale(self, state: _OptimizerState, max_norm: float | None = None) -> None:
        unscale_state(
            state,
            self.scalers[state.loss_id or 0],
            self.master_weights,
            backend=self.unscale_backend,
            refuse_sparse=self._refuse_sparse,
            telemetry=self.telemetry,
            names=self._names,
            max_norm=max_norm,
        )

    def _record_found(self, found_by_loss: dict[int, torch.Tensor]) -> None:
        """Add overflow flags to the ones the next :meth:`update` applies, loss by loss."""
        for loss_id, found in found_by_loss.items():
            seen = self._iteration_found.get(loss_id)
            self._iteration_found[loss_id] = found if seen is None else torch.maximum(seen, found)

    def show_unscaled_on_model(self, optimizer: torch.optim.Optimizer) -> None:
        """At O2, copy the unscaled FP32 master gradients into the half model's gradients (rounded), for code that
        reads the model's own gradients between the unscale and the step (Lightning's ``on_before_optimizer_step``
        hooks, ``grad_norm(self)``). The masters' FP32 gradients stay what the step uses.

        A master gradient given after the unscale to a parameter without a half gradient (Apex's ``scale_loss``
        adds the earlier blocks' gradients so) gets a half gradient too, so that a later ``p.grad = None`` or
        ``zero_grad`` on the model is seen, and clears it, as for any other parameter."""
        state = self._state(optimizer)
        if not self.master_weights or state.stage is not _Stage.UNSCALED:
            return
        follow_cleared_grads(state, self.master_weights)
        for param, master in param_pairs(state, self.master_weights):
            if master is not param and master.grad is not None:
                if param.grad is None:
                    param.grad = master.grad.to(param.dtype)
                else:
                    param.grad.copy_(master.grad)
        state.unscaled_marks = grad_marks(state, self.master_weights)  # the copies are ours, not the user's writes

    def _finish_step(self, state: _OptimizerState) -> None:
        if self.master_weights:
            # The FP32 gradients were the step's: freeing them keeps them out of the next forward's and backward's
            # peak memory. The half gradients are the user's, cleared by their zero_grad as in any loop.
            drop_master_grads(state, self.master_weights)
        state.reset()

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


def _clip_unscaled(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(params, max_norm)`` with its two halves (torch >= 2.6), the coefficient
    left at 1 for a non-finite norm (see :meth:`Amp.clip_grad_norm_`); older torch: its clip as it is."""
    get_norm = getattr(torch.nn.utils, "get_total_norm", None)
    clip_with = getattr(torch.nn.utils, "clip_grads_with_norm_", None)
    if get_norm is None or clip_with is None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    total = get_norm([p.grad for p in params if p.grad is not None])
    # A norm of 0 makes torch's coefficient max_norm / 1e-6, clamped to 1: the gradients are multiplied by one.
    clip_with(params, max_norm, torch.where(torch.isfinite(total), total, 0.0))
    return total
