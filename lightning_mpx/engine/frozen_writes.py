"""A frozen half teacher written by hand at O2: a one-time check, at the engine's backwards, that warns once.

A momentum or EMA teacher kept as a child module and frozen before set-up (``requires_grad_(False)``: MoCo, BYOL,
DINO, Mean Teacher, timm's ``ModelEmaV2``) is half at O2 with no FP32 master, so an update by hand with a decay of
0.999 (``e.lerp_(s, 1 - d)``) mostly never moves it (docs/master_weights.md, "EMA and momentum teachers at O2"). At
set-up it cannot be told from a part frozen on purpose (a LoRA base), which is never written: the writes tell them
apart. At the first backward after an engine step, the versions of the frozen half parameters without a master of
the models an optimizer trains part of are noted; at the first backward after a later engine step they are compared,
and those written in place between (``_version`` changed) are warned about once, naming their children and the
recipe. Then the machine drops the check (``machine.frozen_writes = None``): no per-step work after it. A stage
change of the engine that writes parameters (a ``load_state_dict`` into the model, ``amp.load_state_dict``, a model
prepared again: :meth:`StepMachine.forget_writes`) forgets the note, taken again at the next backward.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from typing import Any, Sequence

import torch
from torch import nn

__all__ = ["FrozenWrites", "holding_modules", "warn_half_ema", "watch_frozen"]

_HALF = (torch.float16, torch.bfloat16)


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
            if not self.versions or self.notes > 3:  # a load between every two steps: looked at enough
                _done(machine)  # no frozen half parameter without a master: nothing to watch
            return
        if machine.steps_taken == self.noted_at:
            return  # accumulation: no engine step since the note
        _done(machine)  # one look, no per-step work after it
        self._warn(self.versions)

    def forget(self) -> None:
        """Forget the note (a stage change of the engine wrote the parameters): taken again at the next backward."""
        self.versions = None

    def _note(self, machine: Any) -> dict[int, int]:
        optimizers = [o for state in machine.optimizers.values() if (o := state.optimizer_ref()) is not None]
        held = {id(p) for o in optimizers for p in itertools.chain.from_iterable(g["params"] for g in o.param_groups)}
        with_master = {id(p) for weights in machine.masters.weights for p, _ in weights.half_pairs}
        versions = {}
        for module in self._trained(held):
            for param in module.parameters():
                key = id(param)
                if not param.requires_grad and param.dtype in _HALF and key not in with_master:
                    versions[key] = param._version
        return versions

    def _trained(self, held: set[int]) -> list[nn.Module]:
        """The live models an optimizer trains part of."""
        modules = [ref() for ref in self.modules]
        return [m for m in modules if m is not None and any(id(p) in held for p in m.parameters())]

    def _warn(self, versions: dict[int, int]) -> None:
        for ref in self.modules:
            module = ref()
            if module is None:
                continue
            written = [
                (name, param.dtype)
                for name, param in module.named_parameters()
                if not param.requires_grad and versions.get(id(param), param._version) != param._version
            ]
            if not written:
                continue
            what = "frozen {dtype} parameters of {owner} ({shown}), which have no FP32 master (frozen at set-up), were "
            warn_half_ema(module, written, what + "written in place between two steps.", frozen=True)


def watch_frozen(modules: Sequence[nn.Module], machine: Any) -> None:
    """Set ``machine.frozen_writes`` for the engine's prepared (unsharded) ``modules``, unless the check ran already
    (``machine.frozen_checked``: once per engine) or there are none."""
    if machine.frozen_checked or not modules:
        machine.frozen_writes = None
        return
    machine.frozen_writes = FrozenWrites(modules)


def warn_half_ema(module: nn.Module, found: list[tuple[str, torch.dtype]], what: str, *, frozen: bool) -> None:
    """Warn, from the engine's backward, that ``found`` (``(name, dtype)`` of ``module``'s half parameters without a
    master) may be an EMA or momentum teacher that never moves in half: ``what`` says what was seen (its
    ``{dtype}``, ``{owner}`` and ``{shown}`` filled in), the rest is the recipe, naming the module that holds them."""
    children = holding_modules([name for name, _ in found])
    dtype = str(found[0][1]).replace("torch.", "")
    shown = ", ".join(repr(c) for c in children[:5])
    shown += f" and {len(children) - 5} more" if len(children) > 5 else ""
    untrained = "" if frozen else "; one that does not train: requires_grad_(False) before set-up"
    warnings.warn(
        f"lightning_mpx: {len(found)} " + what.format(dtype=dtype, owner=type(module).__name__, shown=shown)
        + " If one is an EMA or momentum teacher updated by hand (e.lerp_(s, 1 - d), e.data.mul_(d).add_(s.data, "
        f"alpha=1 - d)), most of its elements never move in {dtype} at decay 0.999 (the update is under half a unit "
        f"in the last place), where \"bf16-mixed\" averages FP32 weights: keep it FP32 with "
        f"fp32_modules=[{children[0]!r}] and average the FP32 masters (amp.master_of(s)){untrained}. See 'EMA and "
        "momentum teachers at O2' in docs/master_weights.md.",
        UserWarning,
        stacklevel=3,
    )


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


def _done(machine: Any) -> None:
    machine.frozen_writes, machine.frozen_checked = None, True
