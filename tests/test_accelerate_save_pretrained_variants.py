"""Hostile review of stop 60's second wave, from the user's side (bfloat16 throughout).

1. ``Fp32SavePretrained`` (Accelerate O2): ``save_pretrained`` with ``variant=``, ``max_shard_size=``,
   ``model.push_to_hub`` (upload stubbed, no network) and after a second Accelerator took the model
   over: ``from_pretrained(path)`` without a dtype gives the FP32 masters, as Accelerate's "bf16" gives its FP32 model.
   ``save_pretrained(path, push_to_hub=True)`` uploads before the config is rewritten (strict xfail).
2. Apex lean checkpoint: two models with ``num_losses=2`` and a DDP-style ``module.`` wrapper resume bit for bit; a
   refused resume into weights of another source (on purpose) names the way out, and loading the loss scales alone
   then trains (the refusal of the earlier load no longer sticks).
3. ``WeakHook``: an unpickled Accelerator's ``save_state`` still writes the engine's file; the user's own bound-method
   hook stays strong.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import pickle
from typing import Any

import pytest
import torch
from torch import nn

from lightning_mpx.apex import _amp_state, amp
from tests.accelerate_helpers import accelerate_state_reset

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

HALF = "bfloat16"


# -- 1. save_pretrained at O2 ------------------------------------------------------------------------------------------
def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


def _accelerator() -> Any:
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs

    return Accelerator(mixed_precision="O2", cpu=True, kwargs_handlers=[MixedPrecisionKwargs(half_dtype=HALF)])


def _prepared_step(accelerator: Any, model: nn.Module) -> nn.Module:
    wrapped, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    accelerator.backward(wrapped(input_ids=ids, labels=ids).loss)
    optimizer.step()
    return accelerator.unwrap_model(wrapped)


def _assert_reloads_masters(path: Any, model: nn.Module, engine: Any, **kwargs: Any) -> None:
    assert json.loads((path / "config.json").read_text())["dtype"] == "float32"
    reloaded = dict(transformers.AutoModelForCausalLM.from_pretrained(str(path), **kwargs).named_parameters())
    for name, param in model.named_parameters():
        assert reloaded[name].dtype == torch.float32, name
        torch.testing.assert_close(reloaded[name], engine.master_of(param), rtol=0, atol=0, msg=name)


def _stub_hub(monkeypatch: Any, uploaded: list[str]) -> None:
    """No network: the repo, the model card and the upload stubbed; the upload records config.json's dtype."""
    import transformers.modeling_utils as modeling
    import transformers.utils.hub as hub

    repo = type("Repo", (), {"repo_id": "user/model"})()
    card = type("Card", (), {"save": lambda self, path: None})()
    for module in (hub, modeling):
        monkeypatch.setattr(module, "create_repo", lambda *a, **k: repo, raising=False)
        monkeypatch.setattr(module, "create_and_tag_model_card", lambda *a, **k: card, raising=False)

    def upload(self: Any, folder: str, *args: Any, **kwargs: Any) -> None:
        uploaded.append(json.loads(open(os.path.join(folder, "config.json")).read())["dtype"])

    monkeypatch.setattr(transformers.PreTrainedModel, "_upload_modified_files", upload)


def test_o2_save_pretrained_variant_shards_push_to_hub_and_a_second_accelerator(tmp_path, monkeypatch) -> None:
    with accelerate_state_reset():
        first = _accelerator()
        model = _prepared_step(first, _gpt2())
        before = {k: v for k, v in model.config.to_dict().items() if k not in ("dtype", "architectures")}
        model.save_pretrained(str(tmp_path / "variant"), variant="fp32")
        assert os.path.exists(tmp_path / "variant" / "model.fp32.safetensors")
        _assert_reloads_masters(tmp_path / "variant", model, first.amp, variant="fp32")
        model.save_pretrained(str(tmp_path / "shards"), max_shard_size="4KB")
        assert os.path.exists(tmp_path / "shards" / "model.safetensors.index.json")
        _assert_reloads_masters(tmp_path / "shards", model, first.amp)
        assert os.path.exists(tmp_path / "shards" / "generation_config.json")
        uploaded: list[str] = []
        _stub_hub(monkeypatch, uploaded)
        model.push_to_hub("user/model")  # saves through the instance's save_pretrained, then uploads
        assert uploaded == ["float32"]
        first.free_memory()  # releases its optimizers: another Accelerator may take the model over
        second = _accelerator()
        model = _prepared_step(second, model)
        model.save_pretrained(str(tmp_path / "second"))
        _assert_reloads_masters(tmp_path / "second", model, second.amp)
        assert {k: v for k, v in model.config.to_dict().items() if k not in ("dtype", "architectures")} == before


def test_o2_save_pretrained_push_to_hub_uploads_a_float32_config(tmp_path, monkeypatch) -> None:
    """``model.save_pretrained(path, push_to_hub=True)`` at O2: the Hub gets the FP32 masters under a config naming
    float32 (transformers uploads inside its call: the config was rewritten after the upload, naming bfloat16), and
    the model keeps no ``_upload_modified_files`` of its own afterwards."""
    with accelerate_state_reset():
        accelerator = _accelerator()
        model = _prepared_step(accelerator, _gpt2())
        uploaded: list[str] = []
        _stub_hub(monkeypatch, uploaded)
        model.save_pretrained(str(tmp_path / "pushed"), push_to_hub=True, repo_id="user/model")
        assert uploaded == ["float32"]
        assert "_upload_modified_files" not in model.__dict__
        _assert_reloads_masters(tmp_path / "pushed", model, accelerator.amp)


# -- 2. the Apex layer's lean checkpoint -----------------------------------------------------------------------------
@pytest.fixture()
def _apex_state():
    _amp_state.reset()
    yield
    _amp_state.reset()


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _initialize(seeds: list[int]) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    _amp_state.reset()  # a new process
    models = [_mlp(seed) for seed in seeds]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    return amp.initialize(models, optimizers, opt_level="O2", cast_model_type=torch.bfloat16, verbosity=0,
                          num_losses=len(models))


class _Wrapper(nn.Module):  # what DDP's state_dict() looks like: a "module." prefix
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def _train(models: list[nn.Module], optimizers: list[Any], steps: int, seed: int) -> list[torch.Tensor]:
    for i in range(steps):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(seed + i))
        for loss_id, (model, optimizer) in enumerate(zip(models, optimizers)):
            with amp.scale_loss(model(x).float().pow(2).mean(), optimizer, loss_id=loss_id) as scaled:
                scaled.backward()
            optimizer.step()
            optimizer.zero_grad()
    return [m.detach().clone() for o in optimizers for m in amp.master_params(o)]


@pytest.mark.usefixtures("_apex_state")
@pytest.mark.parametrize("wrap", [False, True], ids=["two-models-num-losses-2", "module-prefix-wrapper"])
def test_apex_o2_lean_checkpoint_resumes_bit_for_bit(wrap: bool) -> None:
    seeds = [0] if wrap else [0, 5]
    models, optimizers = _initialize(seeds)
    models = [_Wrapper(m) for m in models] if wrap else models
    _train(models, optimizers, 2, 10)
    ckpt = copy.deepcopy({"model": [m.state_dict() for m in models], "optimizer": [o.state_dict() for o in optimizers],
                          "amp": amp.state_dict()})
    expected = _train(models, optimizers, 2, 20)
    models, optimizers = _initialize([s + 1 for s in seeds])  # other initial weights
    models = [_Wrapper(m) for m in models] if wrap else models
    for model, optimizer, m_state, o_state in zip(models, optimizers, ckpt["model"], ckpt["optimizer"]):
        model.load_state_dict(m_state)
        optimizer.load_state_dict(o_state)
    amp.load_state_dict(ckpt["amp"])
    for got, want in zip(_train(models, optimizers, 2, 20), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.usefixtures("_apex_state")
def test_apex_o2_resume_into_weights_of_another_source_names_the_way_out_and_it_works() -> None:
    models, optimizers = _initialize([0])
    _train(models, optimizers, 2, 10)
    ckpt = copy.deepcopy({"amp": amp.state_dict()})
    models, optimizers = _initialize([1])
    amp.load_state_dict(ckpt["amp"])
    models[0].load_state_dict(_mlp(7).state_dict())  # fine-tuning from another source, on purpose
    with pytest.raises(RuntimeError, match="loss scales alone") as refused:
        _train(models, optimizers, 1, 0)
    assert "k.startswith('loss_scaler')" in str(refused.value)
    scales = {k: v for k, v in ckpt["amp"].items() if k.startswith("loss_scaler")}  # the way the error names
    amp.load_state_dict(scales)
    _train(models, optimizers, 1, 0)  # trains from the user's weights
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == scales["loss_scaler0"]["loss_scale"]


# -- 3. WeakHook -------------------------------------------------------------------------------------------------------
class _UserHook:
    def __init__(self) -> None:
        self.calls = 0

    def hook(self, models: Any, weights: Any, output_dir: str) -> None:
        self.calls += 1


def test_unpickled_accelerator_save_state_writes_the_engine_file_and_a_user_bound_hook_stays(tmp_path) -> None:
    with accelerate_state_reset():
        accelerator = _accelerator()
        user = _UserHook()
        accelerator.register_save_state_pre_hook(user.hook)
        del user
        gc.collect()  # the user's bound method is held strongly, as Accelerate holds it
        model = nn.Linear(4, 4)
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        accelerator.backward(model(torch.ones(2, 4)).float().sum())
        optimizer.step()
        clone = pickle.loads(pickle.dumps(accelerator))
        clone.save_state(str(tmp_path / "clone"))
        assert "lightning_mpx_amp.bin" in os.listdir(tmp_path / "clone")
        hooks = list(clone._save_model_state_pre_hook.values())
        assert hooks[0].__self__.calls == 1 and type(hooks[-1]).__name__ == "WeakHook"  # the engine's stays last
