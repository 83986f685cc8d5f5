"""The Fabric and Trainer plugins under what litgpt's own scripts and Hugging Face users do with them, each against a
reference: Fabric's or Lightning's own precision ("32-true", "bf16-mixed", "bf16-true") on the same script.

litgpt (``pretrain.py``, ``finetune/lora.py``, ``generate/base.py``): a LLaMA-shaped ``litgpt.GPT`` (RMSNorm, SwiGLU,
RoPE, grouped queries) built in ``fabric.init_module``, ``setup_module`` then ``setup_optimizers``, logits in chunks
(``lm_head_chunk_size``, the list edited in place as the LoRA script does) into ``chunked_cross_entropy``, gradient
accumulation under ``no_backward_sync``, ``clip_gradients``, a ``fabric.save``/``fabric.load`` resume, generation
with the KV cache mid-run and after a ``load_raw`` of FP32 weights, ``merge_lora_weights`` after O2 training, and the
adapter. Hugging Face: GPT-2 (tied embeddings), LLaMA and T5 in a LightningModule with gradient checkpointing and
``model.generate()`` in ``validation_step``; GPT-2's ``generate`` through Fabric (``mark_forward_method``).
bfloat16 throughout but for one float16 generation (float16 matrix products are slow on CPU); the models are a few
thousand parameters. One expected failure (strict): the compute dtype Lightning's throughput monitors read.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("litgpt")
L = pytest.importorskip("lightning")

from litgpt.generate.base import generate  # noqa: E402
from litgpt.utils import chunked_cross_entropy  # noqa: E402

from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin  # noqa: E402

HALF = "bfloat16"
BF16_ULP = 2.0**-7  # bfloat16's spacing at 1.0


def _config(kind: str = "base", **extra: Any) -> Any:
    """A tiny LLaMA-shaped ``Config`` of litgpt's ``kind`` (``base``, ``lora`` or ``adapter``)."""
    import importlib

    module = importlib.import_module("litgpt" if kind == "base" else f"litgpt.{kind}")
    return module.Config(
        name="tiny-llama", block_size=64, vocab_size=96, padded_vocab_size=96, n_layer=2, n_head=4, n_query_groups=2,
        n_embd=32, rotary_percentage=1.0, parallel_residual=False, bias=False, norm_class_name="RMSNorm",
        mlp_class_name="LLaMAMLP", intermediate_size=64, **extra,
    )  # fmt: skip


def _gpt(kind: str = "base") -> type[nn.Module]:
    import importlib

    return importlib.import_module("litgpt" if kind == "base" else f"litgpt.{kind}").GPT


LORA = {"lora_r": 4, "lora_alpha": 8, "lora_query": True, "lora_value": True, "lora_mlp": True}


def _fabric(precision: str, half: str = HALF) -> tuple[Any, FabricMixedPrecisionPlugin | None]:
    """``Fabric`` with the plugin at ``precision`` ("O1".."O3") or with Fabric's own ``precision``."""
    if precision.startswith("O"):
        mpx = FabricMixedPrecisionPlugin(precision, half_dtype=half)
        return L.Fabric(accelerator="cpu", devices=1, plugins=[mpx]), mpx
    return L.Fabric(accelerator="cpu", devices=1, precision=precision), None


def _batches(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 96, (n, 2, 25), generator=torch.Generator().manual_seed(seed))


def _micro_step(fabric: Any, model: nn.Module, optimizer: Any, batch: torch.Tensor, accumulating: bool) -> float:
    """One micro-batch of litgpt's ``finetune/lora.py`` loop (two micro-batches a step)."""
    with fabric.no_backward_sync(model, enabled=accumulating):
        logits = model(batch[:, :-1], lm_head_chunk_size=8)
        logits[-1] = logits[-1][..., :-1, :]  # the script edits the list of chunks in place
        loss = chunked_cross_entropy(logits, batch[:, 1:-1].contiguous())
        fabric.backward(loss / 2)
    if not accumulating:
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
    return loss.item()


def _litgpt_run(precision: str, kind: str = "base", generate_at: tuple[int, ...] = ()) -> dict[str, Any]:
    """Six micro-batches of litgpt's loop; at each index in ``generate_at`` first a generation as litgpt's
    ``generate_example`` makes it (eval, a KV cache built in ``fabric.init_tensor()``, sampling under inference
    mode, the cache cleared, train)."""
    fabric, mpx = _fabric(precision)
    torch.manual_seed(0)
    with fabric.init_module(empty_init=False):
        model = _gpt(kind)(_config(kind, **(LORA if kind == "lora" else {})))
    if kind == "lora":
        from litgpt.lora import mark_only_lora_as_trainable

        mark_only_lora_as_trainable(model)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2 if kind == "lora" else 3e-3)
    )
    losses, generated = [], []
    for i, batch in enumerate(_batches(6)):
        if i in generate_at:
            model.eval()
            with fabric.init_tensor():
                model.set_kv_cache(batch_size=1)
            torch.manual_seed(7)
            generated.append(generate(model, batch[0, :8], 20, temperature=0.8)[8:].tolist())
            model.clear_kv_cache()
            model.train()
        losses.append(_micro_step(fabric, model, optimizer, batch, accumulating=i % 2 == 0))
    return {"losses": losses, "model": model, "mpx": mpx, "generated": generated}


# -- 1. litgpt's fine-tuning loop against Fabric's own precisions ------------------------------------------------------
@pytest.mark.parametrize("level,reference", [("O1", "bf16-mixed"), ("O2", "32-true"), ("O3", "32-true")])
def test_litgpt_llama_loop_matches_fabrics_own_precision(level, reference):
    """Chunked logits edited in place, ``chunked_cross_entropy``, accumulation and clipping: O1 follows
    ``bf16-mixed``, O2 (FP32 masters) and O3 ``32-true``, each to bfloat16's tolerance (O3's loss is computed from
    FP32 logits, where ``bf16-true`` computes it in bfloat16, up to 0.3% away); O2 keeps FP32 masters of every parameter
    and a half model."""
    ours, theirs = _litgpt_run(level), _litgpt_run(reference)
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=2e-3, atol=0)
    model, mpx = ours["model"], ours["mpx"]
    if level == "O2":
        pairs = [half for masters in mpx.amp.master_weights for half, _ in masters.half_pairs]
        assert {id(p) for p in pairs} == {id(p) for p in model.parameters()}
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_generation_mid_finetuning_leaves_the_training_as_it_was(level):
    """litgpt's ``generate_example`` between steps (inference mode, a KV cache, eval then train) changes nothing in
    the LoRA run: the same losses and weights, bit for bit, as the run without it; the generated tokens are the
    reference's at O1 (``bf16-mixed``)."""
    plain = _litgpt_run(level, "lora")
    with_generation = _litgpt_run(level, "lora", generate_at=(0, 3))
    assert with_generation["losses"] == plain["losses"]
    for p, q in zip(plain["model"].parameters(), with_generation["model"].parameters()):
        assert torch.equal(p, q)
    if level == "O1":
        assert with_generation["generated"] == _litgpt_run("bf16-mixed", "lora", generate_at=(0, 3))["generated"]


def test_the_adapter_trains_as_at_32_true():
    """litgpt's adapter (``mark_only_adapter_as_trainable``; its prefix gated by ``gating_factor``) at O2 against
    ``32-true``. litgpt 0.5.13 keeps the adapter's key/value prefix from the first forward (with its graph), which
    breaks a second backward at any precision: the loop clears it before each forward."""
    from litgpt.adapter import GPT, mark_only_adapter_as_trainable

    def run(precision: str) -> tuple[list[float], nn.Module]:
        fabric, _ = _fabric(precision)
        torch.manual_seed(0)
        model = GPT(_config("adapter", adapter_prompt_length=4, adapter_start_layer=0))
        for block in model.transformer.h:
            nn.init.constant_(block.attn.gating_factor, 0.5)  # zero at init: the prefix would not count
        mark_only_adapter_as_trainable(model)
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(
            torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        )
        losses = []
        for batch in _batches(4):
            for block in model.transformer.h:
                block.attn.adapter_kv_cache = None
            loss = chunked_cross_entropy(model(batch[:, :-1]), batch[:, 1:])
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses, model

    losses, model = run("O2")
    reference, _ = run("32-true")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=1e-3, atol=0)
    assert model.transformer.h[0].attn.gating_factor.dtype == torch.bfloat16


# -- 2. resume ---------------------------------------------------------------------------------------------------------
def _resumable(level: str, seed: int) -> tuple[Any, FabricMixedPrecisionPlugin, nn.Module, Any]:
    fabric, mpx = _fabric(level)
    torch.manual_seed(seed)
    with fabric.init_module(empty_init=False):
        model = _gpt()(_config())
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1))
    assert mpx is not None
    mpx.setup_optimizers(optimizer)  # before fabric.load: O2's optimizer state belongs to the masters
    return fabric, mpx, model, optimizer


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_a_litgpt_checkpoint_resumes_bit_for_bit(level, tmp_path):
    """``fabric.save`` of litgpt's state (``model``, ``optimizer``, ``iter_num``, plus the plugin) and
    ``fabric.load`` into a fresh run built from another seed: the next steps' losses and weights are the saving
    run's, bit for bit."""
    batches = _batches(8)
    fabric, mpx, model, optimizer = _resumable(level, seed=0)
    for i, batch in enumerate(batches[:4]):
        _micro_step(fabric, model, optimizer, batch, accumulating=i % 2 == 0)
    fabric.save(tmp_path / "ckpt.pth", {"model": model, "optimizer": optimizer, "iter_num": 4, "mpx": mpx})
    expected = [_micro_step(fabric, model, optimizer, b, i % 2 == 0) for i, b in enumerate(batches[4:])]

    fabric2, mpx2, model2, optimizer2 = _resumable(level, seed=5)
    state = {"model": model2, "optimizer": optimizer2, "iter_num": 0, "mpx": mpx2}
    fabric2.load(tmp_path / "ckpt.pth", state)
    assert state["iter_num"] == 4
    resumed = [_micro_step(fabric2, model2, optimizer2, b, i % 2 == 0) for i, b in enumerate(batches[4:])]
    assert resumed == expected
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
        if level == "O2":
            assert torch.equal(mpx.amp.master_of(p), mpx2.amp.master_of(q))


def test_litgpts_resume_into_an_o2_optimizer_the_plugin_does_not_know_is_refused(tmp_path):
    """litgpt's ``pretrain.py`` resumes with ``fabric.load`` right after ``fabric.setup_optimizers``: at O2 the
    optimizer's FP32 state would be rounded into the half parameters' state. Refused at its first step, with the
    call that fixes it."""
    fabric, mpx, model, optimizer = _resumable("O2", seed=0)
    _micro_step(fabric, model, optimizer, _batches(1)[0], accumulating=False)
    fabric.save(tmp_path / "ckpt.pth", {"model": model, "optimizer": optimizer, "iter_num": 1, "mpx": mpx})
    fabric2, mpx2 = _fabric("O2")
    torch.manual_seed(0)
    model2 = fabric2.setup_module(_gpt()(_config()))
    optimizer2 = fabric2.setup_optimizers(torch.optim.AdamW(model2.parameters(), lr=3e-3))
    fabric2.load(tmp_path / "ckpt.pth", {"model": model2, "optimizer": optimizer2, "iter_num": 0, "mpx": mpx2})
    with pytest.raises(RuntimeError, match=r"plugin.setup_optimizers\(optimizer\) after fabric.setup\(\) and before"):
        _micro_step(fabric2, model2, optimizer2, _batches(1)[0], accumulating=False)


# -- 3. generation: litgpt's generate/base.py --------------------------------------------------------------------------
def _generate_main(precision: str, checkpoint: Path, prompt: torch.Tensor, half: str = HALF) -> dict[str, Any]:
    """``litgpt/generate/base.py``'s ``main``: built with ``empty_init=True``, the rope cache shortened and the KV
    cache made in ``fabric.init_tensor()``, eval, ``setup_module``, ``load_raw`` of the FP32 weights, greedy
    generation twice (the cache reset in between, as the script does)."""
    fabric, _ = _fabric(precision, half)
    with fabric.init_module(empty_init=True):
        model = _gpt()(_config())
    with fabric.init_tensor():
        model.max_seq_length = 30  # rebuilds the rope cache (FP32, whatever the default dtype)
        model.set_kv_cache(batch_size=1)
    model.eval()
    model = fabric.setup_module(model)
    fabric.load_raw(checkpoint, model)
    with torch.no_grad():
        logits = model(prompt[None])[0, -1].float()
    tokens = generate(model, prompt, 24, top_k=1)
    with torch.inference_mode():  # the cache turned half inside generate's inference mode
        for block in model.transformer.h:
            block.attn.kv_cache.reset_parameters()
    again = generate(model, prompt, 24, top_k=1)
    return {"logits": logits, "tokens": tokens[len(prompt) :].tolist(), "again": again.tolist(),
            "first": tokens.tolist(), "model": model}  # fmt: skip


@pytest.fixture(scope="module")
def fp32_checkpoint(tmp_path_factory) -> Path:
    torch.manual_seed(3)
    model = _gpt()(_config())
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3)  # peaked logits: greedy decoding not decided by ties
    path = tmp_path_factory.mktemp("litgpt") / "lit_model.pth"
    torch.save(model.state_dict(), path)
    return path


@pytest.mark.parametrize("level,reference", [("O1", "bf16-mixed"), ("O2", "bf16-true"), ("O3", "bf16-true")])
def test_litgpt_generate_main_agrees_with_fabrics_own_precision_and_fp32(level, reference, fp32_checkpoint):
    """The same greedy tokens as Fabric's own precision of the same compute (O2/O3 hold the same half weights as
    ``bf16-true``), the last position's logits within bfloat16's tolerance of the FP32 model's, and the cache reset
    gives the same tokens again. At O2/O3 the rope cache rebuilt for the shorter length is cast with the model, as
    ``bf16-true`` casts it, and the KV cache made in FP32 turns half at the first forward."""
    prompt = torch.randint(0, 96, (8,), generator=torch.Generator().manual_seed(2))
    ours = _generate_main(level, fp32_checkpoint, prompt)
    theirs = _generate_main(reference, fp32_checkpoint, prompt)
    fp32 = _generate_main("32-true", fp32_checkpoint, prompt)
    assert ours["tokens"] == theirs["tokens"] and ours["again"] == ours["first"]
    torch.testing.assert_close(ours["logits"], theirs["logits"], rtol=0.02, atol=0.02)
    torch.testing.assert_close(ours["logits"], fp32["logits"], rtol=0, atol=0.1 * fp32["logits"].abs().max().item())
    assert ours["tokens"][0] == fp32["tokens"][0]  # then bfloat16 drifts from FP32 (bf16-mixed's at token 2)
    model = ours["model"]
    half = torch.float32 if level == "O1" else torch.bfloat16
    assert model.cos.dtype == theirs["model"].cos.dtype == half and model.cos.shape[0] == 30
    assert model.transformer.h[0].attn.kv_cache.k.dtype == torch.bfloat16


def test_litgpt_generate_main_in_float16_at_o2_is_16_trues(fp32_checkpoint):
    """The same in float16 (where on CPU Fabric's ``"16-mixed"`` is bfloat16, so only ``"16-true"`` compares): O2's
    greedy tokens and logits are ``16-true``'s, and its logits within float16's tolerance of FP32's."""
    prompt = torch.randint(0, 96, (8,), generator=torch.Generator().manual_seed(2))
    ours = _generate_main("O2", fp32_checkpoint, prompt, half="float16")
    theirs = _generate_main("16-true", fp32_checkpoint, prompt)
    fp32 = _generate_main("32-true", fp32_checkpoint, prompt)
    assert ours["tokens"] == theirs["tokens"] and ours["again"] == ours["first"]
    torch.testing.assert_close(ours["logits"], theirs["logits"], rtol=0, atol=0)
    torch.testing.assert_close(ours["logits"], fp32["logits"], rtol=0, atol=0.01 * fp32["logits"].abs().max().item())
    assert ours["model"].transformer.h[0].attn.kv_cache.k.dtype == torch.float16


# -- 4. LoRA merged after O2 training ----------------------------------------------------------------------------------
def test_merge_lora_weights_after_o2_training_is_bf16_trues_merge():
    """``merge_lora_weights`` on the half model: each merged weight is the merge a bfloat16 copy of the trained
    weights gets (``bf16-true``'s), the FP32 merge of the exported FP32 weights to one bfloat16 rounding of the
    largest, the merged model's logits are the unmerged model's, and ``fp32_state_dict`` exports the merged
    weights (the frozen base keeps no FP32 value at O2: it is its half weight, upcast)."""
    from litgpt.lora import merge_lora_weights

    run = _litgpt_run("O2", "lora")
    model, mpx = run["model"], run["mpx"]
    before = mpx.fp32_state_dict(model)
    reference = copy.deepcopy(model.module).float()  # the FP32 merge: litgpt's own, on the exported FP32 weights
    reference.load_state_dict(before)
    half_copy = copy.deepcopy(reference).to(torch.bfloat16)  # bf16-true's merge: the same weights, merged in half
    merge_lora_weights(reference)
    merge_lora_weights(half_copy)
    expected = reference.state_dict()
    batch = _batches(1, seed=9)[0][:, :-1]
    with torch.no_grad():
        unmerged = model(batch)
    merge_lora_weights(model.module)
    with torch.no_grad():
        merged = model(batch)
    after = mpx.fp32_state_dict(model)
    merged_keys = [k for k in expected if k.endswith("linear.weight") and not torch.equal(expected[k], before[k])]
    assert len(merged_keys) == 8  # per layer: qkv (query and value) and the three weights of the SwiGLU MLP
    for key in merged_keys:
        w, want = before[key], expected[key]
        got = model.module.get_parameter(key).detach().float()
        assert (want - w).abs().max() > 4 * BF16_ULP * w.abs().max()  # the merge is not lost in the rounding
        assert torch.equal(got, half_copy.get_parameter(key).float()), key
        torch.testing.assert_close(got, want, rtol=0, atol=BF16_ULP * want.abs().max().item())
        assert torch.equal(after[key], got)  # the write to the frozen half weight is taken
    torch.testing.assert_close(merged, unmerged, rtol=0, atol=0.05)


# -- 5. Hugging Face models in a LightningModule -----------------------------------------------------------------------
def _hf_model(kind: str) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=64,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    if kind == "llama":
        config = transformers.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          hidden_size=32, intermediate_size=64, vocab_size=64,
                                          max_position_embeddings=64)  # fmt: skip
        return transformers.LlamaForCausalLM(config)
    config = transformers.T5Config(num_layers=2, num_decoder_layers=2, num_heads=2, d_model=32, d_kv=16, d_ff=64,
                                   vocab_size=64, dropout_rate=0.0, decoder_start_token_id=0,
                                   pad_token_id=0)  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def _trainer_run(kind: str, precision: str) -> dict[str, Any]:
    """Four steps of a LightningModule around a Hugging Face model (its own loss from ``labels=``, gradient
    checkpointing on), with ``model.generate()`` in ``validation_step``."""
    pl = pytest.importorskip("lightning.pytorch")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _hf_model(kind)
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self.losses: list[float] = []
            self.generated: list[list[int]] = []

        def _loss(self, batch: torch.Tensor) -> torch.Tensor:
            if kind == "t5":
                return self.model(input_ids=batch[:, :8], labels=batch[:, 8:].contiguous()).loss
            return self.model(input_ids=batch, labels=batch).loss

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = self._loss(batch)
            self.losses.append(loss.item())
            return loss

        def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            out = self.model.generate(batch[:1, :6], max_new_tokens=6, do_sample=False, pad_token_id=0)
            self.generated.append(out[0, -6:].tolist())
            self.log("val_loss", self._loss(batch))

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = torch.randint(1, 64, (16, 16), generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    precision_args: dict[str, Any] = (
        {"plugins": [MixedPrecisionPlugin(precision, half_dtype=HALF)]} if precision.startswith("O")
        else {"precision": precision}
    )  # fmt: skip
    module = Module()
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, limit_val_batches=1, num_sanity_val_steps=0,
                         enable_progress_bar=False, logger=False, enable_checkpointing=False,
                         enable_model_summary=False, **precision_args)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader, loader)
    return {"losses": module.losses, "generated": module.generated, "model": module.model}


@pytest.mark.parametrize(
    "kind,level,reference", [("gpt2", "O2", "32-true"), ("llama", "O1", "bf16-mixed"), ("t5", "O3", "bf16-true")]
)
def test_hugging_face_models_in_the_trainer_match_lightnings_own_precision(kind, level, reference):
    """GPT-2 (tied embeddings) at O2 against ``32-true``, LLaMA at O1 against ``bf16-mixed``, T5 at O3 against
    ``bf16-true``: the model's own loss from ``labels=`` to bfloat16's tolerance (T5 at O3: exactly), and
    ``model.generate()`` in ``validation_step`` (inference mode, the model's own cache) gives the same tokens."""
    ours, theirs = _trainer_run(kind, level), _trainer_run(kind, reference)
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=1e-3, atol=0)
    assert ours["generated"] == theirs["generated"]
    model = ours["model"]
    if kind == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight and model.lm_head.weight.dtype == torch.bfloat16


def test_gpt2_generate_through_fabric_at_o2_is_bf16_trues():
    """``model.mark_forward_method("generate")`` on a set-up GPT-2 after an O2 step: the greedy tokens of
    ``bf16-true``'s, and scores within bfloat16's tolerance of them (O2's step is the FP32 master's)."""

    def run(precision: str) -> Any:
        fabric, _ = _fabric(precision)
        hf = _hf_model("gpt2")
        model, optimizer = fabric.setup(hf, torch.optim.AdamW(hf.parameters(), lr=1e-3))
        model.mark_forward_method("generate")
        data = torch.randint(1, 64, (4, 16), generator=torch.Generator().manual_seed(1))
        fabric.backward(model(input_ids=data, labels=data).loss)
        optimizer.step()
        return model.generate(data[:1, :6], max_new_tokens=6, do_sample=False, pad_token_id=0,
                              output_scores=True, return_dict_in_generate=True)  # fmt: skip

    ours, theirs = run("O2"), run("bf16-true")
    assert torch.equal(ours.sequences, theirs.sequences)
    torch.testing.assert_close(torch.stack(ours.scores), torch.stack(theirs.scores), rtol=0, atol=0.02)


# -- 6. Lightning's throughput monitors (litgpt's pretrain.py logs their MFU) ------------------------------------------
@pytest.mark.xfail(
    strict=True,
    reason="open finding: Lightning reads an FSDPPrecision's compute dtype from mixed_precision_config.reduce_dtype "
    "(FP32 at O1/O2, None at O3), so both plugins report FP32 and the MFU on CUDA is taken against the FP32 peak; "
    "the field is FSDP1's gradient reduction dtype and cannot change (see the report of issue 41, h47)",
)
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_the_throughput_monitors_compute_dtype_is_the_half_dtype_as_for_fabrics_own_precisions(level):
    """``ThroughputMonitor(fabric)`` (litgpt's ``pretrain.py``) and the Trainer's ``ThroughputMonitor`` callback take
    the peak FLOPs of the precision plugin's compute dtype: ``bfloat16`` for Fabric's ``"bf16-mixed"`` and
    ``"bf16-true"``, and so for the opt levels that compute in it."""
    from lightning.fabric.plugins import HalfPrecision
    from lightning.fabric.plugins import MixedPrecision as FabricMixed
    from lightning.fabric.utilities.throughput import _plugin_to_compute_dtype
    from lightning.pytorch.callbacks.throughput_monitor import _plugin_to_compute_dtype as trainer_compute_dtype

    assert _plugin_to_compute_dtype(FabricMixed("bf16-mixed", "cpu")) == torch.bfloat16
    assert _plugin_to_compute_dtype(HalfPrecision("bf16-true")) == torch.bfloat16
    assert _plugin_to_compute_dtype(FabricMixedPrecisionPlugin(level, half_dtype=HALF)) == torch.bfloat16
    assert trainer_compute_dtype(MixedPrecisionPlugin(level, half_dtype=HALF)) == torch.bfloat16
