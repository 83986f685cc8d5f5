"""The engine's checkpoint: its state dict (scalers, FP32 masters, counters, promotions), saved, and loaded at the
same opt level (masters bit-exact) or at another one (into or out of FP32 masters).

:class:`EngineState` is what :meth:`Amp.state_dict <lightning_mpx.engine.amp.Amp.state_dict>` and
:meth:`Amp.load_state_dict <lightning_mpx.engine.amp.Amp.load_state_dict>` do, once the steps pending on the device
are read.
"""

from __future__ import annotations

from typing import Any, Collection, Mapping, Sequence

import torch
from torch import nn

from lightning_mpx.engine.held_masters import HeldMasters
from lightning_mpx.engine.optimizer_state import _Stage
from lightning_mpx.engine.optimizers import StepMachine
from lightning_mpx.engine.overflow import Overflows
from lightning_mpx.engine.rescale import hold_scale
from lightning_mpx.health.promotion import Promotion
from lightning_mpx.masters.level_resume import ExactWeights
from lightning_mpx.masters.pairs import param_pairs
from lightning_mpx.masters.renames import prefix_change, renamed
from lightning_mpx.masters.store import Masters
from lightning_mpx.opt_levels import Properties
from lightning_mpx.scaling.scaler import LossScaler

#: The key of a front door's checkpoint entry (the Trainer plugin's) naming, for each model, the masters it leaves
#: out because the checkpoint's model state dict holds them, FP32 (each written once): at the same level they are
#: what the model's state dict loads into them (the load hooks take an FP32 value exactly), in either load order.
MASTERS_IN_STATE_DICT = "masters_in_state_dict"

#: The key of an O2 entry saved by an engine that only evaluated (``prepare_model(train=False)``: the Trainer's
#: ``validate``/``test``/``predict`` before any ``fit``): it made no masters, and the model's weights saved beside it
#: (FP32: the stage gave the model back) give those of the run that resumes from it. Absent otherwise.
EVALUATED_ONLY = "evaluated_only"


class EngineState:
    """The state dict of one engine.

    Args:
        properties: The opt level's properties.
        scalers: The engine's loss scalers.
        masters: The engine's FP32 masters.
        promotion: The engine's FP32 modules.
        overflows: The engine's overflow steps (``skipped_steps``).
        machine: The engine's optimizers (their pairs are made again after a load).

    Attributes:
        exact_weights: O2 masters resumed at O0/O1: kept through a later load of the model's state dict.
        picked_for: The device type the engine's half dtype was picked for when none was given (``None``: given, or
            not picked yet); a checkpoint of another half dtype is then refused, not resumed in a dtype the user
            never chose.
        held: The masters a loaded lean entry left to the model's entry (:data:`MASTERS_IN_STATE_DICT`), checked at
            the next step (:class:`~lightning_mpx.engine.held_masters.HeldMasters`).
    """

    def __init__(
        self,
        properties: Properties,
        scalers: Sequence[LossScaler],
        masters: Masters,
        promotion: Promotion,
        overflows: Overflows,
        machine: StepMachine,
    ) -> None:
        self.properties = properties
        self.scalers = scalers
        self.masters = masters
        self.promotion = promotion
        self.overflows = overflows
        self.machine = machine
        self.exact_weights = ExactWeights()
        self.picked_for: str | None = None
        self.held = HeldMasters()

    @property
    def opt_level(self) -> str:
        return self.properties.opt_level

    def state_dict(self, shared: Collection[int] = ()) -> dict[str, Any]:
        """:meth:`Amp.state_dict <lightning_mpx.engine.amp.Amp.state_dict>`; the masters of the parameters whose ``id``
        is in ``shared`` not copied (:meth:`AmpRecords._state_dict
        <lightning_mpx.engine.amp_records.AmpRecords._state_dict>`)."""
        # makes the masters the optimizers hold
        masters = self.masters.state_dict(self.machine.optimizers.values(), shared)
        kept = self.masters.initial_state()
        state = {
            "opt_level": self.properties.opt_level,
            "half_dtype": str(self.properties.half_dtype),
            "scalers": [scaler.state_dict() for scaler in self.scalers],
            "master_weights": masters,
            # The FP32 values kept for masters not made yet (None when none is kept).
            "fp32_values": kept if any(kept) else None,
            "skipped_steps": list(self.overflows.skipped_steps),
            "promotion": self.promotion.state_dict(),
        }
        if self.masters.evaluation_only and not masters:
            state[EVALUATED_ONLY] = True
        return state

    def _refuse_picked_dtype(self, saved: str) -> None:
        """Refuse a checkpoint of another half dtype than the one picked for this device with none given (a run saved
        on CUDA in float16, resumed on a CPU): the resumed run would change its dtype silently."""
        here = str(self.properties.half_dtype)
        if self.picked_for is None or saved == here:
            return
        saved_name, here_name = saved.removeprefix("torch."), here.removeprefix("torch.")
        # The scale a switch gets (load_state_dict): a checkpoint's dynamic scale carries over into a dynamic one only.
        such = ", such as bfloat16 with loss_scale='dynamic'" if here_name == "bfloat16" else ""
        raise ValueError(
            f"the checkpoint was trained in {saved_name}, and this run picked {here_name} for its "
            f"{self.picked_for!r} device because no half_dtype was given: a resumed run does not change its half "
            f"dtype silently. Pass half_dtype={saved_name!r} to resume in the checkpoint's dtype, or "
            f"half_dtype={here_name!r} to switch to {here_name} on purpose (with that run's own loss scaling: the "
            f"checkpoint's dynamic scale carries over only into a dynamic one{such})."
        )

    def load_state_dict(self, state: dict[str, Any], *, with_masters: bool) -> None:
        """:meth:`Amp.load_state_dict <lightning_mpx.engine.amp.Amp.load_state_dict>`; ``with_masters``: the
        optimizers step FP32 masters of this engine."""
        state = _engine_entry(state)
        _check_engine_state(state)
        self._refuse_picked_dtype(state.get("half_dtype", str(self.properties.half_dtype)))
        self.masters.prune()
        if len(state["scalers"]) != len(self.scalers):
            raise ValueError(
                f"the checkpoint has {len(state['scalers'])} loss scaler(s) but this Amp has num_losses="
                f"{len(self.scalers)}."
            )
        # (a lean entry names its masters, which the model's entry holds: before set-up it was refused as "0 model(s)
        # were prepared with master weights", naming no call, under fabric.load before fabric.setup)
        named = any(state["master_weights"]) or any(state.get(MASTERS_IN_STATE_DICT) or ())
        if named and not self.masters.weights and not self._prepared_parameters():
            raise RuntimeError(
                f"load_state_dict() was called before prepare_model(): the checkpoint holds FP32 master weights for "
                f"{len(state['master_weights'])} model(s) (or names those its model entry holds), which load into "
                "prepared models. Call prepare_model(model) first (the Trainer, fabric.setup() and "
                "accelerator.prepare() do: fabric.load(path, state) after fabric.setup(model, optimizer)), then "
                "load_state_dict(); nothing was loaded."
            )
        saved_level = state.get("opt_level", self.opt_level)
        if saved_level != self.opt_level:
            self._load_across_levels(state, saved_level)
            return
        if state.get(EVALUATED_ONLY) and not state["master_weights"] and self.masters.weights:
            # Saved by an engine that only evaluated (before any fit): no masters to load; the model's weights saved
            # beside it gave this run's (refused as "master weights for 0 model(s)" before: a fit resumed from a
            # checkpoint saved after trainer.validate())
            self._load_scalers(state)
            self.overflows.skipped_steps = list(state.get("skipped_steps", self.overflows.skipped_steps))
            return
        held = state.get(MASTERS_IN_STATE_DICT) or []
        saved_masters = self.masters.accept(
            [{**dict.fromkeys(held[i] if i < len(held) else ()), **masters} for i, masters in
             enumerate(state["master_weights"])]
        )
        promotion = state.get("promotion")
        kept = state.get("fp32_values")
        if not self.promotion.param_names(promotion):
            saved_masters, kept = self._renamed(saved_masters, kept)
        saved_masters = self._held_in_model(saved_masters)
        self.promotion.check_state_dict(promotion)
        # Masters this run made that the saving run had not made yet (their optimizer had not stepped) take the value
        # that run would have made them from.
        saved_masters = self.masters.complete(
            saved_masters, kept, fp32=self.promotion.param_names(promotion)
        )
        self.masters.check_state_dict(saved_masters, fp32=self.promotion.param_names(promotion))
        # A checkpoint that keeps none (every master made, several processes, or an older release): masters made
        # later come from the half values, as in that run.
        kept = kept if self.masters.weights else None
        if kept is not None:
            self.masters.check_initial_state(kept)
        self._load_scalers(state)
        self.promotion.load_state_dict(promotion)  # the run that saved it promoted these modules: so does this one
        self.masters.load_state_dict(saved_masters)
        if kept is None:
            self.masters.drop_initial()
        else:
            self.masters.load_initial_state(kept)
        self.promotion.load_weights(promotion)
        for optimizer_state in self.machine.optimizers.values():
            # Loading may have made masters for parameters that had none (frozen since the masters were made): the
            # pairs are made again now, and state the optimizer loaded before for such a parameter moves to its
            # master.
            optimizer_state.mirrors = None
            if with_masters and self.masters.weights:
                optimizer_state.pairs_key = None
                param_pairs(optimizer_state, self.masters.weights)
        self.overflows.skipped_steps = list(state.get("skipped_steps", self.overflows.skipped_steps))

    def _load_scalers(self, state: dict[str, Any]) -> None:
        """The checkpoint's loss scalers (checked in number already)."""
        saved_half = state.get("half_dtype", str(self.properties.half_dtype))
        self._hold_left_scales()
        for scaler, scaler_state in zip(self.scalers, state["scalers"]):
            if saved_half == str(self.properties.half_dtype):
                scaler.load_state_dict(scaler_state)
            elif scaler.dynamic and scaler_state.get("dynamic", True):
                # Another half dtype (float16 to bfloat16 or back): its default scaling differs, so, as across opt
                # levels, a dynamic scale carries over into a dynamic one and this run's settings rule otherwise.
                scaler.load_state_dict(scaler_state)

    def _renamed(
        self, saved: list[dict[str, Any]], kept: list[dict[str, torch.Tensor]] | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, torch.Tensor]] | None]:
        """The checkpoint's masters (and kept FP32 values) by this run's names, where they are the model's names with
        one prefix added or removed (saved through another front door, or inside a wrapper); unchanged otherwise."""
        out, out_kept = [], None if kept is None else list(kept)
        for index, (masters, values) in enumerate(zip(self.masters.weights, saved)):
            names = [*values, *(kept[index] if kept is not None and index < len(kept) else {})]
            change = prefix_change(names, masters.names)
            if change is not None:
                values = renamed(values, change)
                if out_kept is not None and index < len(out_kept):
                    out_kept[index] = renamed(out_kept[index], change)
            out.append(values)
        return out, out_kept

    def _held_in_model(self, saved: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``saved`` with each master held in the model's state dict (:data:`MASTERS_IN_STATE_DICT`, a ``None`` here)
        as this run's FP32 value for it: the model's state dict loaded before gave it exactly, one loaded after
        will (a name that matches no parameter is left for the check to refuse)."""
        out = []
        for masters, values in zip(self.masters.weights, saved):
            if any(value is None for value in values.values()):
                live = masters.fp32_by_name()
                values = {k: live.get(k, torch.empty(0)) if v is None else v for k, v in values.items()}
            out.append(values)
        return out

    def _hold_left_scales(self) -> None:
        """Before the scalers load (they change their scale in place): the half gradients a step or an unscale left
        at O2 keep the scale they carry, as across an update (:func:`~lightning_mpx.engine.rescale.hold_scale`); at O1
        those of a group added since the step (:func:`~lightning_mpx.engine.rescale.late_grads`) keep the step's."""
        masters = bool(self.masters.weights)
        for optimizer_state in self.machine.optimizers.values():
            if optimizer_state.stage in (_Stage.STEPPED, _Stage.SKIPPED):
                hold_scale(optimizer_state, self.scalers[optimizer_state.loss_id or 0], masters=masters)

    def _load_across_levels(self, state: dict[str, Any], saved_level: str) -> None:
        """:meth:`load_state_dict` for a checkpoint saved at ``saved_level``, another opt level (checked first,
        changing nothing when refused)."""
        levels = f"the checkpoint was saved at opt_level={saved_level!r} and this run is at {self.opt_level!r}"
        # Masters the model's state dict holds (MASTERS_IN_STATE_DICT) are left out: it gives them to the model.
        saved_masters = [dict(masters) for masters in state["master_weights"]]
        kept = state.get("fp32_values") or []
        into_model: dict[str, torch.Tensor] = {}
        if self.masters.weights:
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
        self._hold_left_scales()
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
            self.exact_weights.guard(roots, [params[name] for name in into_model])
        self.promotion.load_weights(promotion)
        for optimizer_state in self.machine.optimizers.values():
            optimizer_state.mirrors = None
        self.overflows.skipped_steps = list(state.get("skipped_steps", self.overflows.skipped_steps))

    def _prepared_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters of the live prepared models by the names the engine's checkpoints use."""
        out: dict[str, nn.Parameter] = {}
        for prefix, ref in self.promotion._roots:
            model = ref()
            if model is not None:
                for name, param in model.named_parameters():
                    out.setdefault(self.machine.names.get(id(param), prefix + name), param)
        return out


def _engine_entry(state: Any) -> Any:
    """The core's state inside what ``lightning_mpx.apex.amp.state_dict()`` returns (a team moving from the Apex
    API to a front door loads its ``amp.state_dict()`` as it is); any other ``state`` as it is."""
    if isinstance(state, Mapping) and "scalers" not in state and isinstance(state.get("lightning_mpx"), Mapping):
        return state["lightning_mpx"]
    return state


def _check_engine_state(state: object) -> None:
    """Refuse what :meth:`Amp.state_dict <lightning_mpx.engine.amp.Amp.state_dict>` did not make (a model's or an
    optimizer's state dict handed to the engine by mistake) before anything is loaded."""
    if not isinstance(state, Mapping):
        raise TypeError(f"state={type(state).__name__} must be the dict that Amp.state_dict() returned.")
    missing = [key for key in ("scalers", "master_weights") if key not in state]
    if missing and state and all(str(key).startswith("loss_scaler") for key in state):
        raise ValueError(
            f"state (keys {sorted(state)}) is an Apex amp.state_dict() with loss scales only: it has no FP32 master "
            "weights. Load it with lightning_mpx.apex.amp.load_state_dict(state) after amp.initialize(...), or "
            "resume from the model's FP32 weights (model.load_state_dict(...)) with a fresh loss scale."
        )
    if missing:
        shown = ", ".join(repr(key) for key in list(state)[:3]) + (", ..." if len(state) > 3 else "")
        raise ValueError(
            f"state (keys {shown or 'none'}) is not an Amp.state_dict(): it lacks {missing}. A model's state dict "
            "goes to model.load_state_dict(), an optimizer's to optimizer.load_state_dict()." + _foreign_hint(state)
        )


def _foreign_hint(state: Mapping[Any, Any]) -> str:
    """What a state dict that is not the engine's most likely is, and where it goes (empty when unknown)."""
    if {"scale", "_growth_tracker"} <= set(state):
        return (
            " This is a torch.amp.GradScaler state dict: its scale does not carry over (the engine's scalers keep "
            "more state); resume with a fresh loss scale, or pass init_scale=state['scale']."
        )
    if "state_dict" in state and ("optimizer_states" in state or "epoch" in state):
        return (
            " This is a whole Lightning checkpoint: let Trainer.fit(ckpt_path=...) restore it, or pass the "
            "plugin's entry of it (checkpoint['MixedPrecisionPlugin'])."
        )
    return ""

