"""Sequence parallelism and loss parallelism under Lightning's ``ModelParallelStrategy(data_parallel_size=1,
tensor_parallel_size=2)`` (one launch of tests/lightning_sequence_parallel_script.py: two CPU processes, gloo). The plan
is torchtitan's: a rowwise embedding with sequence-sharded output, ``SequenceParallel()`` LayerNorm and RMSNorm,
``PrepareModuleInput`` before a colwise/rowwise MLP (``RowwiseParallel(output_layouts=Shard(1))``), a vocab-parallel
head (``ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)``) and the
cross-entropy on its sharded logits inside ``loss_parallel()`` (backward too, in ``LightningModule.backward``);
``shard_model`` over the one-rank data-parallel mesh follows for the plugin. O2 and O1 in bfloat16 train as
Lightning's ``"bf16-mixed"`` and ``"32-true"``, the replicated norms stay equal on both ranks, ``gradient_clip_val``
clips by the true global norm, the loss is FP32 at O2 (the O2 loss policy casts DTensor logits too), and in float16
an overflow in one rank's gradient shard skips the step on both ranks."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from tests.launch import rank_results, run_script
from tests.lightning_sequence_parallel_script import CLIP, LR, MOMENTUM, STEPS, Block, batch

Weights = dict[str, list[float]]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("seqpar59")
    run_script("lightning_sequence_parallel_script.py", out, timeout=240, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return rank_results(out)


def case(rank: dict, name: str) -> dict:
    """One case's record on one rank, failing with its traceback when the case raised."""
    assert "error" not in rank[name], f"{name}: {rank[name]['error']}"
    return rank[name]


def gap(a: Weights, b: Weights) -> float:
    assert a.keys() == b.keys()
    return max(abs(x - y) for name in a for x, y in zip(a[name], b[name], strict=True))


@functools.lru_cache(maxsize=2)
def one_process(clip: float | None) -> tuple[list[float], Weights]:
    """The same training in FP32 on one process, without any parallelism (torch's own clipping)."""
    model = Block()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for step in range(STEPS):
        idx, y = batch(step)
        loss = F.cross_entropy(model(idx).flatten(0, 1), y.flatten(0, 1))
        losses.append(loss.item())
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return losses, {n: p.detach().double().flatten().tolist() for n, p in model.named_parameters()}


def test_sequence_parallel_trains_as_bf16_mixed_and_32_true(ranks) -> None:
    """Each rank's losses and gradient norms and the gathered weights (``full_tensor()``) follow Lightning's
    ``"bf16-mixed"`` and ``"32-true"`` on the same plan within bfloat16's rounding at O2 (the loss computed in the
    model's own forward: O2's loss region); the norms' replicated weights are the same on both ranks, and the
    ``"32-true"`` run is the one-process FP32 training."""
    level = "O2"
    _, fp32_weights = one_process(None)
    initial = {n: p.detach().double().flatten().tolist() for n, p in Block().named_parameters()}
    for rank in ranks:
        run, bf16, fp32 = case(rank, level), case(rank, "bf16-mixed"), case(rank, "32-true")
        assert run["sharded"] and run["global_step"] == STEPS
        assert "Replicate()" in run["norm_placements"]  # SequenceParallel's weights, under FSDP's data-parallel dim
        assert run["losses"] == pytest.approx(bf16["losses"], abs=2e-3)
        assert run["losses"] == pytest.approx(fp32["losses"], abs=2e-3)
        assert run["norms"] == pytest.approx(bf16["norms"], rel=5e-3)
        assert gap(run["params"], bf16["params"]) < 5e-3 and gap(run["params"], fp32["params"]) < 5e-3
        assert gap(fp32["params"], fp32_weights) < 1e-5
        assert gap(run["params"], initial) > 5e-2  # it trained
        assert gap(run["local_norms"], {n: run["params"][n] for n in run["local_norms"]}) == 0
    assert ranks[0][level]["local_norms"] == ranks[1][level]["local_norms"]
    assert ranks[0][level]["params"] == ranks[1][level]["params"]
    assert ranks[0][level]["losses"] == ranks[1][level]["losses"]


def test_loss_parallel_loss_is_fp32_at_o2(ranks) -> None:
    """At O2 the cross-entropy under ``loss_parallel()`` is an FP32 ``DTensor``: in the model's own forward on its
    bfloat16 ``DTensor`` logits (the O2 loss policy casts them), and in ``training_step`` on the model's FP32 outputs.
    O1's cast table does the same on its bfloat16 logits."""
    for rank in ranks:
        want = "DTensor:torch.bfloat16->DTensor:torch.float32, returned DTensor:torch.float32"
        assert set(case(rank, "O2")["loss_types"]) == {want}
        assert set(case(rank, "O2_clip")["loss_types"]) == {"DTensor:torch.float32->DTensor:torch.float32"}
        assert set(case(rank, "O1_clip")["loss_types"]) == {"DTensor:torch.bfloat16->DTensor:torch.float32"}


@pytest.mark.parametrize("level", ["O2", "O1"])
def test_sequence_parallel_clips_by_the_true_global_norm(ranks, level: str) -> None:
    """``gradient_clip_val`` over the plan's DTensors (the embedding's and the head's shards, the norms' replicated
    weights whose gradients are reduced from ``Partial``): every step's gathered gradients have the global norm
    ``CLIP``, and training follows one-process FP32 with torch's ``clip_grad_norm_``."""
    ref_losses, ref_weights = one_process(CLIP)
    for rank in ranks:
        run = case(rank, f"{level}_clip")
        assert run["norms"] == pytest.approx([CLIP] * STEPS, rel=1e-5)
        assert run["losses"] == pytest.approx(ref_losses, abs=2e-3)
        assert gap(run["params"], ref_weights) < 5e-4
    assert ranks[0][f"{level}_clip"]["local_norms"] == ranks[1][f"{level}_clip"]["local_norms"]
    assert ranks[0][f"{level}_clip"]["params"] == ranks[1][f"{level}_clip"]["params"]


def test_an_overflow_in_one_ranks_shard_skips_the_step_on_both_ranks(ranks) -> None:
    """O2 in float16 (dynamic scaling): an ``inf`` in rank 1's shard of the vocab-parallel head's gradient alone, at
    step 1, skips that step on both ranks and halves the scale on both; the ranks' weights, the replicated norms'
    included, stay the same."""
    for rank in ranks:
        run = case(rank, "O2_fp16_inf")
        assert run["global_step"] == STEPS and len(run["norms"]) == STEPS - 1  # one optimizer step skipped
        first = run["scales"][0]
        assert run["scales"] == [first] + [first / 2] * (STEPS - 1)
    zero, one = ranks[0]["O2_fp16_inf"], ranks[1]["O2_fp16_inf"]
    assert zero["local_norms"] == one["local_norms"] and zero["params"] == one["params"]
    assert zero["losses"] == one["losses"]


def test_manual_optimization_under_loss_parallel_clips_as_automatic(ranks) -> None:
    """In manual optimization, ``with loss_parallel(): self.manual_backward(loss)`` then ``self.clip_gradients(...)``
    (no ``backward`` hook override) trains as the automatic O2 run with ``gradient_clip_val``."""
    for rank in ranks:
        manual, automatic = case(rank, "O2_manual_clip"), case(rank, "O2_clip")
        assert manual["norms"] == pytest.approx([CLIP] * STEPS, rel=1e-5)
        assert manual["losses"] == pytest.approx(automatic["losses"], abs=1e-6)
        assert gap(manual["params"], automatic["params"]) < 1e-6
