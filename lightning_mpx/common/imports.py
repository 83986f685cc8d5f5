"""Optional dependencies: the adapters import their framework through :func:`require`."""

from __future__ import annotations

import importlib
from types import MappingProxyType, ModuleType

#: The extra that installs each optional framework.
EXTRAS = MappingProxyType(
    {
        "lightning": "lightning",
        "accelerate": "accelerate",
        "triton": "triton",
        "tensorboard": "demo",
        "matplotlib": "demo",
    }
)


def require(module: str, *, extra: str | None = None, feature: str | None = None) -> ModuleType:
    """Import ``module`` or raise an ImportError that says which extra of lightning-mpx installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        top = module.split(".")[0]
        extra = extra or EXTRAS.get(top, "all")
        what = feature or "this part of lightning_mpx"
        raise ImportError(
            f"{what} needs the '{top}' package, which is not installed. Install it with: "
            f"pip install 'lightning-mpx[{extra}]'"
        ) from error
