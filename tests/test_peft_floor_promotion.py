"""on_floor="promote" on a peft LoRA model: the layer that overflows is a frozen ``base_layer`` (no trainable
parameter, so no gradient of its own), which the unwatched overflow that arms the forward watch cannot name."""

from __future__ import annotations

import torch

from lightning_mpx import Amp


def test_a_lora_models_frozen_base_layer_that_overflows_is_promoted_at_the_floor():
    # The first overflow at the floor (unwatched) blamed the 8 LoRA adapters (the only gradients, all NaN after the
    # forward overflow); the watched one after it named h.1.mlp.c_fc.base_layer, a sibling of them: "on_floor='promote'
    # could not blame a module: the last 2 overflows at the floor came from different modules (...lora_A.default, ...
    # / ...c_fc.base_layer)". A model without frozen layers is promoted (test_core_doctor_tags_agree): LoRA fine-tuning
    # was not.
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)  # fmt: skip
    base = GPT2LMHeadModel(config)
    net = get_peft_model(base, LoraConfig(r=2, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True))
    amp = Amp("O1", half_dtype="float16", init_scale=4.0, min_loss_scale=1.0, on_floor="promote")
    model = amp.prepare_model(net)
    optimizer = amp.prepare_optimizer(torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3))
    ids = torch.randint(0, 32, (2, 8))
    firsts: set[str] = set()
    for step in range(6):
        if step == 2:
            with torch.no_grad():
                base.transformer.h[1].mlp.c_fc.base_layer.weight.mul_(1e6)  # its output passes float16's maximum
        with amp.forward_context():
            loss = model(input_ids=ids, labels=ids).loss
        amp.backward(loss)
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()
        firsts.update(key for key in amp.metrics() if key.startswith("mpx/overflow_first/"))
    layer = "base_model.model.transformer.h.1.mlp.c_fc.base_layer"
    assert amp.fp32_modules == [layer]
    assert firsts == {f"mpx/overflow_first/{layer}"}
    assert {key for key in amp.metrics() if key.startswith("mpx/promoted/")} == {f"mpx/promoted/{layer}"}
