"""The package as a user installs it: imports, public API, set-up commands."""

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import lightning_mpx
from lightning_mpx.common.imports import require

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fresh_import() -> dict[str, Any]:
    """``import lightning_mpx`` in a fresh interpreter (one for the tests that read it: each paid torch's import):
    the frameworks then in ``sys.modules``, and every warning the import raised (all recorded, none filtered)."""
    code = (
        "import json, sys, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import lightning_mpx\n"
        "frameworks = ('lightning', 'pytorch_lightning', 'accelerate', 'triton')\n"
        "print(json.dumps({'imported': [m for m in frameworks if m in sys.modules],\n"
        "                  'warnings': [f'{w.category.__name__}: {w.message}' for w in caught]}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True, text=True)
    return json.loads(done.stdout.splitlines()[-1])


def test_import_needs_only_torch(fresh_import):
    assert fresh_import["imported"] == []


def test_public_api_is_exported_and_typed():
    for name in lightning_mpx.__all__:
        assert hasattr(lightning_mpx, name), name
    assert (ROOT / "lightning_mpx" / "py.typed").exists()


def test_missing_framework_error_names_the_extra():
    with pytest.raises(
        ImportError, match=r"needs the 'surely_not_installed_pkg' package.*pip install 'lightning-mpx\[all\]'"
    ):
        require("surely_not_installed_pkg")
    with pytest.raises(ImportError, match=r"pip install 'lightning-mpx\[lightning\]'"):
        require("lightning.surely_missing_submodule")


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).strip().splitlines()
    assert len(block) == 2, "the README starts with exactly two commands"
    assert "pytest" in block[1]
    assert block[1] in (ROOT / ".ci" / "run").read_text()


def test_the_torch_floor_is_the_one_pip_is_asked_for_and_older_releases_warn(fresh_import):
    from lightning_mpx.common.compat import MIN_TORCH, old_torch_warning

    pyproject = (ROOT / "pyproject.toml").read_text()
    floor = ".".join(map(str, MIN_TORCH))
    assert f'dependencies = ["torch>={floor}"]' in pyproject
    for version in (f"{floor}.0", f"{floor}.0a0+git1234", "2.13.0+cpu", "3.0.0"):
        assert old_torch_warning(version) is None, version
    older = f"{MIN_TORCH[0]}.{MIN_TORCH[1] - 1}.0+cu128"
    message = old_torch_warning(older)
    assert message is not None and f"torch>={floor}" in message and older in message and "torch.compile" in message
    assert old_torch_warning("2.4.1") is not None
    # The installed torch (CI's) is at or above the floor: importing the package warns about nothing.
    assert fresh_import["warnings"] == []


def test_every_package_a_test_skips_without_is_installed_by_the_dev_extra():
    """CI installs ``.[dev]``: a test that skips when a package is missing must find it there, or CI never runs it
    (the LoRA tests of tests/test_frozen_params_o2.py skipped in every CI run until peft joined the extra)."""
    import tomllib

    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    wanted = {re.match(r"[A-Za-z0-9_.-]+", spec).group(0).lower().replace("_", "-") for spec in dev}
    # The import name where it differs from the distribution's; torch's own modules need nothing.
    distribution = {"sklearn": "scikit-learn", "lightning.pytorch": "lightning", "transformers.modeling_outputs":
                    "transformers", "torch.distributed.fsdp": None}  # fmt: skip
    skipped_on: dict[str, set[str]] = {}
    for path in sorted((ROOT / "tests").glob("*.py")):
        text = path.read_text()
        names = re.findall(r"importorskip\(\s*[\"']([\w.]+)[\"']", text)
        names += re.findall(r"find_spec\(\s*[\"']([\w.]+)[\"']\s*\)\s*is\s*(?:not\s*)?None", text)
        for name in names:
            skipped_on.setdefault(name, set()).add(path.name)
    assert "peft" in skipped_on and "sklearn" in skipped_on  # the scan sees the tests it guards
    # Not in the dev extra on purpose, each with the reason: CI skips these tests until the package joins it.
    waived = {
        "trl": "tests/test_hf_trainer_trl.py; trl upgrades huggingface_hub for every test, its joining the extra is "
               "open"
    }
    missing = {}
    for name, files in skipped_on.items():
        dist = distribution.get(name, name.split(".")[0])
        if dist is not None and dist.lower() not in wanted and name not in waived:
            missing[name] = sorted(files)
    assert not missing, f"tests skip without these packages, which the dev extra does not install: {missing}"


def test_xdist_workers_share_the_cores_out():
    """Under the README's command (pytest-xdist, a worker per core) each worker, and what its tests launch, runs
    torch on its share of the cores (tests/conftest.py): a thread per core in every worker made small tests wait on
    OpenMP threads that were not running."""
    import os

    import torch

    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None:
        pytest.skip("runs under pytest-xdist only (a single-process run keeps torch's default threads)")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    expected = os.environ["OMP_NUM_THREADS"]  # set by tests/conftest.py unless the caller set it
    assert torch.get_num_threads() == int(expected)
    if expected == str(max(1, cores // int(workers))):
        return
    pytest.skip(f"OMP_NUM_THREADS={expected} was set by the caller")
