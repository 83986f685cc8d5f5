"""A frozen half teacher written by hand at O2: a one-time check, at the engine's backwards, that warns once.

A momentum or EMA teacher kept as a child module and frozen before set-up (``requires_grad_(False)``: MoCo, BYOL,
DINO, Mean Teacher, timm's ``ModelEmaV2``) is half at O2 with no FP32 master, so an update by hand with a decay of
0.999 (``e.lerp_(s, 1 - d)``) mostly never moves it (docs/master_weights.md, "EMA and momentum teachers at O2"). At
set-up it cannot be told from a part frozen on purpose (a LoRA base), which is never written: the writes tell them
apart. At the first backward after an engine step, the versions of the frozen half parameters without a master of
the models an optimizer trains part of are noted (not an ``nn.Embedding(max_norm=...)``'s weight, which its forward
renormalises in place); they are compared at the first backward after the 1st, 2nd, 4th, ... 128th engine step since
(a teacher updated every N steps: ema_pytorch's ``update_every=10``), and those written in place between
(``_version`` changed) that are still frozen with no master are warned about once (rank zero only, pointing at the
user's line), naming their children and the recipe. Then, or when none was written by the last look, the machine drops
the check (``machine.frozen_writes = None``): no per-step work after it; before, ``machine.frozen_writes.due`` spares
the backwards between two looks a call. A stage
change of the engine that writes parameters (a ``load_state_dict`` into the model, ``amp.load_state_dict``, a model
prepared again: :meth:`StepMachine.forget_writes`) forgets the note, taken again at the next backward.

An EMA child INSIDE the optimizer (``SGD(self.parameters())`` over a ``copy.deepcopy(student)`` child) has FP32
masters, but never a gradient: the masters take each hand write as its half rounding. The step finds those writes
already (``Mirror.take_writes``, through versions, addresses and the ``.data`` watch: nothing in the usual step), and
only when it took some does it call :class:`HeldWrites` (``machine.held_writes``), before the optimizer steps: a taken
parameter that requires grad, whose master has no gradient at this step and no optimizer state (never stepped with a
gradient: not an MoE expert no token reached, not a part a later micro-batch trains; a state made at construction
whose step count is 0, ``Adagrad``'s, counts as none) is an EMA child inside the
optimizer, warned about once. Not at the engine's first step (weights set after set-up), nor after a load since the
last step (``machine.written_at``: a stage change's write, no hand update). A SAM-style optimizer's step takes no
writes (its passes' are overlooked), and a schedule-free optimizer's ``eval()``/``train()`` is taken into the masters
outside the step.
"""

from __future__ import annotations

import itertools
import sys
import warnings
import weakref
from typing import Any, Sequence

import torch
from torch import nn

from lightning_mpx.common.user_frames import user_stacklevel
from lightning_mpx.settings import _rank_zero

__all__ = ["FrozenWrites", "HeldWrites", "holding_modules", "warn_half_ema", "watch_frozen"]

_HALF = (torch.float16, torch.bfloat16)
# The engine steps since the note by which the last look is taken (looks at 1, 2, 4, ... of them).
_LAST_LOOK = 128


class FrozenWrites:
    """The one-time check for frozen half parameters written by hand between two engine steps (see the module's
    docstring), held by the engine's step machine until it is done.

    Args:
        modules: The prepared models (held weakly; their parameters are read at the two backwards only).
    """

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = tuple(weakref.ref(m) for m in modules)
        # The engine's count of steps at the note, and the noted parameters' versions by id.
        self.noted_at = -1
        self.versions: dict[int, int] | None = None
        self.notes = 0
        # The engine's count of steps from which a backward looks (the machine calls at_backward from it on).
        self.due = 0

    def at_backward(self, machine: Any) -> None:
        """At an engine backward: note after the first engine step, compare after a later one, then drop the check
        (warning once if any noted parameter was written between)."""
        if machine.steps_taken < 1 or not machine.optimizers:
            return
        if not machine.masters.weights:  # no FP32 masters after a step (not O2): nothing of this kind
            _done(machine)
            return
        if self.versions is None:
            self.versions, self.noted_at, self.notes = self._note(machine), machine.steps_taken, self.notes + 1
            self.due = self.noted_at + 1
            if not self.versions or self.notes > 3:  # a load between every two steps: enough
                _done(machine)  # nothing frozen to watch (the usual run: no per-step work after it)
            return
        since = machine.steps_taken - self.noted_at
        if since < 1:
            return  # accumulation: no engine step since the note
        if self._warn(self.versions, machine) or since >= _LAST_LOOK:
            _done(machine)  # warned, or none written by the last look: no per-step work after it
        else:
            self.due = self.noted_at + 2 * since  # the next look

    def forget(self) -> None:
        """Forget the note (a stage change of the engine wrote the parameters): taken again at the next backward."""
        self.versions, self.due = None, 0

    def _note(self, machine: Any) -> dict[int, int]:
        held = _held_ids(machine)
        skipped = _with_master(machine) | machine.renormed  # an embedding's max_norm renormalises it at each forward
        versions = {}
        for module in self._trained(held):
            for param in module.parameters():
                key = id(param)
                if not param.requires_grad and param.dtype in _HALF and key not in skipped:
                    versions[key] = param._version
        return versions

    def _trained(self, held: set[int]) -> list[nn.Module]:
        """The live models an optimizer trains part of."""
        modules = [ref() for ref in self.modules]
        return [m for m in modules if m is not None and any(id(p) in held for p in m.parameters())]

    def _warn(self, versions: dict[int, int], machine: Any) -> bool:
        """Warn about the noted parameters written since, still frozen with no master (not unfrozen and trained
        since: a freezing schedule); whether any was."""
        with_master, warned = _with_master(machine), False
        for ref in self.modules:
            module = ref()
            if module is None:
                continue
            written = [
                (name, param.dtype)
                for name, param in module.named_parameters()
                if not param.requires_grad
                and id(param) not in with_master
                and versions.get(id(param), param._version) != param._version
            ]
            if not written:
                continue
            warned = True
            what = "frozen {dtype} parameters of {owner} ({shown}), which have no FP32 master (frozen at set-up), were "
            warn_half_ema(module, written, what + "written in place between two steps.", frozen=True)
        return warned


class HeldWrites:
    """The judgment of an EMA child inside the optimizer (see the module's docstring), called by an O2 step that
    took hand writes (:func:`~lightning_mpx.masters.mirror.step_mirrored`), before the optimizer steps; held by the
    engine's step machine (``machine.held_writes``) until it warned.

    Args:
        modules: The prepared models (held weakly, their parameters named only when a warning comes).
        machine: The engine's step machine (held weakly).
    """

    def __init__(self, modules: Sequence[nn.Module], machine: Any) -> None:
        self.modules = tuple(weakref.ref(m) for m in modules)
        self.machine = weakref.ref(machine)

    def __call__(self, taken: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Judge the ``(parameter, master)`` pairs whose writes the step took: warn once about those that require
        grad, whose master has no gradient at this step and no optimizer state, by the model holding them."""
        machine = self.machine()
        if machine is None or machine.steps_taken < 1 or machine.written_at == machine.steps_taken:
            return  # weights set before the first step, or a load (a stage change) since the last step
        bare = [(p, m) for p, m in taken if m.grad is None and p.requires_grad and id(p) not in machine.renormed]
        if not bare:
            return  # written where a gradient came (a clamp, a normalisation of trained weights)
        optimizers = [o for state in machine.optimizers.values() if (o := state.optimizer_ref()) is not None]
        # stepped with a gradient before: an MoE expert no token reached, a part another micro-batch trained
        written = {id(p) for p, m in bare if not any(_stepped(o.state.get(m)) for o in optimizers)}
        for ref in self.modules:
            module = ref()
            found = [] if module is None else [(n, p.dtype) for n, p in module.named_parameters() if id(p) in written]
            if found:
                machine.held_writes, machine.held_warned = None, True
                what = ("{dtype} parameters of {owner} ({shown}) that the optimizer holds got no gradient and were "
                        "written in place since the last step, so their FP32 masters take each write as its rounding.")
                warn_half_ema(module, found, what, frozen=True)  # the recipe alone: they are no part left untrained
                return


def watch_frozen(modules: Sequence[nn.Module], machine: Any) -> None:
    """Set ``machine.frozen_writes`` for the engine's prepared (unsharded) ``modules``, unless the check ran already
    (``machine.frozen_checked``: once per engine) or there are none; and ``machine.held_writes`` (:class:`HeldWrites`)
    unless it warned already (``machine.held_warned``) or there are none."""
    machine.held_writes = HeldWrites(modules, machine) if modules and not machine.held_warned else None
    if machine.frozen_checked or not modules:
        machine.frozen_writes = None
        return
    machine.frozen_writes = FrozenWrites(modules)


def warn_half_ema(module: nn.Module, found: list[tuple[str, torch.dtype]], what: str, *, frozen: bool) -> None:
    """Warn, from the engine's backward, that ``found`` (``(name, dtype)`` of ``module``'s half parameters without a
    master) may be an EMA or momentum teacher that never moves in half: ``what`` says what was seen (its
    ``{dtype}``, ``{owner}`` and ``{shown}`` filled in), the rest is the recipe, naming the module that holds them.
    On rank zero only (the same model on every rank), pointing at the user's line (``user_stacklevel``)."""
    if not _rank_zero():
        return
    children = holding_modules([name for name, _ in found])
    dtype = str(found[0][1]).replace("torch.", "")
    shown = ", ".join(repr(c) for c in children[:5])
    shown += f" and {len(children) - 5} more" if len(children) > 5 else ""
    untrained = "" if frozen else "; one that does not train: requires_grad_(False) before set-up"
    if _apex_door(module):  # amp.initialize takes no fp32_modules, and the Apex layer's amp has no master_of
        recipe = (f"keep it FP32, out of the model given to amp.initialize, and average the FP32 masters "
                  f"(amp.master_params(optimizer), in the optimizer's order){untrained}")
    else:
        recipe = (f"keep it FP32 with fp32_modules=[{children[0]!r}] and average the FP32 masters "
                  f"(amp.master_of(s)){untrained}")
    warnings.warn(
        f"lightning_mpx: {len(found)} " + what.format(dtype=dtype, owner=type(module).__name__, shown=shown)
        + " If one is an EMA or momentum teacher updated by hand (e.lerp_(s, 1 - d), e.data.mul_(d).add_(s.data, "
        f"alpha=1 - d)), most of its elements never move in {dtype} at decay 0.999 (the update is under half a unit "
        f"in the last place), where \"bf16-mixed\" averages FP32 weights: {recipe}. See 'EMA and momentum teachers "
        "at O2' in docs/master_weights.md.",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def _apex_door(module: nn.Module) -> bool:
    """Whether ``module`` was set up by the Apex layer's ``amp.initialize`` (its recipe differs)."""
    state = sys.modules.get("lightning_mpx.apex._state")
    return state is not None and module in state._amp_state.models


def _with_master(machine: Any) -> set[int]:
    """The ids of the half parameters with an FP32 master."""
    return {id(p) for weights in machine.masters.weights for p, _ in weights.half_pairs}


def holding_modules(names: list[str]) -> list[str]:
    """The module that holds every written parameter (``pair.teacher`` for a teacher nested in a LightningModule's
    model: its name is what ``fp32_modules`` needs), or, where none but the root does, their top-level children."""
    parts = [name.split(".")[:-1] for name in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    if common:
        return [".".join(common)]
    return list(dict.fromkeys(p[0] if p else n for p, n in zip(parts, names)))


def _held_ids(machine: Any) -> set[int]:
    """The ids of the parameters the machine's registered optimizers hold."""
    optimizers = [o for state in machine.optimizers.values() if (o := state.optimizer_ref()) is not None]
    return {id(p) for o in optimizers for p in itertools.chain.from_iterable(g["params"] for g in o.param_groups)}


def _stepped(state: dict[str, Any] | None) -> bool:
    """Whether an optimizer's ``state`` for a tensor (an FP32 master at O2) shows it was stepped with a gradient
    (momentum, Adam's moments), which an EMA child inside the optimizer never is: not an empty or missing state, nor
    one made at the optimizer's construction whose step count is still 0 (``Adagrad``'s, for every parameter). A step
    count on an accelerator is taken as stepped (no device sync)."""
    if not state:
        return False
    step = state.get("step")
    if isinstance(step, torch.Tensor):
        return step.device.type != "cpu" or bool(step != 0)
    return step is None or step != 0


def _done(machine: Any) -> None:
    machine.frozen_writes, machine.frozen_checked = None, True
