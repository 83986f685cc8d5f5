"""Run the host frameworks' own tests with lightning_mpx substituted (``mpx_substitute.py``), group by group.

    python benchmarks/upstream/run.py prepare    # upstream tests into /tmp/mpx-upstream (not the repo)
    python benchmarks/upstream/run.py run --levels O2 O1 --groups fabric-clip lightning-opt --name stop71
    python benchmarks/upstream/run.py list       # the groups

``prepare`` takes Lightning's tests at a tag (``--lightning-tag``, 2.6.5 by default) and Accelerate's at a ref
(``--accelerate-ref``, ``HEAD``) out of git directories (``--lightning-git``, ``--accelerate-git``: what the search
tool's ``fetch github:Lightning-AI/pytorch-lightning`` / ``github:huggingface/accelerate`` gave, under /work/.mirror)
with ``git archive``, and installs ``parameterized`` (Accelerate's tests need it) into a folder of its own. Nothing
fetched is written into the repository.

``run`` runs each group at each level (in the order given) in one pytest process (no ``-n``), ``MPX_ALL=1`` and
``MPX_OL=<level>``, with ``--timeout`` per test and ``--cap`` seconds for the whole group (``timeout``), writes
``<group>-<level>.log``/``.outcomes``/``.json`` (the outcome of every test id) under ``--out/<name>/``, then reruns each
failure of that group once with ``MPX_OFF=1`` (``<group>-<level>-off.*``). ``compare.py`` diffs two runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
ROOT = Path(os.environ.get("MPX_UPSTREAM_ROOT", "/tmp/mpx-upstream"))

# group -> (suite, paths relative to the suite's folder, extra pytest arguments)
GROUPS: dict[str, tuple[str, list[str], list[str]]] = {
    "fabric-clip": (
        "lightning",
        [
            "tests_fabric/test_fabric.py",
            "tests_fabric/strategies/test_single_device.py",
            "tests_fabric/strategies/test_ddp.py",
            "tests_fabric/strategies/test_strategy.py",
            "tests_fabric/strategies/test_fsdp.py",
            "tests_fabric/strategies/test_model_parallel.py",
            "tests_fabric/strategies/test_dp.py",
            "tests_fabric/plugins/precision/",
        ],
        [],
    ),
    "lightning-opt": (
        "lightning",
        [
            "tests_pytorch/trainer/optimization/",
            "tests_pytorch/plugins/precision/",
            "tests_pytorch/core/test_lightning_optimizer.py",
            "tests_pytorch/trainer/connectors/test_accelerator_connector.py",
            "tests_pytorch/plugins/test_amp_plugins.py",
            "tests_pytorch/models/test_amp.py",
            "tests_pytorch/models/test_cpu.py",
            "tests_pytorch/trainer/test_config_validator.py",
            "tests_pytorch/utilities/test_enums.py",
        ],
        [],
    ),
    "lightning-clip-hooks": (
        "lightning",
        [
            "tests_pytorch/core/test_lightning_module.py",
            "tests_pytorch/models/test_hooks.py",
            "tests_pytorch/trainer/logging_/test_loop_logging.py",
            "tests_pytorch/loops/optimization/",
        ],
        [],
    ),
    "lightning-trainer-clip": ("lightning", ["tests_pytorch/trainer/test_trainer.py"], ["-k", "clip"]),
    "accelerate-clip-accum-state": (
        "accelerate",
        [
            "tests/test_accelerator.py",
            "tests/test_state_checkpointing.py",
            "tests/test_grad_sync.py",
            "tests/test_optimizer.py",
            "tests/test_kwargs_handlers.py",
            "tests/test_utils.py",
            "tests/test_cpu.py",
        ],
        [],
    ),
    "fabric-ddp-wrappers": (
        "lightning",
        [
            "tests_fabric/strategies/test_ddp_integration.py",
            "tests_fabric/test_connector.py",
            "tests_fabric/test_wrappers.py",
        ],
        [],
    ),
    "lightning-checkpointing": ("lightning", ["tests_pytorch/checkpointing/"], ["-k", "not legacy"]),
    # transformers' Trainer tests: not in the 5.3.0 sdist and the repository is over the fetch limit, so a subset is
    # put under $MPX_UPSTREAM_ROOT/hf/tests/trainer/ by hand (README.md); run with MPX_HF=1.
    "hf-trainer": ("hf", ["tests/trainer/"], []),
}


def suite_dir(suite: str) -> Path:
    return ROOT / {"lightning": "lightning/tests", "accelerate": "accelerate", "hf": "hf"}[suite]


def _from_suite_dir(test_id: str, suite: str) -> str:
    """A test id as pytest reports it (from the rootdir, the archive's top: ``tests/tests_fabric/...`` for
    Lightning) as the command line takes it from the folder the suite runs in (``tests_fabric/...``)."""
    prefix = {"lightning": "tests/", "accelerate": "", "hf": ""}[suite]
    return test_id[len(prefix) :] if prefix and test_id.startswith(prefix) else test_id


def prepare(args: argparse.Namespace) -> None:
    for name, git_dir, ref, paths in (
        ("lightning", args.lightning_git, args.lightning_tag, ["tests", "pyproject.toml"]),
        ("accelerate", args.accelerate_git, args.accelerate_ref, ["tests", "pyproject.toml"]),
    ):
        dest = ROOT / name
        if dest.exists():
            print(f"{dest} exists: kept (remove it to take a new copy)")
            continue
        if not Path(git_dir).exists():
            sys.exit(f"{git_dir} not found: fetch the repository first (the search tool's fetch github:...)")
        dest.mkdir(parents=True)
        archive = subprocess.run(["git", "--git-dir", git_dir, "archive", ref, *paths], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
        commit = subprocess.run(["git", "--git-dir", git_dir, "rev-parse", ref], check=True, capture_output=True)
        (dest / "UPSTREAM_REF").write_text(f"{ref} {commit.stdout.decode().strip()}\n")
        print(f"{name}: {ref} -> {dest}")
    pylib = ROOT / "pylib"
    if not (pylib / "parameterized").exists():
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--target", str(pylib), "parameterized"]
        subprocess.run(cmd, check=True)


def _outcomes(path: Path) -> dict[str, str]:
    """Test id -> passed/failed/skipped/error from ``mpx_substitute``'s ``MPX_OUTCOMES`` file (the worst per id)."""
    rank = {"passed": 0, "skipped": 1, "error": 2, "failed": 3}
    result: dict[str, str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            outcome, _, test_id = line.partition("\t")
            if test_id not in result or rank.get(outcome, 0) > rank.get(result[test_id], 0):
                result[test_id] = outcome
    return result


def _pytest(suite: str, paths: list[str], extra: list[str], env_extra: dict[str, str], stem: Path, args) -> dict:
    env = dict(os.environ)
    env.update(env_extra)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(REPO), str(ROOT / "pylib"), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["MPX_OUTCOMES"] = f"{stem}.outcomes"
    Path(env["MPX_OUTCOMES"]).unlink(missing_ok=True)
    cmd = [
        "timeout", str(args.cap), sys.executable, "-m", "pytest", "-p", "mpx_substitute", "-p", "no:cacheprovider",
        "-q", "-rfE", f"--timeout={args.timeout}", *extra, *paths,
    ]  # fmt: skip
    start = time.monotonic()
    with open(f"{stem}.log", "w") as log:
        log.write(" ".join(f"{k}={v}" for k, v in env_extra.items()) + " " + " ".join(cmd) + "\n")
        log.flush()
        rc = subprocess.run(cmd, cwd=suite_dir(suite), env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    outcomes = _outcomes(Path(f"{stem}.outcomes"))
    counts = {k: sum(1 for v in outcomes.values() if v == k) for k in ("passed", "failed", "error", "skipped")}
    summary = {"rc": rc, "seconds": round(time.monotonic() - start), "counts": counts, "outcomes": outcomes}
    Path(f"{stem}.json").write_text(json.dumps(summary, indent=1, sort_keys=True))
    cut = " (cut off by --cap)" if rc in (124, 137) else ""
    print(f"{stem.name}: rc={rc}{cut} {summary['seconds']} s {counts}", flush=True)
    return summary


def run(args: argparse.Namespace) -> None:
    out = Path(args.out) / args.name
    out.mkdir(parents=True, exist_ok=True)
    for group in args.groups:
        suite, paths, extra = GROUPS[group]
        for level in args.levels:
            stem = out / f"{group}-{level}"
            env = {"MPX_ALL": "1", "MPX_OL": level, **({"MPX_HF": "1"} if suite == "hf" else {})}
            summary = _pytest(suite, paths, extra, env, stem, args)
            failed = sorted(k for k, v in summary["outcomes"].items() if v in ("failed", "error"))
            if failed and not args.no_rerun:
                ids = [_from_suite_dir(f, suite) for f in failed]
                _pytest(suite, ids, [], {"MPX_OFF": "1"}, out / f"{group}-{level}-off", args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--lightning-git", default="/work/.mirror/Lightning-AI+pytorch-lightning/repo")
    p.add_argument("--lightning-tag", default="2.6.5")
    p.add_argument("--accelerate-git", default="/work/.mirror/huggingface+accelerate/repo")
    p.add_argument("--accelerate-ref", default="HEAD")
    r = sub.add_parser("run")
    r.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    r.add_argument("--levels", nargs="+", default=["O2", "O1"])
    r.add_argument("--name", default="run")
    r.add_argument("--out", default=str(ROOT / "results"))
    r.add_argument("--timeout", type=int, default=120, help="seconds per test (pytest-timeout)")
    r.add_argument("--cap", type=int, default=560, help="seconds per group and level (timeout)")
    r.add_argument("--no-rerun", action="store_true", help="do not rerun failures with MPX_OFF=1")
    sub.add_parser("list")
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args)
    elif args.command == "run":
        run(args)
    else:
        for name, (suite, paths, extra) in GROUPS.items():
            print(f"{name} ({suite}): {' '.join(paths + extra)}")


if __name__ == "__main__":
    main()
