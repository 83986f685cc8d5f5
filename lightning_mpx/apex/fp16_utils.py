"""Apex's ``apex.fp16_utils``: ``FP16_Optimizer`` over :class:`lightning_mpx.Amp`, and the manual master helpers.

::

    from lightning_mpx.apex.fp16_utils import FP16_Optimizer, network_to_half   # was: from apex.fp16_utils import ...

    model = network_to_half(model)
    optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), dynamic_loss_scale=True)
    optimizer.zero_grad()
    optimizer.backward(loss)
    optimizer.step()

``FP16_Optimizer`` is an O2 :class:`~lightning_mpx.Amp` (no casts, FP32 masters for the optimizer's half parameters,
FP32 parameters stepped as they are) with one loss scaler: the scaling, overflow check, skip and masters are the
core's. Its dynamic scaler follows Apex's old ``DynamicLossScaler`` settings (``init_scale=2**32``,
``scale_factor=2``, ``scale_window=1000``, floor 1; Megatron-LM's ``delayed_shift`` is the core's ``hysteresis``).
``FP16Model``, ``convert_network``, ``convert_module`` and ``clip_grad_norm`` are Apex's too.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterable, NoReturn

import torch
from torch import nn

from lightning_mpx.apex._state import is_rank_zero
from lightning_mpx.common.keywords import check_keywords, checks_keywords
from lightning_mpx.engine.amp import Amp
from lightning_mpx.engine.clipping import clip_limit
from lightning_mpx.settings import check_flag

__all__ = [
    "BN_convert_float",
    "FP16Model",
    "FP16_Optimizer",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "network_to_half",
    "prep_param_lists",
    "to_python_float",
    "tofp16",
]

log = logging.getLogger("lightning_mpx.apex")
_HALF = (torch.float16, torch.bfloat16)
_DYNAMIC_ARGS = ("init_scale", "scale_factor", "scale_window", "min_scale", "delayed_shift")


class _HalfParameters(nn.Module):
    """Holds the optimizer's half parameters so that the core can make their FP32 masters (it makes masters per
    model); FP32 parameters are left out and stepped as they are, as Apex's FP16_Optimizer did."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        super().__init__()
        for i, param in enumerate(params):
            self.register_parameter(f"param{i}", param)


class FP16_Optimizer:
    """Apex's ``FP16_Optimizer``: FP32 master weights and loss scaling around ``init_optimizer``.

    Args:
        init_optimizer: An optimizer over the (half) model's parameters.
        static_loss_scale: The scale when ``dynamic_loss_scale`` is False.
        dynamic_loss_scale: Scale dynamically (backs off on overflow, grows after ``scale_window`` clean steps).
        dynamic_loss_args: Apex's ``DynamicLossScaler`` arguments: ``init_scale``, ``scale_factor``,
            ``scale_window``; Megatron-LM's ``min_scale`` and ``delayed_shift`` (the overflows it takes to back off,
            restored when the scale grows) too.
        verbose: Log the overflow messages (rank zero only).
    """

    @checks_keywords("FP16_Optimizer()")  # Python's TypeError named no valid keyword
    def __init__(
        self,
        init_optimizer: torch.optim.Optimizer,
        static_loss_scale: float = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: dict[str, Any] | None = None,
        verbose: bool = True,
    ) -> None:
        if not isinstance(init_optimizer, torch.optim.Optimizer):
            raise TypeError(f"init_optimizer={type(init_optimizer).__name__} is not a torch.optim.Optimizer.")
        check_flag("dynamic_loss_scale", dynamic_loss_scale)  # a string 'False' would otherwise turn scaling on
        args = dict(dynamic_loss_args or {})
        unknown = sorted(set(args) - set(_DYNAMIC_ARGS))
        if unknown:
            raise TypeError(
                f"dynamic_loss_args has unknown key(s) {unknown}; valid choices: {', '.join(_DYNAMIC_ARGS)}."
            )
        if args and not dynamic_loss_scale:
            raise ValueError("dynamic_loss_args is only used with dynamic_loss_scale=True.")
        scale_factor = float(args.get("scale_factor", 2.0))
        self.verbose = verbose
        half = [p for g in init_optimizer.param_groups for p in g["params"] if p.dtype in _HALF]
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in half})
        if len(dtypes) > 1:
            raise ValueError(
                f"init_optimizer holds parameters of both half dtypes ({', '.join(dtypes)}); FP16_Optimizer trains one "
                "half dtype: make the model one (model.half() or model.bfloat16()) before building the optimizer."
            )
        dynamic = dict(  # what only a dynamic scale reads: a static one is given none (the engine would warn)
            init_scale=float(args.get("init_scale", 2.0**32)),
            growth_factor=scale_factor,
            backoff_factor=1.0 / scale_factor,
            growth_interval=int(args.get("scale_window", 1000)),
            min_loss_scale=float(args.get("min_scale", 1.0)),
            hysteresis=int(args.get("delayed_shift", 1)),
            max_loss_scale=float(torch.finfo(torch.float32).max),
        ) if dynamic_loss_scale else {}
        self.amp = Amp(
            "O2" if half else "O0",  # an all-FP32 optimizer needs no masters: loss scaling only
            # The model's own half dtype (a bfloat16 model stays bfloat16: its range is not float16's); float16,
            # Apex's, for an all-FP32 optimizer (the core's default would pick bfloat16 on a CPU).
            half_dtype=dtypes[0] if dtypes else "float16",
            loss_scale="dynamic" if dynamic_loss_scale else static_loss_scale,
            **dynamic,  # type: ignore[arg-type]
            on_floor="warn",
            skip_on_device=False,  # Apex's FP16_Optimizer sets self.overflow at its step: read on the host there
        )
        self.amp.log_overflows = False
        self.optimizer = init_optimizer
        self._holder = self.amp.prepare_model(_HalfParameters(half)) if half else None
        self.amp.prepare_optimizer(init_optimizer)
        self.overflow = False
        self.first_closure_call_this_step = True

    # -- the loop -------------------------------------------------------------------------------------------------
    def zero_grad(self, set_grads_to_None: bool = False, **misspelt: NoReturn) -> None:
        """Zero the model gradients (the masters' are cleared by the step)."""
        if misspelt:  # refused naming the valid ones (common/keywords.py: no wrapper on a per-step call)
            check_keywords("FP16_Optimizer.zero_grad()", misspelt, ("set_grads_to_None",))
        self.optimizer.zero_grad(set_to_none=set_grads_to_None)

    def backward(
        self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False, **misspelt: NoReturn
    ) -> None:
        """``(loss.float() * loss_scale).backward()``; then, unless ``update_master_grads=False``, unscale into the
        FP32 master gradients. Several calls before one step accumulate."""
        if misspelt:
            check_keywords("FP16_Optimizer.backward()", misspelt, ("loss", "update_master_grads", "retain_graph"))
        self.amp.backward(loss.float(), retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Unscale the model gradients into the FP32 master gradients and check them for overflow."""
        if not self.amp.is_unscaled(self.optimizer):
            self.amp.unscale_(self.optimizer)

    def clip_master_grads(self, max_norm: float, norm_type: float = 2, **misspelt: NoReturn) -> float:
        """Clip the master gradients to a global ``norm_type`` norm; returns the norm before clipping (``-1`` on
        overflow)."""
        if misspelt:
            check_keywords("FP16_Optimizer.clip_master_grads()", misspelt, ("max_norm", "norm_type"))
        if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
            raise ValueError(f"norm_type={norm_type!r} is not valid; valid choices: a positive number or inf.")
        if float(norm_type) == 2.0:
            norm = float(self.amp.clip_grad_norm_(self.optimizer, max_norm))
            return -1.0 if not math.isfinite(norm) else norm
        max_norm = clip_limit("max_norm", max_norm)  # as the engine's clip above: torch's flips or zeroes them
        self.update_master_grads()
        if self.amp.overflowed(self.optimizer):
            return -1.0  # Apex's answer on overflow; the gradients stay for the step to skip
        masters = list(self.amp.master_params(self.optimizer))
        return float(torch.nn.utils.clip_grad_norm_(masters, max_norm, norm_type=norm_type))

    def step(self, closure: Callable[[], Any] | None = None, **misspelt: NoReturn) -> None:
        """Step the optimizer on the FP32 masters, or skip on overflow (and back the scale off)."""
        if misspelt:
            check_keywords("FP16_Optimizer.step()", misspelt, ("closure",))
        if closure is not None:
            raise NotImplementedError(
                "closure: FP16_Optimizer.step(closure) is not supported here (loss scaling cannot re-run a closure "
                "inside the step); run the closure, call backward(), then step()."
            )
        scale = self.loss_scale
        self.overflow = not self.amp.step(self.optimizer)
        self.amp.update()
        if self.overflow and self.verbose and is_rank_zero():
            log.info("OVERFLOW! Skipping step. Attempted loss scale: %s, reducing to %s", scale, self.loss_scale)

    # -- state --------------------------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.amp.scalers[0].get_scale()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def state_dict(self) -> dict[str, Any]:
        """Apex's keys (``loss_scaler`` as a dict here, not a pickled object) plus the core's state with the exact
        FP32 masters under ``'lightning_mpx'``."""
        full = self.amp.state_dict()
        return {
            "loss_scaler": full["scalers"][0],
            "dynamic_loss_scale": self.amp.scalers[0].dynamic,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "lightning_mpx": full,
        }

    @checks_keywords("FP16_Optimizer.load_state_dict()")
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "lightning_mpx" not in state_dict:
            raise ValueError(
                "state_dict has no 'lightning_mpx' entry: only FP16_Optimizer.state_dict() output of lightning_mpx "
                "loads (Apex's pickled a LossScaler object and the masters under another layout)."
            )
        self.amp.load_state_dict(state_dict["lightning_mpx"])
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        self.overflow = bool(state_dict.get("overflow", False))

    def __repr__(self) -> str:
        return f"FP16_Optimizer({self.optimizer!r}, {self.amp.scalers[0]!r})"


# -- manual master helpers --------------------------------------------------------------------------------------------
class tofp16(nn.Module):  # noqa: N801 - Apex's name
    """Casts its input to half (the first module of :func:`network_to_half`)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        return input.half()


@checks_keywords("BN_convert_float()")
def BN_convert_float(module: nn.Module) -> nn.Module:  # noqa: N802 - Apex's name
    """Make the affine batch-norm modules of ``module`` FP32 again (in place), as Apex."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine:
        module.float()
    for child in module.children():
        BN_convert_float(child)
    return module


@checks_keywords("convert_module()")
def convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``module``'s own floating-point parameters (and their gradients) and buffers to ``dtype`` in place, as
    Apex (children untouched)."""
    for param in module.parameters(recurse=False):
        if param.is_floating_point():
            param.data = param.data.to(dtype)
            if param.grad is not None and param.grad.is_floating_point():
                param.grad.data = param.grad.data.to(dtype)
    for buf in module.buffers(recurse=False):
        if buf.is_floating_point():
            buf.data = buf.data.to(dtype)


@checks_keywords("convert_network()")
def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Cast every module of ``network`` to ``dtype`` but the affine batch norms (their statistics too stay FP32), as
    Apex; returns ``network``."""
    if not isinstance(network, nn.Module):
        raise TypeError(f"network={type(network).__name__} is not a torch.nn.Module.")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype={dtype!r} must be a floating-point torch.dtype, such as torch.half.")
    for module in network.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine:
            continue
        convert_module(module, dtype)
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()
    return network


class FP16Model(nn.Module):
    """Apex's ``FP16Model``: ``network`` in float16 (affine batch norms in FP32), its inputs cast to float16."""

    @checks_keywords("FP16Model()")
    def __init__(self, network: nn.Module) -> None:  # noqa: D107
        super().__init__()
        self.network = convert_network(network, dtype=torch.half)

    def forward(self, *inputs: torch.Tensor) -> Any:  # noqa: D102
        return self.network(*(t.half() for t in inputs))


#: Apex's alias of ``torch.nn.utils.clip_grad_norm_``.
clip_grad_norm = torch.nn.utils.clip_grad_norm_


@checks_keywords("network_to_half()")
def network_to_half(network: nn.Module) -> nn.Module:
    """``nn.Sequential(tofp16(), BN_convert_float(network.half()))``, as Apex."""
    return nn.Sequential(tofp16(), BN_convert_float(network.half()))


@checks_keywords("prep_param_lists()")
def prep_param_lists(model: nn.Module, flat_master: bool = False) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(model_params, master_params)``: the trainable parameters and FP32 copies of them (one flat tensor when
    ``flat_master``)."""
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        master = torch.cat([p.detach().reshape(-1).float() for p in model_params])
        flat = nn.Parameter(master)
        flat.grad = torch.zeros_like(flat)
        return model_params, [flat]
    masters = [nn.Parameter(p.detach().clone().float()) for p in model_params]
    return model_params, masters


def model_grads_to_master_grads(
    model_params: list[torch.Tensor], master_params: list[torch.Tensor], flat_master: bool = False,
    **misspelt: NoReturn,
) -> None:
    """Copy the model gradients into the master gradients (as FP32)."""
    if misspelt:  # refused naming the valid ones (common/keywords.py: no wrapper on a per-step call)
        check_keywords("model_grads_to_master_grads()", misspelt, ("model_params", "master_params", "flat_master"))
    if flat_master:
        grads = [
            p.grad.reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=p.device)
            for p in model_params
        ]
        master_params[0].grad = torch.cat([g.float() for g in grads])
        return
    for model, master in zip(model_params, master_params):
        if model.grad is None:
            master.grad = None
            continue
        if master.grad is None:
            master.grad = torch.empty_like(master)
        master.grad.copy_(model.grad)


def master_params_to_model_params(
    model_params: list[torch.Tensor], master_params: list[torch.Tensor], flat_master: bool = False,
    **misspelt: NoReturn,
) -> None:
    """Copy the master values into the model parameters."""
    if misspelt:
        check_keywords("master_params_to_model_params()", misspelt, ("model_params", "master_params", "flat_master"))
    with torch.no_grad():
        if flat_master:
            offset = 0
            flat = master_params[0]
            for model in model_params:
                n = model.numel()
                model.copy_(flat[offset:offset + n].view_as(model))
                offset += n
            return
        for model, master in zip(model_params, master_params):
            model.copy_(master)


def to_python_float(t: Any, **misspelt: NoReturn) -> float:
    """``t.item()`` for a tensor, ``t[0]`` for a sequence, as Apex."""
    if misspelt:
        check_keywords("to_python_float()", misspelt, ("t",))
    if hasattr(t, "item"):
        return t.item()
    return t[0]
