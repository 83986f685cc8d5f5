"""Checkpoint bytes of the Apex layer at O2 (stop 60): each FP32 master written once.

Apex's documented checkpoint is ``{"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp":
amp.state_dict()}``. At O2 ``model.state_dict()`` gives the FP32 masters themselves, and ``amp.state_dict()`` held
them again under ``"lightning_mpx"`` (``benchmarks/checkpoint_size.py``, 0.5M-parameter MLP, AdamW, bfloat16: 8.42 MB
against 6.31 MB for autocast's FP32 model); it now names them instead (6.31 MB). Every resume is into new objects (a
new ``initialize``, as a new process) and goes on bit for bit as the uninterrupted run, in Apex's order and any other;
an ``amp`` entry loaded without its model entry, or with another model's, is refused at the next ``scale_loss`` block
(never training from other masters); an entry written before (masters inside) still loads.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from lightning_mpx.apex import _amp_state, amp


@pytest.fixture(autouse=True)
def _reset_amp_state():
    _amp_state.reset()
    yield
    _amp_state.reset()


def _run(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A fresh ``initialize`` (as a new process), AdamW, bfloat16 O2."""
    _amp_state.reset()
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return amp.initialize(model, optimizer, opt_level="O2", cast_model_type=torch.bfloat16, verbosity=0)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    for i in range(steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed + i))
        with amp.scale_loss(model(x).float().pow(2).mean(), optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        optimizer.zero_grad()


def _bytes(obj: object) -> int:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return len(buffer.getvalue())


def _saved_and_continued() -> tuple[dict, list[torch.Tensor]]:
    model, optimizer = _run()
    _train(model, optimizer, 3, 10)
    ckpt = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()})
    _train(model, optimizer, 3, 20)
    return ckpt, [m.detach().clone() for m in amp.master_params(optimizer)]


def test_apex_o2_checkpoint_holds_each_master_once_and_resumes_bit_for_bit_in_any_load_order() -> None:
    ckpt, expected = _saved_and_continued()
    params = sum(v.numel() for v in ckpt["model"].values())
    assert {v.dtype for v in ckpt["model"].values()} == {torch.float32}  # Apex's contract: the model entry is FP32
    # The amp entry holds scales and counters, not a second copy of the masters (4 bytes a parameter).
    assert _bytes(ckpt["amp"]) < params
    assert _bytes(ckpt) < _bytes({"model": ckpt["model"], "optimizer": ckpt["optimizer"]}) + params
    orders = ["moa", "oam", "amo", "aom", "mao"]  # Apex's documented order first
    for order in orders:
        model, optimizer = _run(seed=1)  # other initial weights: only the checkpoint gives the saved ones
        saved = copy.deepcopy(ckpt)  # the optimizer takes the checkpoint's tensors without copying them
        calls = {
            "m": lambda: model.load_state_dict(saved["model"]),
            "o": lambda: optimizer.load_state_dict(saved["optimizer"]),
            "a": lambda: amp.load_state_dict(saved["amp"]),
        }
        for call in order:
            calls[call]()
        _train(model, optimizer, 3, 20)
        got = list(amp.master_params(optimizer))
        assert all(torch.equal(a, b) for a, b in zip(expected, got)), order


def test_apex_amp_entry_without_its_model_entry_or_with_another_models_is_refused_at_the_next_block() -> None:
    ckpt, _ = _saved_and_continued()
    model, optimizer = _run(seed=1)
    other = copy.deepcopy(model.state_dict())  # a model entry of another run
    optimizer.load_state_dict(copy.deepcopy(ckpt["optimizer"]))
    amp.load_state_dict(copy.deepcopy(ckpt["amp"]))
    before = [p.detach().clone() for p in amp.master_params(optimizer)]
    for _ in range(2):  # every later block too: never a silent resume from this run's masters
        with pytest.raises(RuntimeError, match=r"model\.load_state_dict\(ckpt\['model'\]\).*amp\.load_state_dict"):
            _train(model, optimizer, 1, 20)
    assert all(torch.equal(a, b) for a, b in zip(before, amp.master_params(optimizer)))  # nothing stepped

    for order in ("ma", "am"):  # another model's entry, before or after the amp entry
        model, optimizer = _run(seed=1)
        optimizer.load_state_dict(copy.deepcopy(ckpt["optimizer"]))
        for call in order:
            model.load_state_dict(other) if call == "m" else amp.load_state_dict(copy.deepcopy(ckpt["amp"]))
        with pytest.raises(RuntimeError, match="another model or checkpoint"):
            _train(model, optimizer, 1, 20)


def test_apex_amp_entry_written_with_the_masters_inside_still_loads_alone_or_beside_the_model() -> None:
    model, optimizer = _run()
    _train(model, optimizer, 3, 10)
    engine = _amp_state.amp.state_dict()  # the core's full state: what amp.state_dict() held before this release
    old = copy.deepcopy({
        "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "amp": {**{k: v for k, v in amp.state_dict().items() if k != "lightning_mpx"}, "lightning_mpx": engine},
    })  # fmt: skip
    assert len(old["amp"]["lightning_mpx"]["master_weights"][0]) == 4
    _train(model, optimizer, 3, 20)
    expected = [m.detach().clone() for m in amp.master_params(optimizer)]
    for with_model in (True, False):
        model, optimizer = _run(seed=1)
        saved = copy.deepcopy(old)
        if with_model:
            model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        amp.load_state_dict(saved["amp"])
        _train(model, optimizer, 3, 20)
        assert all(torch.equal(a, b) for a, b in zip(expected, amp.master_params(optimizer))), with_model


def test_apex_models_given_half_with_cast_model_type_false_keep_their_masters_in_the_amp_entry() -> None:
    # Not prepared (a holder of their half parameters is): an FP32 value loaded into them rounds, so the amp entry
    # keeps the masters, and a resume with the model entry loaded after it is still exact.
    def run(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        _amp_state.reset()
        torch.manual_seed(seed)
        model = nn.Linear(16, 8).half()  # Apex's half: float16 (tiny)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return amp.initialize(model, optimizer, opt_level="O2", cast_model_type=False, verbosity=0)

    def train(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
        for i in range(2):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed + i)).half()
            with amp.scale_loss(model(x).float().pow(2).mean(), optimizer) as scaled:
                scaled.backward()
            optimizer.step()
            optimizer.zero_grad()

    model, optimizer = run(0)
    train(model, optimizer, 10)
    ckpt = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()})
    train(model, optimizer, 20)
    expected = [m.detach().clone() for m in amp.master_params(optimizer)]
    model, optimizer = run(1)
    amp.load_state_dict(ckpt["amp"])
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    train(model, optimizer, 20)
    assert all(torch.equal(a, b) for a, b in zip(expected, amp.master_params(optimizer)))
