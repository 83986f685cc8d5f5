"""A hostile user against stop 62's newest surfaces, from the user's side, against the framework's own precision:

- A schedule-free optimizer at O2 through Lightning's Trainer and Fabric: ``optimizer.eval()``/``train()`` around
  validation, ``p in optimizer.state`` / ``optimizer.state.get(p)`` by a model parameter (its state is a
  ``KeyedOnCopy``: they answered ``False``/``None`` where FP32 answers ``True``/its entry), ``copy.deepcopy(optimizer)
  .state_dict()`` and a fresh optimizer's ``load_state_dict``; against an FP32 run.
- Accelerate at O2 with a peft model on a base ``prepare`` made half: ``save_model`` (``safe_serialization=False``,
  ``max_shard_size="1KB"``, twice) against Accelerate's ``"bf16"``; ``save_state`` then ``load_state`` resumes to the
  same adapters, ``optimizer.state.get(p)`` after the load.
- The Apex layer at O2: ``optimizer.state`` by a model parameter and by ``amp.master_params(optimizer)``.
Tiny models, CPU, bfloat16.
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.test_accelerate_schedule_free import ClosureScheduleFreeSGD, ScheduleFreeSGD

BF16 = torch.bfloat16


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(i: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(i))


def _lookups(optimizer: Any, params: list) -> list[tuple[bool, Any]]:
    """``p in optimizer.state`` and ``optimizer.state.get(p)``'s ``z`` (FP32) per parameter, as a log reads them."""
    out = []
    for p in params:
        entry = optimizer.state.get(p)
        out.append((p in optimizer.state, None if entry is None else entry.get("z", torch.zeros(())).float().clone()))
    return out


def _same_lookups(got: list, want: list, atol: float) -> None:
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, g), (_, w) in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, rtol=0, atol=atol)


def _fabric_schedule_free(precision: Any) -> dict[str, Any]:
    from lightning.fabric import Fabric

    plugins = {"plugins": [precision]} if not isinstance(precision, str) else {"precision": precision}
    fabric = Fabric(accelerator="cpu", devices=1, **plugins)
    model = fabric.setup_module(_net())
    optimizer = fabric.setup_optimizers(ScheduleFreeSGD(model.parameters()))
    for i in range(3):
        model.train()
        optimizer.train()
        fabric.backward(F.mse_loss(model(_batch(i)).float(), torch.zeros(4, 4)))
        optimizer.step()
        optimizer.zero_grad()
    params = list(model.parameters())
    seen = {"stepped": _lookups(optimizer, params)}
    model.eval()
    optimizer.eval()
    seen["eval"] = _lookups(optimizer, params)  # before the next forward: the engine has not followed it yet
    with torch.no_grad():
        seen["loss"] = F.mse_loss(model(_batch(9)).float(), torch.zeros(4, 4)).item()
    copied, live = copy.deepcopy(optimizer.optimizer).state_dict(), optimizer.state_dict()
    assert copied["state"].keys() == live["state"].keys() == {0, 1, 2, 3}
    for k in live["state"]:
        torch.testing.assert_close(copied["state"][k]["z"], live["state"][k]["z"], rtol=0, atol=0)
    fresh_model = fabric.setup_module(_net())
    fresh = fabric.setup_optimizers(ScheduleFreeSGD(fresh_model.parameters()))
    fresh.load_state_dict(live)
    seen["loaded"] = _lookups(fresh, list(fresh_model.parameters()))
    optimizer.train()
    seen["weights"] = [p.detach().float().clone() for p in params]
    return seen


def test_fabric_o2_schedule_free_in_and_get_by_param_answer_as_fp32():
    # Before: at O2 `p in optimizer.state` was False and `optimizer.state.get(p)` None after a step (its KeyedOnCopy
    # redirected no lookup), `{}` after eval(); FP32 answers True and its entry {"z": ...}.
    from lightning_mpx import FabricMixedPrecisionPlugin

    ours = _fabric_schedule_free(FabricMixedPrecisionPlugin("O2", half_dtype=BF16))
    ref = _fabric_schedule_free("32-true")
    for moment in ("stepped", "eval", "loaded"):
        _same_lookups(ours[moment], ref[moment], atol=5e-3)
    assert ours["loss"] == pytest.approx(ref["loss"], abs=2e-3)
    for got, want in zip(ours["weights"], ref["weights"]):
        torch.testing.assert_close(got, want, rtol=0, atol=5e-3)


def test_trainer_o2_schedule_free_eval_around_validation_in_and_get_as_fp32():
    pl = pytest.importorskip("lightning.pytorch")
    from lightning_mpx import MixedPrecisionPlugin
    from tests.lightning_helpers import make_trainer

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.seen = _net(), {}

        def training_step(self, batch: Any, i: int) -> torch.Tensor:
            return F.mse_loss(self.net(batch).float(), torch.zeros(4, 4))

        def validation_step(self, batch: Any, i: int) -> None:
            self.seen["val"] = F.mse_loss(self.net(batch).float(), torch.zeros(4, 4)).item()

        def on_train_epoch_start(self) -> None:
            self.optimizers().optimizer.train()

        def on_validation_epoch_start(self) -> None:  # as schedule-free's docs say
            optimizer = self.optimizers().optimizer
            optimizer.eval()
            self.seen["eval"] = _lookups(optimizer, list(self.parameters()))

        def on_validation_epoch_end(self) -> None:
            self.optimizers().optimizer.train()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return ClosureScheduleFreeSGD(self.parameters())

    def run(plugin: Any) -> dict:
        module = Module()
        data = torch.utils.data.DataLoader([_batch(i) for i in range(3)], batch_size=None)
        settings = dict(max_epochs=1, limit_val_batches=1, num_sanity_val_steps=0)
        trainer = make_trainer(plugin, **settings) if plugin else make_trainer(precision="32-true", **settings)
        trainer.fit(module, data, torch.utils.data.DataLoader([_batch(9)], batch_size=None))
        module.seen["end"] = _lookups(trainer.optimizers[0], list(module.parameters()))
        return module.seen

    ours, ref = run(MixedPrecisionPlugin("O2", half_dtype=BF16)), run(None)
    _same_lookups(ours["eval"], ref["eval"], atol=5e-3)
    _same_lookups(ours["end"], ref["end"], atol=5e-3)
    assert ours["val"] == pytest.approx(ref["val"], abs=2e-3)


class _Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 64), nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))


def _peft_setup(mp: str) -> tuple[Any, Any, Any]:
    import accelerate
    import peft

    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    reset_accelerate_state()
    if mp == "O2":
        acc = Accelerator(mixed_precision=mp, cpu=True, kwargs_handlers=[MixedPrecisionKwargs(half_dtype=BF16)])
    else:
        acc = accelerate.Accelerator(mixed_precision=mp, cpu=True)
    torch.manual_seed(0)
    m = peft.get_peft_model(_Base(), peft.LoraConfig(r=2, target_modules=["l1", "l2"], init_lora_weights=False))
    model, opt = acc.prepare(m, torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2))
    return acc, model, opt


def _peft_steps(acc: Any, model: Any, opt: Any, steps: range) -> None:
    for i in steps:
        acc.backward(model(_batch(i)).float().pow(2).mean())
        opt.step()
        opt.zero_grad()


def _read_shards(directory: str, index: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = set(json.load(open(os.path.join(directory, index)))["weight_map"].values())
    out: dict[str, torch.Tensor] = {}
    for f in files:
        path = os.path.join(directory, f)
        out.update(load_file(path) if f.endswith(".safetensors") else torch.load(path, weights_only=True))
    return out


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerate_o2_peft_save_model_variants_and_save_load_state_resume(tmp_path):
    pytest.importorskip("peft")
    ref_acc, ref_model, ref_opt = _peft_setup("bf16")
    _peft_steps(ref_acc, ref_model, ref_opt, range(2))
    ref_acc.save_model(ref_model, tmp_path / "ref", max_shard_size="1KB")
    want = _read_shards(str(tmp_path / "ref"), "model.safetensors.index.json")

    acc, model, opt = _peft_setup("O2")
    _peft_steps(acc, model, opt, range(2))
    for safe, index in ((True, "model.safetensors.index.json"), (False, "pytorch_model.bin.index.json")):
        for _ in range(2):  # twice into the same folder: each an export, each warns about the half base
            with pytest.warns(UserWarning, match="save_model at O2 exports 4 frozen"):
                acc.save_model(model, tmp_path / f"o2_{safe}", max_shard_size="1KB", safe_serialization=safe)
        got = _read_shards(str(tmp_path / f"o2_{safe}"), index)
        assert got.keys() == want.keys()
        for k, v in got.items():
            assert v.dtype == (BF16 if "base_layer" in k else torch.float32), k
            torch.testing.assert_close(v.float(), want[k], rtol=0, atol=2e-2 if "base_layer" in k else 2e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # one file, no shard: the same warning, nothing else
        with pytest.raises(UserWarning, match="frozen"):
            acc.save_model(model, tmp_path / "whole", safe_serialization=False)
    assert sorted(os.listdir(tmp_path / "whole")) == ["pytorch_model.bin"]

    acc.save_state(tmp_path / "state")
    _peft_steps(acc, model, opt, range(2, 4))
    unbroken = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    acc2, model2, opt2 = _peft_setup("O2")
    acc2.load_state(tmp_path / "state")
    trained = [p for p in model2.parameters() if p.requires_grad]
    assert all(p in opt2.state and int(opt2.state.get(p)["step"]) == 2 for p in trained)
    assert opt2.state.get(trained[0])["exp_avg_sq"].dtype == torch.float32
    _peft_steps(acc2, model2, opt2, range(2, 4))
    for n, p in model2.named_parameters():
        torch.testing.assert_close(p.detach().float(), unbroken[n], rtol=0, atol=0)


def test_apex_o2_state_by_model_param_and_by_master_params():
    from lightning_mpx.apex import amp
    from lightning_mpx.apex._state import _amp_state

    def run(level: str | None) -> tuple[Any, list, list]:
        model = _net()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        if level:
            model, opt = amp.initialize(model, opt, opt_level=level, cast_model_type=BF16, verbosity=0)
        for i in range(3):
            loss = F.mse_loss(model(_batch(i)).float(), torch.zeros(4, 4))
            if level:
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            else:
                loss.backward()
            opt.step()
            opt.zero_grad()
        masters = list(amp.master_params(opt)) if level else list(model.parameters())
        return opt, list(model.parameters()), masters

    ref_opt, ref_params, _ = run(None)
    try:  # amp's reset lets go of the optimizer (torch's state back): the reads before it
        opt, params, masters = run("O2")
        assert all(m.dtype == torch.float32 for m in masters) and all(p.dtype == BF16 for p in params)
        for p, m, r in zip(params, masters, ref_params):
            assert p in opt.state and m in opt.state and opt.state.get(p) is opt.state[m] is opt.state[p]
            assert int(opt.state[m]["step"]) == int(ref_opt.state[r]["step"]) == 3
            torch.testing.assert_close(opt.state[m]["exp_avg"], ref_opt.state[r]["exp_avg"], rtol=0.1, atol=1e-4)
        assert len(opt.state) == len(masters)
    finally:
        _amp_state.reset()
