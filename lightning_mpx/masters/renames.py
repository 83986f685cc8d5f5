"""Checkpoint names with a prefix that the model's lack, or the reverse: masters saved through one front door
(a LightningModule's ``self.net``, DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``) and loaded through another
that prepared the module inside the wrapper, or the wrapper."""

from __future__ import annotations

from typing import Any, Iterable


def prefix_change(saved: Iterable[str], live: Iterable[str]) -> tuple[str, str] | None:
    """``(removed, added)``: the one prefix to take off every saved name and the one to put on, so that each saved
    name becomes a distinct name of ``live``; ``None`` when the names already match or no such prefix exists.

    Raises:
        KeyError: when more than one prefix change fits (a checkpoint of one ``Linear`` into a model with two twin
            ``Linear`` submodules, ``encoder.`` and ``decoder.``): which parameters it belongs to cannot be told.
    """
    saved, known = list(saved), set(live)
    if not saved or not known or all(name in known for name in saved):
        return None
    first = saved[0]
    candidates = {(first[: -len(name)], "") for name in known if first.endswith("." + name)}
    candidates |= {("", name[: -len(first)]) for name in known if name.endswith("." + first)}
    # Every fitting change, not the first found: the set's order depends on the process's hash seed.
    fits = sorted(
        (removed, added)
        for removed, added in candidates
        if all(n.startswith(removed) and added + n[len(removed):] in known for n in saved)
    )
    if len(fits) > 1:
        shown = ", ".join(f"{removed!r} removed" if removed else f"{added!r} added" for removed, added in fits)
        raise KeyError(
            f"the checkpoint's master weights {saved[:4]}{' ...' if len(saved) > 4 else ''} match this model's "
            f"parameters under more than one name prefix ({shown}): which parameters they belong to cannot be told, "
            "and nothing was loaded. Rename the checkpoint's keys to the model's names before loading it."
        )
    return fits[0] if fits else None


def renamed(values: dict[str, Any], change: tuple[str, str]) -> dict[str, Any]:
    """``values`` with each key's prefix changed (:func:`prefix_change`)."""
    removed, added = change
    return {added + name[len(removed):]: value for name, value in values.items()}
