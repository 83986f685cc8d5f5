"""Rank-0-only habits around stop 57's optimizers under DDP (two CPU ranks, gloo, every multi-rank check in ONE
launch: tests/fabric_ddp_rank_zero_optimizers_script.py): a schedule-free optimizer's
``eval()``/evaluation/export/``train()`` on rank 0 alone (Fabric, and one Trainer case), the same with ``train()``
forgotten, SAM with one rank's first pass overflowing (O2 float16, dynamic scale), a Lookahead checkpoint written by
rank 0 and loaded on both. O2 bfloat16 held to Fabric's ``"bf16-mixed"`` on the same code and data.

Stop 58: the engine's redo of a schedule-free ``eval()``/``train()`` on the masters (masters/swap.py
``follow_modes``, at the next forward through Fabric's model or state dict) is local: nothing collective, no hang,
the ranks stay together. Found and left (strict xfail): under the Trainer a bare ``self.net(x)`` in a hook
(``on_train_epoch_end``) right after ``optimizer.eval()`` runs at the training point.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.launch import rank_results, run_script

# O2's bfloat16 forward and gradients against "bf16-mixed" (FP32 weights, bfloat16 autocast) over six AdamW-like
# steps of a tiny MLP: measured 9e-5 apart (weights), 1e-3 (an evaluation loss).
ATOL_W = 3e-3
ATOL_LOSS = 2e-3
# Rank 0's eval()/train() round trip on its FP32 masters (two lerps, the optimizer's own math) is exact only up to
# FP32 rounding (measured 1.7e-10 once): the ranks' masters agree to that, where staying at the other point is 1e-3.
ATOL_RANKS = 1e-6


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("ddp58")
    run_script("fabric_ddp_rank_zero_optimizers_script.py", out, timeout=120)
    got = rank_results(out)
    for rank in got:
        assert rank["world"] == 2
        for case, value in rank.items():
            if isinstance(value, dict):
                assert "error" not in value, f"{case}: {value['error']}"
    return got


def _t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _close(got: list[float], want: list[float], atol: float, what: str) -> None:
    a, b = _t(got), _t(want)
    assert a.shape == b.shape, f"{what}: shapes {a.shape} and {b.shape}"
    gap = (a - b).abs().max().item() if a.numel() else 0.0
    assert gap <= atol, f"{what}: {gap:.3g} apart (atol {atol})"  # NaN fails too


def _ranks_together(case: list[dict[str, Any]], key: str = "end") -> None:
    assert _t(case[0][key]["model"]).equal(_t(case[1][key]["model"]))
    if "masters" in case[0][key]:
        _close(case[0][key]["masters"], case[1][key]["masters"], ATOL_RANKS, "the ranks' masters")


def test_group_still_works_after_every_case(ranks: list[dict[str, Any]]) -> None:
    """No rank was left in a collective by the other: an all-reduce after every case sums both ranks."""
    assert [rank["after"]["sum"] for rank in ranks] == [2.0, 2.0]


def test_schedule_free_rank0_eval_export_train_keeps_ranks_together_as_bf16_mixed(ranks: list[dict[str, Any]]) -> None:
    """Fabric DDP, ``ScheduleFreeAdamW``: rank 0 alone evaluates before training and after each epoch between
    ``optimizer.eval()`` and ``optimizer.train()`` and exports ``torch.save(module.state_dict())``. No hang; the ranks'
    weights together; each rank's losses, rank 0's evaluations (at the averaged point) and exports as
    ``"bf16-mixed"``'s."""
    o2 = [rank["sf/O2"] for rank in ranks]
    ref = [rank["sf/ref"] for rank in ranks]
    _ranks_together(o2)
    assert _t(ref[0]["end"]["model"]).equal(_t(ref[1]["end"]["model"]))
    for r in range(2):
        _close(o2[r]["losses"], ref[r]["losses"], ATOL_LOSS, f"rank {r}'s losses")
        _close(o2[r]["end"]["masters"], ref[r]["end"]["model"], ATOL_W, f"rank {r}'s weights")
    assert len(o2[0]["val"]) == 4 and o2[1]["val"] == []
    _close(o2[0]["val"], ref[0]["val"], ATOL_LOSS, "rank 0's evaluations")
    for got, want in zip(o2[0]["export"], ref[0]["export"], strict=True):
        _close(got, want, ATOL_W, "rank 0's FP32 export")


def test_schedule_free_train_forgotten_on_rank0_raises_there_as_bf16_mixed(ranks: list[dict[str, Any]]) -> None:
    """Rank 0 forgets ``optimizer.train()`` after its evaluation: its next step raises the optimizer's own error on
    rank 0 alone at the same step as under ``"bf16-mixed"`` (rank 1 steps; the script's flag ends the case on both,
    as a user's crash would); nothing silently diverges: after rank 0's ``train()`` and one more step each rank's
    weights are ``"bf16-mixed"``'s."""
    for r in range(2):
        o2, ref = ranks[r]["forget/O2"], ranks[r]["forget/ref"]
        assert o2["raised"] == ref["raised"], (r, o2["raised"], ref["raised"])
        _close(o2["end"]["masters"], ref["end"]["model"], ATOL_W, f"rank {r}'s weights after the recovery")
    assert ranks[0]["forget/O2"]["raised"]["step"] == 2
    assert "eval mode" in ranks[0]["forget/O2"]["raised"]["error"] and ranks[1]["forget/O2"]["raised"]["error"] is None


def test_trainer_rank0_eval_export_in_a_hook_as_bf16_mixed(ranks: list[dict[str, Any]]) -> None:
    """The Trainer (DDP, manual optimization): rank 0 alone, in ``on_train_epoch_end``, ``optimizer.eval()``, an
    export ``torch.save(self.state_dict())``, ``optimizer.train()``: the export at the averaged point and the run as
    Fabric's ``"bf16-mixed"`` on the same data; a forward after the state dict at the averaged point; ranks
    together."""
    trainer = [rank["trainer_sf/O2"] for rank in ranks]
    ref = ranks[0]["sf/ref"]
    _ranks_together(trainer)
    _close(trainer[0]["end"]["masters"], ref["end"]["model"], ATOL_W, "the Trainer's weights")
    for got, want in zip(trainer[0]["export"], ref["export"], strict=True):
        _close(got, want, ATOL_W, "the Trainer's FP32 export")
    _close(trainer[0]["val_after_save"], ref["val"][1:], ATOL_LOSS, "evaluations after the state dict")


@pytest.mark.xfail(
    strict=True,
    reason="test_fabric_ddp_rank_zero_optimizers.py: the Trainer plugin redoes a schedule-free optimizer's eval() on "
    "the masters at its forward_context (the Trainer's steps), a state dict or the fit's end; a bare self.net(x) in a "
    "hook (on_train_epoch_end, a rank-zero callback) enters none of them (the boundary-cast hooks hold no engine), so "
    "it runs at the training point where 'bf16-mixed' evaluates the averaged one (2e-3 to 2e-2 apart here)",
)
def test_trainer_forward_in_a_hook_right_after_eval_is_at_the_averaged_point(ranks: list[dict[str, Any]]) -> None:
    """The same hook's forward under ``no_grad`` right after ``optimizer.eval()``, before any state dict."""
    _close(ranks[0]["trainer_sf/O2"]["val"], ranks[0]["sf/ref"]["val"][1:], ATOL_LOSS, "evaluations in the hook")


def test_sam_one_rank_first_pass_overflow_skipped_alike(ranks: list[dict[str, Any]]) -> None:
    """O2 float16, dynamic scale, DoorSAM with its first pass under ``no_backward_sync``: rank 1's first pass alone
    overflows at step 0. Both ranks skip that step (weights unchanged, the scale halved once), no hang, and go on
    training with equal, finite weights and masters."""
    sam = [rank["sam/O2"] for rank in ranks]
    assert sam[0]["w"] == sam[1]["w"] and sam[0]["masters"] == sam[1]["masters"]
    for rank in sam:
        w = [_t(x) for x in rank["w"]]
        assert w[1].equal(w[0]) and not w[2].equal(w[1]) and not w[3].equal(w[2])
        assert all(torch.isfinite(x).all() for x in w + [_t(m) for m in rank["masters"]])
        assert rank["scale"] == 128.0  # 2**8 backed off once


@pytest.mark.parametrize("resume", ["resumed", "resumed_torch"])
def test_lookahead_checkpoint_written_by_rank0_resumes_on_both(ranks: list[dict[str, Any]], resume: str) -> None:
    """timm's Lookahead over AdamW, checkpointed mid-cycle after step 3 by ``fabric.save`` (rank 0 writes) or by
    ``torch.save`` of state dicts made on rank 0 alone, loaded into a fresh model and optimizer on both ranks: three
    more steps give the unbroken run's weights on both ranks, as under ``"bf16-mixed"``."""
    for r in range(2):
        o2, ref = ranks[r]["la/O2"], ranks[r]["la/ref"]
        assert o2["wrote"]
        for key in ("model", "masters"):
            _close(o2[resume][key], o2["straight"][key], 1e-6, f"rank {r}'s resumed {key}")
        _close(ref[resume]["model"], ref["straight"]["model"], 1e-6, f"rank {r}'s bf16-mixed resume")
        _close(o2[resume]["masters"], ref[resume]["model"], ATOL_W, f"rank {r}: O2 against bf16-mixed")
    _ranks_together([rank["la/O2"] for rank in ranks], resume)
