"""Two-dimensional parallelism, Lightning's ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)``
(one launch of tests/lightning_2d_parallel_script.py: four CPU processes, gloo): tp59's tensor-parallel plan (a colwise
and a rowwise ``Linear``, a norm left whole) over ``device_mesh["tensor_parallel"]``, then FSDP2 over
``device_mesh["data_parallel"]`` (``shard_model`` for the plugin, ``fully_shard`` for Lightning's own precisions). The
norm's weight is sharded over the data-parallel mesh and held alike by both tensor-parallel ranks; a ``Linear``'s is
sharded over both dimensions. O2 in bfloat16 trains as ``"bf16-mixed"`` and ``"32-true"``, ``gradient_clip_val`` at O2
and O1 clips by the full model's norm, an overflow in one rank's shard skips the step on all four, O3 trains (its model
cast to half before sharding: before the fix ``convert_module`` left the tensor-parallel ``DTensor``s' local shards
FP32), and the distributed checkpoint resumes the run."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from tests.launch import rank_results, run_script
from tests.lightning_2d_parallel_script import CLIP, INF_AT, LR, MLP, MOMENTUM, SAVE_AT, STEPS, WORLD, batch

Weights = dict[str, list[float]]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp60")
    run_script(
        "lightning_2d_parallel_script.py", out, timeout=240, ranks=WORLD, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1"
    )
    return rank_results(out, world_size=WORLD)


def case(rank: dict, name: str) -> dict:
    """One case's record on one rank, failing with its traceback when the case raised."""
    assert "error" not in rank[name], f"{name}: {rank[name]['error']}"
    return rank[name]


def gap(a: Weights, b: Weights) -> float:
    assert a.keys() == b.keys()
    return max(abs(x - y) for name in a for x, y in zip(a[name], b[name], strict=True))


@functools.lru_cache(maxsize=2)
def one_process(clip: float | None) -> tuple[tuple[float, ...], Weights]:
    """FP32 on one process, no parallelism, the global batch (both replicas' halves; torch's own clipping)."""
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
    return tuple(losses), {n: p.detach().double().flatten().tolist() for n, p in model.named_parameters()}


def all_equal(ranks: list[dict], name: str, key: str = "params") -> bool:
    return all(case(r, name)[key] == case(ranks[0], name)[key] for r in ranks)


def test_2d_trains_as_bf16_mixed_and_32_true(ranks) -> None:
    """At O2 each rank's losses (its replica's half batch) and the gradient norms and gathered weights follow
    Lightning's ``"bf16-mixed"`` and ``"32-true"`` on the same 2-D model within bfloat16's rounding; all four ranks hold
    the same weights; ``"32-true"`` is the one-process FP32 training on the global batch."""
    _, fp32_weights = one_process(None)
    initial = {n: p.detach().double().flatten().tolist() for n, p in MLP().named_parameters()}
    for rank in ranks:
        run, bf16, fp32 = case(rank, "O2"), case(rank, "bf16-mixed"), case(rank, "32-true")
        assert run["sharded"] and run["global_step"] == STEPS
        assert run["layout"] == {"norm": "(Shard(dim=0),)", "w1": "(_StridedShard(dim=0, sf=2), Shard(dim=0))"}
        assert run["losses"] == pytest.approx(bf16["losses"], abs=2e-3)
        assert run["losses"] == pytest.approx(fp32["losses"], abs=2e-3)
        assert run["norms"] == pytest.approx(bf16["norms"], rel=5e-3)
        assert gap(run["params"], bf16["params"]) < 5e-3 and gap(run["params"], fp32["params"]) < 5e-3
        assert gap(fp32["params"], fp32_weights) < 1e-5
        assert gap(run["params"], initial) > 5e-2  # it trained
    assert all_equal(ranks, "O2")
    assert case(ranks[0], "O2")["losses"] != case(ranks[2], "O2")["losses"]  # the replicas saw different halves


@pytest.mark.parametrize("level", ["O2", "O1"])
def test_2d_clips_by_the_full_models_norm(ranks, level: str) -> None:
    """``gradient_clip_val`` (below every step's norm): the norm the plugin clipped by (``mpx/grad_norm``) is the norm
    of the full gradients gathered before clipping (FP64, to 1e-5), the gathered gradients after it have the norm
    ``CLIP``, and training follows one-process FP32 with torch's ``clip_grad_norm_``; all four ranks agree."""
    ref_losses, ref_weights = one_process(CLIP)
    for rank in ranks:
        run = case(rank, f"{level}_clip")
        assert len(run["clip_norms"]) == STEPS and min(run["true_norms"]) > 5 * CLIP
        assert run["clip_norms"] == pytest.approx(run["true_norms"], rel=1e-5)
        assert run["norms"] == pytest.approx([CLIP] * STEPS, rel=1e-5)
        assert gap(run["params"], ref_weights) < 5e-4
    mean_losses = [sum(pair) / 2 for pair in zip(case(ranks[0], f"{level}_clip")["losses"],
                                                 case(ranks[2], f"{level}_clip")["losses"])]  # fmt: skip
    assert mean_losses == pytest.approx(ref_losses, abs=2e-3)
    assert all_equal(ranks, f"{level}_clip")


def test_an_overflow_on_one_rank_skips_the_step_on_all_four(ranks) -> None:
    """O2 in float16 with an ``inf`` written into rank 1's shard of ``w1``'s gradient at step ``INF_AT``: every rank
    skips that step (the optimizer steps three times) and halves its scale; the weights stay equal everywhere."""
    for rank in ranks:
        run = case(rank, "O2_fp16_inf")
        assert run["skipped"] == 1 and len(run["norms"]) == STEPS - 1
        assert run["scales"] == [65536.0, 32768.0, 32768.0, 32768.0]
        assert run["losses"][: INF_AT + 1] == pytest.approx(case(rank, "32-true")["losses"][: INF_AT + 1], abs=2e-3)
    assert all_equal(ranks, "O2_fp16_inf")


def test_o3_trains_under_2d(ranks) -> None:
    """O3 (bfloat16) with ``shard_model`` after ``parallelize_module``: the tensor-parallel ``Linear``s are cast to
    half before sharding (before the fix ``convert_module``'s ``param.data = ...`` changed a ``DTensor``'s dtype but
    not its local shard's, and the plugin refused the FP32 shards, naming ``shard_model``, which the user called),
    and it follows ``"32-true"`` within bfloat16's rounding of half weights."""
    for rank in ranks:
        run, fp32 = case(rank, "O3"), case(rank, "32-true")
        assert run["dtype"] == "torch.bfloat16" and run["sharded"]
        assert run["losses"] == pytest.approx(fp32["losses"], abs=2e-3)
        assert gap(run["params"], fp32["params"]) < 2e-2
    assert all_equal(ranks, "O3")


def test_2d_resumes_from_the_distributed_checkpoint(ranks) -> None:
    """O2 resumed from Lightning's distributed checkpoint (saved after two of four steps) continues the straight run on
    every rank: the same losses, gradient norms and final weights."""
    for rank in ranks:
        straight, resumed = case(rank, "O2"), case(rank, "O2_resumed")
        assert resumed["global_step"] == STEPS and resumed["sharded"]
        assert resumed["losses"] == pytest.approx(straight["losses"][SAVE_AT:], abs=1e-6)
        # torch's distributed checkpoint runs one zero-gradient step to make the optimizer's state first
        assert resumed["norms"][-2:] == pytest.approx(straight["norms"][SAVE_AT:], rel=1e-5)
        assert gap(resumed["params"], straight["params"]) < 1e-6
