"""Review of stop 65's fixes from the user's side (review65).

1. Raw-step refusals kept under DDP's ``no_sync`` until the step (engine/unsynced.py), through the Trainer
   (``accumulate_grad_batches=2``, ``strategy="ddp"``) and the Accelerate adapter (``accelerator.accumulate``), the
   prepared optimizer's parameters and parameters no prepared optimizer holds, stepped by a raw SGD on rank 1 ONLY
   between the accumulated backwards: both ranks raise at the step, rank 0 naming rank 1, and the group still works.
   Habits that are no raw step (a frozen backbone and an EMA teacher written between accumulated backwards; a GAN's
   two optimizers under ``accelerator.accumulate``) train as Lightning's ``"bf16-mixed"`` / Accelerate's ``"bf16"``.
   The DDP watch's one-shot forward pre-hooks find the wrapper after an evaluation under ``torch.no_grad()`` first,
   with ``find_unused_parameters``, ``static_graph`` and a model compiled before ``fabric.setup``, and leave none.
   All in ONE 2-rank launch (tests/lightning_ddp_no_sync_refusals_script.py). Found and fixed: a second ``trainer.fit``
   of the same Trainer wraps the model in a new DDP, which the watch (keyed by the model, watched once) never met: a
   rank-1-only raw step there was raised on rank 1 alone at its backward and rank 0 waited in the all-reduce (a hang).
   The models are watched again at each set-up after the watch settled.
2. The marks a step leaves in its gradients' ``__dict__`` (engine/rescale.py): ``torch.save`` of the gradients loads
   with ``weights_only=True`` and ``pickle`` (the empty mark travels along, inert); clones, ``.to()`` round trips and
   a state_dict save change nothing in training. Held.
3. The evaluation-first warning (masters from the half rounding): not raised for Lightning's ``validate`` then
   ``fit``, Fabric's ``setup_module`` then ``setup_optimizers``, the HF Trainer's ``evaluate()`` then ``train()``
   (their masters start from the FP32 weights exactly); raised once for two evaluation prepares; a load_state right
   after the prepare gives the saved weights exactly. Fixed: the warning named ``trainer.validate/test/predict``
   before ``trainer.fit`` among its causes (Lightning keeps the FP32 weights through an evaluation stage), and now
   names ``accelerator.load_state`` of a checkpoint as a remedy.
4. Found and left (strict xfail): a raw optimizer stepped in the same iteration as the prepared one (fixed at stop
   66, engine/beside_steps.py).
"""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.launch import rank_results, run_script

REFUSED = "were written and their gradients cleared after a backward of lightning_mpx"
UNHELD = "which no optimizer prepared by lightning_mpx holds"
ON_RANK_1 = "on rank 1 (refused on every rank at this step, where the ranks meet"
REFUSALS = ("trainer_raw_rank1", "trainer_unheld_rank1", "accelerate_raw_rank1", "trainer_fit_twice",
            "watch/eval_first", "watch/find_unused", "watch/static_graph", "watch/compile", "watch/clip")  # fmt: skip
# O2 bfloat16 (FP32 masters) against the frameworks' own bf16 autocast, tiny models: the Trainer's 3 SGD steps measured
# 9.0e-4 apart, the GAN's 2 Adam steps (lr 1e-3) 8.8e-6 apart, Fabric's 3 SGD steps on bucket views 5.2e-4.
ATOL = {"trainer_habits": 3e-3, "accelerate_gan": 1e-4, "bucket_view": 3e-3}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("review65")
    run_script("lightning_ddp_no_sync_refusals_script.py", out, timeout=150)
    got = rank_results(out)
    for rank in got:
        assert rank["world"] == 2
        for case, value in rank.items():
            if isinstance(value, dict) and case not in REFUSALS:
                assert "error" not in value, f"{case}: {value['error']}"
    return got


def _message(rank: dict[str, Any], case: str) -> str:
    error = rank[case].get("error", "")
    return error[error.find("RuntimeError:") :]


@pytest.mark.parametrize("case", REFUSALS)
def test_rank1_only_raw_step_under_no_sync_refused_on_both_ranks(ranks: list[dict[str, Any]], case: str) -> None:
    """A raw SGD stepped on rank 1 alone between accumulated backwards (the first under no_sync): both ranks raise at
    the step (rank 0 naming rank 1), no step is taken, and the process group still works afterwards."""
    own, other = _message(ranks[1], case), _message(ranks[0], case)
    expected = UNHELD if "unheld" in case else REFUSED
    assert expected in own and not own.startswith("RuntimeError: on rank"), own or "rank 1 not refused"
    assert ON_RANK_1 in other and expected in other, other or "rank 0 not refused"
    if case.startswith("trainer_") and case != "trainer_fit_twice":
        assert [rank[case]["steps"] for rank in ranks] == [0, 0]
    if case.startswith("watch"):
        assert all(rank[case]["watched"] and rank[case]["hooks_left"] == 0 for rank in ranks)
    assert [rank["after"]["sum"] for rank in ranks] == [2.0, 2.0]


def test_rank0_weights_untouched_by_the_refused_step(ranks: list[dict[str, Any]]) -> None:
    """Rank 0 never ran the raw step and the step that refused it was skipped: its prepared optimizer's weights are
    the half rounding of where they started (nothing written)."""
    for case in ("trainer_raw_rank1", "accelerate_raw_rank1"):
        r0 = ranks[0][case]
        start = torch.tensor(r0["w_start"]).bfloat16().float()
        assert torch.equal(torch.tensor(r0["w"]), start), case


@pytest.mark.parametrize(
    ("case", "ref"), [("trainer_habits", "bf16-mixed"), ("accelerate_gan", "bf16"), ("bucket_view", "bf16-mixed")]
)
def test_no_sync_habits_train_like_the_frameworks_bf16(ranks: list[dict[str, Any]], case: str, ref: str) -> None:
    """A frozen backbone and an EMA teacher written between accumulated backwards (Trainer), a GAN's two optimizers
    under ``accelerator.accumulate`` (Accelerate): no refusal, both ranks equal, within bfloat16's reach of the
    framework's own bf16 run, and moved by training."""
    o2 = [torch.tensor(rank[f"{case}/O2"]["w"]) for rank in ranks]
    bf = [torch.tensor(rank[f"{case}/{ref}"]["w"]) for rank in ranks]
    assert torch.equal(o2[0], o2[1]) and torch.equal(bf[0], bf[1])
    torch.testing.assert_close(o2[0], bf[0], rtol=0, atol=ATOL[case])
    start = torch.tensor(ranks[0][f"{case}/O2"]["w_start"])
    assert (o2[0] - start).abs().max() > 5 * ATOL[case]  # trained


# -- 2. the marks a step leaves in its gradients
def _fabric_o2() -> tuple[Any, Any, Any, Any]:
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    plugin = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16", loss_scale="dynamic", init_scale=2.0**8)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=plugin)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    return fabric, plugin, model, optimizer


def _train_with(habit: Any) -> tuple[torch.Tensor, Any]:
    """Four O2 steps through Fabric; ``habit(module)`` after the second step, before its ``zero_grad``."""
    fabric, plugin, model, optimizer = _fabric_o2()
    seen = None
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        fabric.backward(F.mse_loss(model(x).float(), y))
        optimizer.step()
        if step == 1 and habit is not None:
            seen = habit(model.module)
        optimizer.zero_grad()
    return torch.cat([p.detach().flatten() for p in plugin.master_params(optimizer)]), seen


def _saved_grads(module: nn.Module) -> list[torch.Tensor]:
    buffer = io.BytesIO()
    torch.save({"grads": [p.grad for p in module.parameters()]}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)["grads"]


def _reassigned(module: nn.Module) -> None:
    for p in module.parameters():
        p.grad = p.grad.clone().to(torch.float32).to(p.dtype)


def _all_habits(module: nn.Module) -> list[torch.Tensor]:
    grads = [p.grad for p in module.parameters()]
    pickled = pickle.loads(pickle.dumps(grads))
    copied = copy.deepcopy(grads)
    loaded = _saved_grads(module)
    _reassigned(module)
    return [*pickled, *copied, *loaded]


def test_stepped_gradients_save_pickle_copy_and_reassign() -> None:
    """Gradients a step left (each holding an empty mark in its ``__dict__``): ``torch.save`` loads with
    ``weights_only=True``, ``pickle`` and ``copy.deepcopy`` take them, and none of these, nor each gradient replaced
    by a clone through ``.to()`` before the ``zero_grad``, changes what training gives afterwards."""
    reference, _ = _train_with(None)
    weights, got = _train_with(_all_habits)
    assert torch.equal(weights, reference)
    assert len(got) == 12 and all(isinstance(g, torch.Tensor) and g.dtype == torch.bfloat16 for g in got)


# -- 3. the evaluation-first warning
def _rounding_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "half rounding" in str(w.message)]


class _Module:
    """A LightningModule (built lazily: Lightning imported once)."""

    @staticmethod
    def make() -> Any:
        import lightning.pytorch as pl

        class Classifier(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(0)
                self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
                self.start: list[torch.Tensor] | None = None

            def training_step(self, batch: Any, index: int) -> torch.Tensor:
                if self.start is None:
                    amp = self.trainer.precision_plugin.amp
                    self.start = [m.clone() for m in amp.master_params(self.trainer.optimizers[0])]
                return F.cross_entropy(self.net(batch[0]).float(), batch[1])

            def validation_step(self, batch: Any, index: int) -> None:
                self.log("val", F.cross_entropy(self.net(batch[0]).float(), batch[1]))

            def configure_optimizers(self) -> Any:
                return torch.optim.SGD(self.parameters(), lr=0.1)

        return Classifier()


def test_lightning_validate_then_fit_and_fabric_split_setup_start_from_fp32(tmp_path: Any) -> None:
    """Lightning's ``trainer.validate`` before ``trainer.fit`` and Fabric's ``setup_module`` then
    ``setup_optimizers`` prepare for training: no evaluation-first warning, the masters start from the FP32 weights
    exactly."""
    import lightning.pytorch as pl
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin, MixedPrecisionPlugin

    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    module = _Module.make()
    fp32 = [p.detach().clone() for p in module.parameters()]
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        plugins=[MixedPrecisionPlugin("O2", half_dtype="bfloat16")],
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.validate(module, loader, verbose=False)
        trainer.fit(module, loader)
        plugin = FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16")
        fabric = Fabric(accelerator="cpu", devices=1, plugins=plugin)
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        net_fp32 = [p.detach().clone() for p in net.parameters()]
        model = fabric.setup_module(net)
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
        fabric_start = [m.clone() for m in plugin.master_params(optimizer)]
    assert not _rounding_warnings(caught)
    assert all(torch.equal(a, b) for a, b in zip(module.start, fp32))
    assert all(torch.equal(a, b) for a, b in zip(fabric_start, net_fp32))


def test_hf_trainer_evaluate_then_train_starts_from_fp32(tmp_path: Any, fresh_accelerate_state: Any) -> None:
    """The HF Trainer door's ``evaluate()`` before ``train()``: no evaluation-first warning, and the FP32 masters at
    the first step are the FP32 weights exactly."""
    import transformers

    from lightning_mpx.accelerate import MixedPrecisionKwargs, mpx_trainer

    class Regression(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": ((self.lin(x).squeeze(-1).float() - labels) ** 2).mean()}

    g = torch.Generator().manual_seed(0)
    data = [{"x": row, "labels": row.sum()} for row in torch.randn(8, 4, generator=g)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1, per_device_train_batch_size=4,
        per_device_eval_batch_size=4, save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    model = Regression()
    fp32 = model.lin.weight.detach().clone()
    trainer = mpx_trainer()(model=model, args=args, train_dataset=data, eval_dataset=data, opt_level="O2",
                            mpx_kwargs=MixedPrecisionKwargs(half_dtype="bfloat16"))  # fmt: skip
    seen: dict[str, torch.Tensor] = {}

    class Start(transformers.TrainerCallback):
        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            seen.setdefault("w", trainer.accelerator.amp.fp32_state_dict(trainer.model)["lin.weight"].clone())

    trainer.add_callback(Start())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.evaluate()
        trainer.train()
    assert not _rounding_warnings(caught)
    assert torch.equal(seen["w"], fp32)


def test_accelerate_evaluated_twice_warned_once_and_load_state_exact(
    tmp_path: Any, fresh_accelerate_state: None
) -> None:
    """Two evaluation-only prepares, then the training prepare: one warning. ``load_state`` right after that prepare
    gives the saved run's weights exactly (the warning's remedy: FP32 values go to the masters)."""
    from lightning_mpx.accelerate import Accelerator, MixedPrecisionKwargs
    from tests.accelerate_helpers import reset_accelerate_state

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def accelerator() -> Any:
        reset_accelerate_state()
        return Accelerator(
            mixed_precision="O2", cpu=True, kwargs_handlers=[MixedPrecisionKwargs(half_dtype="bfloat16")]
        )

    first = accelerator()
    module = net()
    model, optimizer = first.prepare(module, torch.optim.SGD(module.parameters(), lr=0.1))
    x, y = torch.randn(4, 4), torch.randint(0, 2, (4,))
    first.backward(F.cross_entropy(model(x).float(), y))
    optimizer.step()
    first.save_state(str(tmp_path / "ck"))
    saved = {k: v.float().clone() for k, v in first.get_state_dict(model).items()}
    second = accelerator()
    module = net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            evaluated = second.prepare_model(module, evaluation_mode=True)
            with torch.no_grad():
                evaluated(x)
        model, optimizer = second.prepare(module, torch.optim.SGD(module.parameters(), lr=0.1))
        second.load_state(str(tmp_path / "ck"))
    (warned,) = _rounding_warnings(caught)
    assert "model.load_state_dict(fp32_state_dict), or a checkpoint with accelerator.load_state" in warned
    # Lightning's validate/test/predict before fit keep the FP32 weights (integrations/lightning_evaluation.py): the
    # warning named them among its causes
    assert "trainer.validate" not in warned and "accelerator.prepare_model(model, evaluation_mode=True)" in warned
    loaded = second.get_state_dict(model)
    assert all(torch.equal(loaded[k].float(), saved[k]) for k in saved)


# -- found and left at stop 65, fixed at stop 66 (engine/beside_steps.py): a raw step next to an engine step in the
# same iteration (a head's optimizer never given to fabric.setup, stepped before or after the prepared one) was never
# refused: an engine step between the backward's note and the next backward voided the note; at O1 float16 the head
# trained on gradients times the loss scale, silently (NaN in 3 steps). tests/test_core_raw_head_beside.py covers every
# door.
def test_raw_head_optimizer_stepped_beside_the_prepared_one_is_refused() -> None:
    from lightning.fabric import Fabric

    from lightning_mpx import FabricMixedPrecisionPlugin

    plugin = FabricMixedPrecisionPlugin("O1", half_dtype="float16", loss_scale="dynamic", init_scale=2.0**8)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=plugin)
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model, optimizer = fabric.setup(module, torch.optim.SGD(module[0].parameters(), lr=0.05))
    head = torch.optim.SGD(module[2].parameters(), lr=0.05)  # forgotten: never given to fabric.setup
    x, y = torch.randn(4, 4), torch.randn(4, 1)
    with pytest.raises(RuntimeError, match="which no optimizer prepared by lightning_mpx holds"):
        for _ in range(3):
            fabric.backward(F.mse_loss(model(x).float(), y))
            head.step()
            optimizer.step()
            head.zero_grad()
            optimizer.zero_grad()
