"""The HF Trainer door (``mpx_trainer()``) under DDP on two gloo ranks, as ``torchrun`` users run it: one launch of
``tests/hf_trainer_ddp_script.py`` (see its docstring for the cases), held to the same 2-rank run with ``bf16=True`` and
FP32, and to ``torch.amp.GradScaler`` for a float16 overflow on one rank only (transformers' ``fp16=True`` on a CPU
gets no GradScaler from Accelerate)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from tests.launch import rank_results, run_script  # noqa: E402

CLIP, LR = 0.05, 0.5  # as in the script


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("hfddp62")
    run_script("hf_trainer_ddp_script.py", out, timeout=120)  # a hang fails it; the run takes 10-30 s, more when loaded
    ranks = rank_results(out)
    for rank, res in enumerate(ranks):
        for case, values in res.items():
            assert "error" not in values, f"rank {rank}, case {case}:\n{values['error']}"
    return out, ranks


def _weights(out: Path, case: str, rank: int) -> torch.Tensor:
    return torch.load(out / f"w_{case}_rank{rank}.pt")


def test_o2_bf16_ddp_trains_as_bf16_true(launched: tuple[Path, list[dict[str, Any]]]) -> None:
    """Losses and ``grad_norm`` logged as with ``bf16=True``; weights equal across ranks; the clip applied; one
    all-reduce per optimizer step with gradient accumulation 2 (the Trainer's ``no_sync``), as with ``bf16=True``."""
    out, ranks = launched
    o2, bf16, fp32 = (ranks[0][c] for c in ("o2", "bf16", "fp32"))
    assert o2["ddp"] and bf16["ddp"] and o2["world"] == 2
    assert len(o2["losses"]) == len(bf16["losses"]) == 4
    for mine, theirs, ref in zip(o2["losses"], bf16["losses"], fp32["losses"]):
        assert abs(mine - ref) <= 3 * abs(theirs - ref) + 0.02, (o2["losses"], bf16["losses"], fp32["losses"])
    for mine, theirs in zip(o2["grad_norms"], bf16["grad_norms"]):
        assert mine > CLIP and math.isclose(mine, theirs, rel_tol=0.05), (o2["grad_norms"], bf16["grad_norms"])
    # One all-reduce of the gradients per optimizer step (none on the accumulating micro-batch), as bf16=True's.
    assert o2["per_step"] == bf16["per_step"] and len(set(o2["per_step"])) == 1 and o2["per_step"][0] >= 1
    for case in ("o2", "bf16", "fp32"):
        w0, w1 = _weights(out, case, 0), _weights(out, case, 1)
        assert torch.equal(w0, w1), f"{case}: the ranks' weights differ after training"
        # SGD, constant LR: each step moves the weights by LR * CLIP (the clip's norm), up to the bf16 rounding.
        moved = (w0[1:] - w0[:-1]).norm(dim=1)
        assert torch.allclose(moved, torch.full_like(moved, LR * CLIP), rtol=0.05), (case, moved)
    final = {c: _weights(out, c, 0)[-1] for c in ("o2", "bf16", "fp32")}
    start = _weights(out, "fp32", 0)[0]
    moved = (final["fp32"] - start).norm()
    assert (final["o2"] - final["fp32"]).norm() <= 3 * (final["bf16"] - final["fp32"]).norm() + 0.05 * moved


def test_o2_float16_overflow_on_one_rank_skips_on_both(launched: tuple[Path, list[dict[str, Any]]]) -> None:
    """Rank 1's loss inf at steps 1 and 2, in the micro-batch under ``no_sync`` (gradient accumulation 2): both ranks
    skip those steps (weights unchanged, equal), the scale backs off on both as torch's GradScaler's does, the step
    counters agree, and nothing hangs; a resume from the checkpoint after the overflows goes on with their scale."""
    out, ranks = launched
    r0, r1 = ranks[0]["fp16"], ranks[1]["fp16"]
    assert r0["ddp"] and r0["per_step"] == [1] * 6
    assert r0["global_step"] == r1["global_step"] == 6 and r0["steps"] == r1["steps"]
    assert r0["scales"] == r1["scales"] == r0["expected_scales"], (r0["scales"], r1["scales"], r0["expected_scales"])
    assert r0["skipped"] == r1["skipped"] == 2
    w0, w1 = _weights(out, "fp16", 0), _weights(out, "fp16", 1)
    assert torch.equal(w0, w1)
    moved = [not torch.equal(a, b) for a, b in zip(w0[:-1], w0[1:])]
    assert moved == [True, False, False, True, True, True], moved
    # Resumed from checkpoint-3 on both ranks: the backed-off scale goes on from the checkpoint (not init_scale).
    a0, a1 = ranks[0]["fp16_resume"], ranks[1]["fp16_resume"]
    assert a0["scales"] == a1["scales"] == r0["scales"][3:], (a0["scales"], r0["scales"])
    again = _weights(out, "fp16_resume", 0)
    assert torch.equal(again, _weights(out, "fp16_resume", 1))
    assert torch.allclose(again[-1], w0[-1], atol=1e-6, rtol=0), (again[-1] - w0[-1]).abs().max()


def test_o2_checkpoint_resume_and_save_model_under_ddp(launched: tuple[Path, list[dict[str, Any]]]) -> None:
    """``save_steps=2``: checkpoint-2 and -4 hold the engine's file (lean: the model file holds the FP32 masters)
    and no scaler.pt; resuming from checkpoint-2 on both ranks ends at the uninterrupted run's weights; ``save_model``
    writes FP32 weights that ``from_pretrained`` loads as trained."""
    out, ranks = launched
    o2 = ranks[0]["o2"]
    assert o2["checkpoints"] == ["checkpoint-2", "checkpoint-4"]
    files, sizes = o2["ckpt_files"], o2["ckpt_sizes"]
    assert "lightning_mpx_amp.bin" in files and "scaler.pt" not in files and "model.safetensors" in files, files
    assert sizes["lightning_mpx_amp.bin"] < sizes["model.safetensors"] / 4, sizes
    resumed = ranks[0]["o2_resume"]
    assert resumed["global_step"] == ranks[1]["o2_resume"]["global_step"] == 4
    end, again = _weights(out, "o2", 0)[-1], _weights(out, "o2_resume", 0)[-1]
    assert torch.equal(again, _weights(out, "o2_resume", 1)[-1])
    assert torch.allclose(again, end, atol=1e-6, rtol=0), (again - end).abs().max()
    assert o2["saved_dtypes"] == ["torch.float32"] and o2["saved_vs_trained"] == 0.0


def test_o2_evaluate_before_train_still_trains_under_ddp(launched: tuple[Path, list[dict[str, Any]]]) -> None:
    """``evaluate()`` before ``train()``: the door prepares the model for training in the evaluation (O2's masters);
    ``train()`` then still runs it in DDP (one all-reduce per optimizer step) and the ranks end equal.
    (transformers' own Trainer with ``bf16=True`` prepares it for evaluation only there and then trains each rank
    alone, without DDP: seen with transformers 5.3 and accelerate 1.15, not asserted here.)"""
    out, ranks = launched
    r0, r1 = ranks[0]["eval_first"], ranks[1]["eval_first"]
    assert r0["ddp"] and r1["ddp"] and r0["per_step"] == [1] * 4 and r0["global_step"] == 4
    w0, w1 = _weights(out, "eval_first", 0), _weights(out, "eval_first", 1)
    assert torch.equal(w0, w1) and not torch.equal(w0[0], w0[-1])
