"""Accelerate's own ``tests/test_accelerator.py`` (1.15), ported to the adapter: prepare, save/load, unwrap and
pickling, each under ``mixed_precision`` O1 and O2 with float16 and bfloat16.

Each test is named after its upstream test and says in its docstring where it comes from and what differs. The tests
upstream that are about other devices, offloading, quantization or Accelerate's state singletons are not ported; the
list, and every deliberate difference, is in docs/testing.md ("Ported framework tests").
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import weakref

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("accelerate")

from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard, skip_first_batches  # noqa: E402
from accelerate.state import GradientState  # noqa: E402
from accelerate.utils import DataLoaderConfiguration  # noqa: E402
from accelerate.utils.modeling import load_checkpoint_in_model  # noqa: E402

from lightning_mpx.integrations.accelerate import AMP_STATE_NAME, Accelerator, MixedPrecisionKwargs  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")  # Accelerate's singleton state: none at each start

@pytest.fixture(autouse=True)
def _seeded():
    """The same weights and inputs in every run (upstream leaves the first unseeded)."""
    torch.manual_seed(0)


HALVES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
LEVELS_AND_HALVES = [(level, half) for level in ("O1", "O2") for half in HALVES]


def _accelerator(level: str, half: str, **kwargs) -> Accelerator:
    return Accelerator(mixed_precision=level, kwargs_handlers=[MixedPrecisionKwargs(half_dtype=half)], **kwargs)


# -- upstream's fixtures, as they are there ----------------------------------------------------------------------------
class ModelWithTiedWeights(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1 = torch.nn.Linear(2, 4)
        self.linear2 = torch.nn.Linear(4, 2)
        self.linear2.weight = self.linear1.weight
        self.linear2.bias = self.linear1.bias

    def forward(self, x):
        return self.linear2(self.linear1(x))


def create_components(tied_weights=False):
    model = ModelWithTiedWeights() if tied_weights else torch.nn.Linear(2, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.01, steps_per_epoch=2, epochs=1)
    train_dl = DataLoader(TensorDataset(torch.tensor([1, 2, 3])))
    valid_dl = DataLoader(TensorDataset(torch.tensor([4, 5, 6])))
    return model, optimizer, scheduler, train_dl, valid_dl


class ModelForTest(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear1 = torch.nn.Linear(3, 4)
        self.batchnorm = torch.nn.BatchNorm1d(4)
        self.linear2 = torch.nn.Linear(4, 5)

    def forward(self, x):
        return self.linear2(self.batchnorm(self.linear1(x)))


def get_signature(model):
    return sum(param.abs().sum().item() for param in model.parameters())


def load_random_weights(model):
    if isinstance(model, torch.nn.Linear):
        state = torch.nn.Linear(*tuple(model.weight.T.shape)).state_dict()
    elif isinstance(model, ModelWithTiedWeights):
        state = ModelWithTiedWeights().state_dict()
    model.load_state_dict(state)


def _trained_values(accelerator, model):
    """The values training goes on from: at O2 the FP32 masters (the model holds their rounding), at O1 the
    model's own FP32 parameters."""
    return {k: v.clone() for k, v in accelerator.amp.fp32_state_dict(accelerator.unwrap_model(model)).items()}


def _assert_equal_values(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


# -- prepare -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level, half", LEVELS_AND_HALVES)
def test_mutable_states(level, half):
    """tests/test_accelerator.py::AcceleratorTester::test_mutable_states: the accelerator's accumulation settings
    are Accelerate's one ``GradientState`` with an opt level too."""
    accelerator = _accelerator(level, half)
    state = GradientState()
    assert state.num_steps == 1
    accelerator.gradient_accumulation_steps = 4
    assert state.num_steps == 4

    assert state.sync_gradients is True
    accelerator.sync_gradients = False
    assert state.sync_gradients is False
    GradientState._reset_state()


@pytest.mark.parametrize("level, half", LEVELS_AND_HALVES)
def test_prepared_objects_are_referenced(level, half):
    """tests/test_accelerator.py::AcceleratorTester::test_prepared_objects_are_referenced; also: the prepared
    optimizer steps through the accelerator's engine (at O2 on FP32 masters of the half model)."""
    accelerator = _accelerator(level, half)
    model, optimizer, scheduler, train_dl, valid_dl = create_components()

    (
        prepared_model,
        prepared_optimizer,
        prepared_scheduler,
        prepared_train_dl,
        prepared_valid_dl,
    ) = accelerator.prepare(model, optimizer, scheduler, train_dl, valid_dl)

    assert prepared_model in accelerator._models
    assert prepared_optimizer in accelerator._optimizers
    assert prepared_scheduler in accelerator._schedulers
    assert prepared_train_dl in accelerator._dataloaders
    assert prepared_valid_dl in accelerator._dataloaders
    assert prepared_scheduler.optimizers == [prepared_optimizer]  # it asks this optimizer whether it skipped
    expected = HALVES[half] if level == "O2" else torch.float32
    assert prepared_model.weight.dtype == expected
    masters = accelerator.amp.master_params(prepared_optimizer.optimizer)
    assert all(p.dtype == torch.float32 for p in masters)
    assert (level == "O2") == all(m is not p for m, p in zip(masters, prepared_model.parameters()))


@pytest.mark.parametrize("level, half", LEVELS_AND_HALVES)
def test_free_memory_dereferences_prepared_components(level, half):
    """tests/test_accelerator.py::AcceleratorTester::test_free_memory_dereferences_prepared_components. Instead of
    upstream's free-RAM reading (the OS's figure, which other processes move), the released engine (its masters
    and optimizers) must be collectable; the accelerator prepares again with a fresh engine of the same settings,
    which goes on from the released one's loss scale and counts."""
    accelerator = _accelerator(level, half)
    accelerator.free_memory()
    model, optimizer, scheduler, train_dl, valid_dl = create_components()
    model, optimizer, scheduler, train_dl, valid_dl = accelerator.prepare(
        model, optimizer, scheduler, train_dl, valid_dl
    )
    accelerator.backward(model(torch.randn(3, 2)).sum())
    optimizer.step()
    old_engine = weakref.ref(accelerator.amp)
    skipped, scale = float(optimizer.step_was_skipped), accelerator.amp.scalers[0].get_scale()

    model, optimizer, scheduler, train_dl, valid_dl = accelerator.free_memory(
        model, optimizer, scheduler, train_dl, valid_dl
    )

    assert len(accelerator._models) == 0
    assert len(accelerator._optimizers) == 0
    assert len(accelerator._schedulers) == 0
    assert len(accelerator._dataloaders) == 0
    gc.collect()
    assert old_engine() is None
    assert accelerator.amp.opt_level == level and accelerator.amp.half_dtype is HALVES[half]
    # The fresh engine goes on from the released one's scale and counts, as Accelerate's GradScaler is kept.
    metrics = accelerator.mpx_metrics()
    assert (metrics["mpx/loss_scale"], metrics["mpx/overflows"], metrics["mpx/skipped_steps"]) == (
        scale, skipped, skipped
    )
    model, optimizer = accelerator.prepare(*create_components()[:2])
    assert accelerator._models == [model] and accelerator._optimizers == [optimizer]
    accelerator.backward(model(torch.randn(3, 2)).mean() * 1e-3)
    optimizer.step()
    assert not optimizer.step_was_skipped


@pytest.mark.parametrize("level, half", LEVELS_AND_HALVES)
def test_accelerator_none(level, half):
    """tests/test_accelerator.py::AcceleratorTester::test_accelerator_none (the adapter reorders the objects,
    models first: ``None`` keeps its place)."""
    accelerator = _accelerator(level, half)
    model, optimizer, scheduler, train_dl, valid_dl = create_components()
    dummy_obj = None

    model, optimizer, scheduler, train_dl, valid_dl, dummy_obj = accelerator.prepare(
        model, optimizer, scheduler, train_dl, valid_dl, dummy_obj
    )
    assert dummy_obj is None
    assert isinstance(model, torch.nn.Linear) and isinstance(train_dl, DataLoader)


@pytest.mark.parametrize("level, half", LEVELS_AND_HALVES)
def test_is_accelerator_prepared(level, half):
    """tests/test_accelerator.py::AcceleratorTester::test_is_accelerator_prepared."""
    accelerator = _accelerator(level, half)
    model, optimizer, scheduler, train_dl, valid_dl = create_components()
    dummy_obj = [1, 2, 3]

    model, optimizer, scheduler, train_dl, valid_dl, dummy_obj = accelerator.prepare(
        model, optimizer, scheduler, train_dl, valid_dl, dummy_obj
    )
    assert getattr(dummy_obj, "_is_accelerate_prepared", False) is False
    for name, obj in [("model", model), ("optimizer", optimizer), ("scheduler", scheduler),
                      ("train_dl", train_dl), ("valid_dl", valid_dl)]:
        assert getattr(obj, "_is_accelerate_prepared", False) is True, name


@pytest.mark.parametrize("level, half", LEVELS_AND_HALVES)
def test_prepare_model_twice_does_not_double_wrap(level, half):
    """tests/test_accelerator.py::AcceleratorTester::test_prepare_model_twice_does_not_double_wrap; also: the
    opt level's forward is installed once (unwrapping gives torch's own forward back) and O2 makes one set of
    masters."""
    accelerator = _accelerator(level, half)
    model = torch.nn.Linear(10, 2)
    prepared_model = accelerator.prepare_model(model)
    num_models_before = len(accelerator._models)
    reprepared_model = accelerator.prepare_model(prepared_model)
    assert len(accelerator._models) == num_models_before
    assert reprepared_model is prepared_model
    assert len(accelerator.amp.master_weights) == (1 if level == "O2" else 0)
    plain = accelerator.unwrap_model(reprepared_model, keep_fp32_wrapper=False)
    assert plain.forward.__func__ is torch.nn.Linear.forward  # not the opt level's forward of a first wrapping


@pytest.mark.parametrize("level, half", LEVELS_AND_HALVES)
def test_accelerator_cpu_flag_prepare(level, half):
    """tests/test_accelerator.py::AcceleratorTester::test_accelerator_cpu_flag_prepare (upstream runs it on a GPU
    machine only; ``cpu=True`` is the machine's device here). An optimizer prepared alone: O1 takes it; O2, whose
    optimizer steps FP32 masters that preparing the model makes, may refuse it, with an error that names the
    model to prepare and does not speak of a model prepared with ``train=False`` when none was."""
    model = torch.nn.Linear(10, 10)
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    accelerator = _accelerator(level, half, cpu=True)
    try:
        prepared = accelerator.prepare(sgd)
    except (RuntimeError, ValueError) as error:
        assert level == "O2", error
        assert "train=False" not in str(error) and "model" in str(error)
    else:
        assert prepared.optimizer is sgd


# -- save and load -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_safetensors, tied_weights", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("level, half", LEVELS_AND_HALVES)
def test_save_load_model(level, half, use_safetensors, tied_weights, tmp_path):
    """tests/test_accelerator.py::AcceleratorTester::test_save_load_model; also: the values training goes on
    from (O2's FP32 masters) come back exactly, not only the model's (half at O2) weights."""
    accelerator = _accelerator(level, half)
    model, optimizer, scheduler, train_dl, valid_dl = create_components(tied_weights)
    accelerator.prepare(model, optimizer, scheduler, train_dl, valid_dl)

    model_signature = get_signature(model)
    trained = _trained_values(accelerator, model)

    accelerator.save_state(str(tmp_path), safe_serialization=use_safetensors)
    assert (tmp_path / AMP_STATE_NAME).is_file()

    # make sure random weights don't match (at O2 FP32 weights loaded into the model go to its masters)
    load_random_weights(model)
    assert abs(model_signature - get_signature(model)) > 1e-3
    assert _trained_values(accelerator, model)["linear1.weight" if tied_weights else "weight"].ne(
        trained["linear1.weight" if tied_weights else "weight"]
    ).any()

    # make sure loaded weights match
    accelerator.load_state(str(tmp_path))
    assert abs(model_signature - get_signature(model)) < 1e-3
    _assert_equal_values(_trained_values(accelerator, model), trained)


@pytest.mark.parametrize("use_safetensors", [True, False])
@pytest.mark.parametrize("level, half", LEVELS_AND_HALVES)
def test_save_model(level, half, use_safetensors, tmp_path):
    """tests/test_accelerator.py::AcceleratorTester::test_save_model, with a prepared model (upstream saves one not
    prepared, which the opt level does not touch). At O2 ``save_model`` saves the FP32 masters (here the FP32 values
    kept for them: no optimizer yet), as Accelerate's own modes save an FP32 model (docs/accelerate.md)."""
    accelerator = _accelerator(level, half)
    model = accelerator.prepare(torch.nn.Linear(10, 10))

    model_signature = get_signature(model)
    accelerator.save_model(model, str(tmp_path), safe_serialization=use_safetensors)
    if use_safetensors:
        from safetensors.torch import load_file

        saved = load_file(str(tmp_path / "model.safetensors"))
    else:
        saved = torch.load(str(tmp_path / "pytorch_model.bin"), weights_only=True)
    assert {t.dtype for t in saved.values()} == {torch.float32}
    # make sure loaded weights match
    load_checkpoint_in_model(model, str(tmp_path))
    assert abs(model_signature - get_signature(model)) < 1e-3


@pytest.mark.parametrize("use_safetensors", [True, False])
@pytest.mark.parametrize("level, half", LEVELS_AND_HALVES)
def test_save_sharded_model(level, half, use_safetensors, tmp_path):
    """tests/test_accelerator.py::AcceleratorTester::test_save_sharded_model, with a prepared model (batch norm
    stays FP32 at O2, the linear layers are half)."""
    accelerator = _accelerator(level, half)
    torch.manual_seed(0)
    inputs = torch.randn(3, 3)
    model = accelerator.prepare(ModelForTest())
    expected = model(inputs)

    # By setting it to 100, the model is split into several shards
    accelerator.save_model(model, str(tmp_path), safe_serialization=use_safetensors, max_shard_size=100)
    assert len([f for f in os.listdir(tmp_path) if f.endswith((".safetensors", ".bin"))]) > 1
    # make sure loaded weights match
    load_checkpoint_in_model(model, str(tmp_path))
    output = model(inputs)

    assert output.dtype == torch.float32
    assert torch.allclose(expected, output, atol=1e-5)


@pytest.mark.parametrize("use_safetensors", [True, False])
@pytest.mark.parametrize("level, half", LEVELS_AND_HALVES)
def test_save_load_model_with_hooks(level, half, use_safetensors, tmp_path):
    """tests/test_accelerator.py::AcceleratorTester::test_save_load_model_with_hooks; also: the adapter's own
    state (loss scale, masters) is saved and loaded with the user's hooks registered and after they are removed."""
    accelerator = _accelerator(level, half)
    model, optimizer, scheduler, train_dl, valid_dl = create_components()
    accelerator.prepare(model, optimizer, scheduler, train_dl, valid_dl)

    model_signature = get_signature(model)
    trained = _trained_values(accelerator, model)

    # saving hook
    def save_config(models, weights, output_dir):
        config = {"class_name": models[0].__class__.__name__}

        with open(os.path.join(output_dir, "data.json"), "w") as f:
            json.dump(config, f)

    # loading hook
    def load_config(models, input_dir):
        with open(os.path.join(input_dir, "data.json")) as f:
            config = json.load(f)

        models[0].class_name = config["class_name"]

    save_hook = accelerator.register_save_state_pre_hook(save_config)
    load_hook = accelerator.register_load_state_pre_hook(load_config)

    first = tmp_path / "with_hooks"
    accelerator.save_state(str(first), safe_serialization=use_safetensors)
    assert (first / AMP_STATE_NAME).is_file()

    # make sure random weights don't match with hooks
    load_random_weights(model)
    assert abs(model_signature - get_signature(model)) > 1e-3

    # random class name to verify correct one is loaded
    model.class_name = "random"

    # make sure loaded weights match with hooks
    accelerator.load_state(str(first))
    assert abs(model_signature - get_signature(model)) < 1e-3
    _assert_equal_values(_trained_values(accelerator, model), trained)

    # mode.class_name is loaded from config
    assert model.class_name == model.__class__.__name__

    # remove hooks
    save_hook.remove()
    load_hook.remove()

    second = tmp_path / "without_hooks"
    accelerator.save_state(str(second), safe_serialization=use_safetensors)
    assert (second / AMP_STATE_NAME).is_file() and not (second / "data.json").exists()

    # make sure random weights don't match with hooks removed
    load_random_weights(model)
    assert abs(model_signature - get_signature(model)) > 1e-3

    # random class name to verify correct one is loaded
    model.class_name = "random"

    # make sure loaded weights match with hooks removed
    accelerator.load_state(str(second))
    assert abs(model_signature - get_signature(model)) < 1e-3
    _assert_equal_values(_trained_values(accelerator, model), trained)

    # mode.class_name is NOT loaded from config
    assert model.class_name != model.__class__.__name__


# -- unwrap --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("level, half", LEVELS_AND_HALVES)
def test_can_unwrap_model_fp16(level, half):
    """tests/test_accelerator.py::AcceleratorTester::test_can_unwrap_model_fp16 (upstream: ``mixed_precision="fp16"``
    on a GPU). Unwrapped with ``keep_fp32_wrapper=False``, the model is the bare converted model: FP32 at O1, which
    takes upstream's FP32 inputs; half at O2 (the opt level's model), which takes half inputs only, as a half
    ``nn.Linear`` does (Accelerate's fp16 model stays FP32 under autocast)."""
    model = create_components()[0]
    accelerator = _accelerator(level, half)
    torch.manual_seed(0)
    inputs = torch.randn(10, 2)
    model = accelerator.prepare(model)
    assert model(inputs).dtype == torch.float32  # sanity check that this works

    model = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    if level == "O2":
        with pytest.raises(RuntimeError, match="dtype"):
            model(inputs)
        inputs = inputs.to(HALVES[half])
    output = model(inputs)  # check that this still works
    assert output.dtype == inputs.dtype

    # check that pickle roundtrip works
    model_loaded = pickle.loads(pickle.dumps(model))
    assert torch.equal(model_loaded(inputs), output)


@pytest.mark.parametrize("level, half", LEVELS_AND_HALVES)
def test_can_unwrap_distributed_compiled_model_keep_torch_compile(level, half):
    """tests/test_accelerator.py::AcceleratorTester::test_can_unwrap_distributed_compiled_model_keep_torch_compile,
    with a prepared model (nothing is compiled: the compiled wrapper is only unwrapped)."""
    accelerator = _accelerator(level, half)
    model = accelerator.prepare(create_components()[0])

    compiled_model = torch.compile(model)

    distributed_model = torch.nn.DataParallel(model)
    distributed_compiled_model = torch.compile(distributed_model)
    unwrapped_model = accelerator.unwrap_model(distributed_compiled_model, keep_torch_compile=True)

    assert compiled_model._orig_mod == unwrapped_model._orig_mod


@pytest.mark.parametrize("level, half", LEVELS_AND_HALVES)
def test_can_unwrap_distributed_compiled_model_remove_torch_compile(level, half):
    """tests/test_accelerator.py::AcceleratorTester::test_can_unwrap_distributed_compiled_model_remove_torch_compile,
    with a prepared model."""
    accelerator = _accelerator(level, half)
    model = accelerator.prepare(create_components()[0])

    compiled_model = torch.compile(model)

    distributed_model = torch.nn.DataParallel(model)
    distributed_compiled_model = torch.compile(distributed_model)
    unwrapped_model = accelerator.unwrap_model(distributed_compiled_model, keep_torch_compile=False)

    assert compiled_model._orig_mod == unwrapped_model


# -- pickling ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dispatch_batches", [True, False])
@pytest.mark.parametrize("level, half", LEVELS_AND_HALVES)
def test_can_pickle_dataloader(level, half, dispatch_batches):
    """tests/test_accelerator.py::AcceleratorTester::test_can_pickle_dataloader: an Accelerator with an opt level
    and prepared dataloaders pickles, and the copy's dataloaders give the same batches."""
    data = torch.arange(10)
    ds = torch.utils.data.TensorDataset(data)
    dl = torch.utils.data.DataLoader(ds)
    skip_dl = skip_first_batches(dl, 2)

    dataloader_config = DataLoaderConfiguration(dispatch_batches=dispatch_batches, use_stateful_dataloader=False)
    accelerator = _accelerator(level, half, dataloader_config=dataloader_config)

    original_dl, _ = accelerator.prepare(dl, skip_dl)
    if dispatch_batches:
        assert isinstance(original_dl, DataLoaderDispatcher)
    else:
        assert isinstance(original_dl, DataLoaderShard)

    prepared_model_dumps = pickle.dumps(accelerator)

    model_loaded = pickle.loads(prepared_model_dumps)
    assert len(model_loaded._dataloaders) == 2

    # Assert equality of recovered and original dataloader
    loaded_dl = model_loaded._dataloaders[0]
    assert isinstance(loaded_dl, DataLoader)
    if dispatch_batches:
        assert isinstance(loaded_dl, DataLoaderDispatcher)
    else:
        assert isinstance(loaded_dl, DataLoaderShard)
    assert len(loaded_dl) == len(original_dl)
    assert [i for i in loaded_dl] == [i for i in original_dl]

    # Test skip dataloader works as expected as well
    loaded_skip_dl = model_loaded._dataloaders[1]
    assert isinstance(loaded_skip_dl, DataLoader)
    assert len(loaded_skip_dl) == len(original_dl) - 2
    assert [i for i in loaded_skip_dl] == [i for i in original_dl][2:]
