"""The FP32 master weights of one engine: one :class:`~lightning_mpx.masters.weights.MasterWeights` per model prepared
for training at O2, made, looked up, refreshed and checkpointed here.

:class:`Masters` owns the list; the optimizers that hold the masters' parameters belong to the step machine
(:mod:`lightning_mpx.engine.optimizers`), which hands their states in where a master is made for a parameter an
optimizer holds.
"""

from __future__ import annotations

import weakref
from typing import Any, Collection, Iterable, Mapping

import torch
from torch import nn

from lightning_mpx.engine.optimizer_state import _OptimizerState
from lightning_mpx.masters.handover import warn_handed_over
from lightning_mpx.masters.pairs import param_pairs
from lightning_mpx.masters.watch import carried_value
from lightning_mpx.masters.weights import MasterWeights
from lightning_mpx.settings import check_flag


class Masters:
    """The FP32 masters of the models prepared for training (empty below O2).

    Args:
        backend: The unscale backend, which also copies the masters to the model (``unscale_backend``).

    Attributes:
        weights: One :class:`~lightning_mpx.masters.weights.MasterWeights` per model prepared for training.
        evaluation_only: Whether an O2 model was prepared with ``train=False`` (then a checkpoint's masters are
            not needed while no model is prepared for training).
    """

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.weights: list[MasterWeights] = []
        self.evaluation_only = False
        #: The FP32 values a model's state dict handed out last (parameter, value, the value's version then), both
        #: held weakly (a model dropped after a state_dict() call takes its masters with it), checked at the next
        #: forward (:meth:`take_lent`), by id of the parameter; empty otherwise.
        self.lent: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor], int]] = {}

    def lend(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Note the FP32 values (masters, or values kept for masters not made yet) a model's ``state_dict()`` hands
        out in place of its half ``param``s (:class:`~lightning_mpx.integrations.fp32_export.MastersInStateDict`), as
        ``(param, value)`` pairs: a write through the state dict (``state_dict()[k].copy_(v)``, an EMA swap) reaches
        the model at the next forward, as in FP32, where the state dict aliases the parameters."""
        self.lent = {id(param): (weakref.ref(param), weakref.ref(value), value._version) for param, value in pairs}

    def forget_lent(self, params: Iterable[torch.Tensor]) -> None:
        """Forget the handed-out values of ``params``, which a step has just written into the model: a write to
        them since :meth:`lend` is stepped with them, and a ``p.data`` write after the step is not overwritten at the
        next forward."""
        for param in params:
            self.lent.pop(id(param), None)

    def take_lent(self) -> None:
        """Write into the half model the handed-out FP32 values written since :meth:`lend` (their rounding; the
        step's take of writes to the model then finds nothing to take back), and forget them."""
        lent, self.lent = self.lent, {}
        with torch.no_grad():
            for param_ref, value_ref, version in lent.values():
                param, value = param_ref(), value_ref()
                if param is not None and value is not None and value._version != version:
                    param.copy_(value)

    def prune(self) -> list[MasterWeights]:
        """Forget the masters of models that were garbage-collected; returns the ones left."""
        self.weights = [masters for masters in self.weights if masters.alive]
        return self.weights

    def covered(self, param: torch.Tensor) -> bool:
        """Whether ``param`` already belongs to the masters of a model prepared for training."""
        return any(masters.covers(param) for masters in self.weights)

    def add_model(
        self, module: nn.Module, names: Mapping[int, str], prefix: str, initial: Mapping[int, torch.Tensor] | None
    ) -> MasterWeights | None:
        """Masters for ``module``'s parameters, made lazily (by the optimizer that holds them, as Apex), unless
        another prepared model already covers all of them (a shared submodule keeps its one master); ``initial``:
        the FP32 values the model held before its cast, which those masters start from. Returns the new masters
        (``None``: none were needed)."""
        if all(map(self.covered, module.parameters())):
            return None
        known = self._of(module)
        if known is not None:
            known.extend(  # prepared again: the new parameters join the model's masters
                ((names.get(id(p), prefix + name), p) for name, p in module.named_parameters()),
                exclude=self.covered,
                initial=initial,
            )
            return None
        weights = MasterWeights(
            ((names.get(id(p), prefix + name), p) for name, p in module.named_parameters()),
            copy_backend=self.backend,
            exclude=self.covered,
            eager=False,
            initial=initial,
        )
        weights.prefix = prefix
        self.weights.append(weights)
        return weights

    def _of(self, module: nn.Module) -> MasterWeights | None:
        """The live masters made for ``module`` when it was first prepared (found by the model their release hooks
        hold weakly), or ``None``: a model prepared again (a head added after set-up) extends them, so that its
        checkpoint holds one model's masters, named as the same model built whole. No table of models is kept: a
        ``WeakKeyDictionary`` of models whose values held the masters (and through their release a weak reference to
        the model again) crashed CPython 3.11 in ``PyObject_ClearWeakRefs`` when the model died under a profiler."""
        for weights in self.prune():
            release = weights.let_go
            if release is not None and getattr(release, "module", None) is module:
                return weights
        return None

    def prefix_of(self, module: nn.Module, default: str) -> str:
        """The prefix of the names of ``module``'s masters if it has some (prepared again), else ``default``."""
        known = self._of(module)
        return known.prefix if known is not None else default

    def initial_state(self) -> list[dict[str, torch.Tensor]]:
        """Per live model, the FP32 values kept for masters not made yet (see :meth:`add_model`)."""
        return [masters.initial_state() for masters in self.weights if masters.alive]

    def check_initial_state(self, saved: list[dict[str, torch.Tensor]]) -> None:
        """Raise, changing nothing, if :meth:`load_initial_state` cannot take ``saved``."""
        if len(saved) != len(self.weights):
            raise ValueError(
                f"the checkpoint keeps FP32 values for {len(saved)} model(s) but {len(self.weights)} model(s) were "
                "prepared with master weights."
            )
        for masters, state in zip(self.weights, saved):
            masters.check_initial_state(state)

    def load_initial_state(self, saved: list[dict[str, torch.Tensor]]) -> None:
        for masters, state in zip(self.weights, saved):
            masters.load_initial_state(state)

    def drop_initial(self) -> None:
        """Let go of the FP32 values kept for masters not made yet (a checkpoint that keeps none was loaded)."""
        for masters in self.weights:
            masters.drop_initial()

    def take_loaded(self, param: torch.Tensor, value: torch.Tensor, states: Iterable[_OptimizerState]) -> None:
        """FP32 ``value`` loaded into half ``param``: its master (made now if an optimizer holds it) takes it, and
        the model its rounding; a value of ``param`` a state dict handed out before is no longer taken at the next
        forward (``load_state`` after ``save_state``, then a ``p.data`` write: the write stays)."""
        self.lent.pop(id(param), None)
        for masters in self.weights:
            if masters.covers(param):
                if param.requires_grad:  # a frozen one gets no master: no need to look through the optimizers
                    self.master_of(param, states, refresh=False)
                masters.take_loaded(param, value)
                return

    def make_held(self, states: Iterable[_OptimizerState]) -> None:
        """Make the masters of the half parameters the optimizers hold (those added since their last step have
        none yet)."""
        for state in list(states):
            param_pairs(state, self.weights, recheck=True)

    def master_of(
        self, param: torch.Tensor, states: Iterable[_OptimizerState], *, refresh: bool = True
    ) -> torch.Tensor:
        """The FP32 master of ``param`` (the parameter itself when it has none), with a write made to ``param`` since
        the last step taken into it first (``refresh``)."""
        if not isinstance(param, torch.Tensor):
            raise TypeError(
                f"param={type(param).__name__} must be a model parameter (a torch.Tensor, such as one of "
                "model.parameters())."
            )
        for masters in self.weights:
            if masters.covers(param):
                master = masters.master_of(param)
                if master is param and param.dtype in (torch.float16, torch.bfloat16):
                    self.make_held(states)  # added to an optimizer since its last step: its master is made now
                    master = masters.master_of(param)
                if refresh and master is not param:
                    masters.refresh([param])  # a write to the model since the last step: as the step will take it
                return master
        return param

    def refresh(self, params: Iterable[torch.Tensor] | None, *, force: bool) -> list[str]:
        """Take writes to the half model into the masters; returns the names of the parameters that took one."""
        check_flag("force", force)
        if params is not None:
            if isinstance(params, (nn.Module, torch.Tensor)) or not isinstance(params, Iterable):
                raise TypeError(
                    f"params={type(params).__name__} must be an iterable of parameters (model.parameters(), or "
                    "[param]) or None (all)."
                )
            params = list(params)
            strays = [type(p).__name__ for p in params if not isinstance(p, torch.Tensor)]
            if strays:
                raise TypeError(f"params holds {strays[0]}; each entry must be a parameter (a torch.Tensor).")
        if self.lent:  # handed-out masters written since (a checkpoint's state_dict edited): the model takes them first
            self.take_lent()
        return [name for masters in self.weights for name in masters.refresh(params, force=force)]

    def fp32_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """``module.state_dict()`` in FP32 (see :meth:`Amp.fp32_state_dict
        <lightning_mpx.engine.amp.Amp.fp32_state_dict>`): masters for the half parameters that have one (or the FP32
        value kept for the master they will get), writes to the model since the last step taken first."""
        self.prune()
        self.refresh(None, force=False)  # writes to the model since the last step, as a step takes them
        # A master not made yet (its optimizer has not stepped) is the FP32 value kept for it, as it will be made.
        masters = {key: value for weights in self.weights for key, value in weights.fp32_values().items()}
        out: dict[str, Any] = {}
        for key, value in module.state_dict(keep_vars=True).items():
            if not isinstance(value, torch.Tensor):
                out[key] = value  # a module's get_extra_state() (any object): as the state dict has it
                continue
            tensor = masters.get(id(value))
            if tensor is None:  # another engine took its master over since (a second stage), or a deep copy's
                tensor = carried_value(value)
            tensor = (value if tensor is None else tensor).detach()
            out[key] = tensor.float() if tensor.is_floating_point() and tensor.dtype != torch.float32 else tensor
        return out

    def state_dict(self, states: Iterable[_OptimizerState], shared: Collection[int] = ()) -> list[dict[str, Any]]:
        """The masters of every live model (parameters added to an optimizer since its last step included), copies
        but for those of the parameters whose ``id`` is in ``shared`` (see
        :meth:`~lightning_mpx.masters.weights_checkpoint.MasterCheckpoint.state_dict`)."""
        if self.weights:
            self.make_held(states)
        warn_handed_over(self.weights)
        return [masters.state_dict(shared) for masters in self.weights if masters.alive]

    def accept(self, saved: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The masters of a checkpoint to load (none when every model was prepared for evaluation only), checked
        in number against the prepared models."""
        self.prune()
        if self.evaluation_only and not self.weights:
            saved = []
        if len(saved) != len(self.weights):
            raise ValueError(
                f"the checkpoint has master weights for {len(saved)} model(s) but "
                f"{len(self.weights)} model(s) were prepared with master weights."
                + (
                    " A checkpoint saved by an engine whose masters a later engine took over since (a second stage's "
                    "plugin, or the model made another dtype) has none: save it with the engine that trains the model."
                    if not saved
                    else ""
                )
            )
        return saved

    def complete(
        self, saved: list[dict[str, Any]], kept: list[dict[str, torch.Tensor]] | None, *, fp32: Any
    ) -> list[dict[str, Any]]:
        """``saved`` (a checkpoint's masters, one dict per model) with a value for each master this run has made
        that the checkpoint lacks: it was saved before that master was made (its optimizer had not stepped, or was not
        known yet). The value is the one the saving run would have made the master from: the FP32 value the
        checkpoint kept for it (``kept``, its ``fp32_values``), else the model's value (its half value, which
        loading the model's checkpoint gives it). ``fp32``: names held elsewhere (promoted to FP32), left out."""
        fp32 = set(fp32 or ())
        out = []
        for index, (masters, state) in enumerate(zip(self.weights, saved)):
            values = kept[index] if kept is not None and index < len(kept) else {}
            extra = {}
            for param, _ in masters.half_pairs:
                name = masters.name_of(param)
                if name is None or name in state or name in fp32:
                    continue
                value = values.get(name)
                if not torch.is_tensor(value) or tuple(value.shape) != tuple(param.shape):
                    value = param.detach().float()
                extra[name] = value
            out.append({**state, **extra} if extra else state)
        return out

    def check_state_dict(self, saved: list[dict[str, Any]], *, fp32: Any) -> None:
        """Check each model's saved masters (``fp32``: the promoted parameters, saved in FP32), changing nothing."""
        for masters, masters_state in zip(self.weights, saved):
            masters.check_state_dict(masters_state, fp32=fp32)

    def load_state_dict(self, saved: list[dict[str, Any]]) -> None:
        """Load what :meth:`check_state_dict` accepted (bit-exact)."""
        for masters, masters_state in zip(self.weights, saved):
            masters.load_state_dict(masters_state)
