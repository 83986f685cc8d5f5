"""Accelerate's own ``tests/test_state_checkpointing.py`` (1.15), ported to the adapter: ``save_state`` /
``load_state`` resume training exactly (weights, optimizer state, scheduler, random state, and the adapter's loss
scale and FP32 masters), with automatic checkpoint naming, limits and relative paths, under ``mixed_precision`` O1 and
O2 with float16 and bfloat16, in safetensors and pickle files (deliberate differences: docs/testing.md, "Ported
framework tests")."""

from __future__ import annotations

import copy
import os
import random
import shutil
import uuid
from contextlib import contextmanager

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("accelerate")

from accelerate.utils import ProjectConfiguration, set_seed  # noqa: E402

from lightning_mpx.integrations.accelerate import AMP_STATE_NAME, Accelerator, MixedPrecisionKwargs  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("fresh_accelerate_state"),  # Accelerate's singleton state: none at each start
    pytest.mark.parametrize("use_safetensors", [True, False], ids=["use_safetensors", "use_pytorch"]),
    pytest.mark.parametrize("level, half", [(lv, h) for lv in ("O1", "O2") for h in ("float16", "bfloat16")]),
]


def _accelerator(level, half, **kwargs):
    # growth_interval=4: float16's dynamic scale moves during these short runs, so that a resume must restore it
    settings = MixedPrecisionKwargs(half_dtype=half, growth_interval=4)
    return Accelerator(mixed_precision=level, kwargs_handlers=[settings], **kwargs)


def _perturb(model, optimizer, accelerator, train_dataloader):
    """Changes to undo by the next ``load_state``, which upstream's tests leave out (they load into the state
    just saved, or into a model built from the same seed): an epoch more, and other weights."""
    train(1, model, train_dataloader, optimizer, accelerator)
    with torch.no_grad():
        accelerator.unwrap_model(model).load_state_dict({"a": torch.tensor([5.0]), "b": torch.tensor([-5.0])})


def dummy_dataloaders(a=2, b=3, batch_size=16, n_train_batches: int = 10, n_valid_batches: int = 2):
    "Generates a tuple of dummy DataLoaders to test with (upstream's, without worker processes)"

    def get_dataset(n_batches):
        x = torch.randn(batch_size * n_batches, 1)
        return TensorDataset(x, a * x + b + 0.1 * torch.randn(batch_size * n_batches, 1))

    train_dataset = get_dataset(n_train_batches)
    valid_dataset = get_dataset(n_valid_batches)
    train_dataloader = DataLoader(train_dataset, shuffle=True, batch_size=batch_size)
    valid_dataloader = DataLoader(valid_dataset, shuffle=False, batch_size=batch_size)
    return (train_dataloader, valid_dataloader)


def train(num_epochs, model, dataloader, optimizer, accelerator, scheduler=None):
    "Trains for `num_epochs`"
    rands = []
    for epoch in range(num_epochs):
        # Train quickly
        model.train()
        for batch in dataloader:
            x, y = batch
            outputs = model(x)
            loss = torch.nn.functional.mse_loss(outputs, y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        rands.append(random.random())  # Introduce some randomness
        if scheduler is not None:
            scheduler.step()
    return rands


class DummyModel(nn.Module):
    "Simple model to do y=mx+b"

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(1))
        self.b = nn.Parameter(torch.randn(1))

    def forward(self, x):
        return x * self.a + self.b


def _state(accelerator, model, optimizer):
    """What resuming must restore beyond upstream's ``(a, b)`` and optimizer state: the FP32 values training goes
    on from (O2's masters) and the loss scale."""
    fp32 = accelerator.amp.fp32_state_dict(accelerator.unwrap_model(model))
    return (
        {k: v.clone() for k, v in fp32.items()},
        accelerator.amp.scalers[0].get_scale(),
        copy.deepcopy(optimizer.state_dict()),  # a copy: upstream's aliases the tensors Adam updates in place
    )


def _assert_same_state(one, other):
    (values, scale, opt_state), (values2, scale2, opt_state2) = one, other
    assert values.keys() == values2.keys()
    assert all(torch.equal(values[k], values2[k]) for k in values)
    assert scale == scale2
    check_adam_state(opt_state, opt_state2)


def check_adam_state(state1, state2):
    assert state1 == state2


def test_with_save_limit(level, half, use_safetensors, tmp_path):
    """tests/test_state_checkpointing.py::CheckpointTest::test_with_save_limit."""
    set_seed(42)
    model = DummyModel()
    optimizer = torch.optim.Adam(params=model.parameters(), lr=1e-3)
    train_dataloader, valid_dataloader = dummy_dataloaders()
    project_config = ProjectConfiguration(total_limit=1, project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    # Train baseline
    accelerator = _accelerator(level, half, project_config=project_config)
    model, optimizer, train_dataloader, valid_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, valid_dataloader
    )
    # Save initial
    accelerator.save_state(safe_serialization=use_safetensors)

    # Save second state
    accelerator.save_state(safe_serialization=use_safetensors)
    assert len(os.listdir(accelerator.project_dir)) == 1
    assert os.listdir(os.path.join(accelerator.project_dir, "checkpoints")) == ["checkpoint_1"]
    assert os.path.isfile(os.path.join(accelerator.project_dir, "checkpoints", "checkpoint_1", AMP_STATE_NAME))


def test_can_resume_training_with_folder(level, half, use_safetensors, tmp_path):
    """tests/test_state_checkpointing.py::CheckpointTest::test_can_resume_training_with_folder; also: the FP32
    values, the loss scale and the optimizer state equal the uninterrupted run's, and each load undoes an epoch
    and other weights in between."""
    tmpdir = str(tmp_path)
    set_seed(42)
    model = DummyModel()
    optimizer = torch.optim.Adam(params=model.parameters(), lr=1e-3)
    train_dataloader, valid_dataloader = dummy_dataloaders()
    # Train baseline
    accelerator = _accelerator(level, half)
    model, optimizer, train_dataloader, valid_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, valid_dataloader
    )
    # Save initial
    initial = os.path.join(tmpdir, "initial")
    accelerator.save_state(initial, safe_serialization=use_safetensors)
    (a, b) = model.a.item(), model.b.item()
    state = _state(accelerator, model, optimizer)
    ground_truth_rands = train(3, model, train_dataloader, optimizer, accelerator)
    (a1, b1) = model.a.item(), model.b.item()
    state1 = _state(accelerator, model, optimizer)

    # Train partially
    set_seed(42)
    model = DummyModel()
    optimizer = torch.optim.Adam(params=model.parameters(), lr=1e-3)
    train_dataloader, valid_dataloader = dummy_dataloaders()
    accelerator = _accelerator(level, half)
    model, optimizer, train_dataloader, valid_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, valid_dataloader
    )
    _perturb(model, optimizer, accelerator, train_dataloader)
    accelerator.load_state(initial)
    (a2, b2) = model.a.item(), model.b.item()
    assert a == a2
    assert b == b2
    _assert_same_state(state, _state(accelerator, model, optimizer))

    test_rands = train(2, model, train_dataloader, optimizer, accelerator)
    # Save everything
    checkpoint = os.path.join(tmpdir, "checkpoint")
    accelerator.save_state(checkpoint, safe_serialization=use_safetensors)

    # Load everything back in and make sure all states work
    _perturb(model, optimizer, accelerator, train_dataloader)
    accelerator.load_state(checkpoint)
    test_rands += train(1, model, train_dataloader, optimizer, accelerator)
    (a3, b3) = model.a.item(), model.b.item()
    assert a1 == a3
    assert b1 == b3
    _assert_same_state(state1, _state(accelerator, model, optimizer))
    assert ground_truth_rands == test_rands


def _resume_with_automatic_naming(level, half, use_safetensors, tmpdir, *, infer_directory):
    """tests/test_state_checkpointing.py's test_can_resume_training and
    test_can_resume_training_checkpoints_relative_path, which differ in the path and in how the first load finds
    its directory."""
    set_seed(42)
    model = DummyModel()
    optimizer = torch.optim.Adam(params=model.parameters(), lr=1e-3)
    train_dataloader, valid_dataloader = dummy_dataloaders()
    project_config = ProjectConfiguration(automatic_checkpoint_naming=True)

    # Train baseline
    accelerator = _accelerator(level, half, project_dir=tmpdir, project_config=project_config)
    model, optimizer, train_dataloader, valid_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, valid_dataloader
    )
    # Save initial
    accelerator.save_state(safe_serialization=use_safetensors)
    (a, b) = model.a.item(), model.b.item()
    state = _state(accelerator, model, optimizer)
    ground_truth_rands = train(3, model, train_dataloader, optimizer, accelerator)
    (a1, b1) = model.a.item(), model.b.item()
    state1 = _state(accelerator, model, optimizer)

    # Train partially
    set_seed(42)
    model = DummyModel()
    optimizer = torch.optim.Adam(params=model.parameters(), lr=1e-3)
    train_dataloader, valid_dataloader = dummy_dataloaders()
    project_config = ProjectConfiguration(iteration=1, automatic_checkpoint_naming=True)
    accelerator = _accelerator(level, half, project_dir=tmpdir, project_config=project_config)
    model, optimizer, train_dataloader, valid_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, valid_dataloader
    )
    _perturb(model, optimizer, accelerator, train_dataloader)
    if infer_directory:
        accelerator.load_state()  # <= infer the directory automatically
    else:
        accelerator.load_state(os.path.join(tmpdir, "checkpoints", "checkpoint_0"))
    (a2, b2) = model.a.item(), model.b.item()
    assert a == a2
    assert b == b2
    _assert_same_state(state, _state(accelerator, model, optimizer))

    test_rands = train(2, model, train_dataloader, optimizer, accelerator)
    # Save everything
    accelerator.save_state(safe_serialization=use_safetensors)

    # Load everything back in and make sure all states work
    _perturb(model, optimizer, accelerator, train_dataloader)
    accelerator.load_state(os.path.join(tmpdir, "checkpoints", "checkpoint_1"))
    test_rands += train(1, model, train_dataloader, optimizer, accelerator)
    (a3, b3) = model.a.item(), model.b.item()
    assert a1 == a3
    assert b1 == b3
    _assert_same_state(state1, _state(accelerator, model, optimizer))
    assert ground_truth_rands == test_rands


def test_can_resume_training(level, half, use_safetensors, tmp_path):
    """tests/test_state_checkpointing.py::CheckpointTest::test_can_resume_training; also: the FP32 values, the
    loss scale and the optimizer state equal the uninterrupted run's, and each load undoes an epoch and other
    weights in between."""
    _resume_with_automatic_naming(level, half, use_safetensors, str(tmp_path), infer_directory=False)


def test_can_resume_training_checkpoints_relative_path(level, half, use_safetensors, tmp_path, monkeypatch):
    """tests/test_state_checkpointing.py::CheckpointTest::test_can_resume_training_checkpoints_relative_path: a
    relative project directory, and the first ``load_state()`` finds the latest checkpoint itself. The relative
    directory is made under pytest's ``tmp_path`` (the working directory for the test), not in the checkout."""

    @contextmanager
    def temporary_relative_directory():
        # This is equivalent to tempfile.TemporaryDirectory() except that it returns a relative path
        rand_dir = f"test_path_{uuid.uuid4()}"
        os.mkdir(rand_dir)
        try:
            yield rand_dir
        finally:
            shutil.rmtree(rand_dir)

    monkeypatch.chdir(tmp_path)
    with temporary_relative_directory() as tmpdir:
        _resume_with_automatic_naming(level, half, use_safetensors, tmpdir, infer_directory=True)


def test_invalid_registration(level, half, use_safetensors):
    """tests/test_state_checkpointing.py::CheckpointTest::test_invalid_registration (no file is written: the
    ``use_safetensors`` parameter is upstream's class parameter)."""
    t = torch.tensor([1, 2, 3])
    t1 = torch.tensor([2, 3, 4])
    net = DummyModel()
    opt = torch.optim.Adam(net.parameters())
    accelerator = _accelerator(level, half)
    with pytest.raises(ValueError) as ve:
        accelerator.register_for_checkpointing(t, t1, net, opt)
    message = str(ve.value)
    assert "Item at index 0" in message
    assert "Item at index 1" in message
    assert "Item at index 2" not in message
    assert "Item at index 3" not in message


def _prepared_with_scheduler(level, half, project_dir):
    """Upstream's set-up of the scheduler tests: ``DummyModel``, Adam, ``StepLR`` and the dummy dataloaders, prepared
    by an accelerator that names its checkpoints automatically under ``project_dir``."""
    model = DummyModel()
    optimizer = torch.optim.Adam(params=model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.99)
    train_dataloader, valid_dataloader = dummy_dataloaders()
    project_config = ProjectConfiguration(automatic_checkpoint_naming=True)
    accelerator = _accelerator(level, half, project_dir=project_dir, project_config=project_config)
    return accelerator, *accelerator.prepare(model, optimizer, train_dataloader, valid_dataloader, scheduler)


def test_with_scheduler(level, half, use_safetensors, tmp_path):
    """tests/test_state_checkpointing.py::CheckpointTest::test_with_scheduler."""
    tmpdir = str(tmp_path)
    set_seed(42)
    accelerator, model, optimizer, train_dataloader, valid_dataloader, scheduler = _prepared_with_scheduler(
        level, half, tmpdir
    )
    # Save initial
    accelerator.save_state(safe_serialization=use_safetensors)
    scheduler_state = scheduler.state_dict()
    train(3, model, train_dataloader, optimizer, accelerator, scheduler)
    assert scheduler_state != scheduler.state_dict()

    # Load everything back in and make sure all states work
    accelerator.load_state(os.path.join(tmpdir, "checkpoints", "checkpoint_0"))
    assert scheduler_state == scheduler.state_dict()


def test_automatic_loading(level, half, use_safetensors, tmp_path):
    """tests/test_state_checkpointing.py::CheckpointTest::test_automatic_loading. That the last epoch moved the
    weights is checked on the FP32 values (at O2 a half parameter may round an epoch's change away); that the
    load brought them back, on the model as upstream and on the FP32 values."""
    tmpdir = str(tmp_path)
    set_seed(42)
    accelerator, model, optimizer, train_dataloader, valid_dataloader, scheduler = _prepared_with_scheduler(
        level, half, tmpdir
    )
    # Save initial
    accelerator.save_state(safe_serialization=use_safetensors)
    train(2, model, train_dataloader, optimizer, accelerator, scheduler)
    (a2, b2) = model.a.item(), model.b.item()
    state2 = _state(accelerator, model, optimizer)
    # Save a first time
    accelerator.save_state(safe_serialization=use_safetensors)
    train(1, model, train_dataloader, optimizer, accelerator, scheduler)
    values3 = _state(accelerator, model, optimizer)[0]

    # Load back in the last saved checkpoint, should point to a2, b2
    accelerator.load_state()
    values = _state(accelerator, model, optimizer)[0]
    assert values3["a"] != values["a"]
    assert values3["b"] != values["b"]
    assert a2 == model.a.item()
    assert b2 == model.b.item()
    _assert_same_state(state2, _state(accelerator, model, optimizer))


def test_checkpoint_deletion(level, half, use_safetensors, tmp_path):
    """tests/test_state_checkpointing.py::CheckpointTest::test_checkpoint_deletion."""
    tmpdir = str(tmp_path)
    set_seed(42)
    model = DummyModel()
    project_config = ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=2)
    # Train baseline
    accelerator = _accelerator(level, half, project_dir=tmpdir, project_config=project_config)
    model = accelerator.prepare(model)
    # Save 3 states:
    for _ in range(11):
        accelerator.save_state(safe_serialization=use_safetensors)
    assert not os.path.exists(os.path.join(tmpdir, "checkpoints", "checkpoint_0"))
    assert os.path.exists(os.path.join(tmpdir, "checkpoints", "checkpoint_9"))
    assert os.path.exists(os.path.join(tmpdir, "checkpoints", "checkpoint_10"))
    assert sorted(os.listdir(os.path.join(tmpdir, "checkpoints"))) == ["checkpoint_10", "checkpoint_9"]


def test_map_location(level, half, use_safetensors, tmp_path):
    """tests/test_state_checkpointing.py::CheckpointTest::test_map_location: upstream launches the file's
    ``__main__`` part on a GPU machine; here it runs in the test's process, on the CPU, which is then the device:
    ``map_location="cpu"`` and ``"on_device"`` load, an invalid one is refused."""
    savedir = str(tmp_path)
    accelerator, model, optimizer, train_dataloader, valid_dataloader, scheduler = _prepared_with_scheduler(
        level, half, savedir
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    train(3, model, train_dataloader, optimizer, accelerator, scheduler)
    # Check that the initial optimizer is loaded on the device
    for group in optimizer.param_groups:
        param_device = group["params"][0].device
        break
    assert param_device.type == accelerator.device.type
    model = model.cpu()
    accelerator.save_state(safe_serialization=use_safetensors)
    saved = _state(accelerator, model, optimizer)

    # Check CPU state
    accelerator.load_state(os.path.join(savedir, "checkpoints", "checkpoint_0"), map_location="cpu")
    for group in optimizer.param_groups:
        param_device = group["params"][0].device
        break
    assert param_device.type == torch.device("cpu").type
    _assert_same_state(saved, _state(accelerator, model, optimizer))

    # Check device state
    model.to(accelerator.device)
    accelerator.load_state(os.path.join(savedir, "checkpoints", "checkpoint_0"), map_location="on_device")
    for group in optimizer.param_groups:
        param_device = group["params"][0].device
        break
    assert param_device.type == accelerator.device.type
    _assert_same_state(saved, _state(accelerator, model, optimizer))

    # Check error
    with pytest.raises(TypeError, match="Unsupported optimizer map location passed"):
        accelerator.load_state(os.path.join(savedir, "checkpoints", "checkpoint_0"), map_location="invalid")
