"""The Fabric plugin's bookkeeping (:class:`FabricBookkeeping`, a base of
:class:`~lightning_mpx.integrations.fabric.FabricMixedPrecisionPlugin`): catching up, at each call that starts work,
with what Fabric did since the last one (the models a strategy sharded after set-up, the masters to take from the
set-up model, a scale update due), the optimizers the plugin meets at their first unscale or step, and the plugin's
records (metrics, checkpoints, teardown). Fabric's ``Precision`` hooks themselves stay on the plugin."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_mpx.common.containers import read_floats
from lightning_mpx.engine.amp import Amp
from lightning_mpx.engine.held_masters import HeldMasters
from lightning_mpx.engine.optimizer_state import optimizer_params
from lightning_mpx.engine.optimizers import shared_inners
from lightning_mpx.engine.overflow import DEFAULT_READER
from lightning_mpx.engine.raw_steps import is_two_pass
from lightning_mpx.engine.sharding import refuse_gathered
from lightning_mpx.integrations.fabric_checkpoint import lean_state_dict
from lightning_mpx.integrations.fabric_sharding import adopt_sharded
from lightning_mpx.integrations.metric_counts import upgrade_unlogged
from lightning_mpx.masters.state_keys import has_own_key
from lightning_mpx.masters.swap import train_modes
from lightning_mpx.masters.weights import MasterWeights
from lightning_mpx.scaling.scaler import LossScaler
from lightning_mpx.scaling.view import GradScalerView

__all__ = ["FabricBookkeeping"]

# Fabric's words for a plugin entry loaded without the model's (the engine's check, HeldMasters.check).
_ENTRY = "the plugin's checkpoint entry loaded before this call"
_ADVICE = (
    'Load the model with the plugin: fabric.load(path, {"model": model, "optimizer": optimizer, "mpx": mpx}), or '
    "load the checkpoint's model entry with fabric.load_raw(path, model) or model.load_state_dict(...) before the next "
    "step."
)


class FabricBookkeeping:
    """The bookkeeping of a Fabric plugin whose ``amp`` is a :class:`~lightning_mpx.Amp`: its records (metrics,
    checkpoints, teardown) and what it catches up with at each call (``_begin``, ``_after_setup``, ``_register``)."""

    amp: Amp
    _modules: weakref.WeakSet[nn.Module]  # the models convert_module prepared
    # masters made by convert_module, to take from the set-up model; True: the ranks agreed on their FP32 values
    _unsynced: list[tuple[MasterWeights, bool]]
    _unchecked: list[weakref.ref[nn.Module]]  # prepared by convert_module; sharded by the strategy?
    _compiled_setups: list[tuple[weakref.ref[nn.Module], Any]]  # ...and those fabric.setup compiled after
    _setups: list[tuple[weakref.ref[nn.Module], Any]]  # ...and the frames of the fabric.setup calls that did
    _optimizers: weakref.WeakSet[Optimizer]  # the optimizers registered with the engine
    _held: HeldMasters  # the engine's: masters a loaded entry left to the model's entry
    _flips: bool  # a schedule-free optimizer registered (its eval()/train() followed at the forward, untraced)

    # -- metrics, checkpoints, teardown ------------------------------------------------------------------------
    def request_telemetry(self) -> None:
        """Measure underflow and headroom in this iteration's unscale (``mpx/underflow/<group>``,
        ``mpx/headroom_doublings/<group>`` in the next :meth:`metrics`); call it before the backward of a step you
        log."""
        self._begin()
        self.amp.request_telemetry()

    @property
    def scaler(self) -> GradScalerView | None:
        """Loss 0's scaler as ``torch.amp.GradScaler``'s read API shows it, for code ported from ``"16-mixed"``
        (``fabric._precision.scaler.get_scale()``): a read-only :class:`~lightning_mpx.scaling.view.GradScalerView`
        of the engine's (``amp.scalers[i]`` for loss ``i``) when its scale is dynamic; ``None`` for a static scale
        (bfloat16's default unit scale, a fixed ``loss_scale``), as ``"bf16-mixed"``'s. It stands for
        ``FSDPPrecision``'s attribute, which none of the plugin's methods reads (each of ``FSDPPrecision``'s is
        replaced): the engine scales, never a ``ShardedGradScaler``."""
        return GradScalerView(self, "fabric") if self.amp.scalers[0].dynamic else None

    def _read_scalers(self) -> list[LossScaler]:
        """The engine's scalers as a read shows them (the :attr:`scaler` view's): after the finished iteration's
        scale update, made as at every call, or, under a process group, where a read never ends the iteration
        (:meth:`_begin_read`), computed on copies of those it changes (the live ones untouched, as on every other
        rank)."""
        if self._begin_read():
            return self.amp._machine.updated_scalers()
        return list(self.amp.scalers)

    def _begin_read(self) -> bool:
        """:meth:`_begin` for a read (``metrics()``, ``scaler``, ``state_dict()``), which code calls on rank 0 alone:
        under a process group it never ends the iteration. Ended there on the reading rank only, the ranks' scales
        would part (and their weights; with ``skip_on_device`` their collectives: a hang) whenever a step still comes
        in the iteration, which a rank cannot always tell (a GAN's G before the plugin met its optimizer, or between
        D's step and its own; an optimizer set up apart, met at a first step over parameters that got no gradient);
        the next call every rank makes (a forward, ``fabric.backward``) ends it. One process: as :meth:`_begin`.
        Whether the scale update was held back: the read then shows the scalers as the update will leave them
        (computed on copies), what it would show had it ended the iteration."""
        amp = self.amp
        if amp.found_inf_reducer is not None and amp.iteration.update_pending:
            self._begin(end=False)
            return True
        self._begin()
        return False

    def metrics(self) -> dict[str, float]:
        """The ``mpx/*`` metrics as Python numbers, for ``fabric.log_dict``: ``mpx/loss_scale``, ``mpx/overflows``
        (since the previous call; after ``fabric.load``, since the saving run's previous call), ``mpx/skipped_steps``...
        (see :meth:`lightning_mpx.engine.amp.Amp.metrics`). Reads the device (it syncs): call it on the steps you log.
        Steps skipped on the device (``skip_on_device``) are read first, so that ``mpx/skipped_steps`` counts them.
        Under a process group, where the read never ends the iteration (:meth:`_begin_read`), the scale and
        ``mpx/overflows`` are those the pending update will leave (computed on copies), as one process shows."""
        held = self._begin_read()
        self.amp.read_step_outcomes()
        return read_floats(self.amp.metrics(after_update=held))  # one host read, not one per metric

    def state_dict(self) -> dict[str, Any]:
        """Loss scalers, FP32 master weights and counters: put the plugin into the state you save
        (``fabric.save(path, {"model": model, "optimizer": optimizer, "mpx": mpx})``). At O2 the masters a set-up
        model's ``state_dict()`` gives are named, not held: the model's entry holds them (each written once)."""
        # A pending scale update belongs to the iteration that is being saved; not ended under a process group
        # (_begin_read): `if fabric.global_rank == 0: mpx.state_dict()` between a GAN's two steps ended the iteration
        # on rank 0 alone, and the ranks' scales and weights parted. Held back there, the save holds the scalers as the
        # update will leave them (computed on copies: the live engine stays as every rank's), what a save that ended
        # the iteration held: a resume does not lose the update.
        held = self._begin_read()
        # with metrics()'s position: a resumed run's first call counts from there
        state = lean_state_dict(self.amp, self._modules)
        if held:
            state["scalers"] = self.amp._machine.scalers_after_update()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (``fabric.load`` does, for the plugin's entry of the state)."""
        self._begin()
        # (a checkpoint of the release before); the engine notes the masters left to the model's entry (self._held)
        self.amp.load_state_dict(upgrade_unlogged(state_dict, DEFAULT_READER))

    def teardown(self) -> None:
        self._begin()
        # Every rank tears down: the last steps skipped on the device are settled (their records merged across
        # ranks, logged, their floor applied).
        self.amp.settle_step_outcomes()

    # -- internals ---------------------------------------------------------------------------------------------
    def _begin(self, end: bool = True) -> None:
        """At every call that starts work (a forward, a backward, metrics, checkpoints): take new models' masters
        from the set-up model, and update the scales after the optimizer steps of the iteration that ended. Not in a
        model compiled after ``fabric.setup`` (traced, it would break the graph or put the update in it): the next
        eager call (``fabric.backward``, before any use of the scale) does it. ``end=False``: without the update (a
        read under a process group, :meth:`_begin_read`)."""
        # torch.compiler.is_compiling() with a call saved (three times a step): dynamo makes is_dynamo_compiling() a
        # constant True (the flag is not traced); eager code reads the flag that is_compiling() returns there.
        if not (torch.compiler.is_dynamo_compiling() or torch.compiler._is_compiling_flag):
            # Each test is the one its call makes first: the calls only when there is work (a forward, a backward,
            # each call per step otherwise).
            if self._unchecked or self._unsynced:
                self._after_setup()
            if self._held.pending:  # checked before the step does, in Fabric's words
                self._held.check(self.amp, entry=_ENTRY, advice=_ADVICE)
            if end and self.amp.iteration.update_pending:
                self.amp.end_iteration()

    def _after_setup(self) -> None:
        """At the first call after ``fabric.setup``: hand the engine the models the strategy sharded, and take new
        models' masters from the set-up model (moved to its device; under a process group, rank zero's weights: taken
        where they differ when the ranks agreed on the FP32 values at set-up, which keeps masters an optimizer
        registered there made from them exact)."""
        for ref, frame in self._compiled_setups:  # the compiled wrapper fabric.setup made: O1's FP32 modules run in
            module, wrapper = ref(), frame.f_locals.get("module")  # FP32 in it (health.promotion._hand_off_compiled)
            if module is not None and isinstance(wrapper, nn.Module) and wrapper is not module:
                self.amp.promotion.add_compiled(module, wrapper)
        self._compiled_setups.clear()
        if self._unchecked:
            adopt_sharded(self)
        if self._unsynced:
            for masters, agreed in self._unsynced:
                if agreed:
                    masters.refresh(force=True)
                else:
                    masters.sync_from_model()
            self._unsynced.clear()
        # A schedule-free optimizer registered at set-up: the forward scope follows its flips untraced from the first
        # eager call on (set at set-up, a model compiled after it would break its first traced forward there).
        self._flips = self._flips or any(train_modes(o) is not None for o in list(self._optimizers))

    def _meet_at_setup(self, optimizers: Any, strategy: Any) -> None:
        """The optimizers ``fabric.setup(model, *optimizers)`` hands the strategy (Fabric hands none to the precision
        plugin), registered at set-up rather than at their first step through Fabric: a raw step of one before that
        is refused at the step (its gradients carry the loss scale), a compiled function entering ``fabric.autocast()``
        is traced with them registered (no recompile at its second call), an O2 optimizer's state loaded by
        ``fabric.load`` goes to its masters, several losses need no ``setup_optimizers``, and a GAN's G keeps the scale
        of its gradients across an update before its first step. Under the single-device and DDP strategies only (the
        others shard the model or replace the optimizers after this), and only an optimizer over models the plugin
        prepared (one that also holds a model set up later is met at its first step, as before); an optimizer set up
        apart (``fabric.setup_optimizers``) is met at its first step too. The masters it makes are taken again after the
        strategy moved (and wrapped) the model (:meth:`_after_setup`)."""
        from lightning.fabric.strategies import DDPStrategy, SingleDeviceStrategy

        if self.amp.sharded or not isinstance(strategy, (DDPStrategy, SingleDeviceStrategy)):
            return
        for optimizer in optimizers if isinstance(optimizers, (tuple, list)) else ():
            if not isinstance(optimizer, Optimizer) or optimizer in self._optimizers:
                continue
            if self._held_by_prepared(optimizer):
                self._register(optimizer, lazily=False, settle=False)

    def _held_by_prepared(self, optimizer: Optimizer) -> bool:
        """Whether every parameter ``optimizer`` holds is one of a model the plugin prepared."""
        prepared = {id(p) for module in list(self._modules) for p in module.parameters()}
        return all(id(p) in prepared for p in optimizer_params(optimizer))

    def _register(self, optimizer: Optimizer, lazily: bool = True, settle: bool = True) -> None:
        # not _begin(): a scale update waits for every optimizer's step; not at set-up (settle=False), where the
        # strategy has yet to move (and wrap) the model the masters are taken from
        if settle and (self._unchecked or self._unsynced):
            self._after_setup()
        if optimizer in self._optimizers:
            return
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"optimizer={type(optimizer).__name__} is not a torch.optim.Optimizer: FabricMixedPrecisionPlugin "
                "supports Fabric's single-device and DDP strategies (DeepSpeed steps its own engine)."
            )
        if lazily and self.amp.num_losses > 1:
            raise RuntimeError(
                f"num_losses={self.amp.num_losses}: the plugin must know every optimizer before the first "
                f"fabric.backward(), to tell which loss's scale its gradients carry; call "
                f"plugin.setup_optimizers({type(optimizer).__name__.lower()}, ...) after fabric.setup()."
            )
        # A raw step over its parameters since the first backward refused; a SAM-style optimizer's first_step in the
        # first iteration (before this first step, where the plugin meets it) told: the parameters it wrote.
        first_step = self.amp.judge_first_writes(optimizer)
        if self.amp.properties.master_weights and _has_half_state(optimizer, first_step):
            if is_two_pass(optimizer):  # its first_step's state (old_p), before Fabric's first optimizer step
                raise RuntimeError(
                    f"optimizer={type(optimizer).__name__}, a SAM-style two-pass optimizer (first_step, second_step), "
                    "holds state for the model's half parameters that it wrote before the plugin knew it (its "
                    "first_step's copies, before Fabric's first optimizer step, where the plugin meets an optimizer): "
                    "the plugin cannot tell it from state loaded (fabric.load) and rounded to half. Call "
                    "plugin.setup_optimizers(optimizer) after fabric.setup() and before the first fabric.backward(); "
                    "see 'SAM and two-pass optimizers' in docs/master_weights.md."
                )
            raise RuntimeError(
                f"optimizer={type(optimizer).__name__} has state for the model's half parameters that the plugin did "
                "not make: it was loaded (fabric.load) before the plugin knew the optimizer, which rounds the FP32 "
                "state of the O2 masters to half. Call plugin.setup_optimizers(optimizer) after fabric.setup() and "
                "before fabric.load()."
            )
        # The plugin prepared its models before a strategy sharded them (the engine never saw them sharded): an
        # optimizer built after an evaluation, over the root's gathered copies, is refused here.
        refuse_gathered(list(self._modules), optimizer_params(optimizer))
        # first_step's state (old_p, half copies of the weights before it) stays with the half parameters, where it
        # stays when the plugin knew the optimizer before: the FP32 masters hold those weights, unperturbed, and its
        # step's copy into the model undoes the perturbation (a restore moved to the masters would round them).
        kept = optimizer.state
        own = {p: kept.pop(p) for p in optimizer_params(optimizer) if id(p) in first_step and has_own_key(kept, p)}
        self.amp.prepare_optimizer(optimizer)
        kept.update(own)
        self._optimizers.add(optimizer)
        if settle and train_modes(optimizer) is not None:  # schedule-free: the forward follows its flips untraced
            self._flips = True  # (registered at set-up: from the first call after it, _after_setup)


def _has_half_state(optimizer: Optimizer, first_step: frozenset[int] = frozenset()) -> bool:
    """Whether ``optimizer`` holds floating-point state (beyond ``step``) in a half parameter's own dtype: what
    torch's ``load_state_dict`` casts a loaded state to. FP32 state of a half parameter is not that: an earlier
    stage's (O1, FP32 training) optimizer, given to this O2 stage, whose masters take it over as it is. The inner
    optimizers that share its ``param_groups`` are asked too (a timm-style Lookahead keeps every state in its base
    optimizer, whose ``load_state_dict`` its own calls: its own ``state`` stays empty). Nor is the state of the
    parameters in ``first_step`` (ids): a SAM-style optimizer's ``first_step`` wrote them and kept it."""
    for each in (optimizer, *shared_inners(optimizer)):
        for group in each.param_groups:
            for param in group["params"]:
                if id(param) in first_step or param.dtype not in (torch.float16, torch.bfloat16):
                    continue
                if has_own_key(each.state, param):  # its own entry: the masters' is FP32
                    state = each.state[param]
                    if any(torch.is_tensor(v) and v.dtype == param.dtype and k != "step" for k, v in state.items()):
                        return True
    return False
