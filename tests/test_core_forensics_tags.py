"""review70b: a hostile user and reviewer of stop 70's one-name tags (``health/tags.py``), the forward watch under
reentrant checkpointing, the doctor's dtype read from the headroom, and house70's splits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_mpx import Amp


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.boom, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.boom(self.enc(x)))


def _overflow_run(state: dict | None = None, steps: int = 4, blow: tuple[int, ...] = (1, 2)) -> tuple[Amp, list[dict]]:
    """A float16 O1 run of ``_Net`` inside ``nn.DataParallel`` (its parameters named ``module.<name>``) whose ``boom``
    overflows in the forward at the steps ``blow``; each step's overflow metrics, read by the default reader."""
    torch.manual_seed(0)
    amp = Amp("O1", half_dtype="float16", init_scale=16.0, min_loss_scale=1.0, diagnose_overflows=True)
    net = _Net()
    model = amp.prepare_model(nn.DataParallel(net))
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    if state is not None:
        amp.load_state_dict(state)
    logs = []
    for step in range(steps):
        kept = net.boom.weight.detach().clone()
        if step in blow:
            with torch.no_grad():
                net.boom.weight.mul_(1e6)
        with amp.forward_context():
            loss = amp.cast_outputs(model(amp.cast_inputs(torch.randn(4, 8)))).float().square().mean()
        amp.backward(loss)
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()
        with torch.no_grad():
            net.boom.weight.copy_(kept)
        logs.append({key: float(v) for key, v in amp.metrics().items() if key.startswith("mpx/overflow")})
    return amp, logs


def test_a_data_parallel_models_checkpoint_loads_and_its_first_log_counts_nothing_twice():
    # Stop 70 named a data-parallel model's modules without the wrapper's "module" in the tags, and the readers'
    # positions with them, but checked them against totals named from the checkpoint's "module.<name>" counts:
    # amp.load_state_dict(amp.state_dict()) of a model given to Amp inside nn.DataParallel or DDP raised "holds
    # mpx/overflow/enc=2, above the checkpoint's total 0". A stop-69 checkpoint (its positions under
    # mpx/overflow/module.<name>) loaded, but its first log reported every module's overflows once more (2 where
    # nothing overflowed) beside stray mpx/overflow/module.<name> tags.
    amp, logs = _overflow_run()
    assert sum(log.get("mpx/overflow_first/boom", 0.0) for log in logs) == 2.0  # the counts the checkpoint carries
    state = amp.state_dict()
    quiet = {"mpx/overflows", "mpx/overflow/enc", "mpx/overflow/boom", "mpx/overflow/head", "mpx/overflow_first/boom"}
    _, resumed = _overflow_run(state, steps=1, blow=())
    assert resumed == [dict.fromkeys(quiet, 0.0)]
    stop69 = dict(state)
    stop69["metric_readers"] = {
        reader: {
            key.replace("overflow/", "overflow/module.").replace("overflow_first/", "overflow_first/module."): value
            for key, value in position.items()
        }
        for reader, position in state["metric_readers"].items()
    }
    stop69["overflow_counts"] = {
        kind: {f"module.{module}": count for module, count in counts.items()}
        for kind, counts in state["overflow_counts"].items()
    }  # stop 69 counted the prepared names
    assert "mpx/overflow/module.boom" in stop69["metric_readers"]["default"]
    _, resumed = _overflow_run(stop69, steps=2, blow=(1,))
    assert resumed == [dict.fromkeys(quiet, 0.0), dict.fromkeys(quiet, 1.0)]


# -- the forward watch: a forward that raises, validation, a shared block under reentrant checkpointing ----------------
class _Raising(nn.Linear):
    fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.fail:
            raise RuntimeError("CUDA out of memory (simulated)")
        return out


def test_a_forward_that_raised_leaves_no_call_open_so_validation_is_not_blamed():
    # A training forward that raises mid-way (an out-of-memory error the user catches and skips the batch) left its
    # calls open in the watch: every later forward counted as inside a training one, so a validation forward under
    # no_grad was watched, and the next overflow step blamed its bad batch (first_module "enc": the head overflowed).
    torch.manual_seed(0)
    amp = Amp("O1", half_dtype="float16", init_scale=16.0, diagnose_overflows=True)
    net = _Net()
    net.boom = _Raising(8, 8)
    model = amp.prepare_model(net)
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))

    def train(x: torch.Tensor) -> bool:
        with amp.forward_context():
            loss = amp.cast_outputs(model(amp.cast_inputs(x))).float().square().mean()
        amp.backward(loss)
        stepped = amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()
        return stepped

    assert train(torch.randn(4, 8))
    net.boom.fail = True
    with pytest.raises(RuntimeError, match="out of memory"):
        train(torch.randn(4, 8))
    net.boom.fail = False
    optimizer.zero_grad()
    with torch.no_grad(), amp.forward_context():  # validation of a bad batch: enc's output overflows float16
        model(amp.cast_inputs(torch.full((4, 8), 1e30)))
    with torch.no_grad():
        net.head.weight.mul_(1e8)
    assert not train(torch.randn(4, 8) * 100)
    assert (amp.last_overflow.origin, amp.last_overflow.first_module) == ("forward", "head")


class _Shared(nn.Module):
    """A block called twice (weights shared), each call under reentrant activation checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.block, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.boom = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))  # the norm keeps a promoted layer's output small

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = self.enc(x)
        h = checkpoint(self.block, h, use_reentrant=True)
        h = checkpoint(lambda t: self.boom(self.block(t)), h, use_reentrant=True)
        return self.head(h)


def test_a_checkpointed_overflow_at_the_floor_promotes_the_layer_with_a_shared_block_and_validation_between():
    # on_floor="promote" after overflows inside reentrant checkpoints (their forwards run under no_grad), with a block
    # called twice and a validation forward between the steps: the layer that overflowed is promoted, not the code
    # around it nor validation's.
    torch.manual_seed(0)
    amp = Amp("O1", half_dtype="float16", init_scale=2.0, min_loss_scale=1.0, on_floor="promote")
    net = _Shared()
    model = amp.prepare_model(net)
    optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    for step in range(8):
        if step == 2:
            with torch.no_grad():
                net.boom[0].weight.mul_(1e6)
        x = torch.randn(4, 8).requires_grad_()
        with amp.forward_context():
            loss = amp.cast_outputs(model(amp.cast_inputs(x))).float().square().mean()
        amp.backward(loss)
        amp.step(optimizer)
        amp.update()
        optimizer.zero_grad()
        with torch.no_grad(), amp.forward_context():  # validation of a bad batch: enc overflows
            model(amp.cast_inputs(torch.full((4, 8), 1e30)))
    assert amp.fp32_modules == ["boom.0"]
    assert {key for key in amp.metrics() if key.startswith("mpx/promoted/")} == {"mpx/promoted/boom.0"}


# -- one launch: the tags under data parallelism (tests/core_forensics_tags_script.py) ---------------------------------
_ONE_DEVICE = {"overflow": ["boom", "enc", "head", "norm"], "overflow_first": ["boom"], "promoted": ["boom"]}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from tests.launch import case_results

    return case_results("core_forensics_tags_script.py", Path(tmp_path_factory.mktemp("review70b")), timeout=150)


@pytest.mark.parametrize("case", ["trainer", "fabric", "compile(ddp)", "ddp(compile)"])
def test_data_parallel_runs_name_each_module_as_the_one_device_run(ranks: list[dict[str, Any]], case: str) -> None:
    # The Trainer and Fabric under strategy="ddp" prepare the model before Lightning wraps it in DDP; the core Amp
    # given torch.compile(DDP(model)) or DDP(torch.compile(model)) is told the wrapper by its type under _orig_mod.
    # Every rank logs the tags of the same run on one device (the Trainer's module holds the net as self.net); a
    # compiled model's watch, armed at the floor, sees inside it (its hooks were put on before its first call).
    expected = {kind: [("net." if case == "trainer" else "") + m for m in names] for kind, names in _ONE_DEVICE.items()}
    for rank in ranks:
        tags = dict(rank[case]["tags"])
        underflow = tags.pop("underflow", None)
        assert tags == expected, (case, rank[case]["tags"])
        assert underflow == (None if case == "trainer" else expected["overflow"]), (case, underflow)


def test_a_data_parallel_runs_checkpoint_resumes_without_the_wrapper_under_the_same_tags():
    # A model trained in nn.DataParallel (or DDP) and resumed on one device without it: stop 70 saved the counts under
    # the wrapped names (module.enc), so the load was refused ("holds mpx/overflow/enc=2, above the checkpoint's total
    # 0"), and a load would have logged module.enc beside enc. The counts are saved under the user's names now.
    amp, _ = _overflow_run()
    state = amp.state_dict()
    assert state["overflow_counts"] == {"modules": {"enc": 2, "boom": 2, "head": 2}, "first": {"boom": 2}}
    torch.manual_seed(0)
    bare = Amp("O1", half_dtype="float16", init_scale=16.0, min_loss_scale=1.0, diagnose_overflows=True)
    net = _Net()
    bare.prepare_model(net)
    bare.prepare_optimizer(torch.optim.SGD(net.parameters(), lr=1e-3))
    bare.load_state_dict(state)
    quiet = {"mpx/overflows", "mpx/overflow/enc", "mpx/overflow/boom", "mpx/overflow/head", "mpx/overflow_first/boom"}
    assert {key: float(v) for key, v in bare.metrics().items() if "overflow" in key} == dict.fromkeys(quiet, 0.0)


# -- the doctor's dtype from mpx/headroom_doublings --------------------------------------------------------------------
def _diverged(doublings: list[float]) -> dict[str, list[tuple[int, float]]]:
    """A run at a static scale of 1 whose headroom was ``doublings`` at its first steps, then 12 overflowing steps."""
    n = len(doublings)
    return {
        "mpx/loss_scale": [(s, 1.0) for s in range(n + 12)],
        "mpx/overflows": [(s, float(s >= n)) for s in range(n + 12)],
        "mpx/skipped_steps": [(s, float(max(0, s - n + 1))) for s in range(n + 12)],
        "train_loss": [(s, 1.0) for s in range(n + 12)],
        "mpx/headroom_doublings/a": [(s, d) for s, d in enumerate(doublings)]
        + [(s, -float("inf")) for s in range(n, n + 12)],
    }


@pytest.mark.parametrize(
    ("doublings", "told"),
    [
        ([118.0 - 4 * s for s in range(30)], "bfloat16"),  # gradients of 1e3 growing 16x a step to bfloat16's maximum
        ([16.0 + s % 7 for s in range(30)], "float16"),  # a float16 run's gradients, tiny ones included (2^-23)
        ([126.0] * 3 + [20.0] * 27, "bfloat16"),  # a float16 run cannot hold a largest gradient 126 doublings down
    ],
)
def test_the_doctor_tells_a_diverging_bfloat16_run_from_a_float16_one(doublings: list[float], told: str) -> None:
    # A bfloat16 run diverging at a static scale of 1: its largest gradients pass 2^-64 of bfloat16's maximum (1.8e19)
    # on the way up, where a float16 run's sit; the majority of points read it as float16, and the fix for float16
    # (fp32_modules=[...], train in bfloat16) was given to a bfloat16 run. A largest gradient below the split is
    # proof: float16 has no such value; the points above it are either dtype's.
    from lightning_mpx.doctor import diagnose_scalars
    from lightning_mpx.health.underflow_checks import logged_half_dtype

    series = _diverged(doublings)
    assert logged_half_dtype(series) == told
    (finding,) = diagnose_scalars(series, "run").findings
    assert finding.kind == "persistent_overflow"
    assert finding.fix.startswith("this run is bfloat16") == (told == "bfloat16"), finding.fix


def test_a_short_trainer_run_with_hyperparameters_and_validation_is_told_why_it_has_no_mpx_scalars():
    # Trainer(log_every_n_steps=50) for 3 steps of a module that calls save_hyperparameters() and validates: the
    # folder holds epoch, hp_metric and val_loss (logged at the epoch's end, not at a training step), so the short-run
    # hint (given only to a folder with no scalar at all) was left out.
    from lightning_mpx.doctor import NoMixedPrecisionTagsError, diagnose_scalars

    found = {"epoch": [(2, 0.0)], "hp_metric": [(0, -1.0)], "val_loss": [(2, 0.25)]}
    with pytest.raises(NoMixedPrecisionTagsError, match="lower log_every_n_steps"):
        diagnose_scalars(found, "short")
