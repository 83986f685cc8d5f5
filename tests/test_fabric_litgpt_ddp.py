"""litgpt's LoRA entry point on two processes: ``python -m lightning_mpx.litgpt finetune_lora <checkpoint> --devices 2
--opt_level O1`` run for real as a subprocess on CPU (gloo; litgpt's ``setup`` takes its ``ModelParallelStrategy``,
FSDP2, on several devices, where O2 is refused). Fabric's subprocess launcher starts rank 1 by re-running the command
line: it must be ours (``-m lightning_mpx.litgpt finetune_lora ...``), not the litgpt flags ``main`` records while it
runs (``python <checkpoint_dir> --lora_r=...``). One launch (a module fixture) on
tests/test_fabric_litgpt_finetune_cli.py's tiny checkpoint, tokenizer and data. By hand (not here: one launch per test
file) the same command with litgpt's own ``litgpt finetune_lora --devices 2 --precision bf16-mixed`` gave a bit-equal
LoRA file and the same losses."""

from __future__ import annotations

import csv
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

pytest.importorskip("litgpt")
pytest.importorskip("lightning")

import litgpt  # noqa: E402
from litgpt.lora import GPT as LoRAGPT  # noqa: E402
from litgpt.lora import Config as LoRAConfig  # noqa: E402
from litgpt.lora import merge_lora_weights  # noqa: E402

from tests.test_fabric_litgpt_finetune_cli import SETTINGS, _checkpoint, _data  # noqa: E402
from tests.warm_python import warm_python  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# a hang (a rank that never joins) fails; 60 s timed out once on a loaded 2-core machine (rank 1 still importing)
TIMEOUT_S = 150
STEPS = 2


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Any]:
    """The one two-process launch: the CLI at O1 bfloat16, 2 optimizer steps of 2 micro-batches on each rank. The
    command starts from the warm interpreter of tests/warm_python.py (``python`` with torch and Lightning imported),
    and so does rank 1, which Fabric starts with ``sys.executable`` and the command line: each process paid those
    imports before stop 64."""
    tmp = tmp_path_factory.mktemp("litgptddp")
    checkpoint, data, out = _checkpoint(tmp / "checkpoint"), _data(tmp / "data.json"), tmp / "out"
    optimizer = {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.2}}
    command = [
        warm_python(), "-m", "lightning_mpx.litgpt", "finetune_lora", str(checkpoint), "--devices", "2",
        "--opt_level", "O1", "--mpx_kwargs", json.dumps({"half_dtype": "bfloat16"}), "--out_dir", str(out),
        "--data", "JSON", "--data.json_path", str(data), "--data.val_split_fraction", "0.25",
        "--data.prompt_style", "alpaca", "--data.num_workers", "0", "--train.save_interval", "null",
        "--train.log_interval", "1", "--train.global_batch_size", "4", "--train.micro_batch_size", "1",
        "--train.lr_warmup_steps", "1", "--train.epochs", "100", "--train.max_steps", str(STEPS),
        "--eval.interval", "100", "--eval.max_new_tokens", "2", "--eval.max_iters", "1",
        "--eval.final_validation", "false", "--optimizer", json.dumps(optimizer), "--seed", "3",
        *[f"--{k}={str(v).lower()}" for k, v in SETTINGS.items()],
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    proc = subprocess.Popen(command, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the launcher's rank-1 child with it (one session)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"timed out after {TIMEOUT_S} s; stderr ends with:\n{stderr[-6000:]}") from None
    assert proc.returncode == 0, f"exit code {proc.returncode}; stderr ends with:\n{stderr[-6000:]}"
    return {"checkpoint": checkpoint, "out": out, "stdout": stdout, "stderr": stderr}


def test_both_ranks_start_from_our_command_line_and_train(run):
    """Rank 1 is started from ``-m lightning_mpx.litgpt finetune_lora ...`` and runs litgpt's ``main`` (its seed
    line), under litgpt's FSDP2 strategy with the plugin; both ranks' steps are logged with the plugin's metrics."""
    assert "Starting with 2 processes" in run["stderr"]
    assert "[rank: 0] Seed set to 3" in run["stderr"] and "[rank: 1] Seed set to 3" in run["stderr"]
    assert "can't find '__main__' module" not in run["stderr"]
    assert f"step {STEPS} | loss train" in run["stdout"]
    (metrics,) = (run["out"] / "logs" / "csv").rglob("metrics.csv")
    rows = [row for row in csv.DictReader(metrics.read_text().splitlines()) if row["loss"]]
    assert len(rows) == 2 * STEPS  # one record per micro-batch of rank 0 (log_interval=1)
    assert all(row["mpx/loss_scale"] == "1.0" and row["mpx/skipped_steps"] == "0.0" for row in rows)


def test_lora_file_is_fp32_trained_and_the_merge_is_its_fp32_product(run):
    """``final/lit_model.pth.lora`` (gathered from the FSDP2 shards) is FP32 and trained; the merged
    ``lit_model.pth`` is FP32 and equals litgpt's own merge of the FP32 base with that LoRA file."""
    final = run["out"] / "final"
    lora = torch.load(final / "lit_model.pth.lora")["model"]
    assert lora and {v.dtype for v in lora.values()} == {torch.float32}
    moved = torch.cat([v.flatten() for k, v in lora.items() if "lora_B" in k])
    assert moved.abs().max() > 1e-3
    merged = torch.load(final / "lit_model.pth")
    assert {v.dtype for v in merged.values()} == {torch.float32}
    litgpt.GPT(litgpt.Config.from_file(final / "model_config.yaml")).load_state_dict(merged)
    hparams = yaml.safe_load((final / "hyperparameters.yaml").read_text())  # litgpt's own merge_lora reads these
    config = LoRAConfig.from_file(run["checkpoint"] / "model_config.yaml",
                                  **{k: v for k, v in hparams.items() if k.startswith("lora_")})  # fmt: skip
    model = LoRAGPT(config)
    model.load_state_dict(torch.load(run["checkpoint"] / "lit_model.pth"), strict=False)
    model.load_state_dict(lora, strict=False)
    merge_lora_weights(model)
    expected = {k.replace("linear.", ""): v for k, v in model.state_dict().items() if "lora_" not in k}
    assert sorted(expected) == sorted(merged)
    for name, value in merged.items():
        torch.testing.assert_close(value, expected[name], atol=1e-6, rtol=1e-5, msg=name)
    base = torch.load(run["checkpoint"] / "lit_model.pth")
    assert not torch.equal(merged["transformer.h.1.attn.qkv.weight"], base["transformer.h.1.attn.qkv.weight"])


def test_hyperparameters_record_the_command(run):
    """``hyperparameters.yaml`` (rank 0) is litgpt's record of the flags: two devices, the LoRA settings merge_lora
    reads, the optimizer; no precision (the opt level set it)."""
    hparams = yaml.safe_load((run["out"] / "final" / "hyperparameters.yaml").read_text())
    assert Path(hparams["checkpoint_dir"]) == run["checkpoint"] and Path(hparams["out_dir"]) == run["out"]
    assert hparams["devices"] == 2 and hparams["train"]["max_steps"] == STEPS
    assert {k: hparams[k] for k in SETTINGS} == SETTINGS
    assert hparams["optimizer"] == {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.2}}
    assert "precision" not in hparams
