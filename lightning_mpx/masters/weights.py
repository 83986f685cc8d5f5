"""Half models and FP32 master weights (O2, O3).

:func:`convert_module` casts a module's floating-point parameters and buffers to half in place, keeping batch norm
in FP32 when asked. :class:`MasterWeights` holds FP32 copies of the half parameters, kept coherent with the model;
:class:`~lightning_mpx.engine.amp.Amp` hands them to the optimizer for its step (so the update and the optimizer state
are FP32), and :meth:`MasterWeights.copy_to_model` writes the result back to the model after each real step.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Mapping

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parameter import is_lazy

from lightning_mpx.common.dtypes import HALF_DTYPES, set_param_data
from lightning_mpx.masters.fp32_buffers import keeps_fp32_buffer
from lightning_mpx.masters.mirror import (
    _CONVERTED,
    _HANDED_OVER,
    Mirror,
    _Entry,
    _resized,
    _take_writes,
)
from lightning_mpx.masters.watch import (
    _TENSOR_DATA,  # noqa: F401  (kept import path)
    WatchedParameter,
    _DataWatch,
    _watch_data,
    take_fp32_value,
)
from lightning_mpx.masters.weights_checkpoint import MasterCheckpoint
from lightning_mpx.masters.weights_cover import MasterCover
from lightning_mpx.scaling.unscale import BACKENDS, UnscaleWorkspace, cast_copy_

if TYPE_CHECKING:
    from lightning_mpx.opt_levels import Properties

__all__ = ["MasterWeights", "Mirror", "WatchedParameter", "convert_module", "has_floating_parameters"]


def _named_pairs(named_parameters: object) -> Iterator[tuple[str, nn.Parameter]]:
    """``named_parameters``' ``(name, parameter)`` pairs, each checked: ``TypeError`` naming what was given instead
    (a model, or a list of parameters, where ``model.named_parameters()`` goes)."""
    hint = "must be (name, parameter) pairs, such as model.named_parameters()"
    if isinstance(named_parameters, (nn.Module, torch.Tensor)) or not isinstance(named_parameters, Iterable):
        raise TypeError(f"named_parameters={type(named_parameters).__name__} {hint}.")
    for pair in named_parameters:
        if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], torch.Tensor)):
            raise TypeError(f"named_parameters holds {type(pair).__name__}; it {hint}.")
        yield pair


def has_floating_parameters(module: nn.Module) -> bool:
    return any(p.is_floating_point() for p in module.parameters())


def convert_module(
    module: nn.Module, dtype: torch.dtype, *, keep_batchnorm_fp32: bool = True, require_parameters: bool = True
) -> nn.Module:
    """Cast ``module``'s floating-point parameters and buffers to ``dtype`` in place and return it.

    Parameters keep their identity (``param.data`` is replaced), so references held elsewhere, an optimizer's
    included, stay valid. Batch-norm modules (every subclass of ``_BatchNorm``, ``SyncBatchNorm`` included) are left
    in FP32 when ``keep_batchnorm_fp32``: their statistics need the range, and torch runs them on half inputs.
    ``require_parameters=False``: a module without floating-point parameters (a parameter-free wrapper) is accepted,
    its floating buffers cast. Rotary inverse frequencies stay FP32, as in transformers' own half models (see
    :func:`~lightning_mpx.masters.fp32_buffers.keeps_fp32_buffer`).

    Raises:
        TypeError: ``dtype`` is not a ``torch.dtype``.
        ValueError: ``dtype`` is not a half dtype (``torch.float16``, ``torch.bfloat16``: the opt levels' half dtype;
            ``module.float()`` makes a model FP32), or the module has no floating-point parameters (there would be
            nothing to train in half) and ``require_parameters``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module={type(module).__name__} is not a torch.nn.Module.")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(
            f"dtype={dtype!r} must be a floating-point torch.dtype; valid choices: torch.float16, torch.bfloat16 "
            "(a name such as 'float16' is not taken here)."
        )
    if dtype not in HALF_DTYPES:  # float64 was taken: a "half" model in double, its masters FP32 below it
        raise ValueError(
            f"dtype={dtype} is not a half-precision dtype; valid choices: torch.float16, torch.bfloat16 (the opt "
            "levels' half dtypes; for an FP32 model, module.float())."
        )
    for name, flag in (("keep_batchnorm_fp32", keep_batchnorm_fp32), ("require_parameters", require_parameters)):
        if not isinstance(flag, bool):  # a string ("False") was taken as true
            raise TypeError(f"{name}={flag!r} must be True or False.")
    if require_parameters and not has_floating_parameters(module):
        raise ValueError(
            f"module={type(module).__name__} has no floating-point parameters, so casting it to {dtype} would do "
            "nothing; use opt_level='O0' or 'O1' for it, or check that the module was built before conversion."
        )
    for submodule in module.modules():
        if keep_batchnorm_fp32 and isinstance(submodule, _BatchNorm):
            continue
        for param in submodule._parameters.values():
            if param is not None and param.is_floating_point() and param.dtype != dtype:
                if param.grad is not None:
                    param.grad = None
                # A DTensor (tensor parallelism) swapped whole: `.data =` would leave its local shard FP32
                set_param_data(param, param.data.to(dtype), name=f"{type(submodule).__name__} parameter")
        for name, buffer in submodule._buffers.items():
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != dtype:
                if buffer.dtype == torch.float32 and keeps_fp32_buffer(submodule, name):
                    continue  # position * inv_freq: its rounding grows with the position
                submodule._buffers[name] = buffer.to(dtype)
    return module


def refuse_meta(module: nn.Module) -> None:
    """O2: the FP32 masters are made from the parameters' values, which a model on the ``meta`` device does not have
    (``to_empty()`` after would also replace the parameters the masters were made for)."""
    name = next((name for name, param in module.named_parameters() if param.is_meta), None)
    if name is not None:
        raise ValueError(
            f"module={type(module).__name__} has parameters on the meta device (first: {name!r}), which have no values "
            "for the FP32 masters of opt_level='O2'; materialize it first (module.to_empty(device=...) and initialize "
            "or load its weights), then call prepare_model()."
        )


def refuse_lazy(module: nn.Module, call: str) -> None:
    """Raise a ``ValueError`` naming ``module``'s uninitialized (lazy) parameters, which O2 cannot make masters of
    yet; ``call`` is the user's call that prepares the model (``"trainer.fit"``, ``"fabric.setup"``,
    ``"accelerator.prepare"``, ``"trainer.train"`` through ``mpx_trainer``, ``"prepare_model()"``)."""
    names = [name for name, param in module.named_parameters() if is_lazy(param)]
    if not names:
        return
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    verb = "is" if len(names) == 1 else "are"
    # Layers built in the LightningModule's configure_model do not exist before trainer.fit: the forward goes there.
    built = ", in configure_model after building them for layers built there" if call == "trainer.fit" else ""
    raise ValueError(
        f"opt_level='O2': {shown} of {type(module).__name__} {verb} not initialized yet (a lazy module such as "
        f"nn.LazyLinear gets its shape at its first forward), and O2 makes the FP32 master weights at {call}, before "
        f"any forward. Run one forward on an example batch before {call} (it materializes the lazy modules){built}, or "
        "give the layers their input sizes (nn.Linear(in_features, ...)); O1 and O3 make no masters and take lazy "
        "modules."
    )


def refuse_unpreparable(module: nn.Module, properties: Properties, call: str) -> None:
    """Raise what preparing ``module`` for training at ``properties`` would refuse in its parameters, before anything
    is changed (for a front door that prepares several models and must fail before the first: the Apex layer's
    ``initialize``): at O2 parameters on the meta device or not initialized yet (lazy), at O2/O3 no floating-point
    parameter to cast. ``call``: the user's call that prepares it (``"amp.initialize"``)."""
    if properties.master_weights:
        refuse_meta(module)
        refuse_lazy(module, call)
    if properties.casts_model and not has_floating_parameters(module):
        convert_module(module, properties.half_dtype)  # refuses it with its own message before it casts anything


class MasterWeights(MasterCover, MasterCheckpoint):
    """FP32 master copies of a model's half parameters, kept coherent with the model.

    The optimizer keeps holding the model's own parameters (so ``optimizer.param_groups``, ``add_param_group``,
    ``toggle_optimizer`` and callbacks that map optimizer parameters to module names see the model);
    :class:`~lightning_mpx.engine.amp.Amp` puts the masters in their place only for the duration of a step, a
    ``state_dict`` and a ``load_state_dict`` of the optimizer. The model is the user's: a write to a half parameter
    made outside the step (``model.load_state_dict`` after preparing, ``StochasticWeightAveraging``, EMA, ``copy_``
    under ``no_grad``, ``p.data = ...``) is seen through the parameter's version counter and storage address and
    taken into its master before the master is next used (:meth:`refresh`): the elements the write changed take the
    model's value, the others keep their FP32 master value, so a model loaded with the half rounding of its own
    masters (a checkpoint resume) keeps the exact masters. Writes made in place through ``p.data`` (``p.data.copy_``,
    ``p.data.clamp_``) bypass the version counter: a half parameter with a master is made a
    :class:`WatchedParameter`, which tells the masters when its ``.data`` is handed out, and that parameter is
    compared at the next :meth:`refresh` (see :class:`_DataWatch`).

    Masters are made for the trainable half parameters when the masters are created (``eager``), and for any other
    half parameter of the model (a frozen backbone unfrozen later) when :meth:`master_of` is asked to create it: the
    first time an optimizer steps it. Parameters are held through weak references: a model the user lets go takes its
    masters with it.

    Args:
        named_parameters: ``(name, parameter)`` pairs of the model; FP32 parameters (batch norm kept FP32) are their
            own masters, half parameters get an FP32 copy.
        copy_backend: How :meth:`copy_to_model` copies: ``"auto"`` (torch's multi-tensor copy, as ``"foreach"``:
            one launch per device and dtype pair, less host work than the fused kernel), ``"foreach"``,
            ``"reference"`` or ``"triton"`` (the fused Triton kernel for CUDA parameters).
        exclude: Parameters another :class:`MasterWeights` already covers (a submodule shared by two models): they
            are left to it, so every tensor has one master.
        eager: Make the masters of the trainable half parameters now. ``False``: only when :meth:`master_of` is
            asked to create one, as :class:`~lightning_mpx.engine.amp.Amp` does for the parameters an optimizer holds
            (an EMA copy or a distillation teacher kept as a submodule, trainable but in no optimizer, gets none).
        initial: FP32 values the half parameters held before their cast (by ``id`` of the parameter): a master made
            while its parameter still holds their rounding starts from them exactly (elements written since keep
            the model's value). Dropped by :meth:`drop_initial` once the masters that need them are made.

    Its checkpoint (the masters, and the FP32 values kept for masters not made yet) is saved and loaded by its base
    :class:`~lightning_mpx.masters.weights_checkpoint.MasterCheckpoint`; parameters that leave or join it after the
    masters were made (handed over, released, adopted) go through its base
    :class:`~lightning_mpx.masters.weights_cover.MasterCover`.

    Attributes:
        workspace: The copy kernel's table cache, kept across steps.
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, nn.Parameter]],
        *,
        copy_backend: str = "auto",
        exclude: Callable[[torch.Tensor], bool] | None = None,
        eager: bool = True,
        initial: Mapping[int, torch.Tensor] | None = None,
    ) -> None:
        if copy_backend not in BACKENDS:
            raise ValueError(f"copy_backend={copy_backend!r} is not valid; valid choices: {', '.join(BACKENDS)}.")
        self.copy_backend = copy_backend
        self.workspace = UnscaleWorkspace()
        self._entries: dict[int, _Entry] = {}
        self._watch = _DataWatch(self)
        self._eager = eager
        # Parameters handed over (hand_over), by id: their names and weak references, so that this engine's checkpoint
        # and master_params() can say so rather than leave them out, or hand out another engine's masters.
        self.handed: dict[int, tuple[str, weakref.ref[torch.Tensor]]] = {}
        self.converted: set[int] = set()  # ... those made another dtype (hand_over(converted=True)), by id
        # Set by the engine that made these masters: removes the hooks it put on their model (see let_go).
        self.let_go: Callable[[], None] | None = None
        # The prefix of the names of these masters ("model1." for an engine's second model): a module added to the model
        # and prepared again is named with it (Masters.prefix_of).
        self.prefix = ""
        # The ids of the half parameters of a SAM-style optimizer between its first backward and its step: their
        # writes since (first_step's perturbation) are its pass's, left out of refresh() unless forced (a checkpoint
        # or fp32_state_dict() made between the passes keeps the weights before first_step). Set and cleared by
        # masters.swap (take_writes_before_pass; the step, or undo_pass).
        self.in_pass: frozenset[int] = frozenset()
        # The names of the parameters frozen when cast to half whose masters were made since from that rounding (read
        # and emptied by masters.pairs.warn_from_rounding, once), and whether that warning was given.
        self.from_rounding: list[str] = []
        self.rounding_warned = False
        self.rounding_cause = "frozen"  # or "evaluation": the model was prepared for evaluation only first
        self.extend(named_parameters, exclude=exclude, initial=initial)

    def extend(
        self,
        named_parameters: Iterable[tuple[str, nn.Parameter]],
        *,
        exclude: Callable[[torch.Tensor], bool] | None = None,
        initial: Mapping[int, torch.Tensor] | None = None,
    ) -> None:
        """Cover the parameters of ``named_parameters`` not covered yet (``exclude``, ``initial``: as the
        constructor's): the model's at construction, then those of a module added to it and prepared again."""
        for name, param in _named_pairs(named_parameters):
            if id(param) in self._entries or (exclude is not None and exclude(param)):
                continue
            entry = _Entry(name, param)
            self._entries[id(param)] = entry
            # A model trained at O2 by another engine (a second stage's new plugin) or a deep copy of one: the masters
            # start from its FP32 value, handed over by that engine (no copy) or carried by the copy. Not under a
            # process group: a rank may hold one that another does not (release_masters on rank 0 only), and the
            # strategy broadcasts rank zero's half weights, whose rounding every rank then starts from.
            taken = take_fp32_value(param, self._watch)
            if initial is not None and id(param) in initial:
                entry.initial = initial[id(param)]
            elif taken is not None and taken.shape == param.shape and not _multi_process():
                entry.initial = taken
            if self._eager and param.requires_grad:
                self._make_master(entry, param)
            elif param.dtype in HALF_DTYPES:
                # Its class now, not when its master is made (the first step of an optimizer met then, under Fabric):
                # a class changed after torch.compile traced the model fails its guard, a recompile.
                _watch_data(param, self._watch)

    # -- lookups ------------------------------------------------------------------------------------------------
    def _live(self) -> Iterator[tuple[_Entry, torch.Tensor]]:
        dead = []
        for key, entry in self._entries.items():
            param = entry.param()
            if param is None:
                dead.append(key)
            else:
                yield entry, param
        for key in dead:
            del self._entries[key]

    def _entry(self, param: torch.Tensor) -> _Entry | None:
        entry = self._entries.get(id(param))
        return entry if entry is not None and entry.param() is param else None

    @property
    def alive(self) -> bool:
        """Whether any parameter these masters were made for still exists."""
        return any(True for _ in self._live())

    @property
    def names(self) -> list[str]:
        return [entry.name for entry, _ in self._live()]

    @property
    def half_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(model parameter, FP32 master)`` for every half parameter that has a master."""
        return [(param, entry.master) for entry, param in self._live() if entry.master is not None]

    def covers(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is one of the model parameters these masters were made for."""
        return self._entry(param) is not None

    def master_of(self, param: torch.Tensor, *, create: bool = False) -> torch.Tensor:
        """The FP32 master of ``param`` (``param`` itself when it is FP32 or not covered); with ``create``, a half
        parameter without one (frozen when the masters were made) gets it now."""
        entry = self._entry(param)
        if entry is None:
            return param
        if entry.master is None and create and param.dtype in HALF_DTYPES:
            self._make_master(entry, param)
        return entry.master if entry.master is not None else param

    def note_rounded(self, ids: set[int], cause: str = "frozen") -> None:
        """The parameters (by ``id``) frozen when their model was cast to half (``cause="evaluation"``: cast when it
        was prepared for evaluation only), with no FP32 value kept: a master made for one later (unfrozen, or the model
        prepared for training since) starts from its rounding, which :attr:`from_rounding` names."""
        for key in ids:
            entry = self._entries.get(key)
            if entry is not None and entry.master is None and entry.initial is None and not entry.rounded:
                entry.rounded = True
                if cause != "frozen":
                    self.rounding_cause = cause

    def rounded_to_come(self) -> list[str]:
        """The names of the trainable parameters cast when their model was prepared for evaluation only whose masters
        are not made yet (another optimizer's, prepared after): they will start from the rounding too, and the one
        warning names them with those made (:func:`~lightning_mpx.masters.pairs.warn_from_rounding`)."""
        return [e.name for e, param in self._live() if e.rounded and e.master is None and param.requires_grad]

    def keeps_value(self, param: torch.Tensor) -> bool:
        """Whether an FP32 value is kept for ``param``'s master, not made yet (``initial``): then making the master
        costs no memory (the value becomes it), and a parameter frozen since preparing gets it from that value."""
        entry = self._entry(param)
        return entry is not None and entry.master is None and entry.initial is not None

    def fp32_by_name(self) -> dict[str, torch.Tensor]:
        """:meth:`fp32_values` by parameter name; a half parameter without one as its value upcast."""
        out = {}
        for entry, param in self._live():
            value = _fp32_of(entry, param)
            out[entry.name] = value if value is not None else param.detach().float()
        return out

    def name_of(self, param: torch.Tensor) -> str | None:
        entry = self._entry(param)
        return entry.name if entry is not None else None

    # -- coherence ----------------------------------------------------------------------------------------------
    def _make_master(self, entry: _Entry, param: torch.Tensor) -> None:
        initial, entry.initial = entry.initial, None
        rounded, entry.rounded = entry.rounded, False
        if param.dtype in HALF_DTYPES:
            with torch.no_grad():
                if initial is not None and initial.shape == param.shape and initial.dtype == torch.float32:
                    # The FP32 value the model held before its cast becomes the master (its own storage, when the
                    # model was not moved since: no second FP32 copy), where the model still holds its rounding;
                    # elements written since (a load of other weights) take the model's value, as refresh does.
                    value = _take_differing(param, initial.to(param.device))
                else:
                    value = param.detach().float()
                    if rounded and not self.rounding_warned:
                        self.from_rounding.append(entry.name)
            entry.master = value.requires_grad_(True)
            _watch_data(param, self._watch)
        entry.mark(param)

    def fp32_values(self) -> dict[int, torch.Tensor]:
        """By ``id`` of the parameter, the FP32 value of each half parameter that has a master or a kept value: its
        master, or the master it will be made from that value (elements written to the model since taking the
        model's value, as :meth:`_make_master` does). A parameter frozen since it was prepared keeps its value too
        (it was trainable then: the value is its FP32 weight, which its export must give); one frozen before has
        none. Nothing is changed."""
        out = {}
        for entry, param in self._live():
            value = _fp32_of(entry, param)
            if value is not None:
                out[id(param)] = value
        return out

    def fp32_value(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param``'s entry of :meth:`fp32_values` (``None`` where it has none). Nothing is changed."""
        entry = self._entry(param)
        return _fp32_of(entry, param) if entry is not None else None

    def drop_initial(self) -> None:
        """Let go of the FP32 values kept from before the cast for masters not made yet (a trainable parameter no
        optimizer holds, a teacher's): a master made later starts from the half value, as in Apex."""
        for entry in self._entries.values():
            entry.initial = None

    def take_loaded(self, param: torch.Tensor, value: torch.Tensor) -> None:
        """FP32 ``value`` is being loaded into half ``param`` (``load_state_dict``): its master, or the initial value
        its master will be made from, takes it exactly; the model takes its rounding, which the master agrees with,
        so the next :meth:`refresh` keeps the exact value."""
        entry = self._entry(param)
        if entry is None or value.shape != param.shape:
            return
        target = entry.master if entry.master is not None else entry.initial
        if target is not None:
            with torch.no_grad():
                target.copy_(value)
        elif param.requires_grad and param.dtype in HALF_DTYPES:
            # No master yet and no value kept (several processes, where values from before the cast are not kept):
            # the loaded value is kept for the master made later, as the same file is loaded on every rank. A frozen
            # parameter (a LoRA base) gets none, as it gets no master.
            entry.initial = value.detach().to(torch.float32, copy=True)

    def refresh(self, params: Iterable[torch.Tensor] | None = None, *, force: bool = False) -> list[str]:
        """Take writes made to the model's half parameters since the masters last matched them; returns the names
        of the parameters taken.

        A parameter counts as written when its version counter or storage address moved (``force``: always). Its
        master then takes the model's value where the two differ as half values, and keeps its FP32 value where
        they agree: the comparison runs only for written parameters, so a step that finds nothing written costs
        two attribute reads per parameter.

        Args:
            params: The model parameters to check (default: all).
            force: Check every parameter's values, whatever its version (after writes through ``p.data``).
        """
        written = []
        entries = list(
            self._live()
            if params is None
            else ((e, p) for p in params if (e := self._entry(p)) is not None)
        )
        if self.in_pass and not force:  # a SAM-style optimizer's pass: its perturbation is no write to take
            entries = [(e, p) for e, p in entries if id(p) not in self.in_pass]
        handed_out = self._watch.due({id(p) for _, p in entries})
        for entry, param in entries:
            if entry.master is None:
                continue
            if force or id(param) in handed_out or not entry.unchanged(param):
                written.append((entry, param))
        return _take_writes(written)

    def mirror(self, params: Iterable[torch.Tensor], *, compare: bool = False) -> Mirror:
        """The step-time view of ``params``' masters (those that have one): see :class:`Mirror`."""
        pairs = [(e, p) for p in params if (e := self._entry(p)) is not None and e.master is not None]
        return Mirror(pairs, self.copy_backend, compare, self._watch)

    def sync_from_model(self) -> None:
        """Re-take the masters from the model parameters, on the model's current device.

        For frameworks that move the model to its device, or broadcast rank zero's weights to every process, after
        the masters were made. Identity is kept (an optimizer's state for them stays valid). In a single process a
        master keeps its exact FP32 value where the model holds its rounding (the model was only moved); across
        processes (a process group initialized) every master is the model's value, so that all ranks hold rank zero's.
        The framework doors call it before any optimizer made a master: a master made after it starts from the FP32
        value kept for it (rank zero's, when the ranks agreed on them at set-up), where the model holds its rounding.
        """
        if not _multi_process():
            self.refresh(force=True)  # moves each master to its parameter's device, takes what differs
            return
        with torch.no_grad():
            for entry, param in self._live():
                master = entry.master
                if master is None:
                    continue
                if master.device != param.device:
                    master.data = master.data.to(param.device)
                master.copy_(param)
                entry.mark(param)

    def copy_to_model(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Write the masters into the half model parameters (after a real optimizer step): all of them, or those of
        ``params``. One pass that reads 4 bytes and writes 2 per element, one launch per device and dtype pair
        (torch's multi-tensor copy; the fused kernel with ``copy_backend="triton"``)."""
        if params is None:
            pairs = [(p, e) for e, p in self._live() if e.master is not None]
        else:
            pairs = [(p, e) for p in params if (e := self._entry(p)) is not None and e.master is not None]
        if not pairs:
            return
        models = [p for p, _ in pairs]
        cast_copy_(models, [e.master for _, e in pairs], backend=self.copy_backend, workspace=self.workspace)
        for param, entry in pairs:
            entry.mark(param)

    def clear_model_grads(self) -> None:
        """Drop the half model gradients once they have been unscaled into the masters."""
        for param, _ in self.half_pairs:
            param.grad = None


def current_fp32_values(masters: MasterWeights) -> dict[int, torch.Tensor]:
    """``masters``' :meth:`~MasterWeights.fp32_values` with the writes made to the model since the masters last
    matched it in them, as :meth:`~MasterWeights.refresh` would take them, without taking them: what an export gives
    (a model's ``state_dict()``, ``save_pretrained``), so that a write undone before the next step leaves the masters
    exact. An EMA swapped in for validation (diffusers' ``ema.store``/``copy_to``, a pipeline saved, ``restore``)
    puts back the half rounding of the masters, which ``refresh`` then finds unchanged; had the save taken the swap
    into the masters, ``restore`` would have left them that rounding. A written parameter gives its master itself
    where the model holds its rounding, else a new tensor: the master with the elements that differ set to the
    model's values. Nothing is changed (one comparison per written parameter, one host read for all)."""
    out = masters.fp32_values()
    gone = (_HANDED_OVER, _CONVERTED)
    # a SAM-style optimizer's pass: its perturbation is no write (as refresh leaves it; the state dict's pass weights)
    entries = [
        (e, p) for e, p in masters._live()
        if e.master is not None and e.version not in gone and id(p) not in masters.in_pass
    ]  # fmt: skip
    pending = masters._watch.pending({id(p) for _, p in entries})
    compared = []
    with torch.no_grad():
        for entry, param in entries:
            if id(param) not in pending and entry.unchanged(param):
                continue
            master = entry.master.detach().to(param.device)
            if master.shape != param.shape:  # resized (``p.data = t``): as refresh takes it
                out[id(param)] = _resized(param, master)
                continue
            # Whether any element differs, not the mask: one parameter's mask and rounding alive at a time (a mask
            # each, kept for the host read, was a quarter of the masters' bytes at a save after trainer.fit)
            compared.append((param, master, (param != master.to(param.dtype)).any()))
        if compared:
            device = compared[0][2].device
            hits = torch.stack([differs.to(device) for _, _, differs in compared]).tolist()
            for (param, master, _), hit in zip(compared, hits):
                if hit:  # written: the mask made again, for this parameter alone
                    out[id(param)] = torch.where(param != master.to(param.dtype), param.float(), master)
    return out


def _fp32_of(entry: _Entry, param: torch.Tensor) -> torch.Tensor | None:
    """See :meth:`MasterWeights.fp32_values`."""
    if entry.master is not None:
        return entry.master
    kept = entry.initial
    if kept is None or param.dtype not in HALF_DTYPES or kept.shape != param.shape:
        return None
    with torch.no_grad():
        kept = kept.to(param.device)
        return torch.where(param != kept.to(param.dtype), param.float(), kept)


_CHUNK = 1 << 22  # elements compared at a time: bounds the temporaries of a large embedding's comparison


def _take_differing(param: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """``master`` (FP32) with the elements where ``param`` (half) is not its rounding set to ``param``'s value, in
    place; compared a slice at a time, so the temporaries stay small next to a large parameter."""
    if not (param.is_contiguous() and master.is_contiguous()):
        return torch.where(param != master.to(param.dtype), param, master, out=master)
    flat_param, flat_master = param.view(-1), master.view(-1)
    for start in range(0, flat_param.numel(), _CHUNK):
        p, m = flat_param[start : start + _CHUNK], flat_master[start : start + _CHUNK]
        torch.where(p != m.to(p.dtype), p, m, out=m)
    return master


def _multi_process() -> bool:
    """Whether a ``torch.distributed`` process group of more than one rank is initialized (its frameworks broadcast
    rank zero's half weights: masters must then be their rounding on every rank, not each rank's own FP32 values).
    A group of one rank (``Trainer(strategy="ddp", devices=1)``, ``torchrun --nproc_per_node=1``) has no other rank
    to agree with: its masters keep their FP32 values, as in a single process."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
