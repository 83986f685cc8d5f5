"""What Apex scripts save, load and clip: ``amp.state_dict()``, ``amp.load_state_dict()`` (Apex's format, or the
core's) and ``amp.master_params(optimizer)``."""

from __future__ import annotations

import itertools
import operator
from typing import Any, Iterator, Mapping, NoReturn

import torch

from lightning_mpx.apex._state import _amp_state
from lightning_mpx.apex.loss_scaling import AmpOptimizer, _wrapper_of
from lightning_mpx.apex.model_hooks import _Fp32StateDict
from lightning_mpx.common.keywords import check_keywords, checks_keywords
from lightning_mpx.engine.amp import Amp
from lightning_mpx.engine.held_masters import HeldMasters, shown
from lightning_mpx.integrations.fabric_checkpoint import lean_state_dict


def master_params(optimizer: torch.optim.Optimizer, **misspelt: NoReturn) -> Iterator[torch.Tensor]:
    """The tensors ``optimizer`` updates: the FP32 masters at O2 (their ``.grad`` holds the unscaled gradients after
    a ``scale_loss`` block), the parameters otherwise. For ``clip_grad_norm_(amp.master_params(opt), ...)``.

    An iterator over a list made at the call (no generator: resuming one is a Python call per parameter, at every
    clip of the Apex habit); a bad argument is refused at the call."""
    if misspelt:  # refused naming the valid one (common/keywords.py: no wrapper on a per-step call)
        check_keywords("amp.master_params()", misspelt, ("optimizer",))
    inner = optimizer.optimizer if isinstance(optimizer, AmpOptimizer) else optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer={type(optimizer).__name__} is not an optimizer (pass the one amp.initialize returned)."
        )
    wrapper = _wrapper_of(optimizer)
    if wrapper is None:
        return iter(list(itertools.chain.from_iterable(map(operator.itemgetter("params"), inner.param_groups))))
    return iter(wrapper._engine.master_params(inner))


@checks_keywords("amp.state_dict()")
def state_dict(destination: dict[str, Any] | None = None) -> dict[str, Any]:
    """Apex's format, ``{'loss_scaler0': {'loss_scale': float, 'unskipped': int}, ...}``, plus the core's state
    under ``'lightning_mpx'``, which Apex ignores with a warning. At O2 the FP32 masters of the models given to
    ``initialize`` are named there, not held: their ``model.state_dict()`` gives them exactly (Apex's checkpoint
    saves it beside this), so each master is written once; masters of no such model (or of models given with
    ``cast_model_type=False``, whose load rounds) are held."""
    amp = _amp_state.require()
    out = {} if destination is None else destination
    # With cast_model_type=False the models were not prepared (a holder of their half parameters was): loading FP32
    # values into them rounds, so their masters stay in this entry.
    kept = _amp_state.holder is not None
    models = [model for model, engine in list(_amp_state.models.items()) if engine is amp and not kept]
    full = lean_state_dict(amp, models, hook_type=_Fp32StateDict)
    for i, scaler_state in enumerate(full["scalers"]):
        out[f"loss_scaler{i}"] = {
            "loss_scale": float(scaler_state["scale"]),
            "unskipped": int(scaler_state["growth_tracker"]),
        }
    out["lightning_mpx"] = full
    return out


@checks_keywords("amp.load_state_dict()")
def load_state_dict(state_dict: dict[str, Any]) -> None:
    """Load :func:`state_dict` output, an Apex checkpoint's ``"amp"`` entry, or a core ``Amp.state_dict()``
    (``state_dict``: Apex's name for the argument, which a script may pass by name)."""
    state = state_dict
    amp = _amp_state.amp
    if amp is None:
        raise RuntimeError(
            "amp.load_state_dict() was called before amp.initialize() (or after initialize(enabled=False)): call "
            "amp.initialize(model, optimizer, ...) first, then model.load_state_dict(...), "
            "optimizer.load_state_dict(...) and amp.load_state_dict(checkpoint['amp']), in Apex's documented order."
        )
    if not isinstance(state, Mapping):
        raise TypeError(f"state_dict={type(state).__name__} must be the dict that amp.state_dict() returned.")
    core = state if "scalers" in state else state.get("lightning_mpx")  # the core's own format, or this layer's
    entries = None if isinstance(core, Mapping) else _loss_scaler_entries(state, amp.num_losses)  # before any change
    # Restoring into the optimizer initialize() returned is the documented order: nothing to refuse later.
    _amp_state.loaded = None if _amp_state.restored is amp else amp
    _amp_state.held = None  # this load replaces an earlier one's (loss scales alone: the user's own weights)
    if entries is None:
        amp.load_state_dict(core)  # type: ignore[arg-type]  (the engine notes the masters left to the model's entry)
        held = amp._checkpoint.held
        _amp_state.held = _ModelEntryMasters(held) if held.pending else None
        return
    for scaler, (scale, unskipped) in zip(amp.scalers, entries):
        current = scaler.state_dict()
        scaler.load_state_dict(
            {
                "scale": scale,
                "growth_tracker": unskipped,
                "hysteresis_tracker": scaler.hysteresis,
                "overflows": current["overflows"],
            }
        )
    amp._checkpoint.held.pending = []  # nor does the engine check an earlier load's masters: the user's weights


def _loss_scaler_entries(state: Mapping[str, Any], num_losses: int) -> list[tuple[float, int]]:
    """Each loss scaler's ``(loss_scale, unskipped)`` in an Apex ``amp.state_dict()``, or a ``ValueError`` naming the
    key and what is valid (a bare ``KeyError``/``TypeError`` from inside before)."""
    keys = sorted(k for k in state if k.startswith("loss_scaler"))
    valid = f"valid keys: loss_scaler0 to loss_scaler{num_losses - 1}"
    unexpected = sorted(set(state) - set(keys))
    if unexpected:
        raise ValueError(f"state has unexpected keys {unexpected}; {valid}.")
    if len(keys) != num_losses:
        raise ValueError(
            f"state has {len(keys)} loss scaler(s) but amp.initialize() was called with num_losses={num_losses}."
        )
    expected = [f"loss_scaler{i}" for i in range(num_losses)]
    if keys != sorted(expected):
        raise ValueError(f"state has keys {keys}; {valid} (num_losses={num_losses}).")
    entries = []
    for key in expected:
        entry = state[key]
        try:
            entries.append((float(entry["loss_scale"]), int(entry["unskipped"])))
        except (TypeError, KeyError, ValueError, IndexError):
            raise ValueError(
                f"state[{key!r}]={entry!r} is not an Apex loss scaler's entry; valid: a dict "
                "{'loss_scale': <a positive number>, 'unskipped': <an integer>}, as amp.state_dict() writes it."
            ) from None
    return entries


class _ModelEntryMasters:
    """The masters a loaded ``amp.state_dict()`` names (the model's entry of the checkpoint holds them; ``held``, the
    engine's :class:`~lightning_mpx.engine.held_masters.HeldMasters`), checked at the next ``scale_loss`` block: by
    then the model's state dict must have given them, bit for bit."""

    def __init__(self, held: HeldMasters) -> None:
        self.held = held

    def check(self, amp: Amp) -> None:
        """Raise ``RuntimeError`` (at every later call too) if a named master is not the saved one; otherwise stop
        checking. Unlike the engine's check, a write since the load is no excuse: the masters Apex's checkpoint
        restores are the saved ones, which the model entry loaded from another checkpoint (or none) does not give."""
        missing = self.held.missing(amp, written_ok=False)
        if not missing:
            return
        raise RuntimeError(
            f"amp.load_state_dict() loaded a checkpoint whose 'amp' entry leaves the FP32 master weights of "
            f"{len(missing)} parameter(s) ({shown(missing)}) to its 'model' entry (at O2 model.state_dict() holds "
            "them, so the file holds each once), and the model does not hold those weights: its checkpoint entry was "
            "not loaded, or one of another model or checkpoint was. Training on would start from other masters than "
            "the checkpoint's. Load the model entry saved with it, in Apex's order: "
            "model.load_state_dict(ckpt['model']), optimizer.load_state_dict(ckpt['optimizer']), "
            "amp.load_state_dict(ckpt['amp']) (any order works), before "
            "the next amp.scale_loss() block. To train from other weights on purpose (keeping the checkpoint's loss "
            "scales), load the amp entry's loss scales alone: "
            "amp.load_state_dict({k: v for k, v in ckpt['amp'].items() if k.startswith('loss_scaler')})."
        )
