"""O1's table follows the model's device when the user gives none (``CastTable.for_device``).

On CUDA, O1's default is the default table with every difference from CUDA ``torch.autocast`` settled autocast's way,
so the forward runs on autocast's C++ dispatch with no torch-function mode (issue 25: the mode's Python per call made
O1 slower than Lightning's "16-mixed" on host-bound steps). Elsewhere the default table and its Python policy stay.
A table the user gives or changes, and the Apex layer's policy, are left alone. The CUDA tests run in
``gpu_suite.py tests``; on CPU the device is simulated at the one point where Amp reads it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lightning_mpx.engine.preparation as amp_module
from lightning_mpx import Amp, CastTable, dispatchable

CUDA = torch.cuda.is_available()


def _categories(table: CastTable) -> dict:
    return {entry.function: entry.category for entry in table}


def test_the_cuda_table_is_autocast_and_nothing_else_changed():
    default, cuda = CastTable.default(), CastTable.for_device("cuda")
    assert cuda.autocast_differences("cuda") == {}
    differences = default.autocast_differences("cuda")
    mine, theirs = _categories(default), _categories(cuda)
    for function, category in mine.items():
        if function not in differences:
            assert theirs[function] == category
    for function, (_, autocast) in differences.items():
        assert theirs.get(function) == autocast
    assert differences, "the default table differs from CUDA autocast (tests/test_autocast_agreement.py pins how)"


@pytest.mark.parametrize("device_type", ["cpu", "mps", "xpu"])
def test_other_devices_keep_the_default_table(device_type):
    assert _categories(CastTable.for_device(device_type)) == _categories(CastTable.default())


def test_for_device_names_the_argument():
    with pytest.raises(TypeError, match="device_type=None"):
        CastTable.for_device(None)
    with pytest.raises(ValueError, match="half_dtype='int8'.*valid choices"):
        CastTable.for_device("cpu", half_dtype="int8")
    with pytest.raises(TypeError, match="model=str is not a torch.nn.Module"):
        CastTable.for_device("cuda", "bfloat16", model="lstm")


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 4))


def test_o1_on_a_cpu_model_keeps_the_python_policy():
    amp = Amp("O1", half_dtype="bfloat16")
    model = amp.prepare_model(_mlp())
    assert amp.policy.engine_in_use == "mode"
    with amp.forward_context():
        out = model(torch.randn(2, 8))
        assert out.dtype == torch.bfloat16
        assert torch.softmax(out, -1).dtype == torch.float32  # the default table's FP32 row (CPU autocast: bf16)


@pytest.fixture
def on_cuda(monkeypatch):
    """Amp sees every model as a CUDA model (a CPU machine cannot hold one): the tables and engines it picks."""
    where = {"device": "cuda"}
    monkeypatch.setattr(amp_module, "_device_type", lambda module: where["device"])
    return where


def _first_forward(amp):
    with amp.forward_context():
        pass


def test_o1_on_a_cuda_model_runs_on_autocast_alone(on_cuda):
    amp = Amp("O1", half_dtype="float16")
    _model = amp.prepare_model(_mlp())  # kept alive: Amp holds the model weakly until its first forward
    _first_forward(amp)
    assert amp.policy.device_type == "cuda"
    assert amp.policy.engine_in_use == "autocast:cuda"
    assert amp.policy.python_functions == ()
    # A user row registered afterwards goes into the CUDA table and brings the Python policy back (its cost).
    amp.policy.table.register(torch.outer, "float")
    assert amp.policy.engine_in_use == "mode"


class _Tagger(torch.nn.Module):
    def __init__(self, rnn):
        super().__init__()
        self.rnn, self.head = rnn, torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


@pytest.mark.parametrize("rnn", [torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN])
def test_bf16_rnn_models_keep_their_rnns_in_bf16_on_cuda(on_cuda, rnn):
    """CUDA autocast runs cuDNN RNNs in float16 even at bfloat16 (torch's _cudnn_rnn wrapper casts to kHalf): a
    bfloat16 model with RNN modules keeps them in bfloat16 through the Python policy; without one, or at float16,
    O1 stays on autocast's dispatch alone."""
    amp = Amp("O1", half_dtype="bfloat16")
    model = amp.prepare_model(_Tagger(rnn(8, 8, batch_first=True)))  # (Amp holds the model weakly)
    _first_forward(amp)
    assert amp.policy.device_type == "cuda" and amp.policy.table.entry(torch.std) is None  # the CUDA table
    assert amp.policy.engine_in_use == "mode"
    rows = {getattr(torch, name) for name in ("lstm", "gru", "rnn_tanh", "rnn_relu")}
    assert rows <= set(amp.policy.table.autocast_differences("cuda", half_dtype="bfloat16"))
    assert all(amp.policy.table.entry(f).category == "half" for f in rows)

    for half, model in (("bfloat16", _mlp()), ("float16", _Tagger(rnn(8, 8, batch_first=True)))):
        other = Amp("O1", half_dtype=half)
        other.prepare_model(model)
        _first_forward(other)
        assert other.policy.engine_in_use == "autocast:cuda" and other.policy.python_functions == ()


@pytest.mark.skipif(not CUDA, reason="needs CUDA (gpu_suite.py tests runs it)")
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_cuda_o1_runs_an_lstm_in_its_own_dtype(half):
    """torch.autocast("cuda", bfloat16) runs nn.LSTM in float16; O1 at bfloat16 runs it in bfloat16."""
    model = _Tagger(torch.nn.LSTM(8, 8, batch_first=True)).cuda()
    x = torch.randn(2, 5, 8, device="cuda")
    seen = []
    model.rnn.register_forward_hook(lambda module, args, out: seen.append(out[0].dtype))
    amp = Amp("O1", half_dtype=half)
    amp.prepare_model(model)
    with amp.forward_context():
        model(x).float().sum().backward()
    assert seen == [half]
    assert model.rnn.weight_ih_l0.grad is not None and model.rnn.weight_ih_l0.grad.dtype == torch.float32


def test_the_rnn_rows_differ_from_cuda_autocast_only_at_bf16():
    default, aligned = CastTable.default(), CastTable.autocast_aligned("cuda")
    rows = {getattr(torch, name) for name in ("lstm", "gru", "rnn_tanh", "rnn_relu")}
    at_bf16 = default.autocast_differences("cuda", half_dtype=torch.bfloat16)
    assert {f: at_bf16[f] for f in rows} == dict.fromkeys(rows, ("half", "float16"))
    assert not rows & set(default.autocast_differences("cuda", half_dtype=torch.float16))
    # A table taking autocast's choices takes this one too, through copies and pickles.
    import pickle

    for table in (aligned, aligned.copy(), pickle.loads(pickle.dumps(aligned))):
        assert table.autocast_differences("cuda", half_dtype="bfloat16") == {}


def test_a_table_the_user_gave_or_changed_is_kept(on_cuda):
    given = CastTable.default()
    amp = Amp("O1", cast_table=given)
    _model = amp.prepare_model(_mlp())  # kept alive: Amp holds the model weakly until its first forward
    _first_forward(amp)
    assert amp.policy.table is given and amp.policy.engine_in_use == "mode"

    changed = Amp("O1")
    changed.policy.table.register(torch.outer, "half")
    _model = changed.prepare_model(_mlp())
    _first_forward(changed)
    assert changed.policy.table.entry(torch.outer).category == "half"
    assert changed.policy.table.entry(torch.std).category == "float"  # still the default table's row
    assert changed.policy.engine_in_use == "mode"

    by_hand = Amp("O1")
    by_hand.policy.engine = "mode"
    _model = by_hand.prepare_model(_mlp())
    _first_forward(by_hand)
    assert by_hand.policy.table.entry(torch.std).category == "float"


def test_the_device_at_the_first_forward_decides(on_cuda):
    """Lightning and Fabric convert the model before they move it to its device: the device it has when the first
    forward runs is the one that counts; later models and moves change nothing."""
    on_cuda["device"] = "cpu"
    amp = Amp("O1")
    model = amp.prepare_model(_mlp())
    assert amp.policy.device_type is None  # not decided yet
    on_cuda["device"] = "cuda"  # the framework moved it
    _first_forward(amp)
    assert amp.policy.device_type == "cuda" and amp.policy.engine_in_use == "autocast:cuda"
    table = amp.policy.table
    on_cuda["device"] = "cpu"
    other = amp.prepare_model(_mlp())
    _first_forward(amp)
    assert amp.policy.table is table and amp.policy.device_type == "cuda"
    del model, other


def test_apex_layer_keeps_apex_table(on_cuda):
    from lightning_mpx.apex import _amp_state
    from lightning_mpx.apex import amp as apex_amp

    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        apex_amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
        assert _amp_state.amp.policy.engine_in_use == "mode"
        assert _amp_state.amp.policy.table.entry(torch.std).category == "float"
    finally:
        _amp_state.reset()
        _amp_state.registrations.clear()


def _amp_step(amp):
    """The Amp half of a loop step (the optimizer prepared at the first call)."""
    prepared = []

    def amp_step(loss, optimizer):
        if not prepared:
            prepared.append(amp.prepare_optimizer(optimizer))
        amp.backward(loss)
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()

    return amp_step


def _train(model, steps, forward_context, scaler_step, poison=None):
    torch.manual_seed(1)
    data = [(torch.randn(16, 8), torch.randint(0, 4, (16,))) for _ in range(steps)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for index, (x, y) in enumerate(data):
        with forward_context():
            loss = F.cross_entropy(model(x.to(next(model.parameters()).device)),
                                   y.to(next(model.parameters()).device))
        if index == poison:
            loss = loss * 1e30  # the scaled gradients overflow: the step is skipped and the scale backed off
        scaler_step(loss, optimizer)
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
def test_o1_on_the_aligned_table_trains_as_an_autocast_loop(half):
    """On CPU, O1 with CPU autocast's own choices is a torch.autocast loop (bfloat16: static scale 1; float16: with
    torch's GradScaler at the same settings), bit for bit: what O1's default on CUDA is to a "16-mixed" loop."""
    torch.manual_seed(0)
    reference = _mlp()
    mine = _mlp()
    mine.load_state_dict(reference.state_dict())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2000, enabled=half == torch.float16)

    def plain_step(loss, optimizer):
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    poison = 2 if half == torch.float16 else None
    expected, reference = _train(reference, 5, lambda: torch.autocast("cpu", dtype=half), plain_step, poison)
    amp = Amp("O1", half_dtype=half, cast_table=CastTable.autocast_aligned("cpu"))
    amp.prepare_model(mine)
    amp_step = _amp_step(amp)
    got, mine = _train(mine, 5, amp.forward_context, amp_step, poison)
    assert amp.policy.engine_in_use == "autocast:cpu"
    assert got == expected
    if poison is not None:
        assert amp.scalers[0].get_scale() == scaler.get_scale() == 2.0**15
    for a, b in zip(reference.parameters(), mine.parameters()):
        assert torch.equal(a, b)


@pytest.mark.skipif(not CUDA, reason="needs CUDA (gpu_suite.py tests runs it)")
def test_o1_default_on_cuda_is_an_autocast_gradscaler_loop():
    """fp16 on CUDA with no table given: no torch-function mode in the forward, autocast's dtypes, and the same
    losses and weights as torch.autocast + GradScaler with the same scaler settings."""
    torch.manual_seed(0)
    reference, mine = _mlp().cuda(), _mlp().cuda()
    mine.load_state_dict(reference.state_dict())
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16, growth_interval=2000)

    def scaler_step(loss, optimizer):
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    expected, reference = _train(reference, 5, lambda: torch.autocast("cuda", dtype=torch.float16), scaler_step, 2)
    amp = Amp("O1", half_dtype="float16")
    amp.prepare_model(mine)
    with amp.forward_context():  # the first forward adopts the model's device (not prepare_model)
        assert amp.policy.engine_in_use == "autocast:cuda"
        assert torch._C._len_torch_function_stack() == 0
        x = torch.randn(4, 8, device="cuda")
        assert mine[0](x).dtype == torch.float16
        assert torch.softmax(mine[0](x), -1).dtype == torch.float32
        assert mine[1](mine[0](x)).dtype == torch.float32

    amp_step = _amp_step(amp)
    got, mine = _train(mine, 5, amp.forward_context, amp_step, 2)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert amp.scalers[0].get_scale() == scaler.get_scale() == 2.0**15
    for a, b in zip(reference.parameters(), mine.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)

    @dispatchable
    def user_op(t):
        return t * 2

    amp.policy.table.register(user_op, "float")
    with amp.forward_context():
        assert user_op(torch.ones(2, device="cuda", dtype=torch.float16)).dtype == torch.float32


class _MatmulSGD(torch.optim.SGD):
    """SGD that also runs a matmul in its step (as Shampoo or Muon do) and records its dtype."""

    def __init__(self, params, seen):
        super().__init__(params, lr=0.1)
        self.seen = seen

    @torch.no_grad()
    def step(self, closure=None):
        weight = self.param_groups[0]["params"][0]
        self.seen.append(torch.mm(weight, weight.t()).dtype)
        return super().step(closure)


@pytest.mark.parametrize("automatic", [True, False], ids=["automatic", "manual"])
def test_the_plugins_backward_and_step_run_outside_autocast(automatic):
    """On autocast's dispatch (O1's default on CUDA; the aligned table here) the optimizer step runs with autocast
    off, also a manual step taken inside the training step's scope, as it does with the Python policy."""
    import lightning.pytorch as pl

    from lightning_mpx import MixedPrecisionPlugin
    from tests.lightning_helpers import classification_data, loader, make_trainer

    seen: list[torch.dtype] = []

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp()
            self.net[-1] = torch.nn.Linear(8, 4)
            self.automatic_optimization = automatic

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = F.cross_entropy(self.net(x[:, :8]), y)
            if automatic:
                return loss
            optimizer = self.optimizers()
            self.manual_backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            return None

        def configure_optimizers(self):
            return _MatmulSGD(self.parameters(), seen)

    plugin = MixedPrecisionPlugin("O1", half_dtype="bfloat16", cast_table=CastTable.autocast_aligned("cpu"))
    make_trainer(plugin, max_steps=2).fit(Module(), loader(classification_data()))
    assert plugin.amp.policy.engine_in_use == "autocast:cpu"
    assert seen == [torch.float32, torch.float32]


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_accelerates_backward_and_step_inside_autocast_run_outside_it():
    """Accelerate users sometimes write the whole step inside ``with accelerator.autocast():``."""
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    seen: list[torch.dtype] = []
    accelerator = Accelerator(mixed_precision="O1", kwargs_handlers=[MixedPrecisionKwargs(
        half_dtype="bfloat16", cast_table=CastTable.autocast_aligned("cpu"))])
    model = _mlp()
    model, optimizer = accelerator.prepare(model, _MatmulSGD(model.parameters(), seen))
    for step in range(2):
        with accelerator.autocast():
            loss = F.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 2, 3]))
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    assert accelerator.amp.policy.engine_in_use == "autocast:cpu"
    assert seen == [torch.float32, torch.float32]


def test_plugin_o1_on_autocast_is_lightnings_own_bf16_mixed_on_a_real_model():
    """A Hugging Face GPT-2 (from a config) trained by the plugin on autocast's dispatch (what O1 runs on CUDA with no
    table given; CPU autocast's table here) and by Lightning's own "bf16-mixed": the same losses and weights, bit for
    bit, as "16-mixed" and the plugin at O1 would be on a GPU."""
    transformers = pytest.importorskip("transformers")
    import lightning.pytorch as pl

    from lightning_mpx import MixedPrecisionPlugin
    from tests.lightning_helpers import make_trainer

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
            self.model = transformers.GPT2LMHeadModel(config)
            self.losses = []

        def training_step(self, batch, batch_idx):
            (tokens,) = batch
            loss = self.model(input_ids=tokens, labels=tokens).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    tokens = torch.randint(0, 64, (12, 16), generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=4)
    runs = []
    for precision in ("lightning", "plugin"):
        module = LM()
        if precision == "lightning":
            make_trainer(precision="bf16-mixed", max_steps=3).fit(module, data)
        else:
            plugin = MixedPrecisionPlugin("O1", half_dtype="bfloat16", cast_table=CastTable.autocast_aligned("cpu"))
            make_trainer(plugin, max_steps=3).fit(module, data)
            assert plugin.amp.policy.engine_in_use == "autocast:cpu"
        runs.append(module)
    lightning_run, plugin_run = runs
    assert plugin_run.losses == lightning_run.losses and len(plugin_run.losses) == 3
    for a, b in zip(lightning_run.parameters(), plugin_run.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("table", ["aligned", "default"])
def test_core_backward_and_step_inside_the_forward_scope_run_outside_it(table):
    """A core loop written with the whole step inside ``amp.forward_context()``: the optimizer's own matmul runs in
    FP32 on either engine."""
    seen: list[torch.dtype] = []
    cast_table = CastTable.autocast_aligned("cpu") if table == "aligned" else None
    amp = Amp("O1", half_dtype="bfloat16", cast_table=cast_table)
    model = amp.prepare_model(_mlp())
    optimizer = amp.prepare_optimizer(_MatmulSGD(model.parameters(), seen))
    with amp.forward_context():
        loss = F.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 2, 3]))
        amp.backward(loss)
        assert amp.step(optimizer)
    amp.update()
    assert seen == [torch.float32]
