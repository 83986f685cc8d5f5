"""FSDP2 with peft LoRA adapters on a frozen base at O2, two CPU ranks (gloo, one launch of
``tests/accelerate_fsdp2_lora_script.py``): Accelerate's ``FullyShardedDataParallelPlugin(fsdp_version=2)`` through
``lightning_mpx.accelerate.Accelerator(mixed_precision="O2")`` against Accelerate's own ``"bf16"``, and a Lightning
``Trainer(strategy=ModelParallelStrategy(...), plugins=[MixedPrecisionPlugin("O2", half_dtype="bfloat16")])`` against
``precision="bf16-mixed"``, on a tiny Llama (2 layers, hidden 32, vocab 128) with
``LoraConfig(r=4, target_modules=["q_proj", "v_proj"])``, the same seed and batches."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")
pytest.importorskip("torch.distributed.fsdp")

from tests.launch import rank_results, run_script  # noqa: E402

LR = 1e-2  # the script's AdamW learning rate
BF16_LOSS = 2.0**-8  # bfloat16's relative rounding: "bf16"'s loss is a bfloat16 number
PARTS = ("accelerate_O2", "accelerate_bf16", "accelerate_O2_half_base", "lightning_O2", "lightning_bf16-mixed")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    out = tmp_path_factory.mktemp("fsdplora62")
    run_script("accelerate_fsdp2_lora_script.py", out, timeout=120, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return {part: rank_results(out, f"{part}_") for part in PARTS}


def _distance(a: dict, b: dict) -> tuple[float, float]:
    """The largest entry difference and the norm of the difference of two ``{name: values}``."""
    diffs = [x - y for name in a for x, y in zip(a[name], b[name], strict=True)]
    return max(map(abs, diffs)), math.sqrt(sum(d * d for d in diffs))


def _check_trained_like(run: dict, reference: dict) -> None:
    assert "error" not in run and "error" not in reference, run.get("error") or reference.get("error")
    before, after = run["before"], run["after"]
    assert after["base"] == before["base"]  # the frozen base: unchanged, every gathered value
    assert all(after["adapters"][name] != before["adapters"][name] for name in before["adapters"])  # all 8 trained
    assert len(after["adapters"]) == 8
    assert run["losses"] == pytest.approx(reference["losses"], rel=BF16_LOSS)
    biggest, norm = _distance(after["adapters"], reference["after"]["adapters"])
    _, moved = _distance(after["adapters"], before["adapters"])
    # Adam moves each entry by about LR a step: two runs whose gradients differ by rounding may differ by a sign
    # flip near 0 (2 * LR), and differ far less than the adapters moved.
    assert biggest <= 2.5 * LR and norm <= 0.3 * moved


def test_accelerate_fsdp2_o2_trains_the_adapters_as_bf16(runs):
    for rank, reference in zip(runs["accelerate_O2"], runs["accelerate_bf16"]):
        _check_trained_like(rank, reference)
        # Stored: FSDP's FP32 shards (the masters), base and adapters, as Accelerate's "bf16" keeps them.
        assert set(rank["after"]["dtypes"].values()) == {"torch.float32"}


def test_accelerate_get_state_dict_gives_the_fp32_adapters(runs):
    rank0 = runs["accelerate_O2"][0]
    state = rank0["state_dict"]  # accelerator.get_state_dict(model): gathered in full, on rank 0
    adapters = {k: v for k, v in state.items() if "lora_" in k}
    assert {v["dtype"] for v in state.values()} == {"torch.float32"}
    assert {k: v["values"] for k, v in adapters.items()} == rank0["after"]["adapters"]  # the masters, exactly
    assert runs["accelerate_O2"][1]["state_dict"] is None


def test_accelerate_save_state_load_state_continues_identically(runs):
    for rank in runs["accelerate_O2"]:
        resume = rank["resume"]
        assert "error" not in resume, resume.get("error")
        assert resume["resumed"] == resume["straight"]
        assert resume["resumed_adapters"] == resume["straight_adapters"]
        assert resume["first"] == rank["losses"][: len(resume["first"])]
        assert {"lightning_mpx_amp.bin", "pytorch_model_fsdp_0", "optimizer_0"} <= set(resume["files"])


def test_accelerate_o2_trains_adapters_on_a_half_base(runs):
    # A base loaded in bfloat16 (from_pretrained(..., dtype=torch.bfloat16)), peft's adapters FP32: "bf16" trains it;
    # O2 refused it before this stop ("the sharded model stores half parameters"), though the frozen half base needs
    # no master (as without FSDP).
    for rank, reference in zip(runs["accelerate_O2_half_base"], runs["accelerate_bf16"]):
        dtypes = rank["after"]["dtypes"]
        assert {d for n, d in dtypes.items() if "lora_" in n} == {"torch.float32"}
        assert {d for n, d in dtypes.items() if "lora_" not in n} == {"torch.bfloat16"}
        _check_trained_like(rank, reference)


def test_lightning_fsdp2_o2_trains_the_adapters_as_bf16_mixed(runs):
    for rank, reference in zip(runs["lightning_O2"], runs["lightning_bf16-mixed"]):
        assert rank["global_step"] == reference["global_step"] == 4
        _check_trained_like(rank, reference)
        assert set(rank["after"]["dtypes"].values()) == {"torch.float32"}
