"""A hostile FSDP2 user (two CPU processes, gloo, one launch of tests/lightning_fsdp2_llama_lora_script.py): a Hugging
Face Llama (RoPE) sharded per decoder layer by the Trainer at O2; a frozen base with LoRA-like adapters in one unit,
through Fabric (O1 float16: accumulation under ``no_backward_sync``, an inf on rank 1 only, a clip, ``fabric.save``
before the first step and later, resumed) and through the Trainer (O2 float16, a second ``fit`` with a new Trainer and
plugin); the Trainer's clip by norm at O1/O2 against Lightning's own FSDP2 ``bf16-mixed``."""

from __future__ import annotations

import pytest

from tests.launch import rank_results, run_script

pytest.importorskip("transformers")

from tests.lightning_fsdp2_llama_lora_script import CLIP, INF_AT, RESUME_AT, STEPS  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp52")
    run_script("lightning_fsdp2_llama_lora_script.py", out, timeout=240, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return rank_results(out)


def _case(rank, name):
    assert "error" not in rank[name], rank[name].get("error")
    return rank[name]


def test_llama_sharded_per_layer_keeps_fp32_rotary_frequencies_and_follows_one_process(ranks):
    """O2 bfloat16, ``shard_model(llama, plugin, blocks=LlamaDecoderLayer)``: ``inv_freq``/``original_inv_freq`` stay
    FP32 with the values of an unsharded O2 run (before and after training); the losses follow that run."""
    for rank in ranks:
        rope = _case(rank, "rope")
        reference = rope["reference"]
        assert sorted(rope["before"]) == ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]
        for stage in ("sharded", "after"):
            assert rope[stage] == rope["before"] == reference["rotary"], stage
        assert {v["dtype"] for v in rope["after"].values()} == {"torch.float32"}
        assert len(rope["losses"]) == STEPS
        assert rope["losses"] == pytest.approx(reference["losses"], abs=2e-3)


def test_fabric_lora_adapters_accumulate_skip_one_rank_inf_and_resume_exactly(ranks):
    """Frozen base and trainable adapters in one unit: both ranks skip rank 1's inf and back off; the frozen weights do
    not move; ``fabric.load`` of the checkpoint saved before the first step and after ``RESUME_AT`` steps continues
    bit for bit (norms, skips, scales, weights)."""
    for rank in ranks:
        lora = _case(rank, "lora")
        straight = lora["straight"]
        assert straight["skipped"] == [step == INF_AT for step in range(STEPS)]
        assert straight["scales"][INF_AT] == straight["scales"][0] / 2
        assert straight["frozen_unchanged"]
        for start in (0, RESUME_AT):
            resumed = lora[f"from{start}"]
            for key in ("norms", "skipped", "scales"):
                assert resumed[key] == straight[key][start:], (start, key)
            assert resumed["params"] == straight["params"], start
    assert ranks[0]["lora"]["straight"]["params"] == ranks[1]["lora"]["straight"]["params"]


def test_a_second_fit_with_a_new_trainer_and_plugin_continues_the_sharded_o2_model(ranks):
    """Fit ``RESUME_AT`` steps (clip by norm, so the engine weighed each shard), zero the gradients at
    ``on_train_end``, then a new Trainer and plugin fit the same sharded model: the weights of one fit of ``STEPS``
    steps (SGD, power-of-two scales). The engine held a weak
    reference to each parameter, and FSDP2's ``_apply`` (the second stage's ``model.to()``) swaps parameters, which
    torch refuses for a tensor with a weak reference: "Couldn't swap Linear.weight"."""
    for rank in ranks:
        trainer = _case(rank, "lora_trainer")
        assert trainer["straight"]["frozen_unchanged"] and trainer["straight"]["skipped"] == [0]
        straight, staged = trainer["straight"]["params"], trainer["staged"]["params"]
        assert sorted(staged) == sorted(straight)
        for name in straight:
            assert staged[name] == pytest.approx(straight[name], abs=1e-6), name
        assert trainer["other_level"].startswith("ValueError: module=FSDPSequential was sharded by an earlier")
        assert "opt_level: O2" in trainer["other_level"]


def test_a_stage_after_a_fit_that_left_its_gradients_runs(ranks):
    """Lightning leaves the last step's gradients on the model; the next Trainer's ``model.to()`` (FSDP2's
    ``_apply``) swaps each ``DTensor`` gradient, which torch refused while the engine held a weak reference to it
    (what the step left, to tell it from a tensor the user assigns): "Couldn't swap Linear.weight.grad"."""
    for rank in ranks:
        assert _case(rank, "lora_trainer")["grads_kept"] == "accepted"


def test_trainer_clip_by_norm_at_o1_and_o2_follows_lightnings_bf16_mixed(ranks):
    """``gradient_clip_val`` by norm (below every step's gathered norm, so each step clips) under
    ``ModelParallelStrategy``: the plugin at O1 and O2 bfloat16 trains as Lightning's own FSDP2 ``bf16-mixed``."""
    for rank in ranks:
        reference = _case(rank, "clip:bf16-mixed")
        assert len(reference["norms"]) == STEPS and min(reference["norms"]) > CLIP
        for level in ("O1", "O2"):
            ours = _case(rank, f"clip:{level}")
            assert ours["norms"] == pytest.approx(reference["norms"], rel=1e-2), level
            assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-2), level
            for name, values in reference["params"].items():
                assert ours["params"][name] == pytest.approx(values, abs=1e-3), (level, name)
        assert rank["clip:O2"]["dtype"] == "torch.float32"  # the root's output cast
