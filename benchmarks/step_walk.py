"""The walk of one ``Amp.step``: which of the package's modules the call passes through, in order.

A reader follows the step by opening the modules it enters; every return to a module already left is a climb back
the reader makes. This script records the package's Python frames during one ``amp.step(optimizer)`` (after a
backward, at a warm engine: the steady step) and reports, per opt level:

* ``modules``: the distinct modules entered;
* ``stays``: the runs of consecutive frames in one module (a call or a return into another module starts a new one);
* ``returns``: stays in a module already visited before (``stays - modules``): the climbs back up;
* ``entries``: calls that cross from one module into another (the script's own call into the engine included), and
  ``max_entries``: the most any one module is entered (the goal of a step that reads as one pipeline: 1);
* ``path``: the modules of the stays, in order.

Deterministic: the same code gives the same walk on any machine. For a before/after figure run it with
``PYTHONPATH`` on each tree (``--label`` names them in the JSON).

    python benchmarks/step_walk.py [--levels O1 O2] [--optimizers 1] [--label L] [--out PATH]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import _harness  # benchmarks/ is on sys.path when a script runs
import torch
from torch import nn

import lightning_mpx
from lightning_mpx import Amp

PACKAGE_DIR = str(Path(lightning_mpx.__file__).resolve().parent)


def _module_of(frame: Any) -> str | None:
    path = str(Path(frame.f_code.co_filename).resolve())
    if not path.startswith(PACKAGE_DIR):
        return None
    rel = Path(path).relative_to(PACKAGE_DIR).with_suffix("")
    return ".".join(rel.parts)


def walk(level: str, half_dtype: str = "bfloat16") -> dict[str, Any]:
    """The module path of one steady ``amp.step(optimizer)`` at ``level`` on a two-layer model with SGD."""
    torch.manual_seed(0)
    amp = Amp(level, half_dtype=half_dtype)
    model = amp.prepare_model(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 8)

    def backward() -> None:
        with amp.forward_context():
            loss = amp.cast_outputs(model(amp.cast_inputs(x))).float().sum()
        amp.backward(loss)

    for _ in range(3):  # warm: the steady step, not the first one's set-up
        backward()
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad(set_to_none=True)
    backward()
    path: list[str] = []
    entries: dict[str, int] = {}

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        # a call enters the callee's module; a return goes back to the caller's
        module = _module_of(frame) if event == "call" else (_module_of(frame.f_back) if frame.f_back else None)
        if event == "call" and module is not None:
            caller = _module_of(frame.f_back) if frame.f_back is not None else None
            if caller != module:
                entries[module] = entries.get(module, 0) + 1
        if module is not None and (not path or path[-1] != module):
            path.append(module)

    sys.setprofile(profile)
    try:
        amp.step(optimizer)
    finally:
        sys.setprofile(None)
    # the outermost frame is this script's call into Amp.step: the walk starts in the engine's module
    seen: set[str] = set()
    returns = 0
    for module in path:
        returns += module in seen
        seen.add(module)
    # the script's own call into Amp.step enters the engine's module once; every other entry is a call made by the
    # package from one of its modules into another
    return {"opt_level": level, "modules": len(seen), "stays": len(path), "returns": returns,
            "entries": sum(entries.values()), "max_entries": max(entries.values()),
            "entered_more_than_once": {m: n for m, n in sorted(entries.items()) if n > 1}, "path": path}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", nargs="+", choices=("O1", "O2", "O3"), default=["O1", "O2"])
    parser.add_argument("--label", default="", help="a name for this tree in the JSON (e.g. before/after)")
    parser.add_argument("--out", type=Path, default=_harness.default_out("step_walk"))
    parser.add_argument("--show-path", action="store_true", help="print each level's path of modules")
    args = parser.parse_args(argv)
    rows = [walk(level) for level in args.levels]
    table = _harness.markdown_table(
        ["opt level", "modules", "stays", "returns", "entries", "most entries of one module"],
        [[r["opt_level"], r["modules"], r["stays"], r["returns"], r["entries"],
          f"{r['max_entries']} ({max(r['entered_more_than_once'], key=r['entered_more_than_once'].get)})"
          if r["entered_more_than_once"] else r["max_entries"]] for r in rows])
    print(f"the walk of one amp.step(optimizer) ({args.label or PACKAGE_DIR}):\n{table}")
    if args.show_path:
        for r in rows:
            print(f"{r['opt_level']}: " + " -> ".join(r["path"]))
    result = {"label": args.label, "package": PACKAGE_DIR, "rows": rows, "table": table}
    _harness.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
