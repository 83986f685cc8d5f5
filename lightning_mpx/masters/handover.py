"""One owner per master after a second stage: what an engine does once the FP32 masters of a model went elsewhere.

Another engine that prepares an O2-trained model for training takes its masters over (O2:
:func:`~lightning_mpx.masters.watch.take_fp32_value`; O0 and O1: the model made FP32 from them; O3, which trains the
model's own weights: :func:`~lightning_mpx.masters.watch.release_masters`). The engine that held them then

* removes the hooks it put on that model (:class:`HookRelease`, called by :func:`let_go_of`), so that N stages leave
  one set of hooks, not N run on every forward;
* refuses to hand out their masters (:func:`refuse_handed`: ``master_params()``, its clipping), which are the other
  engine's now;
* warns when saving a checkpoint that holds none of them (:func:`warn_handed_over`).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from lightning_mpx.masters.mirror import CONVERTED_HINT
from lightning_mpx.masters.watch import WatchedParameter, _owner
from lightning_mpx.masters.weights import MasterWeights

__all__ = ["HookRelease", "let_go_of", "masters_of", "refuse_handed", "warn_handed_over"]

_WHERE = (
    "to another engine that prepared the model for training since (a second stage's plugin or Amp, at any opt level), "
    "into the model made another dtype (.float(), .double(), .half()) or let go (release_masters)"
)


class HookRelease:
    """Removes what one engine put on ``module`` (the handles in ``hooks``' entries for it: forward and load hooks, an
    adapter's forward, see :meth:`hold`) and has the engine forget it (``forget``): called when the engine handed
    over every half parameter of the model. Holds the module and the engine's bookkeeping weakly and the engine's
    hook tables strongly (not the engine): an engine let go before the next stage (a Trainer of the first) leaves
    hooks that must come off too.

    Args:
        module: The prepared model.
        hooks: The engine's hook handles by model (``WeakKeyDictionary`` s of lists of objects with ``remove()``).
        forget: What the engine does to forget the model (a bound method, held weakly), or ``None``.
    """

    def __init__(
        self,
        module: nn.Module,
        hooks: Sequence[weakref.WeakKeyDictionary[nn.Module, list[Any]]],
        forget: Callable[[nn.Module], None] | None = None,
    ) -> None:
        self._module = weakref.ref(module)
        self._hooks = tuple(hooks)
        self._forget = weakref.WeakMethod(forget) if forget is not None else None  # type: ignore[arg-type]
        self._held: list[Any] = []

    @property
    def module(self) -> nn.Module | None:
        """The prepared model, or ``None`` once it is gone."""
        return self._module()

    def hold(self, handle: Any) -> None:
        """Remove ``handle`` (anything with ``remove()``: an adapter's forward on the model) with the hooks."""
        self._held.append(handle)

    def __call__(self) -> None:
        module = self._module()
        if module is None:
            return
        for table in self._hooks:
            for handle in table.pop(module, ()):
                handle.remove()
        for handle in self._held:
            handle.remove()
        self._held.clear()
        forget = self._forget() if self._forget is not None else None
        if forget is not None:
            forget(module)


def masters_of(module: nn.Module) -> list[MasterWeights]:
    """The masters (one per engine that holds some) of ``module``'s half parameters."""
    out: dict[int, Any] = {}
    for param in module.parameters():
        owner = _owner(param) if type(param) is WatchedParameter else None
        if owner is not None:
            out.setdefault(id(owner), owner)
    return [owner for owner in out.values() if isinstance(owner, MasterWeights)]


def let_go_of(olds: Iterable[MasterWeights]) -> None:
    """After another engine prepared the model: each engine among ``olds`` that handed over every half parameter of
    it removes its hooks from it."""
    for old in olds:
        if old.let_go is not None and not old.holds_half():
            release, old.let_go = old.let_go, None
            release()


def _named(names: list[str]) -> str:
    return f"{names[0]!r}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")


def refuse_handed(weights: Sequence[MasterWeights], params: Iterable[torch.Tensor]) -> None:
    """Raise if one of ``params`` (an optimizer's) was handed over by these masters: its master is another
    engine's now (clipping or zeroing it would change that engine's training)."""
    params = list(params)
    names = [name for masters in weights for name in masters.handed_names(params)]
    if names:
        converted = any(masters.converted_names(params) for masters in weights)
        raise RuntimeError(
            f"this engine's optimizer holds parameter(s) {_named(names)} whose FP32 masters this engine handed over "
            f"{_WHERE}; it has no master for them to hand out. Call master_params() (and clip) through the engine "
            "that prepared the model last, with its optimizer." + (f" {CONVERTED_HINT}" if converted else "")
        )


def warn_handed_over(weights: Sequence[MasterWeights]) -> None:
    """Warn that a checkpoint of these masters holds none for the parameters they handed over."""
    names = [name for masters in weights for name in masters.handed_names()]
    if names:
        warnings.warn(
            f"this engine's checkpoint holds no FP32 master for parameter(s) {_named(names)}: it handed them over "
            f"{_WHERE}, and resuming from it fails. Save the checkpoint of the engine that trains the model now (its "
            "state_dict(), with the model's); for FP32 weights, that engine's fp32_state_dict(model).",
            UserWarning,
            stacklevel=3,
        )
