"""O2/O3 keep the rotary inverse frequencies FP32, as transformers' own bfloat16 models do, and cast every other
floating buffer (``lightning_mpx/masters/fp32_buffers.py``, applied by ``convert_module``). Tiny configs, bfloat16.

The Accelerate adapter's LLaMA at O2/O3 against transformers' bfloat16 model is in
``tests/test_accelerate_hf_losses.py``; litgpt's cos/sin tables, cast as ``bf16-true`` casts them, in
``tests/test_hostile_third_party.py``. Two strict expected failures, open findings in other sessions' modules: O2 under
FSDP casts the buffers its own way (integrations/fsdp.py), and ``fp32_modules`` gives a pinned module's buffers back
from their half rounding.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import Amp, convert_module

HALF = torch.bfloat16


class _HFRotaryEmbedding(nn.Module):
    """The shape of transformers' rotary modules: no parameters, non-persistent FP32 frequencies (plain and
    layer-typed), and a cos table (old transformers' ``cos_cached``)."""

    def __init__(self, persistent: bool = False) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float) / 8))
        self.register_buffer("inv_freq", inv_freq, persistent=persistent)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)
        self.register_buffer("sliding_attention_inv_freq", inv_freq.clone(), persistent=False)
        self.register_buffer("cos_cached", torch.arange(64.0)[:, None] * inv_freq, persistent=False)


class _LearnedRotaryEmbedding(nn.Module):
    """A rotary module with a parameter of its own: its ``inv_freq`` is cast with the model."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.register_buffer("inv_freq", torch.rand(4), persistent=False)


class _Positions(nn.Module):
    """A parameterless sinusoidal position table added to the activations: in FP32 it would promote them and the next
    half layer would fail ("mat1 and mat2 must have the same dtype"), so it is cast."""

    def __init__(self, n: int = 32, d: int = 8) -> None:
        super().__init__()
        pos = torch.arange(n)[:, None]
        div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        table = torch.zeros(n, d)
        table[:, 0::2], table[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("table", table, persistent=False)
        self.register_buffer("inv_freq", div.float(), persistent=False)  # not a rotary module's: cast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table[: x.shape[1]]


def test_convert_module_keeps_only_a_rotary_modules_frequencies_fp32():
    """The frequencies of a parameterless ``*RotaryEmbedding`` stay FP32 with their exact values; its cos table,
    a rotary module with parameters of its own and any other module's buffer of the same name are cast; frequencies
    the user rounded before preparing stay rounded (the opt-out)."""
    rotary, learned, rounded = _HFRotaryEmbedding(), _LearnedRotaryEmbedding(), _HFRotaryEmbedding()
    exact = rotary.inv_freq.clone()
    rounded.to(HALF)
    parts = dict(rotary=rotary, learned=learned, positions=_Positions(), rounded=rounded, head=nn.Linear(8, 2))
    model = nn.ModuleDict(parts)
    convert_module(model, HALF)
    dtypes = {name: buffer.dtype for name, buffer in model.named_buffers()}
    fp32 = ["rotary.inv_freq", "rotary.original_inv_freq", "rotary.sliding_attention_inv_freq"]
    assert dtypes == {name: torch.float32 if name in fp32 else HALF for name in dtypes}
    assert torch.equal(rotary.inv_freq, exact) and torch.equal(rotary.sliding_attention_inv_freq, exact)
    assert learned.scale.dtype == HALF


def test_a_persistent_rotary_frequency_is_exported_fp32_and_resumes_unchanged():
    """Old transformers registered ``inv_freq`` persistent: an O2 model's ``state_dict`` holds its exact FP32
    value, a model prepared at O2 loads it (or a half checkpoint's rounding of it) and keeps FP32."""
    amp = Amp(opt_level="O2", half_dtype="bfloat16")
    model = amp.prepare_model(nn.ModuleDict(dict(rotary=_HFRotaryEmbedding(persistent=True), head=nn.Linear(8, 2))))
    state = model.state_dict()
    assert sorted(name for name in state if "freq" in name) == ["rotary.inv_freq"]
    assert state["rotary.inv_freq"].dtype == torch.float32
    assert torch.equal(state["rotary.inv_freq"], _HFRotaryEmbedding().inv_freq)
    resumed = Amp(opt_level="O2", half_dtype="bfloat16").prepare_model(
        nn.ModuleDict(dict(rotary=_HFRotaryEmbedding(persistent=True), head=nn.Linear(8, 2)))
    )
    resumed.rotary.inv_freq.zero_()
    resumed.load_state_dict(state)
    assert resumed.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(resumed.rotary.inv_freq, state["rotary.inv_freq"])
    resumed.load_state_dict({**state, "rotary.inv_freq": state["rotary.inv_freq"].to(HALF)})
    assert resumed.rotary.inv_freq.dtype == torch.float32


def test_a_parameterless_position_table_is_cast_and_trains_at_o2_as_fp32_does():
    """Keeping every buffer of a parameterless module FP32 would break this model at O2 (FP32 activations into a
    half Linear); it trains, its loss within bfloat16's tolerance of FP32's."""

    def losses(level: str | None) -> list[float]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(16, 8), _Positions(), nn.Flatten(), nn.Linear(80, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        amp = Amp(opt_level=level, half_dtype="bfloat16") if level else None
        if amp is not None:
            model, optimizer = amp.prepare_model(model), amp.prepare_optimizer(optimizer)
        x = torch.randint(0, 16, (8, 10), generator=torch.Generator().manual_seed(1))
        y = torch.arange(8) % 4
        out = []
        for _ in range(3):
            loss = F.cross_entropy(model(x).float(), y)
            if amp is None:
                loss.backward()
                optimizer.step()
            else:
                amp.backward(loss)
                amp.step(optimizer)
            optimizer.zero_grad()
            out.append(loss.item())
        return out

    assert losses("O2") == pytest.approx(losses(None), rel=2e-2)


transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def _cos(rotary: nn.Module, positions: int, *layer_type: str) -> torch.Tensor:
    cos, _ = rotary(torch.zeros(1, positions, 32, dtype=HALF), torch.arange(positions)[None], *layer_type)
    return cos


def test_gemma3_layer_typed_frequencies_at_o3_give_transformers_bfloat16_cos_table():
    """Gemma 3's layer-typed ``sliding_attention_inv_freq`` at O3 (core ``Amp``): FP32, and the cos table at 4096
    positions is transformers' own bfloat16 model's, exactly; the non-persistent frequencies are not exported."""
    config = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=64, intermediate_size=48, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=2, head_dim=32)  # fmt: skip
    native = transformers.Gemma3ForCausalLM._from_config(config, dtype=HALF)
    model = Amp(opt_level="O3", half_dtype="bfloat16").prepare_model(transformers.Gemma3ForCausalLM(config))
    freqs = {name: b.dtype for name, b in model.named_buffers() if name.endswith("inv_freq")}
    assert freqs and set(freqs.values()) == {torch.float32}
    ours = _cos(model.model.rotary_emb, 4096, "sliding_attention")
    assert ours.dtype == HALF and torch.equal(ours, _cos(native.model.rotary_emb, 4096, "sliding_attention"))
    assert not [name for name in model.state_dict() if "inv_freq" in name]


def test_trainer_plugin_o2_follows_dynamic_rope_as_bf16_mixed_does():
    """LLaMA with ``rope_type="dynamic"`` through the Trainer plugin at O2, a short batch then one past
    ``max_position_embeddings`` (transformers recomputes ``inv_freq`` for it, in FP32): the frequencies of each step
    are FP32 and ``"bf16-mixed"``'s exactly, the losses within bfloat16's tolerance of its. (transformers 5.3 does
    not restore ``original_inv_freq`` after a long batch: it records the cached length under ``None_...``.)"""
    pl = pytest.importorskip("lightning.pytorch")
    from lightning_mpx import MixedPrecisionPlugin
    from tests.lightning_helpers import make_trainer

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                      rope_scaling={"rope_type": "dynamic", "factor": 2.0})  # fmt: skip
    ids = torch.randint(0, 64, (1, 160), generator=torch.Generator().manual_seed(0))

    def run(**precision: Any) -> tuple[list[float], list[torch.Tensor]]:
        losses: list[float] = []
        freqs: list[torch.Tensor] = []

        class Module(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(0)
                self.model = transformers.LlamaForCausalLM(config)

            def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
                loss = self.model(input_ids=batch, labels=batch).loss
                losses.append(loss.item())
                freqs.append(self.model.model.rotary_emb.inv_freq.clone())
                return loss

            def configure_optimizers(self) -> Any:
                return torch.optim.AdamW(self.parameters(), lr=1e-3)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = make_trainer(max_steps=2, **precision)
            trainer.fit(Module(), torch.utils.data.DataLoader([ids[:, :20], ids], batch_size=None))
        return losses, freqs

    ours, theirs = run(plugins=[MixedPrecisionPlugin("O2", half_dtype="bfloat16")]), run(precision="bf16-mixed")
    assert [f.dtype for f in ours[1]] == [torch.float32] * 2
    assert all(torch.equal(a, b) for a, b in zip(ours[1], theirs[1])) and not torch.equal(*ours[1])
    assert ours[0] == pytest.approx(theirs[0], rel=2e-3)


def test_o2_under_fsdp_keeps_the_rotary_frequencies_fp32():
    """The buffer cast O2 under FSDP makes (its parameters stay FP32, FSDP's masters) keeps the frequencies FP32."""
    from lightning_mpx.integrations.fsdp import _buffers_to

    model = nn.ModuleDict(dict(rotary=_HFRotaryEmbedding(), head=nn.Linear(8, 2)))
    _buffers_to(model, HALF, skip=set())
    assert model.rotary.inv_freq.dtype == torch.float32


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("factor", torch.tensor([1 / 3, 0.1, 3.14159, 2 / 7]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.factor


def test_a_module_pinned_fp32_at_o2_keeps_its_buffers_exact_values():
    """``fp32_modules`` runs a module in FP32 at O2: its buffers hold the values they held before preparing."""
    model = nn.Sequential(nn.Linear(4, 4), _Scaled())
    exact = model[1].factor.clone()
    model = Amp(opt_level="O2", half_dtype="bfloat16", fp32_modules=["1"]).prepare_model(model)
    assert model[1].factor.dtype == torch.float32 and torch.equal(model[1].factor, exact)
