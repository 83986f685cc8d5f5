"""Stop 61's last library changes attacked (review61c): Fabric's read under a process group with gradients no
optimizer holds (``_begin_read``), the litgpt entry points' ``log_mpx_metrics`` wrap, DCP's state-making step
(``state_making_step``) and ``shard_model``'s complex refusal on a torch without a release number at 2.13.

Found and fixed: a logger wrapped by ``log_mpx_metrics`` no longer pickled (a closure in its ``log_metrics``); a
user's raw ``optimizer.step()`` at O2, first step, ``lr`` 0 (a warm-up) and zero gradients, was taken for DCP's
state-making step (its gradients dropped, no refusal until the next step); ``shard_model`` refused complex
parameters on a torch 2.13 source build or nightly (``"2.13.0a0+git..." < (2, 13)``) and would have let them through
on any torch whose ``FSDPParam`` casts them, whatever its number: now torch's own method is asked.
"""

from __future__ import annotations

import pickle

import lightning as L
import pytest
import torch
from lightning.fabric.loggers import CSVLogger
from torch import nn

from lightning_mpx import Amp, FabricMixedPrecisionPlugin
from lightning_mpx.common.compat import torch_release
from lightning_mpx.integrations.collectives import all_reduce_max
from lightning_mpx.integrations.fsdp import shard_model
from lightning_mpx.integrations.litgpt import log_mpx_metrics
from tests.test_complex_params import Spectral

SCALING = {"init_scale": 256.0, "growth_interval": 2}
OVERFLOW_AT = (2, 3, 6)


def _fabric_records(reducer: bool) -> list[tuple[float, float, float, float]]:
    """A Fabric loop at O1 float16 whose optimizer holds the head only (the backbone requires grad: its gradients
    stay), ``mpx.metrics()`` after every step; ``reducer``: the overflow flag all-reduced, as the plugin sets it
    under a process group of more than one rank (a one-rank group does not set it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    mpx = FabricMixedPrecisionPlugin("O1", half_dtype="float16", **SCALING)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[mpx])
    model, optimizer = fabric.setup(model, torch.optim.SGD(model[2].parameters(), lr=1e-2))
    if reducer:
        mpx.amp.found_inf_reducer = all_reduce_max
    records = []
    for step in range(8):
        loss = model(torch.randn(4, 4)).float().pow(2).mean()
        fabric.backward(loss * float("inf") if step in OVERFLOW_AT else loss)
        optimizer.step()
        optimizer.zero_grad()
        m = mpx.metrics()
        records.append((m["mpx/loss_scale"], m["mpx/overflows"], m["mpx/skipped_steps"], mpx.scaler.get_scale()))
    return records


def test_a_read_under_a_process_group_with_a_backbone_no_optimizer_holds_shows_the_update(one_rank):
    """Under a process group the read does not end the iteration while parameters no optimizer holds have gradients
    (``_begin_read``): with a backbone that requires grad and that no optimizer ever holds, that is every read. The
    logged scale (``metrics()`` and ``mpx.scaler``) and ``mpx/overflows`` are those the held-back update will leave
    (computed on copies), record for record what the single-process run (and ``"16-mixed"``) shows; stop 62's read
    showed the scale one update behind and each overflow one record late (tests/test_fabric_held_reads.py)."""
    alone, grouped = _fabric_records(False), _fabric_records(True)
    assert [r[0] for r in alone] == [r[3] for r in alone] == [256, 512, 256, 128, 128, 256, 128, 128]
    assert grouped == alone
    assert sum(r[1] for r in grouped) == 3  # none lost, none counted twice


def test_a_raw_step_at_lr_zero_with_zero_gradients_is_refused_as_any_raw_step():
    """A user's ``optimizer.step()`` outside ``amp.step`` at O2, on the first step, at a warm-up's ``lr`` 0 and with
    zero gradients, was taken for DCP's state-making step: silently a no-op (its gradients dropped), the refusal only
    at the next step. DCP calls ``step(closure=None)``; a plain ``step()`` is refused at once
    (``tests/test_core_optimizer_state_dcp.py`` keeps DCP's own step)."""
    amp = Amp("O2", half_dtype=torch.bfloat16)
    model = amp.prepare_model(nn.Linear(4, 2))
    optimizer = amp.prepare_optimizer(torch.optim.Adam(model.parameters(), lr=1e-2))
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: step / 10)  # lr 0 at step 0
    with amp.forward_context():
        loss = model(torch.randn(3, 4, dtype=torch.bfloat16)).float().sum() * 0.0
    amp.backward(loss)
    assert all(not p.grad.any() for p in model.parameters())
    with pytest.raises(RuntimeError, match="outside Amp.step"):
        optimizer.step()
    assert all(p.grad is not None for p in model.parameters())  # the user's gradients kept


def test_a_logger_wrapped_by_the_litgpt_entry_points_still_pickles(tmp_path):
    """``log_mpx_metrics`` (what the litgpt entry points do to the logger they make) put a closure in the logger's
    ``log_metrics``: the logger, which pickled before, no longer did. Now it pickles, and the copy logs to its files;
    the wrapped logger adds the ``mpx/*`` metrics to a training record and leaves a validation record alone."""
    mpx = FabricMixedPrecisionPlugin("O1", half_dtype="bfloat16")
    logger = CSVLogger(tmp_path, name="csv")
    log_mpx_metrics(logger, mpx)
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[mpx], loggers=logger)
    fabric.log_dict({"loss": 1.0}, step=0)
    fabric.log_dict({"val_loss": 2.0}, step=0)
    logger.save()
    copy = pickle.loads(pickle.dumps(logger))
    copy.log_metrics({"loss": 3.0}, 1)
    copy.save()
    text = (tmp_path / "csv" / "version_0" / "metrics.csv").read_text()
    assert "mpx/loss_scale" in text.splitlines()[0] and "val_loss" in text.splitlines()[0]
    assert text.count("\n") == 4  # header, the training and validation records, the copy's record


@pytest.mark.parametrize("version", ["2.13.0a0+git1234567", "2.11.0"])
def test_shard_models_complex_refusal_asks_what_fsdp_does_not_the_version(one_rank, monkeypatch, version):
    """A unit of complex parameters under O2's ``param_dtype``: refused where FSDP2 would gather them as that real
    dtype (torch 2.11's ``FSDPParam.init_dtype_attrs``), sharded where it gathers them as they are (2.13's), whatever
    ``torch.__version__`` says: ``"2.13.0a0+git..." < (2, 13)`` refused a 2.13 source build, and a version compare
    would let a torch that casts them through."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    own_release = torch_release(torch.__version__)  # the torch installed, before the version is faked
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion(version))
    model = Spectral()
    if own_release is not None and own_release < (2, 12):  # this FSDP2 itself casts them: refused whatever it says
        with pytest.raises(ValueError, match="dropping their imaginary parts"):
            shard_model(model, FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16"), blocks=[model.lin])
    else:
        shard_model(model, FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16"), blocks=[model.lin])
        assert model.phase.dtype == torch.complex64

    def casts(self, policy):  # torch 2.11's: no clamp for a non-floating parameter
        self.orig_dtype, self.reduce_dtype = self.sharded_param.dtype, policy.reduce_dtype
        self.param_dtype = None if policy.param_dtype == self.orig_dtype else policy.param_dtype

    monkeypatch.setattr(FSDPParam, "init_dtype_attrs", casts)
    with pytest.raises(ValueError, match="dropping their imaginary parts"):
        other = Spectral()
        shard_model(other, FabricMixedPrecisionPlugin("O2", half_dtype="bfloat16"), blocks=[other.lin])
