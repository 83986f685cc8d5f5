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
