"""The torch releases this library is tested with, and the warning for an older one.

``pyproject.toml`` asks pip for ``torch>=2.11``; an environment can still hold an older torch (``pip install
--no-deps``, a pinned image). Importing ``lightning_mpx`` there warns, once, naming what is known to fail: on torch
2.10 the suite passes except ``torch.compile`` at O1 (graph breaks, and errors where the cast policy's scope is entered
inside compiled code); releases before that also fail FSDP2 training through Lightning (2.8) and ``import
lightning_mpx.integrations.fsdp`` (2.4-2.5). ``.ci/other_torch VERSION`` runs the suite under another release
(docs/testing.md).
"""

from __future__ import annotations

import torch

#: The oldest torch release the whole suite passes on (``.ci/other_torch``); ``pyproject.toml`` requires it.
MIN_TORCH: tuple[int, int] = (2, 11)


def torch_release(version: str) -> tuple[int, int] | None:
    """torch ``version``'s (major, minor): a pre-release or source build of a release (``2.13.0a0+git...``,
    ``2.13.0.dev20260101``) counts as that release; ``None`` for what is not a release number."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return None


def old_torch_warning(version: str) -> str | None:
    """The warning for torch ``version`` when it is older than :data:`MIN_TORCH` (``None`` otherwise). A pre-release
    of the minimum itself (``2.11.0a0+git...``) counts as that release."""
    release = torch_release(version)
    if release is None or release >= MIN_TORCH:
        return None  # (not a release number: nothing to say)
    floor = ".".join(map(str, MIN_TORCH))
    return (
        f"lightning_mpx is tested with torch>={floor}, and torch {version} is installed: torch.compile at O1 fails "
        f"there (graph breaks, and errors with the cast policy's scope inside compiled code), and older releases also "
        f"fail FSDP2 training; eager training without FSDP passes the suite on torch 2.10. Install torch>={floor}."
    )


def warn_if_old_torch() -> None:
    """Warn (``UserWarning``) when the installed torch is older than :data:`MIN_TORCH`."""
    message = old_torch_warning(torch.__version__)
    if message is not None:
        import warnings

        warnings.warn(message, UserWarning, stacklevel=3)
