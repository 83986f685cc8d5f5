"""The masters a lean checkpoint entry leaves to the model's entry, checked at the next step.

An O2 entry saved beside a model that gives its FP32 masters from ``state_dict()`` (the Fabric plugin's, the
Accelerate adapter's, the Apex layer's ``amp.state_dict()``) names those masters
(:data:`~lightning_mpx.engine.checkpoint.MASTERS_IN_STATE_DICT`) with a checksum of each (:data:`MASTER_SUMS`)
instead of holding them: the model's entry gives them, loaded before or after the engine's. :class:`HeldMasters`
(the engine's, one per :class:`~lightning_mpx.engine.amp.Amp`) notes at :meth:`Amp.load_state_dict
<lightning_mpx.engine.amp.Amp.load_state_dict>` the named masters that are not the saved ones yet; at the next
:meth:`Amp.step <lightning_mpx.engine.amp.Amp.step>` (or earlier, at the next call into a front door that checks
itself), masters that are still not the saved ones and that nothing wrote since the load raise an error naming the
fix, instead of training on this run's masters silently. Masters written since (weights loaded into the model on
purpose after the engine's entry, even the values it held already) are the user's choice and are kept, and so are
those a ``load_state_dict`` wrote since the last step, before the entry (the model's entry of the same checkpoint
loaded first, with a weight replaced by hand: ``fabric.load`` of ``{"model": ..., "mpx": ...}`` refused it, saying
the model's weights were not loaded). The Apex layer's check is stricter (:meth:`HeldMasters.missing` with
``written_ok=False``): only the saved masters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch

from lightning_mpx.masters.renames import prefix_change, renamed

if TYPE_CHECKING:
    from lightning_mpx.engine.amp import Amp

__all__ = ["MASTER_HALF_SUMS", "MASTER_SUMS", "HeldMasters"]

#: The key of a lean engine entry holding, for each model, a checksum of each master its model's entry holds.
MASTER_SUMS = "masters_in_state_dict_sums"

#: The key of a lean engine entry holding, by half dtype (``str(torch.float16)``, ``str(torch.bfloat16)``) and for
#: each model, a checksum of the rounding to that dtype of each master its model's entry holds: what an O3 run's
#: half model in that dtype holds once the model's entry is loaded (since stop 64; an older entry is not checked at
#: O3).
MASTER_HALF_SUMS = "masters_in_state_dict_half_sums"

#: What the core's refusal tells to do (a front door that checks itself names its own calls).
CORE_ADVICE = (
    "Load the model entry saved with it before the next step: model.load_state_dict(ckpt['model']) (before or after "
    "amp.load_state_dict(ckpt['amp']))."
)

_CORE_ENTRY = "Amp.load_state_dict() loaded an entry that"


class HeldMasters:
    """The masters a loaded engine entry left to the model's entry, checked at the next step.

    Attributes:
        pending: For each model with a named master that was not the saved one at the load: (model index, saved
            checksums by this run's names, checksums at the load, the parameters' versions at the load, the names
            a ``load_state_dict`` wrote since the engine's last step, before the load).
        rounded: Resumed at O3: the half dtype whose rounding of the masters the saved checksums are of (the half
            model holds that rounding once the model's entry is loaded); ``None``: of the FP32 masters.
    """

    def __init__(self) -> None:
        self.pending: list[tuple[int, dict[str, int], dict[str, int], dict[str, int], set[str]]] = []
        self.rounded: torch.dtype | None = None
        # (entry, advice): the words of the front door that loaded the entry (its own calls), for the engine's check
        # at the next step; None: the core's (set by the door after each load, reset by the next one)
        self.words: tuple[str, str] | None = None

    def loaded(self, amp: Amp, state: Any) -> None:
        """After ``amp`` loaded ``state`` (its engine entry): note the named masters that are not the saved ones yet
        (the model's entry loads after the engine's, or never)."""
        self.pending, self.rounded, self.words = [], None, None
        saved_sums = state.get(MASTER_SUMS) if isinstance(state, dict) else None
        if not amp.properties.master_weights and amp.properties.casts_model:
            # Resumed at O3: the half model holds the masters' rounding to this run's half dtype, which the model's
            # entry (FP32 masters) gives; checked against the entry's checksums of that rounding (an entry holds
            # both half dtypes'), else (an entry of another format) not at all.
            half = state.get(MASTER_HALF_SUMS) if isinstance(state, dict) else None
            saved_sums = half.get(str(amp.half_dtype)) if isinstance(half, dict) else None
            if not isinstance(saved_sums, list):
                return
            self.rounded = amp.half_dtype
        for index, saved in enumerate(saved_sums or ()):
            saved = _by_live_names(saved, _live_values(amp, index, self.rounded))
            now = _live_sums(amp, index, saved, self.rounded)
            if any(now.get(name) != value for name, value in saved.items()):
                # Loaded into the model since the last step, before this entry (the model's entry of this checkpoint
                # loaded first, a weight in it replaced by hand): the user's values, as those loaded after it are
                self.pending.append((index, dict(saved), now, _versions(amp, index), _loaded_names(amp, index)))

    def missing(self, amp: Amp, *, written_ok: bool = True) -> list[str]:
        """The named masters that are not the saved ones (unless ``written_ok`` is false: and that nothing wrote
        since the load); none: stop checking (``pending`` emptied)."""
        out: list[str] = []
        for index, saved, at_load, versions, loaded in self.pending:
            now = _live_sums(amp, index, saved, self.rounded)
            written = _versions(amp, index) if written_ok else {}
            out += [
                n for n, value in saved.items()
                if now.get(n) != value
                and not (written_ok and (n in loaded or now.get(n) != at_load.get(n)
                                         or written.get(n) != versions.get(n)))
            ]  # fmt: skip
        if not out:
            self.pending = []
        return out

    def check(self, amp: Amp, *, advice: str | None = None, entry: str | None = None) -> None:
        """Raise ``RuntimeError`` (at every later call too: never a silent resume from this run's masters) if a
        named master is not the saved one and nothing wrote it since the load; otherwise stop checking. ``entry``
        and ``advice``: the front door's words for its load and its fix (default: those the door that loaded the
        entry set in :attr:`words`, else the core's)."""
        door_entry, door_advice = self.words or (_CORE_ENTRY, CORE_ADVICE)
        entry, advice = entry or door_entry, advice or door_advice
        missing = self.missing(amp)
        if missing:
            raise RuntimeError(
                f"{entry} leaves the FP32 master weights of {len(missing)} parameter(s) ({shown(missing)}) to the "
                "model's entry of the same checkpoint (at O2 a prepared model's state_dict() holds them, so the file "
                "holds each once), and the model's weights were not loaded from it: training on would start from "
                f"this run's masters, not the checkpoint's. {advice}"
            )


def shown(names: list[str], limit: int = 5) -> str:
    """``names`` for an error message: the first ``limit`` and how many more."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(map(repr, names[:limit])) + more


def checksums(values: dict[str, torch.Tensor], rounded: torch.dtype | None = None) -> dict[str, int]:
    """By name, the sum of each FP32 tensor's bit patterns as 64-bit integers (exact and order-free: the same on
    every device; one host read for all). ``rounded`` (a half dtype): of each floating-point tensor's rounding to it,
    as FP32. Each tensor is summed in turn, :data:`_CHUNK` elements at a time (each chunk rounded as it is summed):
    what the sums hold at once is a few chunks' worth, not a copy of all the values (a model's worth of FP32 copies
    at a save or a load), nor of one large tensor (the sum's 64-bit integers take twice an FP32 tensor's bytes)."""
    if rounded is None:
        names = [name for name, value in values.items() if value.dtype == torch.float32 and value.numel()]
    else:
        names = [name for name, value in values.items() if value.is_floating_point() and value.numel()]
    if not names:
        return {}
    sums = [_bit_sum(values[name], rounded) for name in names]
    return dict(zip(names, torch.stack([s.cpu() for s in sums]).tolist()))


#: How many elements of a tensor :func:`checksums` rounds and sums at a time (4 MiB of FP32).
_CHUNK = 1 << 20


def _bit_sum(value: torch.Tensor, rounded: torch.dtype | None = None) -> torch.Tensor:
    """The sum of the bit patterns of an FP32 tensor (``rounded``: of a floating-point tensor's rounding to that
    dtype, as FP32) as a 64-bit integer (a 0-d tensor on its device), :data:`_CHUNK` elements at a time."""
    total: torch.Tensor | None = None
    for part in value.detach().reshape(-1).split(_CHUNK):
        if rounded is not None:
            part = part.to(rounded).float()
        partial = part.view(torch.int32).sum(dtype=torch.int64)
        total = partial if total is None else total.add_(partial)
    assert total is not None  # names holds only tensors with elements
    return total


def _live_values(amp: Amp, index: int, rounded: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """By this run's names, the FP32 values of model ``index`` that the named masters load into: at O2 its live
    masters (writes made to the model since the last step taken first, as the step will take them); resumed at
    O0/O1 (no masters) the FP32 parameters of the prepared models, which the model's entry gives exactly; at O3
    (``rounded``: the half dtype) the prepared floating-point parameters, whose rounding to it is summed."""
    if amp.properties.master_weights:
        amp.refresh_masters()
        weights = amp._masters.prune()
        return weights[index].fp32_by_name() if index < len(weights) else {}
    params = amp._checkpoint._prepared_parameters()
    if rounded is not None:  # rounded as they are summed (_live_sums)
        return {k: p for k, p in params.items() if p.is_floating_point()}
    return {k: p for k, p in params.items() if p.dtype == torch.float32}


def _versions(amp: Amp, index: int) -> dict[str, int]:
    """By name, the version counter of each parameter of model ``index``: a load into the model since (even of the
    values it holds: the weights loaded again after the engine's entry of another run) writes it."""
    if amp.properties.master_weights:
        weights = amp._masters.prune()
        return {entry.name: param._version for entry, param in weights[index]._live()} if index < len(weights) else {}
    return {k: p._version for k, p in amp._checkpoint._prepared_parameters().items()}


def _loaded_names(amp: Amp, index: int) -> set[str]:
    """The names of model ``index``'s parameters that a ``load_state_dict`` wrote since the engine's last step."""
    machine = amp._machine
    if not machine.loaded:
        return set()
    if amp.properties.master_weights:
        weights = amp._masters.prune()
        live = ((entry.name, param) for entry, param in weights[index]._live()) if index < len(weights) else ()
    else:
        live = amp._checkpoint._prepared_parameters().items()
    return {name for name, param in live if machine.loaded_since_step(param)}


def _by_live_names(saved: dict[str, int], live: dict[str, torch.Tensor]) -> dict[str, int]:
    """``saved`` by this run's names, where they are the saving run's with one prefix added or removed (a model set
    up second by one plugin is named ``model1.``...), as the engine's load renames its masters."""
    try:
        change = prefix_change(saved, live)
    except KeyError:  # several prefixes fit: the engine's load refused it already
        return saved
    return renamed(saved, change) if change is not None else saved


def _live_sums(amp: Amp, index: int, names: Iterable[str], rounded: torch.dtype | None = None) -> dict[str, int]:
    """The checksums of the values of :func:`_live_values` named in ``names``."""
    live = _live_values(amp, index, rounded)
    return checksums({name: live[name] for name in names if name in live}, rounded)
