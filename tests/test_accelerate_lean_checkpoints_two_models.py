"""A hostile user against stop 60's young parts, combined with habits, against the framework's own precision on the same
code: lean O2 checkpoints (the engine file names the FP32 masters the model file holds) of the Accelerate adapter
(two models and two optimizers in one accelerator, under DDP too: one 2-rank launch,
tests/accelerate_lean_checkpoints_two_models_script.py; a save before the first step; two saves into the same folder; a
bf16 copy of the model file), of the Apex layer (``torch.save`` then ``torch.load(weights_only=True)``; step 5's model
entry beside step 10's amp entry); ``save_pretrained`` at O2 (sharded, no dtype in the config, after ``model.float()``);
an EMA kept by the optimizer in its state and an ``AveragedModel`` child updated in ``on_before_zero_grad`` under
accumulation."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_mpx import MixedPrecisionPlugin
from tests.launch import rank_results, run_script
from tests.lightning_helpers import classification_data, loader, make_trainer

HALF = torch.bfloat16
ENGINE_FILE = "lightning_mpx_amp.bin"


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def _accelerator(level: str = "O2") -> Any:
    from accelerate import Accelerator as NativeAccelerator

    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    if level == "bf16":
        return NativeAccelerator(mixed_precision="bf16", cpu=True)
    return Accelerator(mixed_precision=level, cpu=True, kwargs_handlers=[MixedPrecisionKwargs(half_dtype=HALF)])


def _weights(acc: Any, *models: Any) -> list[torch.Tensor]:
    return [v.detach().float().clone() for m in models for v in acc.get_state_dict(m).values()]


def _gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    assert len(a) == len(b)
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# -- the Accelerate adapter's save_state ------------------------------------------------------------------------------
def _two(level: str, seed: int) -> tuple[Any, ...]:
    acc = _accelerator(level)
    a, b = _net(seed), _net(seed + 5)
    opt_a, opt_b = torch.optim.AdamW(a.parameters(), lr=1e-2), torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    return (acc, *acc.prepare(a, opt_a, b, opt_b))


def _train_two(acc: Any, a: Any, opt_a: Any, b: Any, opt_b: Any, steps: range) -> None:
    for step in steps:
        x, y = _batch(step)
        acc.backward(F.cross_entropy(a(x).float(), y) + F.cross_entropy(b(2 * x).float(), y))
        for opt in (opt_a, opt_b):
            opt.step()
            opt.zero_grad()


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_two_models_and_two_optimizers_save_state_names_both_models_masters_and_resumes_bit_for_bit(
    tmp_path: Path,
) -> None:
    """Two models, an AdamW and a momentum SGD prepared in one accelerator: the engine file names the masters of each
    model (the second one's as the engine names them, ``model1.0.weight``; its file ``model_1.safetensors`` holds
    ``0.weight``) and holds none of them; a fresh accelerator with other weights resumes to the uninterrupted run's
    weights bit for bit. Before, the second model's names were looked up in the model files as they are, not found,
    and the engine file fell back to holding every master of both models (each written twice)."""
    pytest.importorskip("accelerate")
    acc, *run = _two("O2", 0)
    _train_two(acc, *run, range(3))
    acc.save_state(str(tmp_path))
    engine = torch.load(tmp_path / ENGINE_FILE, weights_only=True)
    assert [len(names) for names in engine["masters_in_state_dict"]] == [4, 4]
    assert engine["masters_in_state_dict"][1][0].startswith("model1.")
    assert [dict(m) for m in engine["master_weights"]] == [{}, {}]
    _train_two(acc, *run, range(3, 6))
    straight = _weights(acc, run[0], run[2])
    fresh, *again = _two("O2", 3)
    fresh.load_state(str(tmp_path))
    _train_two(fresh, *again, range(3, 6))
    assert _gap(_weights(fresh, again[0], again[2]), straight) == 0.0


def test_two_models_under_ddp_with_rank_one_overflowing_before_save_state_resume_on_two_ranks(
    tmp_path: Path,
) -> None:
    """The same on 2 ranks (DDP-wrapped models, whose state dicts say ``module.0.weight``), float16 with a dynamic
    scale, rank 1 alone overflowing in the second model at the step before ``save_state``: the skipped step is
    saved, the engine file names the 8 masters and holds none, and both ranks resume bit for bit."""
    pytest.importorskip("accelerate")
    run_script("accelerate_lean_checkpoints_two_models_script.py", tmp_path, timeout=150)
    for rank, result in enumerate(rank_results(tmp_path)):
        case = result["two_models"]
        assert "error" not in case, case.get("error")
        assert case["saved_skipped"] == case["loaded_skipped"] == [1]
        assert case["resumed"] == case["straight"], rank
        if rank == 0:
            assert [len(n) for n in case["named"]] == [4, 4] and case["held"] == [[], []]


def _one(level: str = "O2", seed: int = 0) -> tuple[Any, Any, Any]:
    acc = _accelerator(level)
    model = _net(seed)
    return (acc, *acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2)))


def _train_one(acc: Any, model: Any, opt: Any, steps: range) -> None:
    for step in steps:
        x, y = _batch(step)
        acc.backward(F.cross_entropy(model(x).float(), y))
        opt.step()
        opt.zero_grad()


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_save_state_before_the_first_step_and_twice_into_one_folder_resume_bit_for_bit(tmp_path: Path) -> None:
    """Held: a ``save_state`` before any optimizer step (its lean file names the 4 masters) resumes into a model
    built with other weights as the uninterrupted run; so does a folder saved at step 3 and overwritten at step 6
    (no stale engine file against a newer model file). A ``model.safetensors`` replaced by its bf16 copy resumes as
    Accelerate's own ``"bf16"`` resumes from the same copy (both round the weights alike)."""
    pytest.importorskip("accelerate")
    from safetensors.torch import load_file, save_file

    acc, *run = _one()
    _train_one(acc, *run, range(8))
    straight = _weights(acc, run[0])
    acc, *run = _one()
    acc.save_state(str(tmp_path / "first"))
    assert [len(n) for n in torch.load(tmp_path / "first" / ENGINE_FILE)["masters_in_state_dict"]] == [4]
    fresh, *again = _one(seed=1)
    fresh.load_state(str(tmp_path / "first"))
    _train_one(fresh, *again, range(8))
    assert _gap(_weights(fresh, again[0]), straight) == 0.0
    _train_one(acc, *run, range(3))
    acc.save_state(str(tmp_path / "same"))
    _train_one(acc, *run, range(3, 6))
    acc.save_state(str(tmp_path / "same"))
    fresh, *again = _one(seed=1)
    fresh.load_state(str(tmp_path / "same"))
    _train_one(fresh, *again, range(6, 8))
    assert _gap(_weights(fresh, again[0]), straight) == 0.0

    ends = []
    for level in ("O2", "bf16"):
        acc, *run = _one(level)
        _train_one(acc, *run, range(4))
        folder = tmp_path / f"copy_{level}"
        acc.save_state(str(folder))
        weights = load_file(folder / "model.safetensors")
        save_file({k: v.to(HALF) for k, v in weights.items()}, folder / "model.safetensors")
        fresh, *again = _one(level, seed=1)
        fresh.load_state(str(folder))
        _train_one(fresh, *again, range(4, 8))
        ends.append(_weights(fresh, again[0]))
    assert _gap(*ends) <= 1e-6


# -- the Apex layer ---------------------------------------------------------------------------------------------------
def test_apex_checkpoint_loads_with_weights_only_and_a_model_entry_of_another_step_is_named(tmp_path: Path) -> None:
    """Held: ``torch.save({'model', 'optimizer', 'amp': amp.state_dict()})`` loads with ``weights_only=True`` (torch's
    default) and resumes bit for bit; step 5's model entry beside step 10's amp entry is refused at the next
    ``scale_loss`` in either load order, naming the 4 masters, never a silent mix."""
    from lightning_mpx.apex import _amp_state, amp

    def initialize(seed: int) -> tuple[Any, Any]:
        _amp_state.reset()
        model = _net(seed)
        return amp.initialize(  # type: ignore[no-any-return]
            model, torch.optim.AdamW(model.parameters(), lr=1e-2), opt_level="O2", cast_model_type=HALF, verbosity=0
        )

    def train(model: Any, optimizer: Any, steps: range) -> None:
        for step in steps:
            with amp.scale_loss(model(_batch(step)[0]).float().pow(2).mean(), optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            optimizer.zero_grad()

    model, optimizer = initialize(0)
    for end in (5, 10):
        train(model, optimizer, range(end - 5, end))
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()},
                   tmp_path / f"{end}.pt")
    train(model, optimizer, range(10, 12))
    straight = [p.detach().clone() for p in amp.master_params(optimizer)]

    def load(end: int) -> dict[str, Any]:
        return torch.load(tmp_path / f"{end}.pt", weights_only=True)  # type: ignore[no-any-return]

    model, optimizer = initialize(1)
    ckpt = load(10)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    amp.load_state_dict(ckpt["amp"])
    train(model, optimizer, range(10, 12))
    assert _gap([p.detach() for p in amp.master_params(optimizer)], straight) == 0.0
    for model_first in (True, False):
        model, optimizer = initialize(1)
        if model_first:
            model.load_state_dict(load(5)["model"])
        optimizer.load_state_dict(load(10)["optimizer"])
        amp.load_state_dict(load(10)["amp"])
        if not model_first:
            model.load_state_dict(load(5)["model"])
        with pytest.raises(RuntimeError, match=r"4 parameter\(s\)"):
            train(model, optimizer, range(10, 11))
    _amp_state.reset()


# -- save_pretrained at O2 ---------------------------------------------------------------------------------------------
def test_fabric_o2_save_pretrained_sharded_without_config_dtype_and_after_float_reload_the_masters(
    tmp_path: Path,
) -> None:
    """Held: at O2 (Fabric) ``save_pretrained`` with ``max_shard_size="2KB"`` (an index and six shards), of a model
    whose config has no dtype, and again after the user's ``model.float()`` all write config.json float32 and the
    FP32 masters exactly (``from_pretrained`` without a dtype gets them)."""
    transformers = pytest.importorskip("transformers")
    from lightning.fabric import Fabric

    from lightning_mpx.fabric import FabricMixedPrecisionPlugin

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[FabricMixedPrecisionPlugin("O2", half_dtype=HALF)])
    wrapped, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        fabric.backward(wrapped(input_ids=ids, labels=ids).loss)
        opt.step()
        opt.zero_grad()
    amp = fabric.strategy.precision.amp
    masters = {name: amp.master_of(p).clone() for name, p in model.named_parameters()}

    def check(folder: Path) -> None:
        assert json.loads((folder / "config.json").read_text()).get("dtype") == "float32"
        reloaded = dict(transformers.AutoModelForCausalLM.from_pretrained(str(folder)).named_parameters())
        for name, master in masters.items():
            assert reloaded[name].dtype == torch.float32 and torch.equal(reloaded[name], master), name

    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="2KB")
    assert len([n for n in os.listdir(tmp_path / "sharded") if n.endswith(".safetensors")]) > 1
    check(tmp_path / "sharded")
    model.config.dtype = None
    model.save_pretrained(str(tmp_path / "no_dtype"))
    check(tmp_path / "no_dtype")
    model.float()
    model.save_pretrained(str(tmp_path / "float"))
    check(tmp_path / "float")


# -- EMAs --------------------------------------------------------------------------------------------------------------
class _EmaAdamW(torch.optim.AdamW):
    """An optimizer subclass keeping an EMA of each parameter in its state, updated in ``step()``."""

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = super().step(closure)
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state[p]
                    if "ema" not in state:
                        state["ema"] = p.detach().clone()
                    else:
                        state["ema"].lerp_(p, 0.01)
        return loss


class _Emas(pl.LightningModule):
    def __init__(self, averaged: bool) -> None:
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.averaged = averaged
        if averaged:
            self.ema = AveragedModel(self.net, multi_avg_fn=get_ema_multi_avg_fn(0.999), use_buffers=True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.net(batch[0]).float(), batch[1])

    def configure_optimizers(self) -> Any:
        return (torch.optim.AdamW if self.averaged else _EmaAdamW)(self.net.parameters(), lr=1e-2)

    def on_before_zero_grad(self, optimizer: Any) -> None:
        if self.averaged:
            self.ema.update_parameters(self.net)


def _ema_fit(precision: str, averaged: bool) -> tuple[list[str], list[torch.Tensor]]:
    plugin = MixedPrecisionPlugin("O2", half_dtype=HALF) if precision == "O2" else None
    settings: dict[str, Any] = {} if plugin else {"precision": precision}
    trainer = make_trainer(plugin, max_epochs=2, accumulate_grad_batches=2, **settings)
    module = _Emas(averaged)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader(classification_data(n=64)))
    messages = [str(w.message) for w in caught if str(w.message).startswith("lightning_mpx")]
    if averaged:
        return messages, [p.detach().float() for p in module.ema.module.parameters()]
    state = trainer.optimizers[0].state_dict()["state"]
    return messages, [state[i]["ema"] for i in sorted(state)]


def test_an_ema_in_the_optimizers_state_is_fp32_and_an_averaged_model_child_is_warned_about() -> None:
    """Held, under ``accumulate_grad_batches=2``: an EMA the optimizer keeps in its state (updated in ``step()``) is
    FP32 on the masters, as ``"bf16-mixed"``'s (5e-6 apart), with no warning; an ``AveragedModel`` child with
    ``get_ema_multi_avg_fn`` updated in ``on_before_zero_grad`` is half at O2 (1.5e-4 from ``"bf16-mixed"``'s, as
    far as it moved) and warned about once, naming ``'ema.module'``."""
    messages, ours = _ema_fit("O2", averaged=False)
    _, mixed = _ema_fit("bf16-mixed", averaged=False)
    assert messages == [] and all(t.dtype == torch.float32 for t in ours)
    assert _gap(ours, mixed) <= 5e-5
    messages, _ = _ema_fit("O2", averaged=True)
    assert len([m for m in messages if "'ema.module'" in m and "no optimizer holds" in m]) == 1, messages
