"""Stop 60 (review60c): a hostile review of odds60b (an optimizer's ``step()`` value handed to the user; Fabric's
``generate`` at O2) and hfckpt60 (the HF Trainer's lean O2 checkpoint), from the user's side.

Found and fixed: a user's ``Trainer._save`` writing half (or rounded) weights under the state dict's keys made the
engine's file leave the masters out, so a resume rounded them (now read back and compared, value for value); the
optimizer's returned object stayed held by the engine after the last step at the doors that do not hand it on (the
core, Accelerate, the HF Trainer): now dropped at ``Amp.update()``."""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from lightning_mpx import Amp  # noqa: E402
from lightning_mpx.accelerate import mpx_trainer  # noqa: E402
from lightning_mpx.integrations.accelerate import Accelerator  # noqa: E402
from lightning_mpx.integrations.accelerate_checkpoint import AMP_STATE_NAME  # noqa: E402
from tests.accelerate_helpers import accelerate_state_reset  # noqa: E402
from tests.test_hf_trainer_checkpoints import GPT2, KWARGS, Snapshot, _equal, _masters  # noqa: E402


# -- hfckpt60: a user's _save that writes the weights itself -------------------------------------------------------
class HalfWriter(transformers.Trainer):
    """A user's Trainer whose ``_save`` writes the model's weights in bfloat16 (half the disk), ignoring the FP32
    ``state_dict`` it is handed: the keys are the state dict's, the values are not the masters."""

    def _save(self, output_dir: str | None = None, state_dict: Any = None) -> None:
        assert output_dir is not None
        os.makedirs(output_dir, exist_ok=True)
        weights = {k: v.to(torch.bfloat16) for k, v in self.model.state_dict().items()}
        torch.save(weights, os.path.join(output_dir, "pytorch_model.bin"))
        self.model.config.save_pretrained(output_dir)


def _trainer(tmp: Path, seed: int, cls: type, **arguments: Any) -> Any:
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(GPT2)
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    defaults = dict(max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2, save_strategy="no",
                    disable_tqdm=True, optim="adamw_torch", report_to=[], use_cpu=True)  # fmt: skip
    args = transformers.TrainingArguments(output_dir=str(tmp), **{**defaults, **arguments})
    return mpx_trainer(cls)(model=model, args=args, train_dataset=data, opt_level="O2", mpx_kwargs=KWARGS)


def test_o2_checkpoint_of_a_users_half_save_keeps_the_masters_and_resumes_bit_for_bit(tmp_path):
    """Save at step 1 of 2 through the user's ``_save`` writing bfloat16 weights under the state dict's keys: those
    values are not the masters, so the engine's file keeps every master, and a fresh Trainer (another init) resumes
    from the checkpoint with the masters the run had (before: named only, then loaded from the bfloat16 file)."""
    cls = HalfWriter
    at: dict[Any, Any] = {}
    with accelerate_state_reset():
        full = _trainer(tmp_path / "full", 0, cls, save_strategy="steps", save_steps=1)
        full.add_callback(Snapshot(at, lambda: full))
        full.train()
    checkpoint = tmp_path / "full" / "checkpoint-1"
    held = torch.load(checkpoint / AMP_STATE_NAME, weights_only=True)["master_weights"][0]
    assert len(held) == len(dict(full.model.named_parameters()))  # every master (the tied head is one of them)
    with accelerate_state_reset():
        again = _trainer(tmp_path / "again", 1, cls)
        again.train(resume_from_checkpoint=str(checkpoint))
        assert _equal(at[2][0], _masters(again))


# -- odds60b: the optimizer's step() value, not held by the engine past the iteration -------------------------------
class _Stats(dict):
    pass


class _Returning(torch.optim.SGD):
    """A custom optimizer whose ``step()`` returns a (large) object of its own, weakly noted in ``refs``."""

    def __init__(self, params: Any, refs: list[Any]) -> None:
        super().__init__(params, lr=0.1)
        self.refs = refs

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        super().step(closure)
        stats = _Stats(big=torch.zeros(1 << 16))
        self.refs.append(weakref.ref(stats))
        return stats


def test_a_returned_object_is_freed_at_doors_that_do_not_hand_it_on() -> None:
    """The core's ``Amp.step`` (whether it stepped) and Accelerate's optimizer (``None``, as Accelerate's own) do not
    hand the optimizer's value on: it is freed once the iteration ends, not held by the engine until the next step
    (or, after the last, for as long as the model lives)."""
    refs: list[Any] = []
    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(nn.Linear(2, 2))
    optimizer = amp.prepare_optimizer(_Returning(model.parameters(), refs))
    for _ in range(2):
        amp.backward(amp.cast_outputs(model(amp.cast_inputs(torch.ones(1, 2)))).float().sum())
        assert amp.step(optimizer) is True
        amp.update()
        optimizer.zero_grad()
    with accelerate_state_reset():
        accelerator = Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=[KWARGS])
        linear = nn.Linear(2, 2)
        wrapped, prepared = accelerator.prepare(linear, _Returning(linear.parameters(), refs))
        for _ in range(2):
            accelerator.backward(wrapped(torch.ones(1, 2)).float().sum())
            assert prepared.step() is None
            prepared.zero_grad()
    gc.collect()
    assert len(refs) == 4 and all(ref() is None for ref in refs)
