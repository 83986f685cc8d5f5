"""Diff two runs of ``run.py``: the tests whose outcome changed, group by group and level by level.

    python benchmarks/upstream/compare.py /tmp/mpx-upstream/results/stop70 /tmp/mpx-upstream/results/stop71
    python benchmarks/upstream/compare.py A/fabric-clip-O2.json B/fabric-clip-O2.json   # two files
    python benchmarks/upstream/compare.py --failures /tmp/mpx-upstream/results/stop71   # one run's failures

Each ``<group>-<level>.json`` of the first run is set beside the file of the same name in the second; a test id in
one run only is listed as ``absent`` on the other side (a group cut off by its cap leaves its later tests absent).
With ``--failures`` it lists one run's failures with their outcome without the substitution (the ``-off`` file).
The exit status is 1 when a test that passed in the first run fails in the second.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _load(path: Path) -> dict[str, str]:
    return json.loads(path.read_text())["outcomes"]


def _pairs(a: Path, b: Path) -> list[tuple[str, Path, Path]]:
    if a.is_file():
        return [(a.stem, a, b)]
    names = sorted({p.name for p in a.glob("*.json")} | {p.name for p in b.glob("*.json")})
    return [(Path(n).stem, a / n, b / n) for n in names if not n.endswith("-off.json")]


def compare(a: Path, b: Path) -> int:
    worse = 0
    for name, fa, fb in _pairs(a, b):
        if not fa.exists() or not fb.exists():
            print(f"{name}: only in {'the second' if fb.exists() else 'the first'} run")
            continue
        oa, ob = _load(fa), _load(fb)
        count = {k: (sum(v == k for v in oa.values()), sum(v == k for v in ob.values())) for k in ("passed", "failed")}
        print(f"{name}: passed {count['passed'][0]} -> {count['passed'][1]}, failed {count['failed'][0]} -> "
              f"{count['failed'][1]}")  # fmt: skip
        for test_id in sorted(set(oa) | set(ob)):
            before, after = oa.get(test_id, "absent"), ob.get(test_id, "absent")
            if before != after:
                print(f"  {before} -> {after}  {test_id}")
                worse += before == "passed" and after in ("failed", "error")
    return 1 if worse else 0


def failures(run: Path) -> None:
    for path in sorted(run.glob("*.json")):
        if path.stem.endswith("-off"):
            continue
        outcomes = _load(path)
        off_path = path.with_name(f"{path.stem}-off.json")
        off = _load(off_path) if off_path.exists() else {}
        failed = sorted(k for k, v in outcomes.items() if v in ("failed", "error"))
        summary = json.loads(path.read_text())
        print(f"{path.stem}: {summary['counts']} rc={summary['rc']}")
        for test_id in failed:
            rerun = next((v for k, v in off.items() if k.endswith(test_id.split("/", 1)[-1])), "not rerun")
            print(f"  {outcomes[test_id]}  (MPX_OFF: {rerun})  {test_id}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path, nargs="?")
    parser.add_argument("--failures", action="store_true", help="list the first run's failures and their reruns")
    args = parser.parse_args()
    if args.failures or args.second is None:
        failures(args.first)
        return
    sys.exit(compare(args.first, args.second))


if __name__ == "__main__":
    main()
