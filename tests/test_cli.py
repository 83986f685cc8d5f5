"""The ``lightning-mpx`` console script: ``demo`` and ``plot``."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch

from lightning_mpx.cli import main
from lightning_mpx.demo import DemoConfig, choose_half_dtype, resolve_half_dtype, train
from lightning_mpx.health.plot import plot_run, read_scalars

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--steps", "6", "--dim", "16", "--layers", "1", "--batch-size", "4", "--seq-len", "16", "--no-progress-bar"]


def test_demo_trains_logs_and_prints_the_summary(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["demo", *TINY, "--half-dtype", "bfloat16", "--run-dir", str(run), "--plot"]) == 0
    out = capsys.readouterr().out
    for row in ("final train loss", "final val loss", "steps", "skipped steps", "final loss scale", "tokens / second"):
        assert row in out
    assert "| steps            | 6" in out
    series = read_scalars(run)
    assert {"mpx/loss_scale", "mpx/overflows", "mpx/skipped_steps", "train/loss", "val/loss"} <= set(series)
    png = run / "loss_scale.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_final_train_loss_survives_the_closing_validation(tmp_path):
    # 3 steps, validation every 100: the curve's last point comes from a validate() after fit, which used to clear
    # the training metrics (the summary printed "final train loss nan").
    result = train(
        DemoConfig(
            steps=3, dim=16, layers=1, batch_size=4, seq_len=16, val_batches=1, corpus_bytes=20_000,
            progress_bar=False, run_dir=str(tmp_path / "run"),
        )
    )  # fmt: skip
    assert result.val_curve[-1][0] == 3
    assert math.isfinite(result.train_loss) and 0 < result.train_loss < 10


def test_plot_marks_overflows_from_a_run_that_had_them(tmp_path):
    # A scale far beyond float16's range overflows at once, then backs off step by step.
    result = train(
        DemoConfig(
            half_dtype="float16", steps=8, dim=16, layers=1, batch_size=4, seq_len=16, progress_bar=False,
            log_every_n_steps=1,
            run_dir=str(tmp_path / "overflowing"), plugin_kwargs=dict(init_scale=2.0**24),
        )
    )  # fmt: skip
    assert result.skipped_steps > 0
    series = read_scalars(result.run_dir)
    overflow_steps = [step for step, value in series["mpx/overflows"] if value > 0]
    scales = dict(series["mpx/loss_scale"])
    assert overflow_steps and all(scales[s] < 2.0**24 for s in overflow_steps)  # halved where it overflowed
    out = plot_run(result.run_dir, tmp_path / "curves.png")
    assert out.stat().st_size > 10_000


def test_demo_default_runs_bfloat16_with_a_dynamic_scale_on_cpu(tmp_path, capsys):
    """The first README command on a CPU: bfloat16 (float16 matmuls are emulated on many CPUs, 8x slower in the demo)
    with a dynamic loss scale, so the scale's staircase shows; the output says what ran and why; one CPU thread for the
    run, and the process's setting back afterwards."""
    threads = torch.get_num_threads()
    run = tmp_path / "default"
    assert main(["demo", *TINY, "--growth-interval", "2", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "lightning-mpx demo: O1 in bfloat16: bfloat16 (auto): on a CPU, where float16 matmuls are often" in out
    assert "| O1 (bfloat16, dynamic loss scale)" in out and "| cpu, 1 thread(s)" in out
    assert "half dtype: bfloat16 (auto)" in out and 'loss_scale="dynamic"' in out and "--half-dtype float16" in out
    scales = [value for _, value in read_scalars(run)["mpx/loss_scale"]]
    assert scales[0] == 2.0**16 and scales[-1] == 2.0**19  # doubled every 2 steps: the staircase
    assert torch.get_num_threads() == threads
    # float16 stays one flag away.
    assert main(["demo", *TINY, "--half-dtype", "float16", "--run-dir", str(tmp_path / "fp16")]) == 0
    out = capsys.readouterr().out
    assert "| O1 (float16, dynamic loss scale)" in out and "half dtype: chosen by --half-dtype" in out


def test_auto_half_dtype_rules():
    assert choose_half_dtype("cuda")[0] == "float16" and choose_half_dtype("cpu")[0] == "bfloat16"
    # O3's float16 preset has a static scale of 1: bfloat16 keeps it; a loss scale the caller names is kept.
    assert "loss_scale" not in resolve_half_dtype(DemoConfig(opt_level="O3", accelerator="cpu")).plugin_kwargs
    config = resolve_half_dtype(DemoConfig(accelerator="cpu", plugin_kwargs={"loss_scale": 128.0}))
    assert (config.half_dtype, config.plugin_kwargs["loss_scale"]) == ("bfloat16", 128.0)
    assert resolve_half_dtype(DemoConfig(half_dtype="float16")).half_dtype == "float16"
    with pytest.raises(ValueError, match="half_dtype='fp8' is not valid; valid choices: auto, float16, bfloat16"):
        resolve_half_dtype(DemoConfig(half_dtype="fp8"))


def test_plot_explains_a_folder_without_event_files(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert "holds no TensorBoard event files" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_demo_rejects_bad_flags(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--opt-level", "O4"])
    assert "invalid choice: 'O4'" in capsys.readouterr().err
    assert main(["demo", "--steps", "0"]) == 2
    assert "--steps=0 must be >= 1" in capsys.readouterr().err
    assert main(["demo", "--threads", "0"]) == 2
    assert "--threads=0 must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--half-dtype", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


def test_console_script_is_declared():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["lightning-mpx"] == "lightning_mpx.cli:main"


ADAPTERS = {"lightning_mpx.integrations.lightning": "lightning", "lightning_mpx.demo": "lightning"}
_IMPORT_EACH = """
import json, sys
for name in ('lightning', 'lightning.pytorch'): sys.modules[name] = None  # as if not installed
errors = {}
for module in sys.argv[1:]:
    try:
        __import__(module)
    except ImportError as error:
        errors[module] = str(error)
    for name in [n for n in sys.modules if n == module or n.startswith(module + '.')]:
        del sys.modules[name]  # the next module imports afresh what it needs
print(json.dumps(errors))
"""


@pytest.fixture(scope="module")
def import_errors() -> dict[str, str]:
    """Each of :data:`ADAPTERS` imported without its framework, in one process (each a subprocess costs torch's
    import): module -> the ImportError's message (absent: the import did not fail)."""
    run = subprocess.run([sys.executable, "-c", _IMPORT_EACH, *ADAPTERS], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", list(ADAPTERS))
def test_adapter_without_its_framework_names_the_extra(module, import_errors):
    assert f"pip install 'lightning-mpx[{ADAPTERS[module]}]'" in import_errors[module]
