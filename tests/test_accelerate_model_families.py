"""Hugging Face model families beyond the suite's GPT-2/BERT/Llama/T5, trained through the Accelerate adapter
(``lightning_mpx.accelerate.Accelerator``) at O1 and O2 in bfloat16 and held to the same script under Accelerate's own
``mixed_precision="no"`` (FP32) and ``"bf16"`` at the same seed. Each model is built from a tiny config (nothing is
downloaded). The families are those whose loss or forward is most likely to slip past a cast table:

- Mixtral with ``output_router_logits=True``: the load-balancing auxiliary loss (``load_balancing_loss_func``, no
  ``*Loss`` module) is added to the LM loss;
- CLIP with ``return_loss=True``: ``clip_loss`` on logits scaled by ``logit_scale.exp()``, the exp of a learnt scalar;
- Gemma: the embedding scaled by ``sqrt(hidden)`` in a dtype read from the hidden states, RMSNorm with ``1 + weight``;
- DistilBERT, ``problem_type="multi_label_classification"``: ``BCEWithLogitsLoss`` on float labels;
- Whisper: a conv1d front on float ``input_features``, whose ``generate()`` calls the encoder itself.

Figures (CPU, bfloat16, AdamW lr 1e-2, 3 steps; FP32 / Accelerate bf16 / O1 / O2), loss at step 0 then step 2:
mixtral 5.8647 / 5.8647 / 5.8647 / 5.8647, 5.8714 / 5.8718 / 5.8718 / 5.8720; clip 3.3145 / 3.3194 / 3.3024 / 3.3103,
2.1096 / 2.1101 / 2.1105 / 2.1076; gemma 4.8623 / 4.8623 / 4.8623 / 4.8622, 4.8641 / 4.8648 / 4.8648 / 4.8646;
distilbert 0.69341 / 0.69342 / 0.69342 / 0.69341, 0.68604 / 0.68623 / 0.68623 / 0.68623.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("fresh_accelerate_state"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

VOCAB, STEPS, LR = 128, 3, 1e-2
DECODER = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def _tokens(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _floats(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _mixtral() -> torch.nn.Module:
    config = transformers.MixtralConfig(
        **DECODER, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5
    )
    return transformers.MixtralForCausalLM(config)


def _gemma() -> torch.nn.Module:
    return transformers.GemmaForCausalLM(transformers.GemmaConfig(**DECODER, head_dim=8))


def _clip() -> torch.nn.Module:
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=16)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16,
                  patch_size=8)  # fmt: skip
    return transformers.CLIPModel(transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))


def _distilbert() -> torch.nn.Module:
    config = transformers.DistilBertConfig(
        vocab_size=VOCAB, dim=32, hidden_dim=64, n_layers=2, n_heads=2, max_position_embeddings=32, num_labels=3,
        problem_type="multi_label_classification", dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0,
    )  # fmt: skip
    return transformers.DistilBertForSequenceClassification(config)


def _lm_batch(step: int) -> dict[str, Any]:
    ids = _tokens(4, 16, step)
    return dict(input_ids=ids, labels=ids)


def _clip_batch(step: int) -> dict[str, Any]:
    return dict(input_ids=_tokens(8, 8, step), pixel_values=_floats(8, 3, 16, 16, seed=step), return_loss=True)


def _distilbert_batch(step: int) -> dict[str, Any]:
    labels = torch.randint(0, 2, (8, 3), generator=torch.Generator().manual_seed(100 + step)).float()
    return dict(input_ids=_tokens(8, 12, step), labels=labels)


# name: (build, batch, is a decoder (generates after O2 training))
FAMILIES: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[int], dict[str, Any]], bool]] = {
    "mixtral": (_mixtral, _lm_batch, True),
    "clip": (_clip, _clip_batch, False),
    "gemma": (_gemma, _lm_batch, True),
    "distilbert": (_distilbert, _distilbert_batch, False),
}


def _accelerator(mode: str) -> Any:
    if mode in ("O1", "O2"):
        kwargs = MixedPrecisionKwargs(half_dtype="bfloat16")
        return Accelerator(mixed_precision=mode, cpu=True, kwargs_handlers=[kwargs])
    return accelerate.Accelerator(mixed_precision=mode, cpu=True)


def _train(family: str, mode: str) -> tuple[list[torch.Tensor], Any, Any, Any, dict[str, torch.Tensor]]:
    """``(losses, accelerator, prepared model, prepared optimizer, {name: trained parameter as the optimizer holds
    it})``, after STEPS steps of ``family`` under ``mode`` at seed 0."""
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    build, batch, _ = FAMILIES[family]
    accelerator = _accelerator(mode)
    torch.manual_seed(0)
    model = build()
    names = {p: n for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses = []
    for step in range(STEPS):
        loss = model(**batch(step)).loss
        losses.append(loss.detach())
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    amp = getattr(accelerator, "amp", None)
    stepped = {names[p]: (amp.master_of(p) if amp is not None else p) for p in names if p.requires_grad}
    return losses, accelerator, model, optimizer, stepped


# family: (levels, whether Accelerate's own "bf16" is run too: its distance to FP32 widens the margin). O1 where
# the cast table meets the family's loss or its dtype reads (Mixtral's router, CLIP's promoted logits, Gemma's
# normalizer); DistilBERT's float labels meet the boundary casts, at O2 only.
RUNS = {"mixtral": (("O1", "O2"), True), "clip": (("O1", "O2"), True), "gemma": (("O1", "O2"), False),
        "distilbert": (("O2",), False)}  # fmt: skip


@pytest.mark.parametrize("family", list(RUNS))
def test_family_at_o1_and_o2_follows_fp32_and_accelerate_bf16(family: str) -> None:
    """The loss is FP32, near the FP32 run's at step 0 and after STEPS steps (within bfloat16's margin: 3x the larger
    of 0.5% and Accelerate's own "bf16" distance to FP32), never NaN; the optimizer steps FP32 masters of every
    bfloat16 weight at O2, and the decoders generate (greedy) after O2 training. CLIP: its learnt ``logit_scale``
    (exp'd into the logits) moves by about lr per step, less than bfloat16's spacing near 2.66 (2**-6): at O2 its
    FP32 master takes every step as the FP32 run's does, while the model holds its rounding."""
    levels, with_native = RUNS[family]
    reference, *_, fp32_weights = _train(family, "no")
    ref = torch.stack(reference)
    margin = torch.full_like(ref, 5e-3 * float(ref[0]))
    if with_native:
        margin = torch.maximum((torch.stack(_train(family, "bf16")[0]) - ref).abs(), margin)
    for level in levels:
        losses, accelerator, model, _, stepped = _train(family, level)
        assert {loss.dtype for loss in losses} == {torch.float32}, (level, [loss.dtype for loss in losses])
        ours = torch.stack(losses)
        assert torch.isfinite(ours).all(), (level, ours)
        assert ((ours - ref).abs() <= 3 * margin).all(), (level, ours.tolist(), ref.tolist(), margin.tolist())
        assert {p.dtype for p in stepped.values()} == {torch.float32}, level
        if level != "O2":
            continue
        unwrapped = accelerator.unwrap_model(model)
        held = {n for n, p in unwrapped.named_parameters() if p.dtype == torch.bfloat16}
        assert held and held <= set(stepped), sorted(held - set(stepped))  # every half weight has a master
        if family == "clip":
            want, got = fp32_weights["logit_scale"].detach(), stepped["logit_scale"].detach()
            start = torch.tensor(transformers.CLIPConfig().logit_scale_init_value)
            assert (want - start).abs() > 2e-2  # the run moved it by more than bfloat16's spacing there...
            assert (got - want).abs() < 2e-3, (got.item(), want.item())  # ...and the master followed, well under it
            assert torch.equal(unwrapped.logit_scale, got.to(torch.bfloat16))
        if FAMILIES[family][2]:
            # Mixtral's router logits in generate() trip transformers' own load_balancing_loss_func with a KV cache
            # (an FP32 model fails the same way, transformers 5.3): generate without them.
            extra = {"output_router_logits": False} if family == "mixtral" else {}
            prompt = _tokens(1, 4, 99)
            out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3,
                                 do_sample=False, **extra)  # fmt: skip
            assert out.shape == (1, 7) and torch.equal(out[:, :4], prompt), out


def _whisper() -> torch.nn.Module:
    config = transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=8,
        max_target_positions=16, decoder_start_token_id=1, pad_token_id=0, eos_token_id=2, bos_token_id=1,
        suppress_tokens=None, begin_suppress_tokens=None,
    )  # fmt: skip
    return transformers.WhisperForConditionalGeneration(config)


def test_whisper_generates_after_o2_training() -> None:
    """Whisper's ``generate()`` runs its encoder itself (``get_encoder()(input_features)``), outside the prepared
    ``forward``: at O2 the FP32 ``input_features`` reached the bfloat16 conv1d ("Input type (float) and bias type
    (c10::BFloat16) should be the same"). The prepared model's ``generate`` now runs with the forward's casts; its
    tokens are those of the same greedy decode written as a loop of prepared forwards."""
    accelerator = _accelerator("O2")
    torch.manual_seed(0)
    model = _whisper()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    features, labels = _floats(2, 8, 16, seed=0), _tokens(2, 6, 0)
    loss = model(input_features=features, labels=labels).loss
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    accelerator.backward(loss)
    optimizer.step()
    model.eval()
    out = model.generate(input_features=features[:1], max_new_tokens=3, do_sample=False)
    tokens = torch.tensor([[1]])
    with torch.no_grad():
        for _ in range(3):
            logits = model(input_features=features[:1], decoder_input_ids=tokens).logits
            tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, tokens[:, 1:]), (out, tokens)  # generate() leaves out the start token
