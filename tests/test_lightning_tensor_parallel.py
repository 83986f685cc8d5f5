"""Tensor parallelism under Lightning's ``ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)`` (one
launch of tests/lightning_tensor_parallel_script.py: two CPU processes, gloo). The model is Lightning's TP recipe
(``parallelize_module`` with a colwise and a rowwise ``Linear``, a norm left replicated); for the plugin ``shard_model``
over the one-rank ``device_mesh["data_parallel"]`` follows it, so FSDP's FP32 parameters (``DTensor``s on the 2-D mesh;
the norm's on the one-rank data-parallel mesh, held alike by both tensor-parallel ranks) are the masters. O2 in bfloat16
trains as Lightning's ``"bf16-mixed"`` and ``"32-true"`` on the TP model; at O2 and O1 ``gradient_clip_val`` clips by
the true global norm (Lightning's own precisions fail to clip this model: torch's ``clip_grad_norm_`` over mixed
``Tensor``/``DTensor`` gradients), the distributed checkpoint resumes, and TP without ``shard_model`` is refused at
set-up."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.launch import rank_results, run_script
from tests.lightning_tensor_parallel_script import CLIP, LR, MLP, MOMENTUM, SAVE_AT, STEPS, batch

Weights = dict[str, list[float]]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp59")
    run_script("lightning_tensor_parallel_script.py", out, timeout=240, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    results = rank_results(out)
    for rank in results:
        for name, case in rank.items():
            assert name == "O2_tp_only" or "error" not in case, f"{name}: {case['error']}"
    return results


def gap(a: Weights, b: Weights) -> float:
    assert a.keys() == b.keys()
    return max(abs(x - y) for name in a for x, y in zip(a[name], b[name], strict=True))


def one_process(clip: float | None) -> tuple[list[float], Weights]:
    """The same training in FP32 on one process, without tensor parallelism (torch's own clipping)."""
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = F.mse_loss(model(x), y)
        losses.append(loss.item())
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach().double().flatten().tolist() for n, p in model.named_parameters()}


def test_tp_trains_as_bf16_mixed_and_32_true(ranks) -> None:
    """At O2, each rank's losses and gradient norms and the gathered FP32 weights (``full_tensor()``) follow Lightning's
    ``"bf16-mixed"`` and ``"32-true"`` on the same TP model within bfloat16's rounding; both ranks hold the same
    weights, the replicated norm's included (no master drifting apart on one rank)."""
    level = "O2"
    _, fp32_weights = one_process(None)
    initial = {n: p.detach().double().flatten().tolist() for n, p in MLP().named_parameters()}
    for rank in ranks:
        run, bf16, fp32 = rank[level], rank["bf16-mixed"], rank["32-true"]
        assert run["sharded"] and run["global_step"] == STEPS
        assert run["losses"] == pytest.approx(bf16["losses"], abs=1e-3)
        assert run["losses"] == pytest.approx(fp32["losses"], abs=2e-3)
        assert run["norms"] == pytest.approx(bf16["norms"], rel=5e-3)
        assert gap(run["params"], bf16["params"]) < 5e-3 and gap(run["params"], fp32["params"]) < 5e-3
        assert gap(fp32["params"], fp32_weights) < 1e-5  # the reference is the one-process FP32 training
        assert gap(run["params"], initial) > 5e-2  # it trained
    assert ranks[0][level]["params"] == ranks[1][level]["params"]
    assert ranks[0][level]["losses"] == ranks[1][level]["losses"]


@pytest.mark.parametrize("level", ["O2", "O1"])
def test_tp_clips_by_the_true_global_norm(ranks, level: str) -> None:
    """``gradient_clip_val`` over DTensors of different meshes and placements (colwise ``Shard(0)``, rowwise
    ``Shard(1)``, the rowwise bias ``Replicate()``, the norm on the one-rank data-parallel mesh of each TP rank):
    every step's gradients, gathered, have the global norm ``CLIP``, and training follows one-process FP32 with
    torch's ``clip_grad_norm_``. Before the fix the norm's gradients were counted once per TP rank (clipped to
    0.0491-0.0496)."""
    ref_losses, ref_weights = one_process(CLIP)
    for rank in ranks:
        run = rank[f"{level}_clip"]
        assert run["norms"] == pytest.approx([CLIP] * STEPS, rel=1e-5)
        assert run["losses"] == pytest.approx(ref_losses, abs=2e-3)
        assert gap(run["params"], ref_weights) < 5e-4
    assert ranks[0][f"{level}_clip"]["params"] == ranks[1][f"{level}_clip"]["params"]


def test_tp_resumes_from_the_distributed_checkpoint(ranks) -> None:
    """The O2 run resumed from Lightning's distributed checkpoint (saved after two of four steps) continues the
    straight run: the same losses, gradient norms and final weights."""
    for rank in ranks:
        straight, resumed = rank["O2"], rank["O2_resumed"]
        assert resumed["global_step"] == STEPS and resumed["sharded"]
        assert resumed["losses"] == pytest.approx(straight["losses"][SAVE_AT:], abs=1e-6)
        # torch's distributed checkpoint runs one zero-gradient step to make the optimizer's state first
        assert resumed["norms"][-2:] == pytest.approx(straight["norms"][SAVE_AT:], rel=1e-5)
        assert gap(resumed["params"], straight["params"]) < 1e-6


def test_tp_without_shard_model_is_refused_at_set_up(ranks) -> None:
    """O2 on the TP model alone (no FSDP module): refused before training, naming ``shard_model`` and when to call
    it under tensor parallelism."""
    for rank in ranks:
        error = rank["O2_tp_only"].get("error", "")
        assert "ValueError" in error and "no FSDP module" in error, error
        assert "after parallelize_module" in error and "data_parallel_size=1" in error
        assert "losses" not in rank["O2_tp_only"]
