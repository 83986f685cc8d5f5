"""A hostile user against stop 60's lean O2 checkpoints (the engine's file names the FP32 masters the model file
holds) where users scale and switch, each against the framework's own precision on the same code: the Accelerate
adapter under DDP (one 2-rank launch, tests/accelerate_lean_checkpoints_script.py: an overflow on rank 1 at the step
before ``save_state``, ``load_state`` on 2 ranks, ``save_on_each_node``, ``register_for_checkpointing``; then the same
folder loaded by ONE process) and FSDP2 (a sharded engine: its file names nothing); O2 checkpoints loaded by
Accelerate's ``"bf16"``, O1 and O3; an O2 ``transformers.Trainer`` checkpoint resumed by ``bf16=True`` and O1; an Apex
O2 checkpoint loaded by the core ``Amp``; ``save_model`` into the ``save_state`` folder, ``safe_serialization=False``
with tied weights, a model prepared twice."""

from __future__ import annotations

import copy
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.launch import rank_results, run_script

HALF = torch.bfloat16
pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _accelerator(level: str, **kwargs: Any) -> Any:
    from accelerate import Accelerator as NativeAccelerator

    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    if level == "bf16":
        return NativeAccelerator(mixed_precision="bf16", cpu=True)
    kwargs.setdefault("half_dtype", HALF)
    return Accelerator(mixed_precision=level, cpu=True, kwargs_handlers=[MixedPrecisionKwargs(**kwargs)])


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def _train(acc: Any, model: Any, optimizer: Any, steps: range) -> None:
    for step in steps:
        x, y = _batch(step)
        acc.backward(F.cross_entropy(model(x).float(), y))
        optimizer.step()
        optimizer.zero_grad()


def _fp32(acc: Any, model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in acc.get_state_dict(model).items()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


# -- DDP and FSDP2: one launch -----------------------------------------------------------------------------------------
def test_o2_save_state_under_ddp_resumes_on_two_ranks_and_on_one_process_and_fsdp2_keeps_its_masters(
    tmp_path: Path,
) -> None:
    """2 ranks, O2 float16: rank 1's inf at the step before ``save_state`` is a skipped step on both ranks, saved
    (scale 256 -> 128, ``skipped_steps == [1]``); the engine file names the 4 masters and holds none; a fresh
    accelerator on 2 ranks (``save_on_each_node=True``) loads the saved masters, scale, skip and registered object
    exactly and continues bit for bit as the uninterrupted run; its own save writes the same files. The same folder
    loaded by ONE process continues on the whole batch to the 2-rank run's weights (summation order: 1e-3, the steps
    move them by 1e-2). FSDP2 (sharded engine, FP32 shards): the engine file names nothing, and resumes exactly."""
    pytest.importorskip("accelerate")
    run_script("accelerate_lean_checkpoints_script.py", tmp_path, timeout=150)  # ~15 s alone on 2 cores
    ranks = rank_results(tmp_path)
    for rank in ranks:
        for case in ("ddp", "fsdp2"):
            assert "error" not in rank[case], rank[case].get("error")
        ddp = rank["ddp"]
        assert (ddp["saved_scale"], ddp["saved_skipped"]) == (128.0, [1])
        assert (ddp["loaded_scale"], ddp["loaded_skipped"], ddp["counter"]) == (128.0, [1], 2)
        assert ddp["loaded"] == ddp["saved"] and ddp["resumed"] == ddp["straight"] == ranks[0]["ddp"]["straight"]
        assert rank["fsdp2"]["resumed"] == rank["fsdp2"]["straight"]
    ddp = ranks[0]["ddp"]
    assert ddp["named"] == [["0.weight", "0.bias", "2.weight", "2.bias"]] and ddp["held"] == [[]]
    assert ddp["again_files"] == ddp["files"] and "custom_checkpoint_0.pkl" in ddp["files"]
    assert ranks[0]["fsdp2"]["named"] is None

    # ONE process (another world size): the whole batch of steps 2-3 (both ranks' halves)
    from tests.accelerate_lean_checkpoints_script import SAVE_AFTER, STEPS, Counter, batch

    acc = _accelerator("O2", half_dtype="float16", loss_scale="dynamic", init_scale=2.0**8)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    module = _net(7)
    model, optimizer = acc.prepare(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    acc.load_state(str(tmp_path / "ddp_ckpt"))
    loaded = [acc.amp.master_of(p).flatten().tolist() for p in module.parameters()]
    assert loaded == ddp["saved"]
    assert (acc.amp.scalers[0].get_scale(), acc.amp.skipped_steps, counter.n) == (128.0, [1], 2)
    for step in range(SAVE_AFTER, STEPS):
        x, y = batch(step, None)
        acc.backward(F.cross_entropy(model(x).float(), y))
        optimizer.step()
        optimizer.zero_grad()
    for got, want in zip(module.parameters(), ddp["straight"]):
        torch.testing.assert_close(acc.amp.master_of(p := got).flatten(), torch.tensor(want), rtol=0, atol=1e-3)
        assert p.dtype == torch.float16


# -- precision switches ------------------------------------------------------------------------------------------------
def test_o2_save_state_loads_into_bf16_o1_o3_and_a_bf16_continuation_matches_o2s(tmp_path: Path) -> None:
    """An O2 (lean) ``save_state`` folder loaded by Accelerate's own ``"bf16"``, O1 and O3 after one diverging step:
    the FP32 weights are the O2 masters exactly (O3: their bfloat16 rounding), and two more steps track O2's own
    continuation (``"bf16"``/O1 within 1e-3, O3 within 1e-2)."""
    acc = _accelerator("O2")
    module = _net()
    model, optimizer = acc.prepare(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    _train(acc, model, optimizer, range(3))
    acc.save_state(str(tmp_path))
    saved = _fp32(acc, model)
    _train(acc, model, optimizer, range(3, 5))
    continued = _fp32(acc, model)
    for level, load_tol, tol in (("bf16", 0.0, 1e-3), ("O1", 0.0, 1e-3), ("O3", 4e-3, 1e-2)):
        other = _accelerator(level)
        module = _net(1)
        model, optimizer = other.prepare(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
        _train(other, model, optimizer, range(1))
        other.load_state(str(tmp_path))
        assert _max_diff(_fp32(other, model), saved) <= load_tol, level
        _train(other, model, optimizer, range(3, 5))
        assert _max_diff(_fp32(other, model), continued) <= tol, level


def test_o2_hf_trainer_checkpoint_resumes_under_bf16_true_and_o1(tmp_path: Path) -> None:
    """``transformers.Trainer`` at O2 saves ``checkpoint-2`` (lean: its engine file names the masters); resumed by
    transformers' own ``bf16=True`` and by O1 to step 4, the weights track the O2 run's own step 4 (measured 8e-4,
    bound 1.5e-3; AdamW at 1e-3 moves them ~1e-3 a step)."""
    transformers = pytest.importorskip("transformers")
    from tests.accelerate_helpers import accelerate_state_reset
    from tests.test_hf_trainer import SCALED, trainer

    transformers.logging.set_verbosity_error()
    with accelerate_state_reset():
        full, _ = trainer(tmp_path / "o2", "O2", max_steps=4, save_strategy="steps", save_steps=2,
                          mpx_kwargs=SCALED)  # fmt: skip
        full.train()
        want = {k: v.float().clone() for k, v in full.accelerator.amp.fp32_state_dict(full.model).items()}
    engine = torch.load(tmp_path / "o2" / "checkpoint-2" / "lightning_mpx_amp.bin", weights_only=True)
    assert engine["masters_in_state_dict"] and not any(engine["master_weights"])
    for level in (None, "O1"):
        with accelerate_state_reset():
            extra = {"bf16": True} if level is None else {}
            resumed, _ = trainer(tmp_path / str(level), level, max_steps=4, **extra)
            resumed.train(resume_from_checkpoint=str(tmp_path / "o2" / "checkpoint-2"))
            got = {k: v.float() for k, v in resumed.model.state_dict().items()}
        assert max((got[k] - want[k]).abs().max().item() for k in want) < 1.5e-3, level


# -- the Apex layer's lean entry through the core ----------------------------------------------------------------------
def _apex_checkpoint() -> tuple[dict[str, Any], list[torch.Tensor]]:
    from lightning_mpx.apex import _amp_state, amp

    _amp_state.reset()
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", cast_model_type=HALF, verbosity=0)
    for step in range(3):
        x, _ = _batch(step)
        with amp.scale_loss(model(x).float().pow(2).mean(), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()
    ckpt = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()})
    masters = [m.detach().clone() for m in amp.master_params(optimizer)]
    _amp_state.reset()
    return ckpt, masters


def _core_load(ckpt: dict[str, Any], with_model: bool) -> tuple[Any, nn.Module, Any]:
    from lightning_mpx import Amp

    core = Amp("O2", half_dtype=HALF)
    model = core.prepare_model(_net(1))
    optimizer = core.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    if with_model:
        model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    core.load_state_dict(ckpt["amp"]["lightning_mpx"])
    return core, model, optimizer


def _core_step(core: Any, model: nn.Module, optimizer: Any) -> None:
    x, _ = _batch(9)
    with core.forward_context():
        out = model(core.cast_inputs(x))
    core.backward(out.float().pow(2).mean())
    core.step(optimizer)
    core.update()


def test_apex_o2_lean_checkpoint_loads_into_the_core_amp_with_its_model_entry() -> None:
    """The Apex layer's O2 ``amp.state_dict()`` (masters named, not held) with its model entry, through the core
    ``Amp.load_state_dict(ckpt['amp']['lightning_mpx'])``: the masters are the Apex run's exactly."""
    ckpt, masters = _apex_checkpoint()
    assert not any(ckpt["amp"]["lightning_mpx"]["master_weights"])
    core, model, optimizer = _core_load(ckpt, with_model=True)
    for p, want in zip(model.parameters(), masters):
        assert torch.equal(core.master_of(p), want)
    _core_step(core, model, optimizer)


def test_apex_o2_lean_checkpoint_into_the_core_amp_without_its_model_entry_is_refused() -> None:
    """The same entry loaded into the core ``Amp`` WITHOUT ``model.load_state_dict(ckpt['model'])``: the masters
    are this run's own initial weights (0.47 off the saved ones measured), silently; a step must refuse."""
    ckpt, masters = _apex_checkpoint()
    core, model, optimizer = _core_load(ckpt, with_model=False)
    assert any(not torch.equal(core.master_of(p), want) for p, want in zip(model.parameters(), masters))
    with pytest.raises(RuntimeError, match="model"):
        _core_step(core, model, optimizer)


# -- folders and models ------------------------------------------------------------------------------------------------
class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def _train_tied(acc: Any, model: Any, optimizer: Any, steps: range) -> None:
    for step in steps:
        ids = torch.randint(0, 16, (4, 5), generator=torch.Generator().manual_seed(step))
        acc.backward(F.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten()))
        optimizer.step()
        optimizer.zero_grad()


def test_save_model_into_the_save_state_folder_pickled_tied_weights_and_a_model_prepared_twice(tmp_path: Path) -> None:
    """``save_state(safe_serialization=False)`` of a tied model prepared twice (``prepare(model)`` then
    ``prepare(optimizer)``), then ``save_model`` into the same folder: ``load_state`` into a fresh accelerator gives
    the masters exactly, tied, and its continuation is the uninterrupted run's bit for bit."""
    acc = _accelerator("O2")
    module = _Tied()
    model = acc.prepare(module)
    model2, optimizer = acc.prepare(model, torch.optim.AdamW(module.parameters(), lr=1e-2))
    _train_tied(acc, model2, optimizer, range(2))
    acc.save_state(str(tmp_path), safe_serialization=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc.save_model(model2, str(tmp_path), safe_serialization=False)
    assert {"pytorch_model.bin", "lightning_mpx_amp.bin"} <= set(os.listdir(tmp_path))
    saved = _fp32(acc, model2)
    _train_tied(acc, model2, optimizer, range(2, 4))
    want = _fp32(acc, model2)

    fresh = _accelerator("O2")
    module = _Tied()
    torch.nn.init.zeros_(module.mid.weight)
    model, optimizer = fresh.prepare(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    fresh.load_state(str(tmp_path))
    assert _max_diff(_fp32(fresh, model), saved) == 0.0
    assert fresh.amp.master_of(module.head.weight) is fresh.amp.master_of(module.emb.weight)
    _train_tied(fresh, model, optimizer, range(2, 4))
    assert _max_diff(_fp32(fresh, model), want) == 0.0
