"""O2 with frozen parameters: LoRA fine-tuning (Hugging Face peft) and a frozen backbone.

The usual habit is an optimizer over every parameter (``AdamW(model.parameters())``, Lightning's
``self.parameters()``), frozen ones included: torch's optimizers skip a parameter without a gradient. At O2 an FP32
master is made for a half parameter the first time it has a gradient to step, so a frozen base model gets none: a LoRA
fine-tune holds FP32 copies of its adapters only, not of the whole model (which would be twice the half model's
memory again), and a parameter unfrozen later (``requires_grad_(True)``) gets its master at its first gradient, as
Apex made masters for the parameters that require a gradient.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("sklearn")

from lightning_mpx import Amp  # noqa: E402
from tests import real_models as rm  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

# 20 steps: the LoRA run's held-out loss 0.948 of the untrained model's in FP32 and at O2, 0.003% apart (40 steps:
# 0.945, 0.005% apart, for twice the bfloat16 compute).
STEPS, BATCH, LR = 20, 16, 1e-2


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread, as tests/test_real_models.py: the same reductions, so the same bits, on any machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def lora_gpt2(seed: int, checkpointing: bool | None = None) -> nn.Module:
    """real_models' GPT-2 with LoRA adapters on the attention and MLP projections; ``checkpointing``: activation
    checkpointing on, reentrant (``True``) or not (``False``), with ``enable_input_require_grads()`` as PEFT's
    recipe has it (with the embeddings frozen, the reentrant blocks' inputs would not require gradients)."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    base = GPT2LMHeadModel(GPT2Config(**rm.GPT2_CONFIG))
    if checkpointing is not None:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
        base.enable_input_require_grads()
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], lora_dropout=0.0, fan_in_fan_out=True)
    return get_peft_model(base, config)


def fit_lora(plugin: Any, seed: int = 0) -> tuple[nn.Module, list[float], float, Any]:
    """LoRA on the digits through a Lightning Trainer (``plugin``: the MixedPrecisionPlugin, or None for
    Lightning's "32-true"), the optimizer over ``self.parameters()``; returns the model, the training losses, the
    held-out loss and the Trainer."""
    import lightning.pytorch as pl

    from tests.lightning_helpers import make_trainer

    losses: list[float] = []

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = lora_gpt2(seed)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = rm.gpt2_loss(rm.gpt2_forward(self.model, *batch), *batch)
            losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=LR)  # frozen parameters included, as users write it

    module = Module()
    trainer = make_trainer(plugin) if plugin is not None else make_trainer(precision="32-true")
    trainer.fit(module, rm.train_loader(seed, STEPS, BATCH))
    return module.model, losses, held_out_loss(module.model), trainer


@torch.no_grad()
def held_out_loss(model: nn.Module) -> float:
    model.eval()
    total = count = 0.0
    for pixels, labels in rm.held_out_loader():
        total += rm.gpt2_loss(rm.gpt2_forward(model, pixels, labels), pixels, labels).item() * len(labels)
        count += len(labels)
    return total / count


def test_lora_through_the_trainer_keeps_fp32_masters_of_the_adapters_only(tmp_path):
    from lightning_mpx import MixedPrecisionPlugin

    _, reference_losses, reference, _ = fit_lora(None)
    initial = {n: p.detach().clone() for n, p in lora_gpt2(0).named_parameters()}
    plugin = MixedPrecisionPlugin("O2", half_dtype="bfloat16")
    model, losses, held_out, trainer = fit_lora(plugin)
    amp = plugin.amp

    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable) and len(frozen) > len(trainable)
    pairs = [(half, master) for masters in amp.master_weights for half, master in masters.half_pairs]
    assert {id(half) for half, _ in pairs} == {id(p) for p in trainable.values()}
    assert sum(master.numel() for _, master in pairs) == sum(p.numel() for p in trainable.values())
    assert all(master.dtype == torch.float32 for _, master in pairs)
    for name, param in frozen.items():  # the base model: half, untouched, no master
        assert param.dtype == torch.bfloat16 and amp.master_of(param) is param, name
        assert torch.equal(param, initial[name].to(torch.bfloat16)), name
    for name, param in trainable.items():  # the adapters trained in FP32: the model holds their rounding
        assert torch.equal(param, amp.master_of(param).to(torch.bfloat16)), name
        assert not torch.equal(amp.master_of(param), initial[name]), name

    # It learns as the FP32 LoRA run does, and the checkpoint holds the adapters' masters only.
    untrained = held_out_loss(lora_gpt2(0))
    assert reference < 0.96 * untrained and held_out < 0.96 * untrained  # adapters on a random base: a few %
    assert abs(held_out / reference - 1) <= 0.01, (held_out, reference)
    assert amp.skipped_steps[0] == 0 and len(losses) == len(reference_losses) == STEPS
    # The export through the plugin: the adapters as their FP32 masters, the frozen base as its half values upcast.
    exported = plugin.amp.fp32_state_dict(model)
    own = model.state_dict(keep_vars=True)
    assert list(exported) == list(own) and all(t.dtype == torch.float32 for t in exported.values())
    for key, value in own.items():
        expected = amp.master_of(value) if value.requires_grad else value.float()
        assert torch.equal(exported[key], expected), key
    trainer.save_checkpoint(tmp_path / "lora.ckpt")
    saved = torch.load(tmp_path / "lora.ckpt", weights_only=False)
    (entry,) = [state for state in saved.values() if isinstance(state, dict) and "master_weights" in state]
    # Each master once: in the entry, or named there and held (FP32) in the checkpoint's state_dict.
    (masters,), (held,) = entry["master_weights"], entry.get("masters_in_state_dict", [[]])
    assert all(saved["state_dict"][name].dtype == torch.float32 for name in held)
    assert set(masters) | set(held) == {amp._names[id(p)] for p in trainable.values()}


def _two_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _frozen_head() -> tuple[Amp, nn.Sequential, torch.optim.Optimizer]:
    """O2 over two layers, the second frozen before preparing (as a LoRA base is: no FP32 value kept for it), the
    optimizer over every parameter (the usual habit). One frozen after preparing keeps its FP32 value, which becomes
    its master: tests/test_frozen_after_setup.py."""
    amp = Amp("O2", half_dtype="bfloat16")
    model = _two_layers()
    model[2].requires_grad_(False)
    amp.prepare_model(model)
    return amp, model, amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))


def _stepper(amp: Amp, opt: torch.optim.Optimizer) -> Any:
    def step(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
        with amp.forward_context():
            loss = nn.functional.mse_loss(m(x.to(torch.bfloat16)).float(), y)
        amp.backward(loss)
        amp.step(opt)
        amp.update()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def _train(model: nn.Module, step: Any, steps: int) -> list[float]:
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
        losses.append(step(model, x, y))
    return losses


def test_a_frozen_parameter_gets_its_master_at_its_first_gradient():
    """Frozen at first (held by the optimizer, no master, never stepped), then unfrozen in place: its master is
    made at its first gradient, the optimizer steps that FP32 master, and training follows an FP32 run of the same
    schedule."""
    amp, model, opt = _frozen_head()
    head = model[2]
    amp_step = _stepper(amp, opt)
    frozen_value = head.weight.detach().clone()
    _train(model, amp_step, 3)
    assert amp.master_of(head.weight) is head.weight and amp.master_of(head.bias) is head.bias
    assert torch.equal(head.weight, frozen_value) and head.weight not in opt.state
    assert len([1 for masters in amp.master_weights for _ in masters.half_pairs]) == 2  # the first layer's

    head.requires_grad_(True)
    losses = _train(model, amp_step, 6)
    master = amp.master_of(head.weight)
    assert master is not head.weight and master.dtype == torch.float32
    assert opt.state[master]["exp_avg"].dtype == torch.float32  # the optimizer stepped the FP32 master
    assert torch.equal(head.weight, master.to(torch.bfloat16)) and not torch.equal(head.weight, frozen_value)

    # The same schedule in FP32.
    reference = _two_layers()
    reference[2].requires_grad_(False)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)

    def fp32_step(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
        loss = nn.functional.mse_loss(m(x), y)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        return loss.item()

    _train(reference, fp32_step, 3)
    reference[2].requires_grad_(True)
    ref_losses = _train(reference, fp32_step, 6)
    assert losses == pytest.approx(ref_losses, rel=0.05)
    assert torch.allclose(master, reference[2].weight, atol=2e-2)


def test_the_accelerator_makes_masters_for_the_adapters_only_and_exports_them():
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import accelerate_state_reset

    with accelerate_state_reset():
        accelerator = Accelerator(mixed_precision="O2", cpu=True,
                                  kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")])  # fmt: skip
        model = lora_gpt2(0)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        model, opt = accelerator.prepare(model, opt)
        pixels, labels = next(iter(rm.train_loader(0, 2, BATCH)))
        for _ in range(2):
            loss = rm.gpt2_loss(rm.gpt2_forward(model, pixels, labels), pixels, labels)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
        inner = accelerator.unwrap_model(model)
        trainable = [p for p in inner.parameters() if p.requires_grad]
        pairs = [half for masters in accelerator.amp.master_weights for half, _ in masters.half_pairs]
        assert {id(p) for p in pairs} == {id(p) for p in trainable}
        assert all(accelerator.amp.master_of(p) is p for p in inner.parameters() if not p.requires_grad)
        exported = accelerator.amp.fp32_state_dict(inner)
        for key, value in inner.state_dict(keep_vars=True).items():
            expected = accelerator.amp.master_of(value) if value.requires_grad else value.float()
            assert torch.equal(exported[key], expected), key


@pytest.mark.parametrize("unfreeze_before_saving", [False, True])
def test_a_checkpoint_with_a_frozen_parameter_resumes_exactly(unfreeze_before_saving):
    """A checkpoint taken while a parameter is frozen holds no master for it; the resumed run (the same parameter
    frozen, as the code that built it freezes it) continues bit for bit like the run that was not interrupted,
    through the parameter's unfreezing, before or after the checkpoint."""

    amp, model, opt = _frozen_head()
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)) for _ in range(8)]
    step = _stepper(amp, opt)
    for i, (x, y) in enumerate(batches[:4]):
        if i == 2 and unfreeze_before_saving:
            model[2].requires_grad_(True)
        step(model, x, y)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()})
    (masters,) = saved["amp"]["master_weights"]
    assert ("2.weight" in masters) is unfreeze_before_saving

    amp2, model2, opt2 = _frozen_head()
    if unfreeze_before_saving:
        model2[2].requires_grad_(True)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    amp2.load_state_dict(saved["amp"])
    step2 = _stepper(amp2, opt2)
    for i, (x, y) in enumerate(batches[4:]):
        if i == 1 and not unfreeze_before_saving:
            model[2].requires_grad_(True)
            model2[2].requires_grad_(True)
        assert step(model, x, y) == step2(model2, x, y)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q) and torch.equal(amp.master_of(p), amp2.master_of(q))


def test_fp32_state_dict_exports_the_masters_and_peft_saves_them(tmp_path):
    """``amp.fp32_state_dict(model)``: the model's state dict with the FP32 masters for the trained half parameters
    (exactly), frozen half ones upcast, the model itself unchanged; peft's ``save_pretrained(state_dict=...)`` then
    writes FP32 adapters equal to the masters, where the model's own state dict would give their bfloat16 rounding."""
    from safetensors.torch import load_file

    amp = Amp("O2", half_dtype="bfloat16")
    model = amp.prepare_model(lora_gpt2(0))
    opt = amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=LR))
    pixels, labels = next(iter(rm.train_loader(0, 1, BATCH)))
    for _ in range(3):
        with amp.forward_context():
            loss = rm.gpt2_loss(rm.gpt2_forward(model, pixels, labels), pixels, labels)
        amp.backward(loss)
        amp.step(opt)
        amp.update()
        opt.zero_grad()
    exported = amp.fp32_state_dict(model)
    own = model.state_dict(keep_vars=True)
    assert list(exported) == list(own)
    for key, value in own.items():
        master = amp.master_of(value)
        assert exported[key].dtype == (torch.float32 if value.is_floating_point() else value.dtype), key
        if master is not value:  # a trained adapter: its FP32 master, not the rounding the model holds
            assert torch.equal(exported[key], master) and not torch.equal(exported[key], value.float()), key
        else:
            assert torch.equal(exported[key], value.float() if value.is_floating_point() else value), key
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # the model is not changed

    model.save_pretrained(str(tmp_path), state_dict=exported)
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    masters = [amp.master_of(p) for p in model.parameters() if p.requires_grad]
    assert saved and len(saved) == len(masters)
    assert all(v.dtype == torch.float32 and any(torch.equal(v, m) for m in masters) for v in saved.values())


def test_fp32_state_dict_takes_writes_to_the_model_and_refuses_what_is_not_a_module():
    amp, model, opt = _frozen_head()
    _train(model, _stepper(amp, opt), 2)
    with torch.no_grad():
        model[0].weight.fill_(0.5)  # a write after the last step (loaded weights): the export has it
    exported = amp.fp32_state_dict(model)
    assert torch.equal(exported["0.weight"], torch.full_like(exported["0.weight"], 0.5))
    assert torch.equal(exported["2.weight"], model[2].weight.float())  # frozen: its half value, upcast
    with pytest.raises(TypeError, match="module=OrderedDict is not a torch.nn.Module"):
        amp.fp32_state_dict(model.state_dict())
    amp.sharded = True  # as prepare_model sets it for an FSDP-sharded model (tests/test_*fsdp* run real ones)
    with pytest.raises(ValueError, match="module=Sequential: this Amp trains an FSDP-sharded model"):
        amp.fp32_state_dict(model)
    o1 = Amp("O1", half_dtype="bfloat16")
    plain = o1.prepare_model(_two_layers())
    assert all(torch.equal(a, b) for a, b in zip(o1.fp32_state_dict(plain).values(), plain.state_dict().values()))


@pytest.mark.parametrize("reentrant", [True, False])
def test_lora_with_activation_checkpointing_trains_as_without(reentrant):
    """PEFT's recipe with activation checkpointing (``enable_input_require_grads``) at O2: the recomputed blocks
    give the adapters the gradients the plain forward gives, bit for bit."""
    pixels, labels = next(iter(rm.train_loader(0, 1, BATCH)))
    runs = []
    for checkpointing in (None, reentrant):
        amp = Amp("O2", half_dtype="bfloat16")
        model = amp.prepare_model(lora_gpt2(0, checkpointing))
        opt = amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=LR))
        losses = []
        for _ in range(3):
            with amp.forward_context():
                loss = rm.gpt2_loss(rm.gpt2_forward(model, pixels, labels), pixels, labels)
            amp.backward(loss)
            trainable = [p for p in model.parameters() if p.requires_grad]
            assert all(p.grad is not None for p in trainable)
            amp.step(opt)
            amp.update()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append((losses, [amp.master_of(p).clone() for p in model.parameters() if p.requires_grad]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_lora_through_the_trainer_resumes_from_a_checkpoint_exactly(tmp_path):
    """Two epochs of LoRA at O2 through the Trainer equal one epoch, a checkpoint, and a second epoch resumed from it
    by a new Trainer and plugin (``fit(ckpt_path=...)``): adapters' masters, the model and the optimizer state."""
    import lightning.pytorch as pl

    from lightning_mpx import MixedPrecisionPlugin
    from tests.lightning_helpers import make_trainer

    data = rm.train_loader(0, 6, BATCH)  # 6 steps per epoch

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = lora_gpt2(0)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return rm.gpt2_loss(rm.gpt2_forward(self.model, *batch), *batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=LR)

    def fit(epochs: int, ckpt: Path | None = None) -> tuple[Module, MixedPrecisionPlugin, Any]:
        plugin = MixedPrecisionPlugin("O2", half_dtype="bfloat16")
        module, trainer = Module(), make_trainer(plugin, max_epochs=epochs)
        trainer.fit(module, data, ckpt_path=ckpt)
        return module, plugin, trainer

    straight, straight_plugin, straight_trainer = fit(2)
    first, _, first_trainer = fit(1)
    first_trainer.save_checkpoint(tmp_path / "one_epoch.ckpt")
    resumed, resumed_plugin, resumed_trainer = fit(2, tmp_path / "one_epoch.ckpt")
    assert resumed_trainer.global_step == straight_trainer.global_step == 12
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(straight_plugin.amp.master_of(a), resumed_plugin.amp.master_of(b))
    states = [t.optimizers[0].state_dict()["state"] for t in (straight_trainer, resumed_trainer)]
    trainable = sum(p.requires_grad for p in straight.parameters())
    assert states[0].keys() == states[1].keys() and len(states[0]) == trainable
    for key in states[0]:
        assert all(torch.equal(states[0][key][k], states[1][key][k]) for k in states[0][key])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (gpu_suite.py tests runs it)")
def test_cuda_frozen_parameters_with_the_fused_kernels():
    """On CUDA the unscale into the masters and the master-to-model copy run the fused kernels: a frozen parameter
    the optimizer holds gets no master and stays as it is, one unfrozen in place gets its master at its first
    gradient, and a checkpoint resumes exactly, as on the CPU."""
    device = torch.device("cuda")

    def build() -> tuple[Amp, nn.Module, torch.optim.Optimizer]:
        amp = Amp("O2", half_dtype="bfloat16")
        model = _two_layers().to(device)
        model[2].requires_grad_(False)  # before preparing, as a LoRA base (no FP32 value kept for it)
        amp.prepare_model(model)
        return amp, model, amp.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))

    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(16, 6, generator=g).to(device), torch.randn(16, 3, generator=g).to(device))
               for _ in range(8)]  # fmt: skip
    amp, model, opt = build()
    step = _stepper(amp, opt)
    frozen = model[2].weight.detach().clone()
    for x, y in batches[:3]:
        step(model, x, y)
    assert amp.master_of(model[2].weight) is model[2].weight and torch.equal(model[2].weight, frozen)
    model[2].requires_grad_(True)
    step(model, *batches[3])
    assert amp.master_of(model[2].weight).dtype == torch.float32
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()})
    amp2, model2, opt2 = build()
    model2[2].requires_grad_(True)
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    amp2.load_state_dict(saved["amp"])
    step2 = _stepper(amp2, opt2)
    for x, y in batches[4:]:
        assert step(model, x, y) == step2(model2, x, y)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q) and torch.equal(amp.master_of(p), amp2.master_of(q))


def test_litgpt_lora_through_fabric_keeps_masters_of_the_adapters_only():
    """litgpt's own LoRA (``litgpt.lora.GPT``, ``mark_only_lora_as_trainable``) through Lightning Fabric with the
    Fabric plugin at O2: masters for the LoRA matrices only, and the losses of the FP32 run within bfloat16's
    rounding."""
    pytest.importorskip("litgpt")
    from lightning.fabric import Fabric
    from litgpt.lora import GPT, Config, mark_only_lora_as_trainable

    from lightning_mpx import FabricMixedPrecisionPlugin

    def run(plugin: Any) -> tuple[list[float], nn.Module]:
        torch.manual_seed(0)
        config = Config(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=100, padded_vocab_size=100,
                        lora_r=4, lora_alpha=8, lora_query=True, lora_value=True, lora_mlp=True)  # fmt: skip
        model = GPT(config)
        mark_only_lora_as_trainable(model)
        fabric = Fabric(accelerator="cpu", devices=1, **({"plugins": [plugin]} if plugin else {"precision": "32-true"}))
        model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
        ids = torch.randint(0, 100, (4, 17), generator=torch.Generator().manual_seed(1))
        losses = []
        for _ in range(8):
            logits = model(ids[:, :-1])
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, 100), ids[:, 1:].reshape(-1))
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, model

    reference, _ = run(None)
    mpx = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")
    losses, model = run(mpx)
    trainable = [p for p in model.parameters() if p.requires_grad]
    pairs = [half for masters in mpx.amp.master_weights for half, _ in masters.half_pairs]
    assert {id(p) for p in pairs} == {id(p) for p in trainable} and len(trainable) < len(list(model.parameters()))
    assert losses == pytest.approx(reference, rel=2e-3) and losses[-1] < 0.95 * losses[0]
