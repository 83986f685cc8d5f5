"""examples/apex_legacy.py runs (a few steps of each loop)."""

from __future__ import annotations

import pathlib
import runpy
import sys

import pytest

from lightning_mpx.apex import _amp_state

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "apex_legacy.py"


@pytest.mark.parametrize("args", [["--opt-level", "O1"], ["--opt-level", "O2"], ["--fp16-optimizer"]])
def test_apex_legacy_example_runs(args, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), *args, "--steps", "3"])
    try:
        runpy.run_path(str(EXAMPLE), run_name="__main__")
    finally:
        _amp_state.reset()
    out = capsys.readouterr().out
    assert "step   0 loss" in out
    if "--opt-level" in args:
        assert "resumed at loss scale" in out
