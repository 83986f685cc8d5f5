"""The constraints of ``.ci/other_torch``'s venv: ``python .ci/dev_pins.py TORCH_VERSION [NAME ...]`` prints
``torch==TORCH_VERSION`` and ``name==version`` for every package that the dev extra of lightning-mpx resolved in the
interpreter running it: the extra's requirements and, through them, theirs (their extras followed), each at the
version installed here, read with ``importlib.metadata``.

A fresh venv then gets CI's versions (it got transformers 5.24 where CI has 5.3.0) and the torch asked. Left unpinned:
torch's own exact pins (``triton``, the NVIDIA and CUDA libraries: the asked torch's wheel brings those it was built
with; torch 2.12's brings triton 3.7 where the dev extra has 3.6), the packaging tools (``setuptools``: torch 2.11 asks
for < 82), packages only torch needs (never followed into), and
the ``NAME``\\ s given (``MPX_UNPIN`` in ``.ci/other_torch``: a package whose version here an older torch cannot take).

The dev extra is read from this interpreter's installed ``lightning-mpx`` (the editable install), else from
``pyproject.toml`` next to this folder. Exit status 1, with a message, when neither is readable.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

#: Never pinned: torch (the version asked is), what a torch wheel pins exactly for itself, and the packaging tools
#: (torch 2.11 asks for setuptools<82; tensorboard brings setuptools 84 here).
TORCH_OWN = re.compile(r"^(torch|triton|pytorch-triton(-.*)?|nvidia-.*|cuda-.*|setuptools|pip|wheel)$")


def dev_requirements(root: Path) -> list[Requirement]:
    """The dev extra's requirements: this interpreter's installed lightning-mpx's metadata, else ``pyproject.toml``."""
    try:
        texts = metadata.requires("lightning-mpx") or []
        found = [r for r in map(Requirement, texts) if r.marker is not None and r.marker.evaluate({"extra": "dev"})
                 and not r.marker.evaluate({"extra": ""})]  # fmt: skip
        if found:
            return found
    except metadata.PackageNotFoundError:
        pass
    import tomllib  # Python >= 3.11 (3.10: install the project, whose metadata is read above)

    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    return [Requirement(text) for text in project["optional-dependencies"]["dev"]]


def resolved(requirements: list[Requirement], unpinned: set[str]) -> dict[str, str]:
    """``{name: installed version}`` for ``requirements`` and, through them, theirs (the extras each asked for
    followed), as installed in this interpreter; a package not installed here (a marker left it out) is skipped."""
    pins: dict[str, str] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = list(requirements)
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if TORCH_OWN.match(name) or name in unpinned or (name, frozenset(req.extras)) in seen:
            continue
        seen.add((name, frozenset(req.extras)))
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue
        pins[name] = dist.version
        for text in dist.requires or []:
            sub = Requirement(text)
            if sub.marker is None or any(sub.marker.evaluate({"extra": extra}) for extra in ("", *req.extras)):
                todo.append(sub)
    return pins


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python .ci/dev_pins.py TORCH_VERSION [NAME ...]", file=sys.stderr)
        return 2
    version, unpinned = argv[0], {canonicalize_name(name) for name in argv[1:]}
    try:
        pins = resolved(dev_requirements(Path(__file__).resolve().parent.parent), unpinned)
    except (OSError, KeyError, ImportError) as error:
        print(f"dev_pins: cannot read the dev extra ({type(error).__name__}: {error}); install the project in this "
              "interpreter (pip install -e '.[dev]') or run it with Python >= 3.11", file=sys.stderr)  # fmt: skip
        return 1
    print(f"torch=={version}")
    for name in sorted(pins):
        print(f"{name}=={pins[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
