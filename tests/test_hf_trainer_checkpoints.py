"""The ``transformers.Trainer`` door's ``checkpoint-N`` at O2 (stop 60): each FP32 master written once.

Measured (``python benchmarks/checkpoint_size.py --doors hf_trainer``: a 466,432-parameter GPT-2 from a config, AdamW,
two steps, bfloat16, CPU; the ``checkpoint-2`` folder's bytes against transformers' own ``bf16=True``): bf16 5.65 MB,
O1 5.65 MB, O2 5.65 MB (7.52 MB before: ``lightning_mpx_amp.bin`` held the masters that ``model.safetensors`` holds),
O3 2.85 MB. The engine's file now names those masters; transformers loads the model file before ``_load_scaler``, and
it gives them exactly. Every resume is into a fresh Trainer and model (another init) and goes on bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_mpx.accelerate import MixedPrecisionKwargs, mpx_trainer  # noqa: E402
from lightning_mpx.engine.checkpoint import MASTERS_IN_STATE_DICT  # noqa: E402
from lightning_mpx.integrations.accelerate import Accelerator  # noqa: E402
from lightning_mpx.integrations.accelerate_checkpoint import AMP_STATE_NAME, write_amp_state  # noqa: E402
from tests.accelerate_helpers import accelerate_state_reset  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

transformers.logging.set_verbosity_error()
GPT2 = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
KWARGS = MixedPrecisionKwargs(half_dtype=torch.bfloat16, loss_scale="dynamic", init_scale=2.0**10)


def _trainer(tmp: Path, seed: int, level: str | None = "O2", cls: Any = None, **arguments: Any) -> Any:
    torch.manual_seed(seed)
    model = (cls or transformers.GPT2LMHeadModel)(GPT2)
    ids = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    defaults = dict(max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2, save_strategy="no",
                    disable_tqdm=True, optim="adamw_torch", report_to=[], use_cpu=True)  # fmt: skip
    args = transformers.TrainingArguments(output_dir=str(tmp), **{**defaults, **arguments})
    if level is None:
        return transformers.Trainer(model=model, args=args, train_dataset=data)
    return mpx_trainer()(model=model, args=args, train_dataset=data, eval_dataset=data[:4], opt_level=level,
                         mpx_kwargs=KWARGS)  # fmt: skip


def _masters(trainer: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.accelerator.amp.fp32_state_dict(trainer.model).items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() <= b.keys() and all(torch.equal(a[k], b[k].to(a[k].dtype)) for k in a)


class Snapshot(transformers.TrainerCallback):
    """Into ``at``: by global step, the masters and the engine's state of an opt-level Trainer after each step; under
    ``"begin"``, a plain Trainer's weights as training begins (after the resumed checkpoint's load)."""

    def __init__(self, at: dict[Any, Any], trainer: Any) -> None:
        self.at, self.trainer = at, trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer()
        if isinstance(trainer.accelerator, Accelerator):
            self.at[state.global_step] = (_masters(trainer), trainer.accelerator.amp.state_dict())

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.at["begin"] = {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_o2_checkpoint_writes_each_master_once_and_resumes_bit_for_bit(tmp_path):
    """Save at step 2 of 4 with ``save_total_limit=1`` and ``load_best_model_at_end`` (the best: step 2): the engine's
    file names the masters the model file holds; a fresh Trainer resumes from it (and from the same checkpoint with
    the masters inside the engine's file, as written before) bit for bit as the run went on; the best model's load
    at the end brings its masters back; transformers' own ``bf16=True`` Trainer resumes from it with those FP32
    weights; ``save_model()`` writes FP32 weights under a config.json naming float32, as ``bf16=True`` does."""
    at: dict[Any, Any] = {}
    with accelerate_state_reset():
        full = _trainer(tmp_path / "full", 0, save_strategy="steps", save_steps=2, eval_strategy="steps",
                        eval_steps=2, save_total_limit=1, load_best_model_at_end=True, metric_for_best_model="loss",
                        greater_is_better=False)  # fmt: skip
        full.add_callback(Snapshot(at, lambda: full))
        full.train()
        assert full.state.best_model_checkpoint.endswith("checkpoint-2")
        assert _equal(at[2][0], _masters(full))  # the best model's weights reached the masters the optimizer steps
        full.save_model(str(tmp_path / "final"))
    checkpoint = tmp_path / "full" / "checkpoint-2"
    files = {p.name: p.stat().st_size for p in checkpoint.iterdir()}
    engine = torch.load(checkpoint / AMP_STATE_NAME, weights_only=True)
    assert engine.get(MASTERS_IN_STATE_DICT) and not any(engine["master_weights"])  # named, not held
    assert files[AMP_STATE_NAME] < files["model.safetensors"] / 20

    def resumed(seed: int) -> None:
        with accelerate_state_reset():
            again = _trainer(tmp_path / f"resumed{seed}", seed)
            again.train(resume_from_checkpoint=str(checkpoint))
            assert _equal(at[4][0], _masters(again))
            assert again.accelerator.amp.state_dict()["scalers"] == at[4][1]["scalers"]

    resumed(1)
    write_amp_state(at[2][1], str(checkpoint))  # as written before this release: every master in the engine's file
    assert torch.load(checkpoint / AMP_STATE_NAME, weights_only=True)["master_weights"][0]
    resumed(2)

    with accelerate_state_reset():  # the precision switch: transformers' own bf16=True loads the FP32 model file
        native = _trainer(tmp_path / "bf16", 3, level=None, bf16=True, max_steps=3)
        native.add_callback(Snapshot(at, lambda: native))
        native.train(resume_from_checkpoint=str(checkpoint))
        assert _equal(at[2][0], at["begin"])
        native.save_model(str(tmp_path / "native"))
    ours = json.loads((tmp_path / "final" / "config.json").read_text())["dtype"]
    assert ours == json.loads((tmp_path / "native" / "config.json").read_text())["dtype"] == "float32"
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "final")).state_dict()
    assert all(v.dtype == torch.float32 for v in loaded.values())
    assert _equal(at[2][0], loaded)  # the final (best) FP32 masters exactly


class Unsaved(transformers.GPT2LMHeadModel):
    """``save_pretrained`` leaves the position embedding out of the model file."""

    _keys_to_ignore_on_save = ["transformer.wpe.weight"]


def test_o2_master_the_model_file_lacks_stays_in_the_engines_file(tmp_path):
    """A weight ``save_pretrained`` does not write (``_keys_to_ignore_on_save``): the engine's file keeps its master,
    so a fresh Trainer (another init) resumes bit for bit, not from its own initial value."""
    at: dict[Any, Any] = {}
    with accelerate_state_reset():
        full = _trainer(tmp_path / "full", 0, cls=Unsaved, max_steps=2, save_strategy="steps", save_steps=1)
        full.add_callback(Snapshot(at, lambda: full))
        full.train()
    checkpoint = tmp_path / "full" / "checkpoint-1"
    engine = torch.load(checkpoint / AMP_STATE_NAME, weights_only=True)
    assert "transformer.wpe.weight" in engine["master_weights"][0]
    with accelerate_state_reset():
        again = _trainer(tmp_path / "resumed", 1, cls=Unsaved, max_steps=2)
        again.train(resume_from_checkpoint=str(checkpoint))
        assert _equal(at[2][0], _masters(again))
