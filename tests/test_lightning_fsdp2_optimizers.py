"""Stop 57's optimizers under FSDP2 (one launch of tests/lightning_fsdp2_optimizers_script.py: two CPU processes, gloo,
the Trainer with ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)`` and ``shard_model`` in
``configure_model``): a schedule-free SGD (``eval()`` before validation and before a checkpoint, ``train()`` after), a
timm Lookahead over AdamW and SAM's two passes per step (the documented recipe), each at O2 bfloat16 against Lightning's
own ``"bf16-mixed"`` (``fully_shard`` + autocast) on the same sharded model and data, and resumed from a distributed
checkpoint (``torch.distributed.checkpoint``) saved after two of four steps. Under FSDP the masters are FSDP's FP32
shards: ``eval()``/``train()``, the wrappers and SAM's perturbation act on them directly."""

from __future__ import annotations

import pytest

from tests.launch import rank_results, run_script
from tests.lightning_fsdp2_optimizers_script import KINDS, PRECISIONS, STEPS  # noqa: E402

Weights = dict[str, list[float]]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp58")
    run_script("lightning_fsdp2_optimizers_script.py", out, timeout=240, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    results = rank_results(out)
    for rank in results:
        for name, case in rank.items():
            assert "error" not in case, f"{name}: {case['error']}"
    return results


def gap(a: Weights, b: Weights) -> float:
    assert a.keys() == b.keys()
    return max(abs(x - y) for name in a for x, y in zip(a[name], b[name], strict=True))


def runs(rank: dict, kind: str) -> tuple[dict, dict, dict, dict]:
    return tuple(rank[f"{kind}_{p}_{r}"] for p in PRECISIONS for r in ("straight", "resumed"))  # type: ignore[return-value]


@pytest.mark.parametrize("kind", KINDS)
def test_o2_trains_and_resumes_as_bf16_mixed_on_the_sharded_model(ranks, kind: str) -> None:
    """Each rank's losses and the gathered FP32 weights of the straight run and of the run resumed from the distributed
    checkpoint are those of ``"bf16-mixed"`` (with the same optimizer: its own resume is the reference, see
    docs/fsdp.md on torch's ``get_optimizer_state_dict`` and wrappers), and the model trained."""
    for rank in ranks:
        o2, o2_resumed, bf16, bf16_resumed = runs(rank, kind)
        assert o2["sharded"] and o2_resumed["sharded"]  # the engine saw FSDP's shards as the masters
        assert o2["global_step"] == o2_resumed["global_step"] == STEPS
        assert o2["losses"] == pytest.approx(bf16["losses"], abs=1e-4)
        assert o2_resumed["losses"] == pytest.approx(bf16_resumed["losses"], abs=1e-4)
        assert o2_resumed["losses"][0] == pytest.approx(o2["losses"][2], abs=1e-6)  # resumed at the saved step
        assert gap(o2["params"], bf16["params"]) < 1e-3 and gap(o2_resumed["params"], bf16_resumed["params"]) < 1e-3
        assert gap(o2["params"], o2["initial"]) > 1e-2  # it trained
    assert ranks[0][f"{kind}_O2_straight"]["params"] == ranks[1][f"{kind}_O2_straight"]["params"]


def test_schedule_free_eval_moves_the_fp32_shards_and_resumes_from_an_eval_mode_checkpoint(ranks) -> None:
    """``optimizer.eval()`` before each validation moves FSDP's FP32 shards to the averaged point, as in
    ``"bf16-mixed"`` (validation losses and the evaluated weights); the checkpoint saved in eval mode resumes to the
    straight run's weights: ``train()`` at the next epoch's start moves back from the saved averaged point."""
    for rank in ranks:
        o2, o2_resumed, bf16, _ = runs(rank, "sf")
        assert len(o2["eval_weights"]) == len(bf16["eval_weights"]) == 2
        for train_w, eval_w, ref in zip(o2["train_weights"], o2["eval_weights"], bf16["eval_weights"], strict=True):
            assert gap(train_w, eval_w) > 5e-4  # eval() moved the weights
            assert gap(eval_w, ref) < 1e-4
        assert o2["val_losses"] == pytest.approx(bf16["val_losses"], abs=1e-4)
        assert o2_resumed["val_losses"] == pytest.approx(o2["val_losses"][1:], abs=1e-4)
        assert gap(o2_resumed["params"], o2["params"]) < 1e-4
        assert gap(o2["params"], o2["eval_weights"][-1]) < 1e-6  # the fit ended at the averaged point


def test_sam_two_passes_under_a_dynamic_float16_scale_train_and_resume_as_bf16_mixed(ranks) -> None:
    """SAM at O2 float16 on the sharded model: both backwards scaled, the base step on unscaled FP32 shards, no step
    skipped; the weights, straight and resumed from the distributed checkpoint (the scale restored), are
    ``"bf16-mixed"``'s within float16's rounding."""
    for rank in ranks:
        straight, resumed = rank["sam_O2-float16_straight"], rank["sam_O2-float16_resumed"]
        bf16, bf16_resumed = rank["sam_bf16-mixed_straight"], rank["sam_bf16-mixed_resumed"]
        assert straight["sharded"] and straight["skipped"] == resumed["skipped"] == [0]
        assert resumed["scale"] == straight["scale"] == 2.0**16
        assert straight["losses"] == pytest.approx(bf16["losses"], abs=2e-3)
        assert gap(straight["params"], bf16["params"]) < 2e-3 and gap(resumed["params"], bf16_resumed["params"]) < 2e-3
