"""A hostile user against stop 59's newest surfaces, each against the framework's own precision on the same code:
the Accelerate adapter's state dicts at O2 (``get_state_dict``, sharded ``save_model``, ``save_pretrained``, a peft
LoRA model's adapter save, a load of FP32 values then training, GPT-2's tied embeddings) and ``generate`` at O1/O2/O3
(``AmpGenerate``) against Accelerate's ``"bf16"``; the O2 EMA/teacher warnings' false positives (a frozen backbone
loaded after set-up, a WGAN clamp, ``BackboneFinetuning``, ``EMAWeightAveraging``, an ``AveragedModel`` outside the
model) and one false negative (strict xfail); the Trainer's stages and teardown (fit, validate, test, predict, fit
again from ``ckpt_path="last"``, an exception at step 3 then a new fit) against ``"bf16-mixed"``. bfloat16, tiny."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import MixedPrecisionPlugin
from tests.lightning_helpers import classification_data, loader, make_trainer

HALF = torch.bfloat16
OURS = "lightning_mpx:"


# -- Accelerate: state dicts and generate ------------------------------------------------------------------------------
def _gpt2(**extra: Any) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16, pad_token_id=0,
                        eos_token_id=1, bos_token_id=1, **extra)
    return GPT2LMHeadModel(config)


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(2, 32, (2, 6), generator=torch.Generator().manual_seed(seed))


def _train(accelerator: Any, model: Any, optimizer: Any, seeds: range) -> None:
    for seed in seeds:
        ids = _ids(seed)
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()


def _accelerator(level: str) -> Any:
    from accelerate import Accelerator as NativeAccelerator

    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    if level == "bf16":
        return NativeAccelerator(mixed_precision="bf16", cpu=True)
    return Accelerator(mixed_precision=level, kwargs_handlers=[MixedPrecisionKwargs(half_dtype=HALF)])


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_o2_every_accelerate_save_writes_the_fp32_masters_and_a_load_of_fp32_values_trains_on(tmp_path: Path) -> None:
    """``save_model`` sharded by a small ``max_shard_size``, ``save_pretrained`` either way, GPT-2's tied embedding
    saved once and tied again on load: the masters exactly, FP32, as Accelerate's ``"bf16"`` writes; an FP32 state
    dict loaded into the prepared model becomes its masters, and one step moves them by about the learning rate."""
    pytest.importorskip("transformers")
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    accelerator = _accelerator("O2")
    model = _gpt2()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    _train(accelerator, model, optimizer, range(3))
    masters = accelerator.get_state_dict(model)
    assert {v.dtype for v in masters.values()} == {torch.float32}
    assert torch.equal(masters["lm_head.weight"], masters["transformer.wte.weight"])  # tied: one master

    accelerator.save_model(model, tmp_path / "sharded", max_shard_size="10KB")
    shards = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 1
    saved = {k: v for shard in shards for k, v in load_file(shard).items()}
    assert set(masters) - set(saved) == {"lm_head.weight"}  # the tied copy saved once, as Accelerate does
    assert all(torch.equal(saved[k], masters[k]) for k in saved)
    for safe in (True, False):
        out = tmp_path / f"pretrained_{safe}"
        accelerator.unwrap_model(model).save_pretrained(out, safe_serialization=safe)
        back = GPT2LMHeadModel.from_pretrained(out, dtype=torch.float32)
        assert back.lm_head.weight is back.transformer.wte.weight
        assert all(torch.equal(v, masters[k]) for k, v in back.state_dict().items())

    fresh = _gpt2(n_ctx=16).state_dict()  # another FP32 start, loaded into the prepared half model
    torch.manual_seed(1)
    fresh = {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v for k, v in fresh.items()}
    fresh["lm_head.weight"] = fresh["transformer.wte.weight"]
    model.load_state_dict(fresh)
    assert all(torch.equal(v, fresh[k]) for k, v in accelerator.get_state_dict(model).items())
    _train(accelerator, model, optimizer, range(3, 4))
    moved = max((v - fresh[k]).abs().max().item() for k, v in accelerator.get_state_dict(model).items())
    assert 1e-4 < moved <= 2e-3  # one Adam step from the loaded FP32 values, not from their bfloat16 rounding


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_o2_peft_lora_save_pretrained_writes_fp32_adapters_close_to_accelerates_bf16(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    saved = {}
    for level in ("bf16", "O2"):
        accelerator = _accelerator(level)
        lora = get_peft_model(_gpt2(), LoraConfig(r=4, target_modules=["c_attn"], init_lora_weights=False))
        model, optimizer = accelerator.prepare(lora, torch.optim.AdamW(
            [p for p in lora.parameters() if p.requires_grad], lr=1e-2))
        _train(accelerator, model, optimizer, range(3))
        accelerator.unwrap_model(model).save_pretrained(tmp_path / level)
        saved[level] = load_file(tmp_path / level / "adapter_model.safetensors")
    masters = accelerator.get_state_dict(model)
    assert len(saved["O2"]) == 2 and {v.dtype for v in saved["O2"].values()} == {torch.float32}
    for key, value in saved["O2"].items():
        assert torch.equal(value, masters[key.replace(".weight", ".default.weight")])  # the masters exactly
        assert (value - saved["bf16"][key]).abs().max() <= 3 * 1e-2 * 1.5  # three Adam steps each way


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_generate_at_o1_o2_o3_gives_accelerates_bf16_tokens_beams_samples_and_fp32_scores() -> None:
    """Sampling from a seed with ``output_scores`` (FP32 as under ``"bf16"``) at every level; at O2 also two beams,
    and greedy after ``unwrap_model`` under ``accelerator.autocast()``: the same tokens as Accelerate's ``"bf16"`` on
    a tiny GPT-2 (its bfloat16 logits are the same at every level here: the same kernels)."""
    pytest.importorskip("transformers")

    def run(level: str, every: bool) -> dict[str, Any]:
        accelerator = _accelerator(level)
        model = accelerator.prepare(_gpt2().eval())
        ids = _ids(7)
        torch.manual_seed(3)
        with torch.no_grad():
            sampled = model.generate(ids, max_new_tokens=4, do_sample=True, output_scores=True,
                                     return_dict_in_generate=True)
        out = {"sample": sampled.sequences.tolist(), "score_dtypes": {s.dtype for s in sampled.scores}}
        if every:
            with torch.no_grad():
                out["beams"] = model.generate(ids, max_new_tokens=4, num_beams=2).tolist()
            with accelerator.autocast():  # greedy, after unwrap_model (the wrapper kept: Accelerate's default)
                out["greedy"] = accelerator.unwrap_model(model).generate(ids, max_new_tokens=4).tolist()
        return out

    reference = run("bf16", every=True)
    assert reference["score_dtypes"] == {torch.float32}
    assert run("O2", every=True) == reference
    short = {key: reference[key] for key in ("sample", "score_dtypes")}
    for level in ("O1", "O3"):
        assert run(level, every=False) == short, level


# -- the O2 EMA/teacher warnings ---------------------------------------------------------------------------------------
def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.backbone, self.head = _mlp(), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch[0]).float(), batch[1])

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


class FrozenLoaded(Net):
    """A frozen pretrained backbone loaded after set-up, and again after steps 1 and 2."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone.requires_grad_(False)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx < 3:
            torch.manual_seed(5 + batch_idx)
            self.backbone.load_state_dict(_mlp().state_dict())


class Clamped(Net):
    """WGAN's critic clamp on every parameter the optimizer holds, after each step."""

    def on_train_batch_end(self, *args: Any) -> None:
        for p in self.parameters():
            p.data.clamp_(-0.05, 0.05)


class Finetuned(Net):
    """The head alone at first; ``BackboneFinetuning`` unfreezes the backbone into the optimizer at epoch 1."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.head.parameters(), lr=0.1)


class Averaged(Net):
    """An ``AveragedModel`` of the model kept outside it, updated after each step."""

    def on_train_start(self) -> None:
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        self.__dict__["average"] = AveragedModel(self, multi_avg_fn=get_ema_multi_avg_fn(0.999))

    def on_train_batch_end(self, *args: Any) -> None:
        self.__dict__["average"].update_parameters(self)


def _callbacks(name: str) -> list[Any]:
    from lightning.pytorch.callbacks import BackboneFinetuning, EMAWeightAveraging

    return {"finetuning": [BackboneFinetuning(unfreeze_backbone_at_epoch=1)], "ema_callback": [EMAWeightAveraging()]
            }.get(name, [])


def _fit(model: pl.LightningModule, precision: str, name: str, epochs: int = 2) -> tuple[list[str], dict[str, Any]]:
    plugin = MixedPrecisionPlugin("O2", half_dtype=HALF) if precision == "O2" else None
    kwargs: dict[str, Any] = {} if plugin else {"precision": precision}
    trainer = make_trainer(plugin, max_epochs=epochs, callbacks=_callbacks(name), **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader(classification_data(n=32)))
    return [str(w.message) for w in caught if OURS in str(w.message)], model.state_dict()


@pytest.mark.parametrize(
    ("name", "cls"),
    [("frozen_loaded", FrozenLoaded), ("clamp", Clamped), ("finetuning", Finetuned), ("ema_callback", Net),
     ("averaged_outside", Averaged)],
)
def test_o2_no_ema_warning_for_ordinary_writes_and_training_as_bf16_mixed(name: str, cls: type) -> None:
    messages, weights = _fit(cls(), "O2", name)
    assert messages == []
    if name == "averaged_outside":
        return  # the model trains as Net's; the average outside it is no part of it
    _, reference = _fit(cls(), "bf16-mixed", name)
    for key, value in reference.items():
        assert torch.allclose(weights[key].float(), value.float(), atol=2e-3), (name, key)
    if name == "finetuning":
        # The backbone unfrozen into the optimizer at epoch 1 trains as under bf16-mixed, from the bfloat16 rounding
        # of its pretrained weights (frozen before set-up, it kept no FP32 value: docs/master_weights.md); that
        # rounding (4.9e-4 here) is as large as its fine-tuning moved it (4.5e-4 to 1.8e-3).
        for key, start in _mlp().state_dict().items():
            want, got = reference[f"backbone.{key}"], weights[f"backbone.{key}"].float()
            moved, rounding = (want - start).abs().max(), (start.to(HALF).float() - start).abs().max()
            assert moved > 2e-4 and (got - start.to(HALF).float()).abs().max() > 0.5 * moved, key  # it trained
            assert (got - want).abs().max() <= rounding + 0.1 * moved, key


class EmaInTheOptimizer(Net):
    """A ``copy.deepcopy`` EMA child updated by ``lerp_`` under ``no_grad``, handed to the optimizer with the rest
    (``SGD(self.parameters())``, the everyday habit): it never holds a gradient, so the step skips it."""

    def __init__(self) -> None:
        super().__init__()
        self.ema = copy.deepcopy(self.backbone)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_train_batch_end(self, *args: Any) -> None:
        with torch.no_grad():
            for e, p in zip(self.ema.parameters(), self.backbone.parameters()):
                e.lerp_(p.to(e.dtype), 0.001)


def test_o2_an_ema_child_inside_the_optimizer_is_warned_about_once() -> None:
    messages, _ = _fit(EmaInTheOptimizer(), "O2", "ema_in_optimizer", epochs=1)
    assert len(messages) == 1 and "'ema'" in messages[0], messages


# -- the Trainer's stages and teardown ---------------------------------------------------------------------------------
class Staged(pl.LightningModule):
    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.net, self.fail_at, self.end_dtype = _mlp(), fail_at, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.global_step == self.fail_at:
            raise RuntimeError("boom at step 3")
        return F.cross_entropy(self(batch[0]).float(), batch[1])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val", F.cross_entropy(self(batch[0]).float(), batch[1]))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("tst", F.cross_entropy(self(batch[0]).float(), batch[1]))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def on_train_end(self) -> None:
        self.end_dtype = self(torch.randn(2, 16)).dtype

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _stages(precision: str, root: Path) -> dict[str, Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    def trainer(**kwargs: Any) -> pl.Trainer:
        plugin = MixedPrecisionPlugin("O2", half_dtype=HALF) if precision == "O2" else None
        extra = {} if plugin else {"precision": precision}
        return make_trainer(plugin, **extra, **kwargs)

    data, seen = loader(classification_data(n=32)), {}
    model = Staged()
    saving = {"enable_checkpointing": True, "default_root_dir": root}
    first = trainer(max_epochs=1, callbacks=[ModelCheckpoint(dirpath=root, save_last=True)], **saving)
    first.fit(model, data, data)
    seen["end_dtype"] = model.end_dtype
    seen["val"] = first.validate(model, data, verbose=False)[0]["val"]
    seen["test"] = first.test(model, data, verbose=False)[0]["tst"]
    seen["predict"] = torch.cat(first.predict(model, data, return_predictions=True))
    again = trainer(max_epochs=2, callbacks=[ModelCheckpoint(dirpath=root, save_last=True)], **saving)
    again.fit(model, data, data, ckpt_path="last")
    seen["steps"], seen["weights"] = again.global_step, model.state_dict()

    failing = Staged(fail_at=3)
    with pytest.raises(RuntimeError, match="boom at step 3"):
        trainer(max_epochs=2).fit(failing, data)
    seen["hooks_left"] = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in failing.modules())
    seen["forward_left"] = "forward" in failing.__dict__
    failing.fail_at = None
    trainer(max_epochs=1).fit(failing, data)
    seen["after_failure"] = failing.state_dict()
    return seen


def test_o2_stages_fit_validate_test_predict_fit_last_and_a_failed_fit_then_a_new_one_as_bf16_mixed(
    tmp_path: Path,
) -> None:
    o2, reference = _stages("O2", tmp_path / "o2"), _stages("bf16-mixed", tmp_path / "bf16")
    assert o2["end_dtype"] == reference["end_dtype"] == torch.float32  # a forward in on_train_end
    assert o2["val"] == pytest.approx(reference["val"], abs=1e-3)
    assert o2["test"] == pytest.approx(reference["test"], abs=1e-3)
    # predict: O2 hands back FP32 outputs (Apex's O2 output cast), "bf16-mixed" its autocast's bfloat16; same values
    assert o2["predict"].dtype == torch.float32 and reference["predict"].dtype == HALF
    torch.testing.assert_close(o2["predict"], reference["predict"].float(), atol=2e-2, rtol=2e-2)
    assert o2["steps"] == reference["steps"] == 4
    assert o2["hooks_left"] == 0 and not o2["forward_left"]  # the teardown after the exception unhooked the model
    for key in ("weights", "after_failure"):
        for name, value in reference[key].items():
            assert torch.allclose(o2[key][name].float(), value.float(), atol=2e-3), (key, name)
