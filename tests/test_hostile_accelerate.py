"""The Accelerate adapter driven the way Accelerate scripts (Hugging Face's ``no_trainer`` examples) drive
``accelerate.Accelerator``, each habit checked against a reference: Accelerate's own ``mixed_precision="no"`` on
the same script (to the half dtype's tolerance), or the same run without the interruption (bit for bit).

Habits covered: ``prepare`` in any order with several models, optimizers and schedulers; ``accumulate`` with an
overflow in a micro-batch that does not synchronise; ``save_state``/``load_state`` into a fresh Accelerator, before the
first step and mid-run; ``free_memory()`` and the model prepared again (a retried training function); schedulers
made before or after ``prepare``; ``unscale_gradients`` then torch's own clip; Hugging Face models built from configs
(GPT-2 with tied embeddings and gradient checkpointing, BERT), peft LoRA, torch's fused AdamW; two gloo processes
(``tests/hostile_accelerate_two_process.py``).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("accelerate")

from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs  # noqa: E402
from tests.accelerate_helpers import reset_accelerate_state  # noqa: E402
from tests.launch import accelerate_launch  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

ROOT = Path(__file__).resolve().parents[1]


def _accelerator(level, half="float16", **kwargs):
    reset_accelerate_state()  # a fresh Accelerator, as in a new process
    handlers = [MixedPrecisionKwargs(half_dtype=half, init_scale=2.0**8)] if level.startswith("O") else None
    return Accelerator(mixed_precision=level, kwargs_handlers=handlers, **kwargs)


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _batch(step, inf=False):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
    if inf:
        x[0, 0] = float("inf")
    return x, y


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _weights(accelerator, model, opt):
    """The weights training produced: the FP32 masters at O2, the parameters otherwise."""
    return [p.detach().clone() for p in accelerator.amp.master_params(opt.optimizer)]


# -- free_memory(), then the same model prepared again -----------------------------------------------------------------
@pytest.mark.parametrize("level,again", [("O1", "raw"), ("O2", "raw"), ("O2", "prepared")])
def test_model_prepared_again_after_free_memory_goes_on_as_the_straight_run(level, again):
    """A retried training function (``find_executable_batch_size``) calls ``free_memory()`` and prepares the model it
    still holds with a new optimizer. At O2 this was refused with "prepared before its model" (the fresh engine did
    not know the converted model); now the new engine takes it over with the old FP32 masters, exactly: with SGD (no
    state to lose) the run is the straight run's, bit for bit."""

    def train(accelerator, model, opt, steps):
        for step in steps:
            x, y = _batch(step)
            accelerator.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()

    straight = _accelerator(level, "bfloat16")
    model = _net()
    model, opt = straight.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    train(straight, model, opt, range(4))
    expected = _weights(straight, model, opt)

    accelerator = _accelerator(level, "bfloat16")
    raw = _net()
    model, opt = accelerator.prepare(raw, torch.optim.SGD(raw.parameters(), lr=0.5))
    train(accelerator, model, opt, range(2))
    accelerator.free_memory()
    again = raw if again == "raw" else model
    model, opt = accelerator.prepare(again, torch.optim.SGD(again.parameters(), lr=0.5))
    assert not any(p.grad is not None for p in model.parameters())
    train(accelerator, model, opt, range(2, 4))
    assert _same(_weights(accelerator, model, opt), expected)
    # The model now runs with the new engine's forward: the old engine is no longer referenced by it.
    assert accelerator.unwrap_model(model).forward._amp is accelerator.amp


def test_unpickled_accelerator_prepares_the_unpickled_model_again():
    """The pickling contract (docs/accelerate.md): an unpickled Accelerator starts a fresh engine and "trains what it
    prepares next". At O2 the unpickled prepared model was refused (its forward belonged to a copy's engine); now it
    trains, from its own (half) weights, as a model prepared afresh from them does."""
    import pickle

    accelerator = _accelerator("O2", "bfloat16")
    model = _net()
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    accelerator2, model2 = pickle.loads(pickle.dumps((accelerator, model)))
    model2, opt2 = accelerator2.prepare(model2, torch.optim.SGD(model2.parameters(), lr=0.5))
    x, y = _batch(0)
    accelerator2.backward(F.cross_entropy(model2(x), y))
    opt2.step()
    assert not opt2.step_was_skipped
    reference = _net()  # the same half weights, upcast: what the unpickled model holds
    with torch.no_grad():
        for p, q in zip(reference.parameters(), model.parameters()):
            p.copy_(q.float())
    reset_accelerate_state()
    fresh = _accelerator("O2", "bfloat16")
    reference, ref_opt = fresh.prepare(reference, torch.optim.SGD(reference.parameters(), lr=0.5))
    fresh.backward(F.cross_entropy(reference(x), y))
    ref_opt.step()
    assert _same(_weights(accelerator2, model2, opt2), _weights(fresh, reference, ref_opt))


# -- accumulation, overflow, schedulers, checkpoints -------------------------------------------------------------------
def _run(level, *, steps, fused=False, save_at=None, load=None, accumulation=2, inf_at=(3,), out=None):
    """A ``no_trainer``-style loop: ``accumulate``, ``backward``, clip under ``sync_gradients``, step, scheduler,
    ``zero_grad``; prepare given in a scrambled order. ``save_at``: ``save_state`` to ``out`` before that micro-batch;
    ``load``: ``load_state`` from it after ``prepare`` and start there."""
    accelerator = _accelerator(level, gradient_accumulation_steps=accumulation)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    sched, opt, model = accelerator.prepare(sched, opt, model)
    start = 0
    if load is not None:
        accelerator.load_state(str(load))
        start = save_at
    skipped = []
    for step in range(start, steps):
        if step == save_at and load is None:
            accelerator.save_state(str(out))
        x, y = _batch(step, inf=step in inf_at)
        with accelerator.accumulate(model):
            accelerator.backward(F.cross_entropy(model(x), y))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            skipped.append(opt.step_was_skipped)
    scale = accelerator.amp.scalers[0].get_scale() if accelerator.amp is not None else None
    return {"weights": _weights(accelerator, model, opt) if accelerator.amp is not None else
            [p.detach().clone() for p in model.parameters()], "skipped": skipped,
            "lr": sched.get_last_lr(), "scale": scale, "optimizer": opt.state_dict()}


@pytest.mark.parametrize("level,fused,save_at", [("O1", False, 6), ("O2", False, 0), ("O2", True, 6)])
def test_save_state_into_a_fresh_accelerator_resumes_bit_for_bit(tmp_path, level, fused, save_at):
    """``save_state`` before the first step or at the end of an accumulation window (after a skipped one), then
    ``load_state`` into a new Accelerator (Accelerate's singleton state emptied, as in a new process): the same bits
    as the uninterrupted run: weights, loss scale, optimizer state and the scheduler."""
    straight = _run(level, steps=10, fused=fused, save_at=save_at, out=tmp_path)
    resumed = _run(level, steps=10, fused=fused, save_at=save_at, load=tmp_path)
    assert _same(resumed["weights"], straight["weights"])
    assert resumed["scale"] == straight["scale"] and resumed["lr"] == straight["lr"]
    assert resumed["skipped"] == straight["skipped"][save_at // 2:]
    for key, value in straight["optimizer"]["state"].items():
        assert _same(list(value.values()), list(resumed["optimizer"]["state"][key].values()))


@pytest.mark.parametrize("level,inf_at", [("O1", 2), ("O2", 3)])
def test_an_inf_in_either_micro_batch_skips_that_window_and_holds_the_scheduler(level, inf_at):
    """An inf in the batch of the first (no ``sync``) or last micro-batch of an accumulation window: that window's step
    is skipped, and only it, the scale backs off once, and the prepared scheduler does not advance. Reference:
    Accelerate's ``"no"`` on the same script steps the scheduler on every window (5 here), so one fewer here."""
    run = _run(level, steps=10, inf_at=(inf_at,))
    assert run["skipped"] == [False, True, False, False, False]
    assert run["scale"] == 2.0**7
    native = _run("no", steps=10, inf_at=())
    assert native["lr"] == pytest.approx([1e-2 / 6]) and run["lr"] == pytest.approx([1e-2 / 5])


def test_several_models_optimizers_and_a_scheduler_in_any_order():
    """Two models, an optimizer each, a scheduler on the first, passed to ``prepare`` in three orders (O2, whose
    optimizers need their model's masters): the same run every time; an overflowing loss skips both optimizers on
    that step only (``optimizer_step_was_skipped``), and the scheduler holds."""
    runs = []
    for order in ("a b oa ob sa", "sa ob oa b a", "oa a sa ob b"):
        accelerator = _accelerator("O2")
        a, b = _net(0), nn.Sequential(nn.Linear(3, 3))
        oa, ob = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
        objects = {"a": a, "b": b, "oa": oa, "ob": ob, "sa": torch.optim.lr_scheduler.StepLR(oa, 1, 0.5)}
        names = order.split()
        objects = dict(zip(names, accelerator.prepare(*(objects[n] for n in names))))
        a, b, oa, ob, sa = (objects[n] for n in ("a", "b", "oa", "ob", "sa"))
        log = []
        for step in range(4):
            x, y = _batch(step)
            loss = F.cross_entropy(b(a(x)), y) * (float("inf") if step == 2 else 1.0)
            accelerator.backward(loss)
            oa.step()
            ob.step()
            sa.step()
            oa.zero_grad()
            ob.zero_grad()
            log.append((oa.step_was_skipped, ob.step_was_skipped, accelerator.optimizer_step_was_skipped))
        runs.append((log, sa.get_last_lr(), _weights(accelerator, a, oa) + _weights(accelerator, b, ob)))
    for log, lr, weights in runs:
        assert log == [(False,) * 3, (False,) * 3, (True,) * 3, (False,) * 3]
        assert lr == [0.1 * 0.5**3]
        assert _same(weights, runs[0][2])


@pytest.mark.parametrize("made", ["before", "after"])
def test_a_scheduler_sets_the_learning_rate_of_the_o2_masters_step(made):
    """A scheduler made from the optimizer before ``prepare`` or from the prepared one after it (and prepared then):
    at O2 the step updates the FP32 masters, and the rate the scheduler sets is the one they are stepped with (a
    rate of 0 from the second step on freezes the weights)."""
    accelerator = _accelerator("O2", "bfloat16")
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rule = lambda step: 1.0 if step < 1 else 0.0  # noqa: E731
    if made == "before":
        model, opt, sched = accelerator.prepare(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, rule))
    else:
        model, opt = accelerator.prepare(model, opt)
        sched = accelerator.prepare(torch.optim.lr_scheduler.LambdaLR(opt, rule))
    snapshots = []
    for step in range(3):
        x, y = _batch(step)
        accelerator.backward(F.cross_entropy(model(x), y))
        opt.step()
        sched.step()
        opt.zero_grad()
        snapshots.append(_weights(accelerator, model, opt))
    assert not _same(snapshots[0], [p.float() for p in _net().parameters()])
    assert _same(snapshots[0], snapshots[1]) and _same(snapshots[1], snapshots[2])


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_unscale_gradients_then_torch_clip_matches_accelerate_no(level):
    """The torch-AMP habit: ``accelerator.unscale_gradients()`` then ``torch.nn.utils.clip_grad_norm_`` on the
    model's own parameters (at O2 the half ones, not the masters). The step takes the clipped gradients: the update
    is the one of Accelerate's ``"no"`` on the same script, to the half dtype's tolerance."""

    def update(level):
        accelerator = _accelerator(level, "bfloat16")
        model = _net()
        model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
        x, y = _batch(0)
        accelerator.backward(F.cross_entropy(model(x * 10), y) * 100)
        accelerator.unscale_gradients()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        before = [p.detach().float().clone() for p in model.parameters()] if level == "no" else \
            [p.detach().clone() for p in accelerator.amp.master_params(opt.optimizer)]
        opt.step()
        after = [p.detach().float() for p in model.parameters()] if level == "no" else \
            [p.detach() for p in accelerator.amp.master_params(opt.optimizer)]
        return float(norm), torch.cat([(a - b).flatten() for a, b in zip(after, before)])

    ref_norm, ref = update("no")
    norm, got = update(level)
    assert norm == pytest.approx(ref_norm, rel=1e-2)
    assert float(got.norm()) == pytest.approx(0.01, rel=1e-2)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=0)



# -- Hugging Face models built from configs, peft ---------------------------------------------------------------------
def _gpt2(checkpointing=False):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = transformers.GPT2LMHeadModel(config)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return model.train()


def _tokens(step):
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(step))
    mask = torch.ones_like(ids)
    mask[:, :2] = 0  # left padding
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _train_gpt2(level, model, steps, *, lr=0.1):
    accelerator = _accelerator(level, "bfloat16")
    trained = [p for p in model.parameters() if p.requires_grad]
    model, opt = accelerator.prepare(model, torch.optim.SGD(trained, lr=lr))
    losses = []
    for step in range(steps):
        loss = model(**_tokens(step)).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return accelerator, model, opt, losses


def test_gpt2_at_o2_keeps_its_tied_embeddings_and_exports_the_fp32_masters(tmp_path):
    """GPT-2 (tied ``lm_head``/``wte``, left padding, reentrant gradient checkpointing) at O2: the tie survives the
    conversion and the steps (one master for the shared weight), checkpointing changes no bit of the run, the losses
    follow Accelerate's ``"no"``, and ``save_pretrained(state_dict=amp.fp32_state_dict(...))`` reloads as the FP32
    masters, tied."""
    transformers = pytest.importorskip("transformers")
    accelerator, model, opt, losses = _train_gpt2("O2", _gpt2(), 2)
    _, _, ckpt_opt, ckpt_losses = _train_gpt2("O2", _gpt2(checkpointing=True), 2)
    *_, ref_losses = _train_gpt2("no", _gpt2(), 2)
    inner = accelerator.unwrap_model(model)
    assert inner.lm_head.weight is inner.transformer.wte.weight
    assert inner.lm_head.weight.dtype == torch.bfloat16
    masters = _weights(accelerator, model, opt)
    assert len(masters) == len(list(inner.parameters())) and all(m.dtype == torch.float32 for m in masters)
    assert ckpt_losses == losses
    assert _same([p.detach().clone() for p in ckpt_opt.amp.master_params(ckpt_opt.optimizer)], masters)
    assert losses == pytest.approx(ref_losses, abs=2e-2)
    state = accelerator.amp.fp32_state_dict(inner)
    inner.save_pretrained(tmp_path, state_dict=state)
    # transformers 5 loads in the dtype config.json names (dtype="auto"); the FP32 state dict given makes it float32
    # (Fp32SavePretrained), so a plain from_pretrained loads the masters, as Accelerate's "bf16" save does.
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float32"
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert reloaded.lm_head.weight is reloaded.transformer.wte.weight
    assert torch.equal(reloaded.transformer.wte.weight, accelerator.amp.master_of(inner.transformer.wte.weight))


def test_gpt2_save_state_mid_run_resumes_bit_for_bit_in_a_fresh_accelerator(tmp_path):
    """Tied embeddings through Accelerate's safetensors checkpoint (which drops the shared ``lm_head.weight``) at O2:
    the resumed run (a new Accelerator) ends on the straight run's bits."""

    def run(steps, *, save_at=None, load=False):
        accelerator = _accelerator("O2", "bfloat16")
        model = _gpt2()
        model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        if load:
            accelerator.load_state(str(tmp_path))
        for step in range(save_at if load else 0, steps):
            if step == save_at and not load:
                accelerator.save_state(str(tmp_path))
            accelerator.backward(model(**_tokens(step)).loss)
            opt.step()
            opt.zero_grad()
        inner = accelerator.unwrap_model(model)
        assert inner.lm_head.weight is inner.transformer.wte.weight
        return _weights(accelerator, model, opt)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # safetensors' note on the removed shared tensor
        straight = run(3, save_at=1)
        assert _same(run(3, save_at=1, load=True), straight)


def test_peft_lora_at_o2_trains_the_adapters_and_saves_their_fp32_masters(tmp_path):
    """peft LoRA on GPT-2 at O2: only the adapters get masters and move, the frozen half base stays put; the losses
    follow Accelerate's ``"no"``; ``save_pretrained`` with the FP32 state dict reloads the adapters as their masters."""
    peft = pytest.importorskip("peft")

    def lora():
        config = peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
        torch.manual_seed(1)
        return peft.get_peft_model(_gpt2(), config)

    accelerator, model, opt, losses = _train_gpt2("O2", lora(), 3, lr=0.5)
    *_, ref_losses = _train_gpt2("no", lora(), 3, lr=0.5)
    assert losses == pytest.approx(ref_losses, abs=2e-2) and losses[-1] < losses[0] - 1e-3
    inner = accelerator.unwrap_model(model)
    trained = {name: p for name, p in inner.named_parameters() if p.requires_grad}
    assert len(_weights(accelerator, model, opt)) == len(trained) == 4
    base = inner.base_model.model.transformer.h[0].attn.c_attn.base_layer.weight
    assert base.dtype == torch.bfloat16 and torch.equal(base, lora().base_model.model.transformer.h[0].attn.c_attn
                                                        .base_layer.weight.to(torch.bfloat16))
    inner.save_pretrained(tmp_path, state_dict=accelerator.amp.fp32_state_dict(inner))
    reloaded = dict(peft.PeftModel.from_pretrained(_gpt2(), tmp_path).named_parameters())
    for name, param in trained.items():
        assert torch.equal(reloaded[name], accelerator.amp.master_of(param))


@pytest.mark.parametrize("level", ["O1"])
def test_bert_with_padding_in_float16_follows_accelerate_no(level):
    """BERT for sequence classification with padded batches (its additive mask at FP32's minimum, which is -inf in
    float16) and torch's fused AdamW, float16: the losses of Accelerate's ``"no"`` to float16's tolerance."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()

    def run(level):
        accelerator = _accelerator(level, "float16")
        torch.manual_seed(0)
        config = transformers.BertConfig(
            num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, vocab_size=64,
            max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
        model = transformers.BertForSequenceClassification(config)
        model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
        g, losses = torch.Generator().manual_seed(1), []
        for _ in range(3):
            ids = torch.randint(0, 64, (4, 8), generator=g)
            mask = torch.ones_like(ids)
            mask[:, 5:] = 0
            mask[0, 1:] = 0
            out = model(input_ids=ids, attention_mask=mask, labels=torch.tensor([0, 1, 2, 0]))
            assert out.logits.dtype == torch.float32
            accelerator.backward(out.loss)
            opt.step()
            opt.zero_grad()
            losses.append(out.loss.item())
        return losses

    assert run(level) == pytest.approx(run("no"), abs=5e-3)


# -- two processes -----------------------------------------------------------------------------------------------------

def test_two_processes_accumulate_overflow_on_one_rank_and_rank_zero_checkpoint(tmp_path):
    """One launch (tests/hostile_accelerate_two_process.py), two gloo ranks at O2: an inf in rank 1's input on a
    ``no_sync`` micro-batch, and one in rank 0's gradient after the all-reduce of a synchronising one, skip those
    windows on both ranks (and only them), with the same scale and schedule; a ``save_state`` called on rank 0 only
    does not hang, and ``load_state`` of it into a fresh model on every rank ends on the straight run's bits."""
    accelerate_launch("hostile_accelerate_two_process.py", tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["world_size"] == 2
    assert ranks[0] == ranks[1]
    straight, resumed, reloaded = (ranks[0][k] for k in ("straight", "resumed", "reloaded"))
    assert straight["skipped"] == [False, True, False, True]
    assert straight["scale"] == [2.0**10, 2.0**9, 2.0**9, 2.0**8]
    # Accelerate steps the scheduler once per process on a real step (its batch is num_processes times larger).
    assert straight["lr"] == pytest.approx([1e-2 * 0.25, 1e-2 * 0.25, 1e-2 * 0.25**2, 1e-2 * 0.25**2])
    assert resumed == straight
    assert reloaded == {key: values[2:] for key, values in straight.items()}
    weights = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert _same(weights[0]["straight"], weights[1]["straight"])
    for rank in range(2):
        assert _same(weights[rank]["reloaded"], weights[rank]["straight"])
