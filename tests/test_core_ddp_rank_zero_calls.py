"""Rank-0-only habits under DDP: the calls users guard with ``if accelerator.is_main_process:``, ``if
trainer.is_global_zero:`` or ``if fabric.global_rank == 0:`` (exports, checkpoints, metrics, scale reads, optimizer
state reads), made on rank 0 ONLY in the middle of a 2-rank gloo run, then training continued on both ranks.

One launch of ``tests/core_ddp_rank_zero_calls_script.py``: a call that did a collective on rank 0 alone would hang
there (each runs in a thread joined with a timeout: reported as ``"hang"`` by name); one that moved rank 0's state alone
would part the ranks' weights or scales, or the run from the same run without the guarded calls.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.launch import rank_results, run_script

pytest.importorskip("peft")
pytest.importorskip("accelerate")

ACCELERATE_CALLS = {
    "save_model", "get_state_dict", "mpx_metrics", "deepcopy(optimizer).state_dict", "optimizer.state[p]",
    "unwrap_model.save_pretrained", "mpx_metrics (before the step)", "get_state_dict (before the step)",
}  # fmt: skip
TRAINER_CALLS = {
    "scaler.get_scale", "scaler.state_dict", "precision_plugin.state_dict", "dump_checkpoint",
    "precision_plugin.amp.metrics", "scaler.get_scale (before the step)",
    "precision_plugin.amp.metrics (before the step)", "precision_plugin.state_dict (before the step)",
}  # fmt: skip
FABRIC_CALLS = {
    "mpx.metrics (G unheld)", "plugin.scaler.get_scale (G unheld)", "plugin.state_dict (G unheld)", "mpx.metrics",
    "plugin.scaler.get_scale", "plugin.state_dict", "plugin.state_dict (between the steps)",
    "mpx.metrics (between the steps)",
}  # fmt: skip
CASES = {
    "accelerate-plain": ACCELERATE_CALLS, "accelerate-peft": ACCELERATE_CALLS, "trainer-O2": TRAINER_CALLS,
    "fabric-False": FABRIC_CALLS, "fabric-True": FABRIC_CALLS,
}  # fmt: skip


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("rankzero62")
    run_script("core_ddp_rank_zero_calls_script.py", out, timeout=120)
    return out, rank_results(out)


def test_guarded_calls_on_rank_zero_neither_hang_nor_part_the_ranks(launched: Any) -> None:
    """Every call made on rank 0 alone returns (no collective on one rank), and the run continued on both ranks ends
    with the same weights and scale on each rank as the same run without the guarded calls (float16 with an overflow
    on rank 1 only for the plain Accelerate model, the Trainer and Fabric; Fabric's reads also between a GAN's two
    optimizer steps, with and without ``skip_on_device``; the peft model at bfloat16).

    Fabric's ``plugin.state_dict()`` (G unmet) and ``metrics()``/``state_dict()`` between D's and G's steps (both
    met) ended the iteration on rank 0 alone: the ranks' scales and weights parted (with ``skip_on_device``, a
    mismatched collective at the next step). Now such reads leave the iteration to the next call every rank makes."""
    _, (zero, one) = launched
    for case, calls in CASES.items():
        guarded, plain = zero[f"{case}-True"], zero[f"{case}-False"]
        assert "error" not in guarded and "error" not in plain, (case, guarded.get("error"), plain.get("error"))
        assert set(guarded["calls"]) == calls, case
        failed = {name: out for name, out in guarded["calls"].items() if not out.startswith("ok")}
        assert not failed, (case, failed)
        assert one[f"{case}-True"]["calls"] == {}  # rank 1 never made them
        for rank in (zero, one):
            for key in ("weights", "masters", "scale", "skipped"):
                if key in plain:
                    assert rank[f"{case}-True"][key] == pytest.approx(plain[key], rel=1e-9, abs=1e-9), (case, key)
    assert zero["accelerate-plain-False"]["skipped"] == 1 and zero["fabric-True-False"]["skipped"] == 2  # it overflowed


def test_trainer_reads_on_rank_zero_match_16_mixed_and_save_checkpoint_keeps_lightnings_contract(launched: Any) -> None:
    """The Trainer callback's ``if trainer.is_global_zero:`` reads show what ``"16-mixed"`` (a GradScaler) shows at
    the same points, and the plugin's checkpoint (``dump_checkpoint``, what ``save_checkpoint`` writes) is made on
    rank 0 alone as ``"16-mixed"``'s and ``"bf16-mixed"``'s is. ``trainer.save_checkpoint`` itself must be called on
    every rank (Lightning's barrier, under any precision): called so after ``fit``, it returns on both ranks."""
    _, (zero, one) = launched
    ours, native = zero["trainer-O2-True"], zero["trainer-16-mixed-True"]
    for name in ("scaler.get_scale", "scaler.get_scale (before the step)"):
        assert ours["calls"][name] == native["calls"][name] != "ok", name  # "ok=<scale>"
    for reference in ("trainer-16-mixed-True", "trainer-bf16-mixed-True"):
        for name in ("precision_plugin.state_dict", "dump_checkpoint"):
            assert zero[reference]["calls"][name] == "ok", (reference, name)
    assert ours["scale"] == native["scale"] == one["trainer-O2-True"]["scale"]
    assert ours["weights"] == pytest.approx(native["weights"], rel=1e-3)  # other kernels: O2 vs autocast
    assert all(zero[c]["save_checkpoint_all_ranks"] == one[c]["save_checkpoint_all_ranks"] == "ok"
               for c in ("trainer-O2-True", "trainer-O2-False"))  # fmt: skip


def test_exports_made_on_rank_zero_alone_hold_the_fp32_masters(launched: Any) -> None:
    """``accelerator.save_model`` and ``unwrap_model(model).save_pretrained`` on rank 0 alone write the FP32 masters
    (``config.json``: float32); for a peft model ``save_model`` names the frozen half base in its warning (on rank 0,
    where the call was made) and ``save_pretrained`` writes the FP32 adapters."""
    from safetensors.torch import load_file

    out, (zero, _) = launched
    files = out / "files"
    for folder in ("plain_save_model/model.safetensors", "plain_pretrained/model.safetensors",
                   "peft_pretrained/adapter_model.safetensors"):  # fmt: skip
        assert {t.dtype for t in load_file(files / folder).values()} == {torch.float32}, folder
    assert json.loads((files / "plain_pretrained/config.json").read_text())["dtype"] == "float32"
    peft_whole = load_file(files / "peft_save_model/model.safetensors")
    assert all(t.dtype == torch.float32 for name, t in peft_whole.items() if "lora" in name)
    assert "warned: save_model at O2 exports" in zero["accelerate-peft-True"]["calls"]["save_model"]
