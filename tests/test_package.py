"""The package as a user installs it: imports, public API, set-up commands."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_mpx
from lightning_mpx._imports import require

ROOT = Path(__file__).resolve().parents[1]


def test_import_needs_only_torch():
    code = (
        "import sys, lightning_mpx; "
        "bad = [m for m in ('lightning', 'pytorch_lightning', 'accelerate', 'triton') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_public_api_is_exported_and_typed():
    for name in lightning_mpx.__all__:
        assert hasattr(lightning_mpx, name), name
    assert (ROOT / "lightning_mpx" / "py.typed").exists()


def test_missing_framework_error_names_the_extra():
    with pytest.raises(ImportError, match=r"needs the 'surely_not_installed_pkg' package.*pip install 'lightning-mpx\[all\]'"):
        require("surely_not_installed_pkg")
    with pytest.raises(ImportError, match=r"pip install 'lightning-mpx\[lightning\]'"):
        require("lightning.surely_missing_submodule")


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).strip().splitlines()
    assert len(block) == 2, "the README starts with exactly two commands"
    assert "pytest" in block[1]
    assert block[1] in (ROOT / ".ci" / "run").read_text()


def test_the_torch_floor_is_the_one_pip_is_asked_for_and_older_releases_warn():
    from lightning_mpx._compat import MIN_TORCH, old_torch_warning

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
    code = "import warnings; warnings.simplefilter('error'); import lightning_mpx"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
