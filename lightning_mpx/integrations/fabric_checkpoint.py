"""The Fabric plugin's checkpoint entry at O2: each FP32 master written once.

At O2 a model the Fabric plugin set up gives its FP32 masters from ``state_dict()``
(:class:`~lightning_mpx.integrations.fp32_export.MastersInStateDict`), so the documented save
(``fabric.save(path, {"model": model, "optimizer": optimizer, "mpx": mpx})``) holds them in the model's entry. Fabric
asks the plugin for its state on its own, without the other entries, so the plugin's entry
(:func:`masters_left_to_models`) leaves out the masters of the models that carry the hook (any save of the model holds
them), names them (:data:`~lightning_mpx.engine.checkpoint.MASTERS_IN_STATE_DICT`, as the Trainer plugin's entry
does) and records a checksum of each. On load, in either order, the engine takes them from the model's load (its load
hooks take an FP32 value loaded into the half model exactly). A plugin entry loaded without the model's
is the engine's to check (:class:`~lightning_mpx.engine.held_masters.HeldMasters`); the plugin checks it at its next
call (a forward, a backward), before the step, naming Fabric's calls.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from lightning_mpx.engine.amp import Amp
from lightning_mpx.engine.checkpoint import MASTERS_IN_STATE_DICT

# The check of the masters a loaded entry left to the model's entry is the engine's; its old import path here keeps
# working.
from lightning_mpx.engine.held_masters import MASTER_HALF_SUMS, MASTER_SUMS, HeldMasters, checksums
from lightning_mpx.integrations.fp32_export import MastersInStateDict

__all__ = ["MASTER_SUMS", "HeldMasters", "lean_state_dict", "masters_left_to_models", "shared_masters"]

_HALVES = (torch.float16, torch.bfloat16)


def _hooked_params(amp: Amp, modules: Iterable[nn.Module], hook_type: type = MastersInStateDict) -> set[int]:
    """The ids of the half parameters of ``modules`` that carry ``amp``'s state-dict post-hook of ``hook_type``
    (:class:`MastersInStateDict`; the Apex layer's FP32 state-dict hook): their ``state_dict()`` gives those
    parameters' FP32 masters."""
    out: set[int] = set()
    for module in modules:
        hooks = [h for h in module._state_dict_hooks.values() if isinstance(h, hook_type)]
        if any(h._amp is not None and h._amp() is amp for h in hooks):
            out.update(id(p) for p in module.parameters() if p.dtype in _HALVES)
    return out


def shared_masters(amp: Amp, modules: Iterable[nn.Module], hook_type: type = MastersInStateDict) -> set[int]:
    """The ids of the parameters whose masters :func:`masters_left_to_models` leaves to the state dicts of
    ``modules``: what ``amp``'s state dict may hold as the live masters, not copies (``amp._state_dict(shared)``),
    when the lean entry drops them at once. None below O2 or for a sharded engine."""
    if not amp.properties.master_weights or amp.sharded:
        return set()
    return _hooked_params(amp, modules, hook_type)


def lean_state_dict(amp: Amp, modules: Iterable[nn.Module], *, hook_type: type = MastersInStateDict) -> dict[str, Any]:
    """``amp``'s state dict without the masters that the state dicts of ``modules`` hold
    (:func:`masters_left_to_models`), those masters never copied: the entry a front door saves beside its models'
    (a copy of each, dropped at once, was a model's worth of FP32 memory at every save)."""
    modules = list(modules)
    return masters_left_to_models(amp, modules, amp._state_dict(shared_masters(amp, modules, hook_type)),
                                  hook_type=hook_type)  # fmt: skip


def masters_left_to_models(
    amp: Amp, modules: Iterable[nn.Module], state: dict[str, Any], *, hook_type: type = MastersInStateDict
) -> dict[str, Any]:
    """``state`` (the engine's state dict) without the masters that the state dicts of ``modules`` (the models the
    plugin set up; their state-dict hook is a ``hook_type``) hold, in place: named under
    :data:`MASTERS_IN_STATE_DICT`, with their checksums under :data:`MASTER_SUMS` and those of their rounding to the
    half dtype under :data:`MASTER_HALF_SUMS` (what the half model holds when the entries are resumed at O3). Unchanged
    below O2, for a sharded engine (the hook is inert there) and with no such model."""
    saved = state.get("master_weights")
    if not amp.properties.master_weights or amp.sharded or not isinstance(saved, list) or not saved:
        return state
    hooked = _hooked_params(amp, modules, hook_type)
    if not hooked:
        return state
    held: list[list[str]] = []
    sums: list[dict[str, int]] = []
    half_sums: dict[str, list[dict[str, int]]] = {str(half): [] for half in _HALVES}
    for weights, masters in zip(amp._masters.prune(), saved):  # the engine's order: its live models'
        params = {entry.name: param for entry, param in weights._live()}
        names = [name for name in masters if name in params and id(params[name]) in hooked]
        # Each master's checksum and those of its rounding to each half dtype (a resume at O3 may take either; the
        # model's entry holds the FP32 masters, which it rounds once): each rounding made and summed in turn.
        values = {n: masters[n] for n in names}
        sums.append(checksums(values))
        for half in _HALVES:
            half_sums[str(half)].append(checksums(values, rounded=half))
        for name in names:
            del masters[name]
        held.append(names)
    state[MASTERS_IN_STATE_DICT] = held
    state[MASTER_SUMS] = sums
    state[MASTER_HALF_SUMS] = half_sums
    return state
