"""attack70c: a hostile user of real third-party models and of what a run reports (``mpx/*`` tags,
``lightning-mpx doctor``), checked against the run's own facts, an FP32 run and the framework's own ``"bf16-mixed"``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_mpx import Amp


# -- one module, one tag: forensics, promotion and telemetry name it the same, with or without nn.DataParallel ---------
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.boom, self.norm, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.boom(self.enc(x))))


class _Holder(nn.Module):
    """A user's own wrapper whose only child is called ``module`` (as many EMA and loss wrappers are)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def _tags(wrap) -> dict[str, set[str]]:
    """The modules each kind of per-module tag names in a float16 O1 run whose ``boom`` overflows in the forward from
    step 2 on, promoted at the floor (``on_floor="promote"``), telemetry requested at every step."""
    torch.manual_seed(0)
    amp = Amp("O1", half_dtype="float16", init_scale=4.0, min_loss_scale=1.0, on_floor="promote")
    net = _Net()
    model = amp.prepare_model(wrap(net))
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    found: dict[str, set[str]] = {}
    for step in range(8):
        if step == 2:
            with torch.no_grad():
                net.boom.weight.mul_(3e5)
        amp.request_telemetry()
        with amp.forward_context():
            loss = amp.cast_outputs(model(amp.cast_inputs(torch.randn(4, 8)))).float().square().mean()
        amp.backward(loss)
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()
        for key in amp.metrics():
            kind, _, module = key[len("mpx/") :].partition("/")
            if module and kind not in ("zeros", "headroom_doublings"):
                found.setdefault(kind, set()).add(module)
    return found


def test_a_modules_tags_agree_in_every_report_with_or_without_data_parallel():
    # Stop 69: a model given to Amp inside nn.DataParallel logged mpx/overflow/module.boom, mpx/overflow_first/
    # module.boom and mpx/promoted/module.boom but mpx/underflow/boom (the doctor then judged the promoted group's
    # underflow), and a user's own only child called "module" lost that segment in the underflow tags alone.
    plain = _tags(lambda net: net)
    assert plain == {
        "overflow": {"enc", "boom", "norm", "head"},
        "overflow_first": {"boom"},
        "promoted": {"boom"},
        "underflow": {"enc", "boom", "norm", "head"},
    }
    assert _tags(nn.DataParallel) == plain  # the wrapper's "module" is no module of the user's
    held = _tags(_Holder)  # the user's own "module" is kept, in every tag
    assert held == {kind: {f"module.{name}" for name in names} for kind, names in plain.items()}


def test_a_ddp_models_tags_are_those_of_the_same_run_on_one_device():
    # DistributedDataParallel given to Amp whole names every parameter "module.<name>" as nn.DataParallel does: one
    # process group of one rank (gloo), so that no launch is needed; the wrapper is told by its type.
    import socket

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        wrapped = _tags(DistributedDataParallel)
    finally:
        dist.destroy_process_group()
    assert wrapped == _tags(lambda net: net)


def test_a_run_written_before_the_tags_agreed_is_read_with_its_promoted_module_not_judged_for_underflow():
    # An event folder of stop 69 (a model in nn.DataParallel, boom promoted at step 10): mpx/promoted/module.boom beside
    # mpx/underflow/boom. A promoted module runs in FP32, its small gradients kept: its underflow is not judged.
    from lightning_mpx.doctor import diagnose_scalars

    steps = range(0, 45, 5)
    series = {
        "mpx/loss_scale": [(s, 2.0**10) for s in steps],
        "mpx/overflows": [(s, 0.0) for s in steps],
        "mpx/skipped_steps": [(s, 2.0) for s in steps],
        "mpx/promoted/module.boom": [(s, 1.0) for s in steps if s >= 10],
        "mpx/underflow/boom": [(s, 0.9) for s in steps],
        "mpx/headroom_doublings/boom": [(s, 20.0) for s in steps],
        "mpx/underflow/head": [(s, 0.0) for s in steps],
        "mpx/headroom_doublings/head": [(s, 4.0) for s in steps],
    }
    diagnosis = diagnose_scalars(series, "old")
    assert diagnosis.healthy, diagnosis.format()
    assert [f.modules for f in diagnosis.findings if f.kind == "promoted"] == [("module.boom",)]
    # the same group not promoted is a problem: the check above is not blind
    del series["mpx/promoted/module.boom"]
    assert [f.kind for f in diagnose_scalars(series, "old").findings] == ["heavy_underflow"]


# -- the doctor tells a bfloat16 run from a float16 one by its own headroom --------------------------------------------
def _collapsed(doublings: float | None) -> dict[str, list[tuple[int, float]]]:
    """A run at a static scale of 1 whose last 12 steps all overflowed, with a finite loss, each logged point's largest
    gradient ``doublings`` below the half maximum before the overflows (``None``: no telemetry)."""
    series: dict[str, list[tuple[int, float]]] = {
        "mpx/loss_scale": [(s, 1.0) for s in range(30)],
        "mpx/overflows": [(s, float(s >= 18)) for s in range(30)],
        "mpx/skipped_steps": [(s, float(max(0, s - 17))) for s in range(30)],
        "train_loss": [(s, 1.0) for s in range(30)],
    }
    if doublings is not None:
        series["mpx/headroom_doublings/a"] = [(s, doublings if s < 18 else -float("inf")) for s in range(30)]
    return series


@pytest.mark.parametrize(("doublings", "told"), [(130.0, "bfloat16"), (20.0, "float16"), (None, None)])
def test_the_doctor_reads_the_runs_half_dtype_from_its_headroom_at_a_static_scale_of_one(doublings, told):
    # Stop 69 left it: a scale of 1 at every step is bfloat16's static scale and a float16 static one; the advice gave
    # both ("in bfloat16 ...; in float16: ... or train in bfloat16"). A largest gradient 130 doublings below the half
    # maximum is past float16's whole range (40 doublings): the run says it is bfloat16.
    from lightning_mpx.doctor import diagnose_scalars
    from lightning_mpx.health.underflow_checks import logged_half_dtype

    series = _collapsed(doublings)
    assert logged_half_dtype(series) == told
    (finding,) = diagnose_scalars(series, "run").findings
    assert finding.kind == "persistent_overflow"
    if told == "bfloat16":
        assert finding.fix.startswith("this run is bfloat16") and "fp32_modules=" not in finding.fix, finding.fix
    elif told == "float16":
        assert "bfloat16 run's" not in finding.fix and "fp32_modules=[...]" in finding.fix, finding.fix
    else:
        assert finding.fix.startswith("a scale of 1 at every logged step is a bfloat16 run's"), finding.fix


def test_a_run_shorter_than_its_logging_interval_is_told_why_it_logged_nothing(tmp_path, capsys):
    # Trainer(log_every_n_steps=50) (the default) for fewer steps logs no scalar at all: the doctor said only "was it
    # logged by a run with MixedPrecisionPlugin ... and a logger?" to a run that had both.
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_mpx import MixedPrecisionPlugin
    from lightning_mpx.cli import main

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 1)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = self.a(batch[0]).float().square().mean()
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-2)

    trainer = pl.Trainer(
        accelerator="cpu", max_steps=3, log_every_n_steps=50, enable_checkpointing=False, enable_progress_bar=False,
        logger=TensorBoardLogger(str(tmp_path), name="", version=0), enable_model_summary=False,
        plugins=[MixedPrecisionPlugin("O1", half_dtype="bfloat16")],
    )  # fmt: skip
    trainer.fit(Net(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(6, 4)), batch_size=2))
    capsys.readouterr()
    assert main(["doctor", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "scalars found: none" in err and "lower log_every_n_steps" in err, err


# -- Hugging Face habits at O2 -----------------------------------------------------------------------------------------
def test_resize_token_embeddings_after_setup_at_o2_is_refused_naming_the_call_and_the_order():
    # A user adds tokens after fabric.setup: transformers sets new half Parameters on embed_tokens and lm_head, which
    # have no FP32 master. The refusal named only an untie by nn.Parameter(...), not the call the user made.
    from lightning.fabric import Fabric
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_mpx import FabricMixedPrecisionPlugin

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=8)  # fmt: skip
    net = LlamaForCausalLM(config)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")])
    model = fabric.setup_module(net)
    net.resize_token_embeddings(40, mean_resizing=False)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(net.parameters(), lr=1e-2))
    ids = torch.randint(0, 40, (2, 6))
    with pytest.raises(ValueError, match=r"resize_token_embeddings\(\).*before fabric\.setup"):
        fabric.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()


def test_a_compiled_models_overflow_at_the_floor_promotes_the_layer_not_the_whole_model():
    # The watch's hooks of a model compiled before it is prepared are put on at prepare (before the first compiled
    # call, inactive until an overflow at the floor arms them): torch.compile does not trace in hooks put on later.
    torch._dynamo.reset()  # (nor on a model of a class it compiled before in this process: its code is reused)
    torch.manual_seed(0)
    amp = Amp("O1", half_dtype="float16", init_scale=4.0, min_loss_scale=1.0, on_floor="promote")
    net = _Net()
    model = amp.prepare_model(torch.compile(net, backend="eager"))
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    for step in range(6):
        if step == 2:
            with torch.no_grad():
                net.boom.weight.mul_(3e5)
        with amp.forward_context():
            loss = amp.cast_outputs(model(amp.cast_inputs(torch.randn(4, 8)))).float().square().mean()
        amp.backward(loss)
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()
    assert [name.replace("_orig_mod.", "") for name in amp.fp32_modules] == ["boom"]


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_overflow_is_blamed_on_the_layer_that_overflowed(reentrant):
    # model.gradient_checkpointing_enable() (use_reentrant=True, transformers' old default) runs each block's forward
    # under no_grad inside the training forward; the watch skipped those calls as if they were validation's, saw the
    # first non-finite value at ln_f's input and blamed the code after transformer.drop (mpx/overflow_first/
    # transformer.drop: on_floor="promote" would have promoted a dropout).
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)  # fmt: skip
    net = GPT2LMHeadModel(config)
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    with torch.no_grad():
        net.transformer.h[1].mlp.c_fc.weight.mul_(1e6)  # its output passes float16's maximum
    amp = Amp("O2", half_dtype="float16", diagnose_overflows=True, init_scale=16.0)
    model = amp.prepare_model(net).train()
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1e-2))
    ids = torch.randint(0, 32, (2, 8))
    with amp.forward_context():
        loss = model(input_ids=ids, labels=ids).loss
    amp.backward(loss)
    assert not amp.step(optimizer)
    record = amp.last_overflow
    assert (record.origin, record.first_module, record.region) == ("forward", "transformer.h.1.mlp.c_fc", None)
    assert [key for key in amp.metrics() if key.startswith("mpx/overflow_first/")] == [
        "mpx/overflow_first/transformer.h.1.mlp.c_fc"
    ]
