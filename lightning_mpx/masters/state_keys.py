"""``optimizer.state[p]`` by a model parameter at O2: the entry of its FP32 master.

At O2 an optimizer's groups hold the half model parameters outside the step, and its state is keyed by the FP32
masters the engine swaps in for the step (:mod:`lightning_mpx.masters.swap`). User code that reads the state by a
parameter of its groups after a step (transformers' ``AdafactorSchedule.get_lr``: ``opt.state[group["params"][0]]``,
a log of Adam's ``exp_avg_sq``, Lightning's ``trainer.optimizers[0].state[p]``) would get torch's fresh ``{}``.
:class:`StateByMasters`, installed per optimizer in place of torch's ``defaultdict(dict)``, overrides ``__missing__``
(not ``__getitem__``): a half parameter with a master gets the master's entry (the same dict: one owner; made empty
under the master when it has none yet). A hit (torch's own ``self.state[master]`` in the step) costs no Python call.
``del optimizer.state[p]`` and ``optimizer.state.pop(p)`` (a reset of ``p``'s moments) remove the master's entry,
``optimizer.state[p] = {}`` (or ``.update({p: {}})``, ``|= {p: {}}``) replaces it, and ``optimizer.state.setdefault(p,
{})`` gives it; ``p in optimizer.state`` is true when ``p`` or its master has an entry and ``optimizer.state.get(p)``
gives the master's entry when ``p`` has none (neither makes an entry; torch's step calls neither: ``.get(p, [])`` is in
its optimizers' ``__setstate__`` only), so ``if p in optimizer.state: del optimizer.state[p]`` resets ``p``'s moments as
in FP32. The engine's own tests of a key itself (a half parameter's own entry: a SAM-style ``old_p``, state moved
between a master and its parameter) say so: :func:`has_own_key`. Iteration and ``len`` are torch's (the masters' keys).
A SAM-style optimizer keeps its ``old_p`` under the half parameter (docs/master_weights.md) and keeps torch's
``defaultdict``; a schedule-free one's ``eval()``/``train()`` called on the half parameters must move nothing (the
engine redoes them on the masters, :func:`~lightning_mpx.masters.swap.follow_modes`): it gets a :class:`KeyedOnCopy`,
torch's ``[]`` with the copies re-keyed, and ``in``/``get`` by a half parameter answered by its master's entry (a
schedule-free ``eval()``/``train()`` reads ``self.state[p]`` only).
"""

from __future__ import annotations

import collections
import weakref
from typing import Any

import torch

from lightning_mpx.engine.optimizer_state import _OptimizerState


class KeyedOnCopy(collections.defaultdict):
    """An optimizer's ``state`` as torch's ``defaultdict(dict)`` (``state[p]`` not redirected; ``p in state`` and
    ``state.get(p)`` by a half parameter answer by its master's entry, as in FP32) that pickles and deep-copies
    keyed by its groups' half parameters outside the step (the masters are not pickled with the optimizer: keyed by
    them, the copy's ``state_dict()`` would find no parameter of its groups for its entries), by the masters while
    they stand in; ``copy.copy`` is one of its items. A schedule-free optimizer's (its ``eval()``/``train()`` on the
    half parameters must find no state through ``state[p]``); :class:`StateByMasters` redirects ``state[p]`` and the
    writes by a half parameter too.

    Args:
        owner: The engine's state of the optimizer (its pairs: which master each parameter has).
        items: The entries of the optimizer's state so far.
    """

    __slots__ = ("_owner", "_pairs_id", "_index")

    def __init__(self, owner: _OptimizerState, items: Any = ()) -> None:
        super().__init__(dict, items)
        self._owner = weakref.ref(owner)
        self._pairs_id = 0  # id of the pairs list _index was made from
        self._index: dict[int, int] = {}  # id(half parameter) -> its position in the pairs (ids only: no tensor held)

    def __contains__(self, key: Any) -> bool:
        """``p in optimizer.state`` by a half parameter: whether it or its master has an entry (makes none)."""
        if dict.__contains__(self, key):
            return True
        master = self._master(key)
        return master is not None and dict.__contains__(self, master)

    def get(self, key: Any, default: Any = None) -> Any:
        """``optimizer.state.get(p, default)`` by a half parameter: its master's entry where ``p`` has none of its own
        or only the empty ``{}`` a schedule-free ``eval()``/``train()`` on the half parameters made (makes none);
        torch's ``eval()``/``train()`` of schedulefree read ``self.state[p]``, which stays torch's."""
        own = dict.get(self, key, default)
        if own is not default and own:
            return own
        master = self._master(key)
        return dict.get(self, master, own) if master is not None else own

    def _master(self, key: Any) -> torch.Tensor | None:
        """The FP32 master of ``key`` when it is a half parameter of the optimizer's pairs, else ``None``."""
        owner = self._owner()
        if owner is None or not isinstance(key, torch.Tensor):
            return None
        pairs = owner.pairs
        if id(pairs) != self._pairs_id:
            self._index = {id(p): i for i, (p, m) in enumerate(pairs) if m is not p}
            self._pairs_id = id(pairs)
        i = self._index.get(id(key))
        return pairs[i][1] if i is not None and i < len(pairs) and pairs[i][0] is key else None

    def __reduce__(self) -> Any:
        """Pickled or deep-copied (``copy.deepcopy(optimizer)``): a plain ``defaultdict(dict)`` keyed as the groups."""
        return (collections.defaultdict, (dict,), None, None, self._items_by_groups())

    def _items_by_groups(self) -> Any:
        """The entries, a master's under its half parameter outside the step; an entry kept by a half parameter whose
        master has one too (the empty ``{}`` a schedule-free ``eval()`` on the half parameters made) is left out."""
        owner = self._owner()
        if owner is None or owner.swapped is not None:
            return iter(self.items())
        halves = {id(m): p for p, m in owner.pairs if m is not p}
        shadowed = {id(halves[id(k)]) for k in self if isinstance(k, torch.Tensor) and id(k) in halves}
        return (
            (halves.get(id(k), k), v) if isinstance(k, torch.Tensor) else (k, v)
            for k, v in self.items()
            if not (isinstance(k, torch.Tensor) and id(k) in shadowed)
        )

    def __copy__(self) -> collections.defaultdict:
        return collections.defaultdict(dict, self)

    copy = __copy__  # ``optimizer.state.copy()``: defaultdict's calls the class (an owner-less instance)

    def __or__(self, other: Any) -> Any:
        """``optimizer.state | other`` (either side): a plain ``defaultdict(dict)``, as :meth:`copy`."""
        return collections.defaultdict.__or__(self.copy(), other)

    def __ror__(self, other: Any) -> Any:
        return collections.defaultdict.__ror__(self.copy(), other)


class StateByMasters(KeyedOnCopy):
    """An optimizer's ``state`` whose lookup of a half parameter with an FP32 master (absent as a key) returns the
    master's entry (``[]``, ``in``, ``get``, ``del``, ``pop``, ``=``, ``update``, ``|=``, ``setdefault``); anything
    else as torch's ``defaultdict(dict)``. Holds the engine's optimizer state weakly (no cycle optimizer -> state ->
    engine). Pickles and deep-copies as :class:`KeyedOnCopy`.

    Args:
        owner: The engine's state of the optimizer (its pairs: which master each parameter has).
        items: The entries of the optimizer's state so far.
    """

    __slots__ = ()

    def __missing__(self, key: Any) -> Any:
        master = self._master(key)
        if master is not None:
            return self[master]  # the master's entry, made under the master if it has none
        return super().__missing__(key)

    def __delitem__(self, key: Any) -> None:
        """``del optimizer.state[p]`` (a reset of ``p``'s moments) by a half parameter deletes its master's entry."""
        master = self._master(key) if not dict.__contains__(self, key) else None
        super().__delitem__(master if master is not None else key)

    def __setitem__(self, key: Any, value: Any) -> None:
        """``optimizer.state[p] = {}`` (a reset of ``p``'s moments) by a half parameter replaces its master's entry;
        dict's own would leave the master's moments in use and put a second entry under ``p``, which the reads by
        ``p`` would then find instead of the master's."""
        master = self._master(key) if not dict.__contains__(self, key) else None
        super().__setitem__(master if master is not None else key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:
        """``optimizer.state.update({p: {}})`` by a half parameter: each entry as ``optimizer.state[p] = ...`` (dict's
        own would bypass ``__setitem__``)."""
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __ior__(self, other: Any) -> StateByMasters:
        """``optimizer.state |= {p: {}}``: as :meth:`update` (dict's own would put a second entry under ``p``)."""
        self.update(other)
        return self

    def pop(self, key: Any, *default: Any) -> Any:
        """``optimizer.state.pop(p, None)`` by a half parameter pops its master's entry (a reset, as torch's)."""
        master = self._master(key) if not dict.__contains__(self, key) else None
        return super().pop(master if master is not None else key, *default)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        """``optimizer.state.setdefault(p, {})`` by a half parameter gives its master's entry (made under the master
        if it has none), as ``optimizer.state[p]`` does; dict's own would put a second entry under ``p``, which the
        reads by ``p`` would then find instead of the master's."""
        master = self._master(key) if not dict.__contains__(self, key) else None
        return super().setdefault(master if master is not None else key, default)


def has_own_key(state: Any, key: Any) -> bool:
    """Whether ``state`` has an entry under ``key`` itself, a half parameter included: the engine's own tests of a
    parameter's entry (a SAM-style ``old_p``, state moved between a master and its parameter), which a
    :class:`StateByMasters`' ``in`` would answer by the master's entry too."""
    return dict.__contains__(state, key) if isinstance(state, dict) else key in state


def put_by_param(state: Any, key: torch.Tensor, value: Any) -> None:
    """``state[key] = value`` under ``key`` itself, a half parameter included: the engine's own moves of an entry
    between a master and its parameter (a release, a promotion to FP32, a state dict's move undone), which a
    :class:`StateByMasters`' ``__setitem__`` would send back to the master."""
    if isinstance(state, StateByMasters):
        dict.__setitem__(state, key, value)
    else:
        state[key] = value


def key_by_masters(state: _OptimizerState, optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer`` a :class:`StateByMasters` (its entries kept) unless it has one of ``state``'s already; a
    schedule-free one (``state.train_modes``: its ``eval()`` and ``train()`` on the half parameters must find no
    state, the engine redoes them on the masters) a :class:`KeyedOnCopy` (its copies keyed as its groups); nothing
    for a SAM-style optimizer (``state.two_pass``), nor where its ``state`` is not torch's ``defaultdict`` or is
    shared with an inner optimizer (a wrapper aliasing its base optimizer's state: replacing it would part the
    two)."""
    kept = optimizer.state
    kind = KeyedOnCopy if state.train_modes is not None else StateByMasters
    if state.two_pass or type(kept) not in (collections.defaultdict, kind):
        return
    if kept.default_factory is not dict:
        return
    if type(kept) is kind and kept._owner() is state:
        return
    if any((inner := ref()) is not None and inner.state is kept for ref in state.inners):
        return
    optimizer.state = kind(state, kept)


def key_by_params(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer the engine lets go of: torch's plain ``defaultdict(dict)`` back, its entries kept."""
    if type(optimizer.state) in (StateByMasters, KeyedOnCopy):
        optimizer.state = collections.defaultdict(dict, optimizer.state)
