"""The Fabric plugin's checkpoint entry at O2: each FP32 master written once.

At O2 a model the Fabric plugin set up gives its FP32 masters from ``state_dict()``
(:class:`~lightning_mpx.integrations.fp32_export.MastersInStateDict`), so the documented save
(``fabric.save(path, {"model": model, "optimizer": optimizer, "mpx": mpx})``) holds them in the model's entry. Fabric
asks the plugin for its state on its own, without the other entries, so the plugin's entry
(:func:`masters_left_to_models`) leaves out the masters of the models that carry the hook (any save of the model holds
them), names them (:data:`~lightning_mpx.engine.checkpoint.MASTERS_IN_STATE_DICT`, as the Trainer plugin's entry
does) and records a checksum of each. On load, in either order, the engine takes them from the model's load (its load
hooks take an FP32 value loaded into the half model exactly). A plugin entry loaded without the model's
(:class:`HeldMasters`): at the next call into the plugin (a forward, a backward), masters that are not the saved ones
(by their checksums) and that nothing wrote since the plugin's load raise an error naming the fix, instead of
training on this run's masters silently. Masters written since (weights loaded into the model on purpose after the
plugin's entry, even the values it held already) are the user's choice and are kept.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from lightning_mpx.engine.amp import Amp
from lightning_mpx.engine.checkpoint import MASTERS_IN_STATE_DICT
from lightning_mpx.integrations.fp32_export import MastersInStateDict
from lightning_mpx.masters.renames import prefix_change, renamed

__all__ = ["MASTER_SUMS", "HeldMasters", "masters_left_to_models"]

#: The key of the Fabric plugin's entry holding, for each model, a checksum of each master its model's entry holds.
MASTER_SUMS = "masters_in_state_dict_sums"
_HALVES = (torch.float16, torch.bfloat16)


def _checksums(values: dict[str, torch.Tensor]) -> dict[str, int]:
    """By name, the sum of each FP32 tensor's bit patterns as 64-bit integers (exact and order-free: the same on
    every device; one host read for all)."""
    names = [name for name, value in values.items() if value.dtype == torch.float32 and value.numel()]
    if not names:
        return {}
    sums = [values[name].detach().reshape(-1).view(torch.int32).sum(dtype=torch.int64) for name in names]
    return dict(zip(names, torch.stack([s.cpu() for s in sums]).tolist()))


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


def masters_left_to_models(
    amp: Amp, modules: Iterable[nn.Module], state: dict[str, Any], *, hook_type: type = MastersInStateDict
) -> dict[str, Any]:
    """``state`` (the engine's state dict) without the masters that the state dicts of ``modules`` (the models the
    plugin set up; their state-dict hook is a ``hook_type``) hold, in place: named under
    :data:`MASTERS_IN_STATE_DICT`, with their checksums under :data:`MASTER_SUMS`. Unchanged below O2, for a sharded
    engine (the hook is inert there) and with no such model."""
    saved = state.get("master_weights")
    if not amp.properties.master_weights or amp.sharded or not isinstance(saved, list) or not saved:
        return state
    hooked = _hooked_params(amp, modules, hook_type)
    if not hooked:
        return state
    held: list[list[str]] = []
    sums: list[dict[str, int]] = []
    for weights, masters in zip(amp._masters.prune(), saved):  # the engine's order: its live models'
        params = {entry.name: param for entry, param in weights._live()}
        names = [name for name in masters if name in params and id(params[name]) in hooked]
        sums.append(_checksums({name: masters[name] for name in names}))
        for name in names:
            del masters[name]
        held.append(names)
    state[MASTERS_IN_STATE_DICT] = held
    state[MASTER_SUMS] = sums
    return state


class HeldMasters:
    """The masters a loaded plugin entry left to the model's entry, checked at the next call into the plugin."""

    def __init__(self) -> None:
        # (model index, saved sums, sums at load, the model's parameters' versions at load)
        self.pending: list[tuple[int, dict[str, int], dict[str, int], dict[str, int]]] = []

    def loaded(self, amp: Amp, state: dict[str, Any]) -> None:
        """After the engine loaded ``state``: note the named masters that are not the saved ones yet (the model's
        entry loads after the plugin's, or never)."""
        self.pending = []
        saved_sums = state.get(MASTER_SUMS) if isinstance(state, dict) else None
        if not amp.properties.master_weights and amp.properties.casts_model:
            return  # resumed at O3: the half model holds the masters' rounding, which the model's entry gives
        for index, saved in enumerate(saved_sums or ()):
            saved = _by_live_names(saved, _live_values(amp, index))
            now = _live_sums(amp, index, saved)
            if any(now.get(name) != value for name, value in saved.items()):
                self.pending.append((index, dict(saved), now, _versions(amp, index)))

    def check(self, amp: Amp) -> None:
        """Raise ``RuntimeError`` if a named master is not the saved one and nothing wrote it since the plugin's
        load; otherwise stop checking."""
        pending, self.pending = self.pending, []
        missing: list[str] = []
        for index, saved, at_load, versions in pending:
            now, written = _live_sums(amp, index, saved), _versions(amp, index)
            missing += [
                n for n, value in saved.items()
                if now.get(n) != value and now.get(n) == at_load.get(n) and written.get(n) == versions.get(n)
            ]  # fmt: skip
        if not missing:
            return
        self.pending = pending  # every later call raises too: never a silent resume from this run's masters
        shown = ", ".join(map(repr, missing[:5])) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise RuntimeError(
            f"the plugin's checkpoint entry loaded before this call leaves the FP32 master weights of {len(missing)} "
            f"parameter(s) ({shown}) to the model's entry of the same checkpoint (at O2 a set-up model's state_dict() "
            "holds them, so the file holds each once), and the model's weights were not loaded from it: training on "
            "would start from this run's masters, not the checkpoint's. Load the model with the plugin: "
            'fabric.load(path, {"model": model, "optimizer": optimizer, "mpx": mpx}), or load the checkpoint\'s '
            "model entry with fabric.load_raw(path, model) or model.load_state_dict(...) before the next step."
        )


def _live_values(amp: Amp, index: int) -> dict[str, torch.Tensor]:
    """By this run's names, the FP32 values of model ``index`` that the named masters load into: at O2 its live
    masters (writes made to the model since the last step taken first, as the step will take them); resumed at
    O0/O1 (no masters) the FP32 parameters of the prepared models, which the model's entry gives exactly."""
    if amp.properties.master_weights:
        amp.refresh_masters()
        weights = amp._masters.prune()
        return weights[index].fp32_by_name() if index < len(weights) else {}
    return {k: p for k, p in amp._checkpoint._prepared_parameters().items() if p.dtype == torch.float32}


def _versions(amp: Amp, index: int) -> dict[str, int]:
    """By name, the version counter of each parameter of model ``index``: a load into the model since (even of the
    values it holds: the weights loaded again after the plugin's entry of another run) writes it."""
    if amp.properties.master_weights:
        weights = amp._masters.prune()
        return {entry.name: param._version for entry, param in weights[index]._live()} if index < len(weights) else {}
    return {k: p._version for k, p in amp._checkpoint._prepared_parameters().items()}


def _by_live_names(saved: dict[str, int], live: dict[str, torch.Tensor]) -> dict[str, int]:
    """``saved`` by this run's names, where they are the saving run's with one prefix added or removed (a model set
    up second by one plugin is named ``model1.``...), as the engine's load renames its masters."""
    try:
        change = prefix_change(saved, live)
    except KeyError:  # several prefixes fit: the engine's load refused it already
        return saved
    return renamed(saved, change) if change is not None else saved


def _live_sums(amp: Amp, index: int, names: Iterable[str]) -> dict[str, int]:
    """The checksums of the values of :func:`_live_values` named in ``names``."""
    live = _live_values(amp, index)
    return _checksums({name: live[name] for name in names if name in live})
