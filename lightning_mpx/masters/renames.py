"""Checkpoint names with a prefix that the model's lack, or the reverse: masters saved through one front door
(a LightningModule's ``self.net``, DDP's ``module.``, ``torch.compile``'s ``_orig_mod.``) and loaded through another
that prepared the module inside the wrapper, or the wrapper."""

from __future__ import annotations

from typing import Any, Iterable


def prefix_change(saved: Iterable[str], live: Iterable[str]) -> tuple[str, str] | None:
    """``(removed, added)``: the one prefix to take off every saved name and the one to put on, so that each saved
    name becomes a distinct name of ``live``; ``None`` when the names already match or no such prefix exists."""
    saved, known = list(saved), set(live)
    if not saved or not known or all(name in known for name in saved):
        return None
    first = saved[0]
    candidates = [(first[: -len(name)], "") for name in known if first.endswith("." + name)]
    candidates += [("", name[: -len(first)]) for name in known if name.endswith("." + first)]
    for removed, added in candidates:
        if all(n.startswith(removed) and added + n[len(removed):] in known for n in saved):
            return removed, added
    return None


def renamed(values: dict[str, Any], change: tuple[str, str]) -> dict[str, Any]:
    """``values`` with each key's prefix changed (:func:`prefix_change`)."""
    removed, added = change
    return {added + name[len(removed):]: value for name, value in values.items()}
