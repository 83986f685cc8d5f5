"""The Trainer plugin's checkpoint hooks (:class:`CheckpointHooks`, a base of
:class:`~lightning_mpx.integrations.lightning.MixedPrecisionPlugin`): the engine's state in Lightning's checkpoints,
and at O2 the FP32 masters as the checkpoint's model weights, each written once."""

from __future__ import annotations

import sys
from types import CodeType
from typing import Any

from torch import nn

from lightning_mpx.integrations.fabric_checkpoint import shared_masters
from lightning_mpx.integrations.lightning_conversion import frozen_masters_from_checkpoint, masters_into_checkpoint
from lightning_mpx.integrations.metric_counts import LOG_READER, upgrade_unlogged

__all__ = ["CheckpointHooks", "LentMasters", "native_scale_from", "native_scale_into"]

#: The entries of Lightning's own float16 precisions that hold a ``GradScaler``'s state dict (``"16-mixed"``):
#: ``MixedPrecision``'s, ``FSDPPrecision``'s (its ``ShardedGradScaler``, under ``strategy="fsdp"``) and that of older
#: checkpoints. The plugin writes the first two; each is read only by its own plugin (Lightning loads an entry into the
#: precision plugin of its name), and those plugins without a scaler (``"bf16-mixed"``, ``"32-true"``) ignore it.
_NATIVE_KEYS = ("MixedPrecision", "FSDPPrecision", "native_amp_scaling_state")
_WRITTEN_KEYS = _NATIVE_KEYS[:2]


def native_scale_into(amp: Any, checkpoint: dict[str, Any]) -> None:
    """Give the scale and growth tracker of the ``torch.amp.GradScaler`` in a checkpoint of Lightning's own
    ``"16-mixed"`` (its ``MixedPrecision`` or, under FSDP, ``FSDPPrecision`` entry) to ``amp``'s dynamic loss
    scalers, as a dynamic scale carries over between opt levels (a static scale is a setting: it stays)."""
    for key in _NATIVE_KEYS:
        state = checkpoint.get(key)
        if isinstance(state, dict) and "scale" in state:
            for scaler in amp.scalers:
                if scaler.dynamic:
                    scaler.load_state_dict({
                        "scale": state["scale"], "growth_tracker": int(state.get("_growth_tracker", 0)),
                        "hysteresis_tracker": scaler.hysteresis, "overflows": 0, "dynamic": True,
                    })
            return


def native_scale_from(amp: Any, checkpoint: dict[str, Any], own: Any) -> None:
    """Write the dynamic scale of loss 0 in ``own`` (the plugin's entry of ``checkpoint``, :meth:`Amp.state_dict
    <lightning_mpx.engine.amp.Amp.state_dict>`) as the entries of Lightning's own ``"16-mixed"`` (its ``GradScaler``'s
    state dict, under ``MixedPrecision`` and, for ``strategy="fsdp"``'s ``ShardedGradScaler``, ``FSDPPrecision``),
    which a run resumed under ``"16-mixed"`` loads; the plugin's own resume reads its entry, not these. A
    static scale (bfloat16's, ``loss_scale=<number>``) writes none, and the other losses' scalers have no place
    there."""
    if isinstance(own, dict) and own.get("scalers") and amp.scalers:
        native = amp.scalers[0].grad_scaler_state(own["scalers"][0])
        if native is not None:
            for key in _WRITTEN_KEYS:
                checkpoint[key] = dict(native)


def _dump_checkpoint_code() -> CodeType | None:
    """The code of Lightning's ``_CheckpointConnector.dump_checkpoint`` (``None`` where this Lightning has none)."""
    try:
        from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
    except ImportError:  # pragma: no cover - another Lightning: the entry copies the masters
        return None
    return getattr(getattr(_CheckpointConnector, "dump_checkpoint", None), "__code__", None)


_DUMP_CHECKPOINT = _dump_checkpoint_code()


class LentMasters:
    """The FP32 masters the plugin's entry holds live, not copied, from its ``state_dict()`` to its
    ``on_save_checkpoint()``, when Lightning's ``dump_checkpoint`` asks for both (``trainer.save_checkpoint``,
    ``ModelCheckpoint``), one call after the other. The checkpoint's ``state_dict`` (the model's, made just before)
    holds the same masters (:class:`~lightning_mpx.integrations.fp32_export.MastersInStateDict`), and
    ``on_save_checkpoint`` drops them from the entry (:func:`masters_into_checkpoint`): copying each first, as the
    engine's state dict does, held a model's worth of FP32 memory at every save. Any master the entry still holds
    then (the checkpoint's ``state_dict`` lacks it: a ``state_dict()`` of the user's that leaves it out) is copied
    there, before the callbacks' ``on_save_checkpoint`` and the checkpoint IO see the entry: they get what they got
    before. Anywhere else (``plugin.state_dict()`` called directly, a subclass's ``on_save_checkpoint``) the entry
    holds copies, as before."""

    def __init__(self) -> None:
        self._entry: dict[str, Any] | None = None

    def shared(self, plugin: Any, caller: Any) -> set[int]:
        """The ids of the parameters whose masters ``plugin``'s entry may hold live: those its model's state dict
        gives, when ``caller`` (the frame that asked for the entry) is Lightning's ``dump_checkpoint``, whose next
        call is the plugin's own ``on_save_checkpoint``; else none."""
        self._entry = None
        module = plugin._module
        if (module is None or _DUMP_CHECKPOINT is None or caller.f_code is not _DUMP_CHECKPOINT
                or type(plugin).on_save_checkpoint is not CheckpointHooks.on_save_checkpoint):  # fmt: skip
            return set()
        return shared_masters(plugin.amp, [module])

    def lend(self, entry: dict[str, Any]) -> None:
        """``entry`` (the plugin's ``state_dict()``) holds live masters until :meth:`settle`."""
        self._entry = entry

    def settle(self, amp: Any) -> None:
        """Copy each live master of ``amp`` that the lent entry still holds (the others went to the checkpoint's
        ``state_dict``), one at a time; the entry is then the plugin's as before."""
        entry, self._entry = self._entry, None
        saved = entry.get("master_weights") if entry is not None else None
        if not isinstance(saved, list):
            return
        live = {e.master.untyped_storage().data_ptr() for w in amp._masters.prune() for e, _ in w._live()
                if e.master is not None}  # fmt: skip
        for masters in saved:
            for name, value in list(masters.items()):
                if value.untyped_storage().data_ptr() in live:
                    masters[name] = value.clone()


class CheckpointHooks:
    """Lightning's ``Precision`` checkpoint hooks of a plugin whose ``amp`` is a :class:`~lightning_mpx.Amp`, whose
    ``_module`` is the model it prepared last and whose ``_end_iteration`` settles a pending scale update."""

    amp: Any
    _module: nn.Module | None
    _frozen_warned: bool
    _manual_step: Any
    _range_test: Any
    _end_iteration: Any  # the plugin's: update the scales of the iteration that ended, log it
    _evaluation: Any  # the plugin's EvaluationValues: the FP32 values of a model in an evaluation before any fit
    _lent: LentMasters  # the masters the entry holds live within Lightning's dump_checkpoint

    def state_dict(self) -> dict[str, Any]:
        """Loss scalers, FP32 master weights and counters, saved in Lightning checkpoints (inside a manual training
        step, ``trainer.save_checkpoint``: the scale before that iteration's update, which the step's end makes). The
        masters are copies; within Lightning's ``dump_checkpoint`` those the checkpoint's ``state_dict`` holds are
        lent until :meth:`on_save_checkpoint` drops them (:class:`LentMasters`)."""
        if not self._manual_step.running:
            self._end_iteration()  # a pending scale update belongs to the iteration that was just checkpointed
        shared = self._lent.shared(self, sys._getframe(1))
        state = self.amp._state_dict(shared)  # with the log's position: a resumed run's first log counts from there
        if shared:
            self._lent.lend(state)
        return state

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """At O2 the checkpoint's ``state_dict`` holds the FP32 masters (``load_from_checkpoint`` and a resume under
        another precision get the trained weights, not their half rounding); a dynamic scale of loss 0 also goes to
        the entries of Lightning's own ``"16-mixed"`` (:func:`native_scale_from`)."""
        if self._module is not None:
            own = checkpoint.get(type(self).__qualname__)
            self._frozen_warned |= masters_into_checkpoint(self.amp, self._module, checkpoint, own, self._frozen_warned)
            # Saved in an O2 evaluation before the first fit (trainer.save_checkpoint in its hooks): the FP32 values
            # the stage gives back, not their half rounding (a fit resumed from it trained from the rounding)
            weights = checkpoint.get("state_dict")
            for name, value in self._evaluation.fp32_values(self._module).items():
                if isinstance(weights, dict) and name in weights:
                    weights[name] = value
        self._lent.settle(self.amp)  # a lent master not in the checkpoint's state_dict: copied now
        native_scale_from(self.amp, checkpoint, checkpoint.get(type(self).__qualname__))

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The masters of parameters frozen in the resumed model come from the checkpoint (the others from the
        model's state-dict loads, which Lightning makes before :meth:`load_state_dict`). A checkpoint of Lightning's
        own ``"16-mixed"`` (no entry of this plugin) gives its ``GradScaler`` scale to the dynamic scalers."""
        if self._module is not None:
            frozen_masters_from_checkpoint(self._module, checkpoint, type(self).__qualname__)
        if type(self).__qualname__ not in checkpoint:
            native_scale_into(self.amp, checkpoint)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the engine from the plugin's entry of a checkpoint (a checkpoint of the release before too)."""
        self._range_test.leave(self.amp)  # the tuner restores its checkpoint when its range test ends
        self.amp.load_state_dict(upgrade_unlogged(state_dict, LOG_READER))
