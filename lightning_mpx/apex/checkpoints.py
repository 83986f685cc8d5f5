"""What Apex scripts save, load and clip: ``amp.state_dict()``, ``amp.load_state_dict()`` (Apex's format, or the
core's) and ``amp.master_params(optimizer)``."""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch

from lightning_mpx.apex._state import _amp_state
from lightning_mpx.apex.loss_scaling import AmpOptimizer, _wrapper_of


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The tensors ``optimizer`` updates: the FP32 masters at O2 (their ``.grad`` holds the unscaled gradients after
    a ``scale_loss`` block), the parameters otherwise. For ``clip_grad_norm_(amp.master_params(opt), ...)``."""
    inner = optimizer.optimizer if isinstance(optimizer, AmpOptimizer) else optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer={type(optimizer).__name__} is not an optimizer (pass the one amp.initialize returned)."
        )
    wrapper = _wrapper_of(optimizer)
    if wrapper is None:
        for group in inner.param_groups:
            yield from group["params"]
        return
    yield from wrapper._engine.master_params(inner)


def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """Apex's format, ``{'loss_scaler0': {'loss_scale': float, 'unskipped': int}, ...}``, plus the core's full state
    (scalers and exact FP32 masters) under ``'lightning_mpx'``, which Apex ignores with a warning."""
    amp = _amp_state.require()
    out = {} if destination is None else destination
    full = amp.state_dict()
    for i, scaler_state in enumerate(full["scalers"]):
        out[f"loss_scaler{i}"] = {
            "loss_scale": float(scaler_state["scale"]),
            "unskipped": int(scaler_state["growth_tracker"]),
        }
    out["lightning_mpx"] = full
    return out


def load_state_dict(state: dict[str, Any]) -> None:
    """Load :func:`state_dict` output, an Apex checkpoint's ``"amp"`` entry, or a core ``Amp.state_dict()``."""
    amp = _amp_state.amp
    if amp is None:
        raise RuntimeError(
            "amp.load_state_dict() was called before amp.initialize() (or after initialize(enabled=False)): call "
            "amp.initialize(model, optimizer, ...) first, then model.load_state_dict(...), "
            "optimizer.load_state_dict(...) and amp.load_state_dict(checkpoint['amp']), in Apex's documented order."
        )
    if not isinstance(state, Mapping):
        raise TypeError(f"state={type(state).__name__} must be the dict that amp.state_dict() returned.")
    # Restoring into the optimizer initialize() returned is the documented order: nothing to refuse later.
    _amp_state.loaded = None if _amp_state.restored is amp else amp
    if "scalers" in state:  # the core's own format
        amp.load_state_dict(state)
        return
    if "lightning_mpx" in state:
        amp.load_state_dict(state["lightning_mpx"])
        return
    keys = sorted(k for k in state if k.startswith("loss_scaler"))
    unexpected = sorted(set(state) - set(keys))
    if unexpected:
        raise ValueError(f"state has unexpected keys {unexpected}; valid keys: loss_scaler0 to loss_scaler"
                         f"{amp.num_losses - 1}.")
    if len(keys) != amp.num_losses:
        raise ValueError(
            f"state has {len(keys)} loss scaler(s) but amp.initialize() was called with num_losses={amp.num_losses}."
        )
    for i, scaler in enumerate(amp.scalers):
        entry = state[f"loss_scaler{i}"]
        current = scaler.state_dict()
        scaler.load_state_dict({
            "scale": float(entry["loss_scale"]),
            "growth_tracker": int(entry["unskipped"]),
            "hysteresis_tracker": scaler.hysteresis,
            "overflows": current["overflows"],
        })
