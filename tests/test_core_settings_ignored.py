"""No setting silently ignored at any opt level, and the bad input stop 54 left (stop 55)."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
from torch import nn

from lightning_mpx import Amp, MixedPrecisionSettings
from lightning_mpx.integrations.fabric import FabricMixedPrecisionPlugin
from lightning_mpx.integrations.lightning import MixedPrecisionPlugin
from lightning_mpx.opt_levels import OPT_LEVELS
from tests.lightning_helpers import Classifier, classification_data, loader, make_trainer

IGNORED = "ignored: opt_level="


def _warnings(build) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build()
    return [str(w.message) for w in caught if IGNORED in str(w.message)]


# The settings an opt level never reads, the levels where they were accepted without a word, and what the warning
# tells the user to do; each is read (no warning) at the level named last.
IGNORED_AT = [
    ("model_writes", "values", ("O0", "O1", "O3"), "model_writes only applies to O2's masters", "O2"),
    ("allow_banned", True, ("O0", "O2", "O3"), "only O1's cast table bans ops", "O1"),
    ("fp32_modules", ["0"], ("O0",), "runs the whole model in FP32 already", "O1"),
]


@pytest.mark.parametrize(("name", "value", "levels", "remedy", "reads"), IGNORED_AT, ids=[c[0] for c in IGNORED_AT])
def test_a_setting_the_opt_level_never_reads_is_named_once_with_the_remedy(name, value, levels, remedy, reads):
    for level in levels:
        (message,) = _warnings(lambda: Amp(level, half_dtype="bfloat16", **{name: value}))
        assert f"{name}={value!r} is ignored: opt_level={level!r}" in message and remedy in message, message
    assert _warnings(lambda: Amp(reads, half_dtype="bfloat16", **{name: value})) == []
    # With a scaler setting a static scale ignores too: still one warning, naming both.
    (message,) = _warnings(lambda: Amp(levels[-1], half_dtype="bfloat16", growth_interval=500, **{name: value}))
    assert "growth_interval=500 is ignored" in message and f"{name}={value!r} is ignored" in message


def test_the_settings_o0_reads_do_not_warn_and_diagnose_overflows_acts_there():
    # Stop 54 listed diagnose_overflows and unscale_backend as unused at O0: O0 checks, unscales (with the backend
    # given) and diagnoses each step's gradients as every level does, so neither is ignored.
    read = dict(diagnose_overflows=True, unscale_backend="reference", skip_on_device=False, overflow_log_interval=0.0,
                num_losses=2, on_floor="continue", loss_scale="dynamic", init_scale=8.0)
    assert _warnings(lambda: Amp("O0", half_dtype="bfloat16", **read)) == []
    origins = {}
    for diagnose in (False, True):
        amp = Amp("O0", half_dtype="bfloat16", diagnose_overflows=diagnose, on_floor="continue")
        model = amp.prepare_model(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
        optimizer = amp.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        with amp.forward_context():
            loss = model[1](model[0](torch.randn(2, 4)) * float("inf")).sum()
        amp.backward(loss)
        assert not amp.step(optimizer)
        origins[diagnose] = amp._overflows.last.describe()
    assert "origin unknown" in origins[False] and "origin forward" in origins[True]


def test_the_warning_comes_once_per_settings_object_and_not_for_defaults():
    settings = MixedPrecisionSettings("O1", half_dtype="bfloat16", model_writes="values")
    assert len(_warnings(lambda: [Amp.from_settings(settings) for _ in range(2)])) == 1
    given_defaults = dict(model_writes="versions", allow_banned=False, fp32_modules=[], diagnose_overflows=False)
    for level in OPT_LEVELS:
        assert _warnings(lambda: Amp(level, half_dtype="bfloat16", **given_defaults)) == [], level
    # half_dtype=None: said when the engine picks the dtype (the first model), once.
    built: list[Amp] = []
    assert _warnings(lambda: built.append(Amp("O3", allow_banned=True))) == []
    assert len(_warnings(lambda: built[0].prepare_model(nn.Linear(4, 4)))) == 1
    assert _warnings(lambda: built[0].prepare_model(nn.Linear(4, 4))) == []


@pytest.mark.usefixtures("fresh_accelerate_state")  # Accelerate's singleton state: none at the start
def test_every_front_warns_once_for_an_ignored_setting_and_never_at_its_defaults(monkeypatch):
    from lightning_mpx.apex import _amp_state
    from lightning_mpx.apex import amp as apex_amp
    from lightning_mpx.integrations.accelerate import Accelerator, MixedPrecisionKwargs

    def apex_initialize(level: str, **kwargs) -> None:
        model = nn.Linear(4, 4)
        apex_amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level, verbosity=0, **kwargs)

    for level in OPT_LEVELS:
        plugin = MixedPrecisionPlugin(level, half_dtype="bfloat16")
        fabric_plugin = FabricMixedPrecisionPlugin(level, half_dtype="bfloat16")
        assert _warnings(lambda: [
            MixedPrecisionPlugin.from_settings(plugin.settings), pickle.loads(pickle.dumps(plugin)),
            FabricMixedPrecisionPlugin.from_settings(fabric_plugin.amp.settings),
            pickle.loads(pickle.dumps(fabric_plugin)), Amp(level, **plugin.settings.to_kwargs()),
        ]) == [], level
        # Apex's documented per-level defaults, given as Apex's scripts give them.
        apex_defaults = dict(cast_model_type=None, patch_torch_functions=None, keep_batchnorm_fp32=None,
                             master_weights=None, loss_scale=None)
        assert _warnings(lambda: apex_initialize(level, **apex_defaults)) == [], level
    try:  # Apex's older entry point: O1, which reads it; it turns O1's casts on for this thread until reset
        assert _warnings(lambda: apex_amp.init(allow_banned=True)) == []
    finally:
        _amp_state.reset()
    assert len(_warnings(lambda: MixedPrecisionPlugin("O1", half_dtype="bfloat16", model_writes="values"))) == 1
    assert len(_warnings(lambda: FabricMixedPrecisionPlugin("O3", half_dtype="bfloat16", allow_banned=True))) == 1
    assert _warnings(lambda: Accelerator(mixed_precision="O0", kwargs_handlers=[MixedPrecisionKwargs()])) == []
    handler = MixedPrecisionKwargs(half_dtype="bfloat16", fp32_modules=["0"])
    (message,) = _warnings(lambda: Accelerator(mixed_precision="O0", kwargs_handlers=[handler]))
    assert "fp32_modules=['0'] is ignored: opt_level='O0'" in message
    monkeypatch.setenv("RANK", "1")
    assert _warnings(lambda: Amp("O0", half_dtype="bfloat16", model_writes="values")) == []  # rank zero only


def test_bad_arguments_name_the_argument_the_value_and_what_is_valid():
    from lightning_mpx.telemetry import module_groups

    amp = Amp("O1", half_dtype="bfloat16")
    with pytest.raises(TypeError, match=r"other=3 must be a lightning_mpx.Amp"):
        amp.continue_from(3)  # was: AttributeError: 'int' object has no attribute 'read_step_outcomes'
    amp.continue_from(Amp("O1", half_dtype="bfloat16"))
    for level in ("O0", "O1"):  # O0 has no policy: the flag was not even looked at
        with pytest.raises(TypeError, match=r"create_graph='x' must be True or False"):
            Amp(level, half_dtype="bfloat16").backward_context(create_graph="x")
    with Amp("O1", half_dtype="bfloat16").backward_context(create_graph=True):
        pass
    o2 = Amp("O2", half_dtype="bfloat16")
    model = o2.prepare_model(nn.Linear(4, 4))
    o2.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match=r"force='x' must be True or False"):
        o2.refresh_masters(force="x")  # was: accepted (read as true)
    with torch.no_grad():
        model.weight.fill_(0.5)
    assert o2.refresh_masters(force=True) == ["weight"]
    with pytest.raises(TypeError, match=r"names='ab.c' must be a list of parameter names.*names=\['ab.c'\]"):
        module_groups("ab.c")  # was: ['a', 'b', '', 'c'], one group per character
    with pytest.raises(TypeError, match=r"all_names='x'"):
        module_groups(["x.w"], "x")
    assert module_groups(["enc.w", "head.b"]) == ["enc", "head"]


def test_stepping_the_trainer_plugins_engine_after_teardown_names_the_calls():
    plugin = MixedPrecisionPlugin("O2", half_dtype="bfloat16")
    model = Classifier()
    trainer = make_trainer(plugin, max_steps=1)
    trainer.fit(model, loader(classification_data(n=16)))
    optimizer = trainer.optimizers[0]
    before = [p.detach().clone() for p in model.parameters()]
    # Was: stepped again with the last batch's gradients, changing the trained weights after the fit.
    with pytest.raises(RuntimeError, match=r"amp.step\(\) was called after the Trainer's teardown.*trainer.fit\(\)"):
        plugin.amp.step(optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    make_trainer(plugin, max_steps=1).fit(model, loader(classification_data(n=16)))  # the same plugin trains on
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
