"""benchmarks/upstream: the harness that runs the host frameworks' own tests with our precision substituted.

One pytest subprocess loads ``mpx_substitute`` as the upstream runs do (``-p``) and checks, from a test written the way
Lightning's, Fabric's and Accelerate's tests build their objects, that the precision is ours where it should be and
the framework's where it should stay; ``run.py``'s outcome reading and ``compare.py``'s diff are checked in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parent.parent / "benchmarks" / "upstream"
REPO = HARNESS.parent.parent

_UPSTREAM_STYLE_TEST = """
import inspect
import pickle

import pytest


def test_trainer_and_fabric_get_our_plugins():
    import lightning.fabric as lf
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.precision import HalfPrecision

    from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin

    assert "precision" in inspect.signature(pl.Trainer.__init__).parameters  # Lightning reads it (PL_TRAINER_*)
    trainer = pl.Trainer(precision="bf16-mixed", logger=False, enable_checkpointing=False)
    assert isinstance(trainer.precision_plugin, MixedPrecisionPlugin)
    assert trainer.precision_plugin.amp.opt_level == "O1"
    trainer = pl.Trainer(precision="16-true", logger=False, enable_checkpointing=False)  # not a mixed precision
    assert isinstance(trainer.precision_plugin, HalfPrecision)
    fabric = lf.Fabric(accelerator="cpu", devices=1)  # MPX_ALL=1: no precision asked, ours all the same
    assert isinstance(fabric._precision, FabricMixedPrecisionPlugin)
    assert "bfloat16" in str(fabric._precision.amp.settings.half_dtype)


def test_accelerator_is_ours_and_pickles():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    assert accelerator.amp is not None and accelerator.amp.opt_level == "O1"
    assert type(pickle.loads(pickle.dumps(accelerator))).__name__ == "MpxHarnessAccelerator"
    AcceleratorState._reset_state(True)


def test_a_failure_is_recorded():
    assert False
"""


def test_substitution_from_an_upstream_style_test(tmp_path):
    pytest.importorskip("lightning")
    pytest.importorskip("accelerate")
    (tmp_path / "test_upstream_style.py").write_text(_UPSTREAM_STYLE_TEST)
    outcomes = tmp_path / "outcomes.txt"
    env = dict(os.environ, MPX_ALL="1", MPX_OL="O1", MPX_OUTCOMES=str(outcomes), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(HARNESS), str(REPO), env.get("PYTHONPATH", "")])
    env.pop("MPX_OFF", None)
    cmd = [sys.executable, "-m", "pytest", "-p", "mpx_substitute", "-p", "no:cacheprovider", "-q", "-rf"]
    done = subprocess.run(
        [*cmd, "test_upstream_style.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    out = done.stdout + done.stderr
    assert "1 failed, 2 passed" in out, out[-3000:]
    assert "substituted: Accelerator 1, Fabric 1, Trainer 1" in out, out[-3000:]
    lines = sorted(outcomes.read_text().splitlines())
    assert lines == [
        "failed\ttest_upstream_style.py::test_a_failure_is_recorded",
        "passed\ttest_upstream_style.py::test_accelerator_is_ours_and_pickles",
        "passed\ttest_upstream_style.py::test_trainer_and_fabric_get_our_plugins",
    ]


def test_outcomes_take_the_worst_and_compare_lists_changes(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(HARNESS))
    import compare
    import run

    path = tmp_path / "g.outcomes"
    path.write_text("passed\tt.py::a\nerror\tt.py::a\nskipped\tt.py::b\nfailed\tt.py::c\n")
    assert run._outcomes(path) == {"t.py::a": "error", "t.py::b": "skipped", "t.py::c": "failed"}
    assert run._from_suite_dir("tests/tests_fabric/test_fabric.py::x", "lightning") == "tests_fabric/test_fabric.py::x"
    assert run._from_suite_dir("tests/test_cpu.py::x", "accelerate") == "tests/test_cpu.py::x"
    first, second = tmp_path / "first", tmp_path / "second"
    for folder, outcomes in ((first, {"a": "passed", "b": "failed"}), (second, {"a": "failed", "c": "passed"})):
        folder.mkdir()
        (folder / "g-O2.json").write_text(json.dumps({"outcomes": outcomes, "counts": {}, "rc": 1}))
    assert compare.compare(first, second) == 1  # a pass became a failure
    out = capsys.readouterr().out
    assert "passed -> failed  a" in out and "failed -> absent  b" in out and "absent -> passed  c" in out
    assert compare.compare(second, second) == 0
