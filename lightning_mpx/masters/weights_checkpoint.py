"""The checkpoint of one model's FP32 masters (:class:`MasterCheckpoint`, a base of
:class:`~lightning_mpx.masters.weights.MasterWeights`): the masters by name, exact, and the FP32 values kept from
before the cast for masters not made yet, each checked before anything is loaded (a refused checkpoint changes
nothing)."""

from __future__ import annotations

from typing import Any, Callable, Collection, Iterable, Iterator

import torch

from lightning_mpx.common.dtypes import HALF_DTYPES
from lightning_mpx.masters.mirror import _Entry

__all__ = ["MasterCheckpoint"]


class MasterCheckpoint:
    """Saving and loading the masters of a :class:`~lightning_mpx.masters.weights.MasterWeights` (the attributes
    below are its own, see it)."""

    _eager: bool
    _live: Callable[[], Iterator[tuple[_Entry, torch.Tensor]]]  # the entries whose parameter is alive
    _make_master: Callable[[_Entry, torch.Tensor], None]
    refresh: Callable[..., list[str]]
    copy_to_model: Callable[..., None]

    # -- the FP32 values kept for masters not made yet ----------------------------------------------------------
    def initial_state(self) -> dict[str, torch.Tensor]:
        """The FP32 values kept from before the cast for masters not made yet, by name, cloned (a checkpoint taken
        before the first step carries them, so that a resumed run makes those masters as the run it came from)."""
        return {e.name: e.initial.detach().clone() for e, _ in self._live() if e.initial is not None}

    def check_initial_state(self, state: dict[str, torch.Tensor]) -> None:
        """Raise, changing nothing, if :meth:`load_initial_state` cannot take ``state``."""
        live = {entry.name: param for entry, param in self._live()}
        for name, tensor in state.items():
            if name not in live or tuple(tensor.shape) != tuple(live[name].shape):
                raise ValueError(
                    f"kept FP32 value {name!r} of the checkpoint matches no parameter of this model (or not its "
                    "shape); nothing was loaded."
                )

    def load_initial_state(self, state: dict[str, torch.Tensor]) -> None:
        """Keep exactly the FP32 values of ``state`` for the masters not made yet (others are let go)."""
        for entry, param in self._live():
            value = state.get(entry.name)
            entry.initial = None if value is None or entry.master is not None else value.detach().clone().float()

    # -- the masters -------------------------------------------------------------------------------------------
    def state_dict(self, shared: Collection[int] = ()) -> dict[str, Any]:
        """The FP32 masters of the half parameters, by name, cloned (exact, not rounded through half); writes made to
        the model since the last step are taken first. The masters of the parameters whose ``id`` is in ``shared``
        are the live masters, not copies: for a caller that drops them from the state before anything writes them (a
        lean entry, whose model's entry holds them: a copy of each would be a model's worth of memory at a save)."""
        for entry, param in list(self._live()) if self._eager else ():
            if entry.master is None and param.requires_grad and param.dtype in HALF_DTYPES:
                # Trainable now (unfrozen since preparing) but not stepped yet: its master is made here, so the
                # checkpoint matches a run that prepares the model with it trainable.
                self._make_master(entry, param)
        self.refresh()
        return {
            entry.name: entry.master.detach() if id(param) in shared else entry.master.detach().clone()
            for entry, param in self._live()
            if entry.master is not None
        }

    def check_state_dict(self, state: dict[str, torch.Tensor], fp32: Iterable[str] = ()) -> None:
        """Raise, changing nothing, if ``state`` cannot be loaded: other names, or a tensor of another shape.
        ``fp32``: names of parameters the checkpoint holds elsewhere, as FP32 weights (modules promoted to FP32)."""
        live = {entry.name: (entry, param) for entry, param in self._live()}
        expected = {name for name, (entry, param) in live.items() if entry.master is not None} - set(fp32)
        unexpected = [name for name in state if name not in live]
        missing = sorted(expected - set(state))
        if missing or unexpected:
            raise KeyError(
                f"master-weight state does not match the model: missing {missing}, unexpected {sorted(unexpected)}."
            )
        for name, tensor in state.items():
            param = live[name][1]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"master weight {name!r} has shape {tuple(tensor.shape)} in the checkpoint but the parameter has "
                    f"shape {tuple(param.shape)}; nothing was loaded."
                )

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore masters bit-exactly and refresh the half model parameters from them.

        Raises:
            KeyError: when names are missing or unexpected; ValueError: when a shape differs (also one that would
                broadcast). Nothing is loaded in either case.
        """
        self.check_state_dict(state)
        with torch.no_grad():
            for entry, param in list(self._live()):
                if entry.name not in state:
                    continue
                if entry.master is None:
                    entry.rounded = False  # its master is the checkpoint's, not the rounding it is made from here
                    self._make_master(entry, param)
                if entry.master is None:  # an FP32 parameter now (its module was promoted): the value is its own
                    param.copy_(state[entry.name])
                    continue
                entry.master.copy_(state[entry.name])
        self.copy_to_model()
