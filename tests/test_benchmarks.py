"""The benchmark scripts run end to end in tiny configurations and write the rows and fields the docs rely on.

These tests prove that the scripts work; they never assert on timings.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import _harness  # noqa: E402
import convergence  # noqa: E402
import engine_overhead  # noqa: E402
import step  # noqa: E402

from tests.warm_python import warm_python  # noqa: E402

STEP_FIELDS = {
    "variant", "model", "steps_timed", "step_ms_median", "samples_per_second", "peak_memory_bytes",
    "peak_memory_kind", "repeats", "throughput_vs_bf16_mixed", "step_time_vs_bf16_mixed",
}  # fmt: skip


def test_step_script_end_to_end_in_subprocesses(tmp_path, monkeypatch):
    """step.py's default method: each variant in a child process of its own (the parent runs here: its ``__main__``
    door is test_every_script_answers_help's; the children are the script's own, ``--_child`` and all)."""
    out = tmp_path / "step.json"
    variants = ["mpx-O1-bf16", "lightning-bf16-mixed"]
    # The children start from the warm interpreter of tests/warm_python.py (``sys.executable`` is what step.py starts
    # them with): a process and a ``__main__`` of their own each, the imports of torch and Lightning already paid.
    monkeypatch.setattr(sys, "executable", warm_python())
    step.main(["--device", "cpu", "--model", "gpt", "--size", "tiny", "--steps", "2", "--warmup", "1", "--variants",
               *variants, "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert result["method"] == "a child process per run"
    assert result["device_type"] == "cpu" and result["torch"] and result["lightning"] and result["loadavg"]
    assert [r["variant"] for r in result["rows"]] == variants
    for row in result["rows"]:
        assert STEP_FIELDS <= set(row), STEP_FIELDS - set(row)
        assert row["model"] == "gpt" and row["steps_timed"] == 2 and row["peak_memory_kind"] == "peak_rss"
        assert row["step_ms_median"] > 0 and row["peak_memory_bytes"] > 0
    reference = next(r for r in result["rows"] if r["variant"] == "lightning-bf16-mixed")
    assert reference["throughput_vs_bf16_mixed"] == pytest.approx(1.0)
    (target,) = result["targets"]  # the CPU target: O1 against Lightning's bf16-mixed
    assert target["model"] == "gpt" and isinstance(target["met"], bool)
    assert target["value"] == pytest.approx(result["rows"][0]["step_time_vs_bf16_mixed"])


@pytest.mark.parametrize(
    "variant", ["mpx-O3-bf16", "torch-autocast-bf16", "loop-fp32", "lightning-16-mixed", "mpx-O1-fp16-compiled",
                "fabric-mpx-O2-fp16", "fabric-16-mixed", "mpx-O1-bf16-aligned", "core-O1-bf16-aligned",
                "core-O1-devskip-bf16"]
)  # fmt: skip
def test_step_child_variants_run_in_process(variant):
    spec = step.ModelSpec(batch=2, image=8, width=4, blocks=(1, 1))
    # aot_eager: the compiled variant's own code path (compiled network under the Trainer) without inductor's
    # CPU code generation (the GPU suite runs it with inductor).
    row = step.run_child(variant, "resnet", spec, steps=2, warmup=1, device="cpu", threads=1,
                         compile_backend="aot_eager")
    assert row["variant"] == variant and row["steps_timed"] == 2 and row["samples_per_second"] > 0
    if variant.endswith("16-mixed"):
        assert row["effective_dtype"] == "bfloat16"  # Lightning's and Fabric's "16-mixed" run as bfloat16 on CPU
    if "mpx-" in variant or variant.startswith("core-"):
        assert row["skipped_steps"] == 0


def test_step_ratios_and_cpu_target_from_rows():
    rows = [
        {"model": "gpt", "variant": "fp32", "step_ms_median": 20.0, "samples_per_second": 400.0,
         "peak_memory_bytes": 100},
        {"model": "gpt", "variant": "lightning-bf16-mixed", "step_ms_median": 10.0, "samples_per_second": 800.0,
         "peak_memory_bytes": 90},
        {"model": "gpt", "variant": "mpx-O1-bf16", "step_ms_median": 14.0, "samples_per_second": 8 / 0.014,
         "peak_memory_bytes": 95},
    ]  # fmt: skip
    step.add_ratios(rows)
    assert rows[0]["throughput_vs_bf16_mixed"] == pytest.approx(0.5)
    assert rows[2]["peak_memory_vs_fp32"] == pytest.approx(0.95)
    (check,) = step.check_targets(rows, "cpu")
    assert check["value"] == pytest.approx(1.4) and check["met"] is False


def test_step_rejects_unknown_variants_and_models(capsys):
    with pytest.raises(SystemExit):
        step.main(["--variants", "mpx-O4-fp16"])
    with pytest.raises(SystemExit):
        step.main(["--model", "bert"])
    assert "invalid choice" in capsys.readouterr().err


def test_convergence_quick_writes_rows_curves_and_plot(tmp_path):
    out, png = tmp_path / "conv.json", tmp_path / "conv.png"
    result = convergence.main(
        ["--quick", "--levels", "O0", "O2", "--dtypes", "bfloat16", "--out", str(out), "--plot", str(png),
         "--runs-dir", str(tmp_path / "runs")]
    )  # fmt: skip
    saved = json.loads(out.read_text())
    assert saved["rows"] == result["rows"]
    assert [r["variant"] for r in saved["rows"]] == ["O0", "O2-bfloat16"]
    o0, o2 = saved["rows"]
    assert o0["verdict"] == "baseline" and o0["ratio_to_O0"] == pytest.approx(1.0)
    assert o2["verdict"] in ("PASS", "FAIL") and o2["skipped_steps"] == [0] and o2["final_loss_scale"] == [1.0]
    assert set(saved["curves"]) == {"O0", "O2-bfloat16"} and len(saved["curves"]["O0"]) >= 2
    assert png.stat().st_size > 0 and not out.with_suffix(".partial.json").exists()


def test_convergence_summary_survives_a_diverged_run():
    runs = [
        {"variant": "O0", "seed": s, "val_loss": 2.0 + s / 100, "skipped_steps": 0, "loss_scale": 1.0,
         "seconds": 1.0, "val_curve": [[10, 3.0], [20, 2.0]]} for s in (0, 1)
    ] + [
        {"variant": "O1-float16", "seed": s, "val_loss": 2.05, "skipped_steps": 1, "loss_scale": 2.0**15,
         "seconds": 1.0, "val_curve": [[20, 2.05]]} for s in (0, 1)
    ] + [
        {"variant": "O3-float16", "seed": 0, "val_loss": None, "skipped_steps": 19, "loss_scale": 1.0,
         "seconds": 1.0, "val_curve": [[20, None]]},
        {"variant": "O3-float16", "seed": 1, "val_loss": 2.5, "skipped_steps": 0, "loss_scale": 1.0,
         "seconds": 1.0, "val_curve": [[20, 2.5]]},
    ]  # fmt: skip
    rows = {r["variant"]: r for r in convergence.summarise(runs, tolerance=0.02)}
    assert rows["O0"]["val_loss_mean"] == pytest.approx(2.005)
    assert rows["O1-float16"]["verdict"] == "FAIL"  # +2.2 %
    assert rows["O3-float16"]["val_loss_mean"] is None and rows["O3-float16"]["non_finite_runs"] == 1
    assert rows["O3-float16"]["verdict"] == "reported"
    assert convergence.mean_curves(runs)["O3-float16"] == [(20, 2.5)]
    json.dumps(rows, allow_nan=False)  # strict JSON
    assert not any(isinstance(v, float) and math.isnan(v) for r in rows.values() for v in r.values())


def test_convergence_variant_names_and_bad_flags():
    assert convergence.variant_names(["O0", "O3"], ["bfloat16"]) == ["O0", "O3-bfloat16"]
    with pytest.raises(SystemExit):
        convergence.main(["--levels", "O5"])


def test_engine_overhead_rows(tmp_path):
    out = tmp_path / "eo.json"
    result = engine_overhead.main(["--parts", "engine", "telemetry", "--params", "6", "--steps", "3", "--repeats",
                                   "1", "--out", str(out)])  # fmt: skip
    assert [r["opt_level"] for r in json.loads(out.read_text())["rows"]] == ["O1", "O2"]
    assert all(r["parameters"] == 6 and r["engine_us_per_step"] > 0 for r in result["rows"])
    telemetry = result["telemetry_rows"]
    assert [r["opt_level"] for r in telemetry] == ["O1", "O2"]
    # --telemetry-every 10 by default, two "on" engines: 2 warm-up requests each, then iteration 20 (of 20-22).
    assert all(r["logging_iterations"] == 2 and r["measurements"] == 6 for r in telemetry)
    assert all(r["off_us_median"] > 0 and r["on_nonlogging_us_median"] > 0 for r in telemetry)
    assert result["forensics_rows"] == [] and result["write_check_rows"] == []  # parts not asked for: not run
    assert "| O2 | 6 |" in out.with_suffix(".md").read_text()


def test_engine_overhead_write_check_rows(tmp_path):
    """The ``writes`` part (O2's check for writes to the half model; it was benchmarks/mirror_check.py)."""
    out = tmp_path / "mc.json"
    result = engine_overhead.main(["--parts", "writes", "--params", "4", "--steps", "2", "--repeats", "1",
                                   "--out", str(out)])  # fmt: skip
    cases = [r["case"] for r in json.loads(out.read_text())["write_check_rows"]]
    assert cases == ["nothing", "data_read", "data_clamp", "values_nothing", "values_clamp", "pattern_read",
                     "pattern_clamp"]  # fmt: skip
    assert all(r["params"] == 4 and r["us_median"] > 0 for r in result["write_check_rows"])


def test_engine_overhead_forensics_rows(tmp_path):
    """The ``forensics`` part (a clean step, an iteration and an overflow step, unwatched and watched; it was
    benchmarks/forensics_overhead.py)."""
    out = tmp_path / "fo.json"
    engine_overhead.main(["--parts", "forensics", "--levels", "O2", "--layers", "2", "--steps", "2", "--repeats", "1",
                          "--out", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())["forensics_rows"]
    assert [(r["row"], r["diagnose"]) for r in rows] == [
        (row, diagnose) for diagnose in ("off", "watched") for row in ("clean-step", "iteration", "overflow-step")
    ]
    assert all(r["us"] > 0 and r["modules"] == 5 and r["parameters"] == 4 for r in rows)


def test_engine_overhead_skip_rows_pair_the_host_read_with_skip_on_device(tmp_path):
    """The ``skip`` part: two engines with AdamW(fused=True), the default and ``skip_on_device=True``, stepped in
    turn; torch's fused step with and without a found_inf beside them."""
    out = tmp_path / "skip.json"
    result = engine_overhead.main(["--parts", "skip", "--params", "4", "--steps", "2", "--repeats", "2",
                                   "--out", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())["skip_rows"]
    assert [r["opt_level"] for r in rows] == ["O1", "O2"] and result["rows"] == []
    for row in rows:
        assert row["parameters"] == 4 and len(row["host_read_repeat_means_us"]) == 2
        assert row["settings_skip_on_device"] == {"host": False, "device": True}
        assert row["device_vs_host"] == pytest.approx(statistics.median(
            d / h for d, h in zip(row["skip_on_device_repeat_means_us"], row["host_read_repeat_means_us"])))
        assert row["torch_fused_step_us"] > 0 and row["torch_fused_step_with_found_inf_us"] > 0
    assert "skip_on_device" in out.with_suffix(".md").read_text()


def test_plugin_overhead_rows_ratios_syncs_and_profile(tmp_path, capsys):
    import plugin_overhead

    out = tmp_path / "po.json"
    # Logging every 6 steps, 13 counted steps hold logging steps 5 and 11 (Lightning's default, 50, took 52 steps)
    result = plugin_overhead.main(["--variants", "plugin-O2", "core-O2", "--steps", "3", "--warmup", "1",
                                   "--repeats", "2", "--count-syncs", "--sync-steps", "13", "--log-every", "6",
                                   "--profile", "plugin-O2", "--out", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["bf16-mixed", "plugin-O2", "core-O2"]  # the reference first
    assert all(r["step_ms_p20"] > 0 and len(r["ratios"]) == 2 for r in rows)
    assert rows[0]["ratio_to_bf16-mixed"] == 1.0 and rows[1]["lightning_precision"] == "bf16-true"
    assert set(result["pairs"]) == {"plugin-O2 / core-O2"}
    syncs = {s["variant"]: s for s in result["syncs"]}
    # The plugin reads its metrics on the logging steps (5, 11) only, in one transfer (a tolist, no .item() per metric);
    # the step's own reads are the same as the core's.
    assert syncs["plugin-O2"]["per_logging_step"] == syncs["plugin-O2"]["per_step_nonlogging"]
    assert syncs["plugin-O2"]["per_step_nonlogging"] == syncs["core-O2"]["per_step_nonlogging"]
    # One host read of the overflow flag per step beyond Lightning's own (AdamW's step counters on CPU), as
    # GradScaler's: one loss in one process reads it with .item(), counted by the dispatch mode.
    assert syncs["plugin-O2"]["per_step_nonlogging"] == syncs["reference"]["per_step_nonlogging"] + 1
    # tolist: the metrics' one read on the one logging step of the counted steps (10 and 11), none in the reference.
    assert syncs["reference"]["tolist_per_step"] == 0
    assert round(syncs["plugin-O2"]["tolist_per_step"] * (13 - 11), 6) == 1
    assert (
        "lightning_mpx/integrations/lightning.py" in result["profile"]
        and "optimizer_step" in capsys.readouterr().out
    )


@pytest.fixture(scope="module")
def o1_proxy_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """One small ``o1_proxy.py --phases`` run (the result and its JSON file), read by the tests of its rows and of
    its phases."""
    import o1_proxy

    out = tmp_path_factory.mktemp("o1_proxy") / "o1.json"
    result = o1_proxy.main(["--variants", "core-O1-aligned", "plugin-O2", "--steps", "6", "--warmup", "1",
                            "--repeats", "2", "--phases", "--out", str(out)])  # fmt: skip
    return result, out


def test_o1_proxy_pairs_each_row_with_its_reference_in_the_same_repeat(o1_proxy_run):
    import o1_proxy

    result, out = o1_proxy_run
    assert json.loads(out.read_text())["rows"] == result["rows"]
    rows = {(r["row"], r["reference"]): r for r in result["rows"]}
    # references added; the aligned core loop against both torch loops (bare, and with Amp's skip check)
    assert set(rows) == {("core-O1-aligned", "loop-autocast"), ("core-O1-aligned", "loop-autocast-checked"),
                         ("plugin-O2", "bf16-mixed")}
    samples = result["samples_ms"]
    for (row, reference), r in rows.items():
        assert r["ratios"] == [a / b for a, b in zip(samples[row], samples[reference])] and len(r["ratios"]) == 2
        assert r["meets_goal"] == (r["ratio"] <= o1_proxy.GOAL)
    assert o1_proxy.main(["--_child", "core-O1-aligned", "1", "1", "2"]) == {}  # what --instructions runs per process
    assert o1_proxy.main(["--_child", "plugin-O2", "1", "1", "2"]) == {}  # a Trainer row too


def test_o1_proxy_phases_split_each_trainer_step_into_its_parts(o1_proxy_run):
    """``--phases``: per Trainer row, the forward, backward and step phases of the same runs, with their difference
    to the reference taken within each repeat; the loops have none."""
    import o1_proxy

    result, out = o1_proxy_run
    phases = {r["row"]: r for r in result["phases"]}
    assert set(phases) == {"bf16-mixed", "plugin-O2"}
    for row in phases.values():
        assert all(row[p] > 0 for p in o1_proxy.PHASES)
    assert all(phases["bf16-mixed"][f"{p}_minus_reference"] == 0 for p in o1_proxy.PHASES)
    step = {r["row"]: r for r in result["rows"]}[("plugin-O2")]
    # The phases tile the step: their p20s add up to about the step's p20 (each a percentile of its own)
    total = sum(phases["plugin-O2"][p] for p in o1_proxy.PHASES)
    assert 0.5 * step["row_ms"] < total < 2.0 * step["row_ms"]
    assert "phases of the Trainer rows" in out.with_suffix(".md").read_text()


def test_cast_overhead_rows_counts_and_references(tmp_path, capsys, fresh_dynamo):
    """cast_overhead.py (issue 12's figures) in its smallest configuration (the ``micro`` model, one warm-up step,
    dynamo's counts over three steps): every eager and compiled row, the ratios to each reference, and dynamo's
    counts. The counts are facts, not timings: a compiled O1 step has no graph break and no recompile, and the
    handed-off and inside variants make no call into the policy's hook. In this process (the script's ``__main__``
    door is test_every_script_answers_help's): dynamo's state is emptied before and after, and the thread count the
    script sets is put back."""
    import cast_overhead
    import torch

    out = tmp_path / "cast_overhead.json"
    threads = torch.get_num_threads()
    try:
        cast_overhead.main(["--models", "micro", "--steps", "8", "--repeats", "1", "--warmup", "1", "--count-steps",
                            "3", "--backend", "aot_eager", "--out", str(out)])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert "/twin_floor" in capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    eager = {r["variant"]: r for r in rows if r["mode"] == "eager"}
    compiled = {r["variant"]: r for r in rows if r["mode"] != "eager"}
    assert list(eager) == ["fp32", "autocast", "mode_floor", "O1", "twin", "twin_floor"]
    assert list(compiled) == ["autocast", "O1_outside", "O1_handoff", "O1_inside"]
    for ref in ("autocast", "mode_floor", "twin", "twin_floor"):
        assert eager["O1"][f"over_{ref}"] > 0 and len(eager["O1"][f"over_{ref}_iqr"]) == 2
    assert eager["O1"]["hook_calls"] > 0
    for name, row in compiled.items():
        assert (row["graph_breaks"], row["graphs"], row["recompiles"]) == (0, 1, 0), (name, row)
    assert compiled["O1_handoff"]["hook_calls"] == 0 and compiled["O1_inside"]["hook_calls"] == 0
    assert compiled["O1_outside"]["hook_calls"] > 0  # the reference: without the hand-off the hook is called


def test_cast_overhead_split_times_forward_and_backward_apart():
    """cast_overhead.py --split: each eager variant's forward and backward, its step's difference to the do-nothing
    mode over autocast and to autocast (per round), and the tiny goal's 2% budget."""
    import argparse

    import cast_overhead
    import torch

    rows = {r["variant"]: r for r in cast_overhead.split("micro", torch.bfloat16, argparse.Namespace(batch=1),
                                                         rounds=3)}
    assert list(rows) == ["autocast", "mode_floor", "O1", "twin", "twin_floor"]
    assert rows["autocast"]["step_over_autocast_us"] == 0 and rows["mode_floor"]["step_over_floor_us"] == 0
    for row in rows.values():
        assert row["forward_us"] > 0 and row["backward_us"] > 0
    # The budget is 2% of the floor's median step (a median of per-round sums, not the sum of the two medians,
    # which differ by the rounds' noise: compared with that, this test failed once on a loaded machine).
    assert rows["O1"]["budget_us"] == pytest.approx(0.02 * rows["mode_floor"]["step_us"])
    assert all(row["step_us"] > 0 for row in rows.values())


def test_cast_instructions_rows_subtract_the_base_process_and_divide_by_steps():
    """cast_instructions.py counts whole processes (import, warm-up, then the measured steps): a variant's figure
    is its process's count less the base process's, per measured step, and each ratio is to the same model's
    reference."""
    import cast_instructions

    counts = {("tiny", "base"): 1000, ("tiny", "mode_floor"): 1000 + 10 * 200, ("tiny", "O1"): 1000 + 10 * 210,
              ("tiny", "twin_floor"): 1000 + 10 * 205}  # fmt: skip
    rows = {r["variant"]: r for r in cast_instructions.rows_from_counts(counts, 10)}
    assert rows["O1"]["instructions_per_step"] == 210
    assert rows["O1"]["over_mode_floor"] == pytest.approx(1.05)
    assert rows["O1"]["over_twin_floor"] == pytest.approx(210 / 205)
    assert "over_autocast" not in rows["O1"] and "over_mode_floor" not in rows["mode_floor"]
    with pytest.raises(SystemExit):
        cast_instructions.main(["--steps", "0"])


def test_gpu_host_profile_check_runs_its_code_path_on_cpu(tmp_path):
    """gpu_host_profile.py --check: every variant's loop (step.loop_step) and both profilers on CPU; a CUDA run is
    the only measurement, so the file says it measured nothing."""
    import gpu_host_profile

    out = tmp_path / "hp.json"
    assert gpu_host_profile.main(["--check", "--steps", "1", "--warmup", "0", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["check"] and "measures nothing" in result["device"]
    assert [r["variant"] for r in result["rows"]] == list(gpu_host_profile.CHECK_VARIANTS)
    assert all(r["host_ms"] > 0 and r["step_ms"] > 0 for r in result["rows"])
    assert result["profiled"] == "core-O1-bf16" and "lightning_mpx" in result["python_profile"]


def test_gpu_host_profile_interleaved_is_a_step_result_the_report_judges(tmp_path):
    """--interleave: the loops side by side in one process, written as a step result under step.py's row names, so
    gpu_report.py takes the core loop's verdicts from it when it is the latest file holding both rows."""
    import gpu_host_profile
    import gpu_report

    out = tmp_path / "step_interleaved_gpt.json"
    argv = ["--check", "--interleave", "2", "--steps", "1", "--warmup", "0", "--out", str(out)]
    assert gpu_host_profile.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "step" and result["repeats"] == 2
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"torch-autocast-bf16", "core-O1-bf16"}
    assert all(len(r["step_ms_runs"]) == 2 and r["samples_per_second"] > 0 for r in rows.values())
    verdicts = gpu_report.step_targets(gpu_report.load_sources([tmp_path]).items)
    core = next(v for v in verdicts if v.target == "core O1 bf16 >= 0.97x torch.autocast loop" and v.scope == "gpt")
    expected = rows["core-O1-bf16"]["samples_per_second"] / rows["torch-autocast-bf16"]["samples_per_second"]
    assert core.source == out.name and core.value == pytest.approx(expected)
    with pytest.raises(SystemExit):
        gpu_host_profile.main(["--check", "--interleave", "-1"])


def test_harness_interleave_rotates_and_pairs_within_rounds():
    """Each round starts one variant later, so every variant runs first as often as the others; a paired ratio
    divides samples of the same round."""
    order: list[str] = []
    samples = _harness.interleave({v: (lambda v=v: order.append(v) or len(order)) for v in "abc"}, 3,
                                  warmup_rounds=1)  # fmt: skip
    assert order == list("abc" "bca" "cab" "abc")  # the first round warms up and is dropped
    assert samples == {"a": [6, 8, 10], "b": [4, 9, 11], "c": [5, 7, 12]}
    assert _harness.interleave({"x": lambda: 1, "y": lambda: 2}, 2, rotate=False) == {"x": [1, 1], "y": [2, 2]}
    ratio = _harness.paired([2.0, 4.0, 9.0, 8.0], [1.0, 2.0, 3.0, 4.0])
    assert ratio.median == 2.0 and ratio.low <= 2.0 <= ratio.high and ratio.text(suffix="x").startswith("2.000x (")
    assert _harness.paired([3.0], [1.0], difference=True) == _harness.Spread(2.0, 2.0, 2.0)
    with pytest.raises(ValueError, match="one length"):
        _harness.paired([1.0], [1.0, 2.0])


def test_harness_tables_and_result_files(tmp_path):
    table = _harness.markdown_table(["variant", "ms"], [["a", "1.50"], ["bb", None]])
    assert table == "| variant | ms |\n|---|---:|\n| a | 1.50 |\n| bb | - |"
    padded = _harness.markdown_table(["variant", "ms"], [["a", "1.50"]], pad=True).splitlines()
    assert len({len(line) for line in padded}) == 1 and padded[1] == "| ------- | ---: |"
    with pytest.raises(ValueError, match="2 columns"):
        _harness.markdown_table(["a", "b"], [["only one"]])
    machine = _harness.machine()
    assert machine["device"] == _harness.cpu_model() and machine["torch"] and machine["lightning_mpx"]
    _harness.save(tmp_path / "r.json", {"benchmark": "x", **machine}, {"title": table})
    assert json.loads((tmp_path / "r.json").read_text())["benchmark"] == "x"
    assert "## title" in (tmp_path / "r.md").read_text() and table in (tmp_path / "r.md").read_text()


_HELP = """
import contextlib, io, json, runpy, sys
answers = {}
for path in sys.argv[1:]:
    sys.path.insert(0, path.rsplit("/", 1)[0])  # as `python benchmarks/<script>` puts its folder first
    sys.argv = [path, "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(path, run_name="__main__")
            code = None
        except SystemExit as stop:
            code = stop.code
    answers[path] = [code, out.getvalue()[:200]]
print(json.dumps(answers))
"""


def test_the_warm_python_of_these_tests_is_warm_in_the_suites_environment():
    """The runs of ``warm_python()`` here (step.py's children, the --help sweep, prepare_memory.py's child) are forks
    of its server, which imported Lightning in the import mode they inherit from this process (conftest.py sets
    ``TRITON_INTERPRET=1`` without a GPU). Before stop 63 the server imported without it, and every run here started
    cold: a fresh interpreter each, importing torch and Lightning again (~6.5 s of CPU)."""
    code = "import os, sys; print('lightning.pytorch' in sys.modules, os.environ.get('TRITON_INTERPRET', '-'))"
    done = subprocess.run([warm_python(), "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", os.environ.get("TRITON_INTERPRET", "-")]


def test_every_script_answers_help():
    """``python benchmarks/<script> --help`` works for every script (in one process: importing torch once)."""
    scripts = sorted(str(p) for p in (ROOT / "benchmarks").glob("[!_]*.py"))
    # From the warm interpreter of tests/warm_python.py: torch and Lightning imported before, each script afresh.
    done = subprocess.run([warm_python(), "-c", _HELP, *scripts], capture_output=True, text=True, timeout=180,
                          cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(answers) == len(scripts) >= 9
    for script, (code, text) in answers.items():
        assert code in (0, None) and text.startswith("usage:"), (script, code, text)


def test_step_one_process_rotates_rounds_and_keeps_the_rounds_a_cut_run_finished(tmp_path, monkeypatch):
    """step.py --one-process: every variant in one process, the order rotated each round, each row the median of its
    rounds; the file is written after each round, so a run stopped in round 2 still holds round 1's rows."""
    import step

    out = tmp_path / "step.json"
    variants = ["torch-autocast-bf16", "loop-fp32"]
    argv = ["--device", "cpu", "--model", "resnet", "--size", "tiny", "--steps", "1", "--warmup", "0", "--repeats",
            "2", "--one-process", "--variants", *variants, "--out", str(out)]  # fmt: skip
    order: list[str] = []
    real = step.run_in_process

    def recorded(variant, *args, **kwargs):
        order.append(variant)
        return real(variant, *args, **kwargs)

    monkeypatch.setattr(step, "run_in_process", recorded)
    result = step.main(argv)
    assert order == variants + variants[::-1]  # rotated: the second round starts with the other variant
    assert result["method"] == "one process, rotated rounds" and result["rounds_done"] == 2
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == set(variants) and all(len(r["step_ms_runs"]) == 2 for r in rows.values())

    calls = iter(range(100))

    def cut(variant, *args, **kwargs):
        if next(calls) == 2:  # the first run of round 2
            raise KeyboardInterrupt
        return real(variant, *args, **kwargs)

    out.unlink()
    monkeypatch.setattr(step, "run_in_process", cut)
    with pytest.raises(KeyboardInterrupt):
        step.main(argv)
    kept = json.loads(out.read_text())
    assert kept["rounds_done"] == 1 and {r["variant"] for r in kept["rows"]} == set(variants)
    assert all(r["step_ms_runs"] and len(r["step_ms_runs"]) == 1 for r in kept["rows"])


@pytest.mark.parametrize("fused", [False, True])
def test_checked_reference_loop_skips_a_step_with_non_finite_gradients(fused):
    """loop_step("autocast-checked"): the bf16 autocast loop with torch's own non-finite check, the reference that
    core O1 bf16 is compared with on a GPU: it must skip exactly the steps whose gradients are not finite (its
    optimizer's state included) and step the others, as Amp does."""
    import step
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    one, amp = step.loop_step("autocast-checked", net, "cpu", torch.bfloat16, fused=fused)
    assert amp is None
    before = [p.detach().clone() for p in net.parameters()]
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    one(x.clone().fill_(float("inf")), y)  # non-finite gradients: skipped
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    one(x, y)  # finite: a step
    assert all(not torch.equal(a, b) for a, b in zip(before, net.parameters()))
    assert all(torch.isfinite(p).all() for p in net.parameters())
    with pytest.raises(ValueError, match="kind='autocast-unchecked' is not a loop; valid choices"):
        step.loop_step("autocast-unchecked", net, "cpu", torch.bfloat16)


def test_lora_masters_counts_the_adapters_only(tmp_path):
    """benchmarks/lora_masters.py: at O2 a LoRA model's FP32 masters hold its adapters, not its frozen base."""
    pytest.importorskip("peft")
    import lora_masters

    out = tmp_path / "lora.json"
    result = lora_masters.main(["--hidden", "32", "--layers", "1", "--steps", "1", "--out", str(out)])
    assert json.loads(out.read_text())["master_elements"] == result["master_elements"]
    assert result["master_tensors"] == result["trainable_tensors"] > 0
    assert result["master_elements"] == result["trainable_elements"] < result["model_elements"] // 10
    with pytest.raises(SystemExit):
        lora_masters.main(["--hidden", "30"])


def test_prepare_memory_reports_peaks_and_the_masters_gap(tmp_path, monkeypatch):
    """benchmarks/prepare_memory.py: peak host memory after each prepare call, in a child process per tree, and the
    masters' distance from the FP32 weights (none in this checkout)."""
    pytest.importorskip("transformers")
    import prepare_memory

    # The child (``sys.executable -c``) starts from the warm interpreter, as step.py's children: a process of its own,
    # torch and lightning_mpx imported (transformers, in the child); its peaks then count those imports too, which
    # the test, reading only their order, does not judge.
    monkeypatch.setattr(sys, "executable", warm_python())
    out = tmp_path / "prepare.json"
    result = prepare_memory.main(["--layers", "1", "--hidden", "64", "--out", str(out)])
    (row,) = result["rows"]
    assert json.loads(out.read_text())["rows"] == result["rows"]
    assert row["exact_tensors"] == row["tensors"] > 0 and row["max_abs_gap"] == 0.0
    assert 0 < row["built_mib"] <= row["prepare_model_mib"] <= row["prepare_optimizer_mib"]
    with pytest.raises(SystemExit):
        prepare_memory.main(["--hidden", "100"])


def test_step_persistent_builds_each_variant_once_and_trains_it_on(tmp_path, monkeypatch):
    """step.py --one-process --persistent: each variant (a Trainer row and a loop) built once, then trained on round
    after round; a Trainer row's rounds continue its fit (the global step counts on), a loop's its step; no peak
    memory is judged from the shared process."""
    import step

    built: list[str] = []
    real = step.Persistent.__init__

    def counted(self, variant, *args, **kwargs):
        built.append(variant)
        real(self, variant, *args, **kwargs)

    monkeypatch.setattr(step.Persistent, "__init__", counted)
    advanced: list[tuple[str, int]] = []
    real_advance = step.Persistent.advance

    def advance(self, steps):
        record = real_advance(self, steps)
        advanced.append((self.variant, self.trainer.global_step if self.trainer is not None else -1))
        return record

    monkeypatch.setattr(step.Persistent, "advance", advance)
    out = tmp_path / "step.json"
    variants = ["mpx-O2-bf16", "core-O1-bf16", "fp32"]
    result = step.main(["--device", "cpu", "--model", "resnet", "--size", "tiny", "--steps", "2", "--warmup", "1",
                        "--repeats", "2", "--one-process", "--persistent", "--variants", *variants,
                        "--out", str(out)])  # fmt: skip
    assert sorted(built) == sorted(variants)  # once each, for both rounds
    assert result["method"].startswith("one process, each variant built once") and result["rounds_done"] == 2
    steps_of = [gs for v, gs in advanced if v == "mpx-O2-bf16"]
    assert steps_of == [3, 5]  # 1 warm-up step, then 2 more per round: one fit continued
    rows = {r["variant"]: r for r in result["rows"]}
    assert all(len(r["step_ms_runs"]) == 2 and r["steps_timed"] == 2 for r in rows.values())
    assert rows["mpx-O2-bf16"]["peak_memory_kind"].startswith("process") and rows["fp32"]["peak_memory_bytes"] > 0
    assert "peak_memory_vs_fp32" not in rows["mpx-O2-bf16"]  # no memory ratio from the process's shared peak
    assert not any("peak memory" in t["target"] for t in result["targets"])  # the process's peak is not a row's
    with pytest.raises(SystemExit):
        step.main(["--device", "cpu", "--persistent", "--variants", "fp32"])  # --persistent needs --one-process


def test_gpu_host_profile_census_lists_what_a_loop_does_beyond_torchs(tmp_path):
    """--census: per step of each loop, the operators and their difference from the torch loop of the same dtype
    (the checked loop for bfloat16), and Amp's own Python for the core loops."""
    import gpu_host_profile

    out = tmp_path / "census.json"
    argv = ["--check", "--census", "--steps", "2", "--warmup", "1", "--model", "resnet", "--variants",
            "autocast-bf16", "autocast-checked-bf16", "core-O1-bf16", "--out", str(out)]  # fmt: skip
    assert gpu_host_profile.main(argv) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["core-O1-bf16"]["reference"] == "torch-autocast-checked-bf16"
    checked = rows["torch-autocast-checked-bf16"]
    # The checked loop's one non-finite check is what it does beyond the bare loop, counted per step.
    assert checked["op_differences"]["aten::_amp_foreach_non_finite_check_and_unscale_"] == [0.0, 1.0]
    assert rows["core-O1-bf16"]["ops_per_step"] > 0 and rows["core-O1-bf16"]["python"]
    # The census names the package's own functions, by their file under lightning_mpx/ (the step's, wherever the
    # engine's modules put them).
    assert all((ROOT / "lightning_mpx" / name.split(":")[0]).is_file() for name, _, _ in rows["core-O1-bf16"]["python"])
    assert rows["torch-autocast-bf16"]["python"] == []  # torch's loops run none of ours
    with pytest.raises(SystemExit):
        gpu_host_profile.main(["--check", "--census", "--interleave", "2"])


def _keep_built_rows(monkeypatch: pytest.MonkeyPatch) -> dict:
    """step.py's persistent rows by variant, as each is built (to look at its Trainer and plugin)."""
    import step

    built = {}
    real = step.Persistent.__init__

    def keep(self, variant, *args, **kwargs):
        real(self, variant, *args, **kwargs)
        built[variant] = self

    monkeypatch.setattr(step.Persistent, "__init__", keep)
    return built


def test_clip_rows_clip_and_are_compared_with_16_mixed_clipping_the_same(tmp_path, monkeypatch):
    """The ``-clip`` rows run their Trainer with ``gradient_clip_val=1.0`` (the plugin's row computes the norm in its
    unscale) and carry their ratio to Lightning's "16-mixed" with the same clip, a column of their own."""
    import step
    import torch

    built = _keep_built_rows(monkeypatch)
    variants = ["lightning-16-mixed-clip", "mpx-O2-fp16-clip"]
    result = step.main(["--device", "cpu", "--model", "resnet", "--size", "tiny", "--steps", "2", "--warmup", "1",
                        "--repeats", "2", "--one-process", "--persistent", "--variants", *variants,
                        "--out", str(tmp_path / "s.json")])  # fmt: skip
    assert all(built[v].trainer.gradient_clip_val == 1.0 for v in variants)
    amp = built["mpx-O2-fp16-clip"].trainer.precision_plugin.amp
    assert amp.half_dtype == torch.float16 and "mpx/grad_norm" in amp.metrics()
    rows = {r["variant"]: r for r in result["rows"]}
    mine, ref = rows["mpx-O2-fp16-clip"], rows["lightning-16-mixed-clip"]
    assert mine["throughput_vs_16_mixed_clip"] == pytest.approx(mine["samples_per_second"] / ref["samples_per_second"])
    assert "vs 16-mixed-clip" in step.table(result["rows"])
    assert step.base_variant("mpx-O2-fp16-clip") == "mpx-O2-fp16" and step.is_fp16("mpx-O1-fp16-clip")


def test_fused_rows_step_a_fused_adamw_and_the_plugins_skip_on_the_device(tmp_path, monkeypatch):
    """The ``-fused`` rows train with ``AdamW(fused=True)``: Lightning's with its own precision string, the plugin's
    with ``skip_on_device=True`` (the overflow flag handed to the fused step); each carries its ratio to Lightning's
    AMP of its dtype with the same fused AdamW, a column of its own."""
    import step
    import torch

    from lightning_mpx import MixedPrecisionPlugin

    built = _keep_built_rows(monkeypatch)
    variants = ["lightning-16-mixed-fused", "lightning-bf16-mixed-fused", "mpx-O1-fp16-fused", "mpx-O1-bf16-fused",
                "mpx-O2-fp16-fused"]  # fmt: skip
    result = step.main(["--device", "cpu", "--model", "resnet", "--size", "tiny", "--steps", "2", "--warmup", "1",
                        "--repeats", "2", "--one-process", "--persistent", "--variants", *variants,
                        "--out", str(tmp_path / "s.json")])  # fmt: skip
    rows = {r["variant"]: r for r in result["rows"]}
    for variant in variants:
        trainer = built[variant].trainer
        (optimizer,) = trainer.optimizers
        assert type(optimizer) is torch.optim.AdamW and all(g["fused"] for g in optimizer.param_groups), variant
        plugin = trainer.precision_plugin
        if variant.startswith("lightning-"):
            own = variant.removeprefix("lightning-").removesuffix("-fused")
            assert not isinstance(plugin, MixedPrecisionPlugin)
            assert step._trainer_precision(variant, "cpu") == {"precision": own, "fused": True}
        else:
            assert isinstance(plugin, MixedPrecisionPlugin) and plugin.amp.settings.skip_on_device, variant
            assert plugin.amp.opt_level == variant.split("-")[1]
            assert plugin.amp.half_dtype == step.half_dtype_of(variant)
            assert rows[variant]["skipped_steps"] == 0
    for variant, reference, key in (("mpx-O1-fp16-fused", "lightning-16-mixed-fused", "16_mixed_fused"),
                                    ("mpx-O2-fp16-fused", "lightning-16-mixed-fused", "16_mixed_fused"),
                                    ("mpx-O1-bf16-fused", "lightning-bf16-mixed-fused", "bf16_mixed_fused")):
        expected = rows[variant]["samples_per_second"] / rows[reference]["samples_per_second"]
        assert rows[variant][f"throughput_vs_{key}"] == pytest.approx(expected)
    header = step.table(result["rows"]).splitlines()[0]
    assert "vs 16-mixed-fused" in header and "vs bf16-mixed-fused" in header and "clip" not in header
    assert step.base_variant("mpx-O2-fp16-fused") == "mpx-O2-fp16" and step.is_fp16("mpx-O1-fp16-fused")
    assert not step.is_fp16("mpx-O1-bf16-fused") and step.half_dtype_of("mpx-O1-bf16-fused") == torch.bfloat16


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_devskip_loops_skip_on_the_device_with_a_fused_adamw(dtype, monkeypatch):
    """``core-O1-devskip-<dtype>``: ``Amp`` at O1 with ``skip_on_device=True`` on ``AdamW(fused=True)``. Its step
    hands the overflow flag to the optimizer's and returns a :class:`StepOutcome` unread; a step with non-finite
    gradients leaves the parameters as they were and is counted once read, finite ones step."""
    import step
    import torch

    from lightning_mpx import Amp, StepOutcome

    optimizers, outcomes = [], []
    real_prepare, real_step = Amp.prepare_optimizer, Amp.step

    def prepare(self, optimizer):
        optimizers.append(optimizer)
        return real_prepare(self, optimizer)

    def stepped(self, optimizer, **kwargs):
        outcomes.append(real_step(self, optimizer, **kwargs))
        return outcomes[-1]

    monkeypatch.setattr(Amp, "prepare_optimizer", prepare)
    monkeypatch.setattr(Amp, "step", stepped)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    one, amp = step.loop_of(f"core-O1-devskip-{dtype}", net, torch.device("cpu"))
    assert amp.settings.skip_on_device and amp.opt_level == "O1"
    assert amp.half_dtype == (torch.float16 if dtype == "fp16" else torch.bfloat16)
    (optimizer,) = optimizers
    assert type(optimizer) is torch.optim.AdamW and all(g["fused"] for g in optimizer.param_groups)
    before = [p.detach().clone() for p in net.parameters()]
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    one(x.clone().fill_(float("inf")), y)  # non-finite gradients: skipped on the device
    assert isinstance(outcomes[-1], StepOutcome) and not outcomes[-1].known  # not read in the step
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    for _ in range(3):
        one(x, y)
    assert all(not torch.equal(a, b) for a, b in zip(before, net.parameters()))
    assert step._loop_extra(amp) == {"skipped_steps": 1}  # read after the timed steps
    assert [o.stepped for o in outcomes] == [False, True, True, True]


def test_habit_census_writes_rows_findings_and_tables(tmp_path):
    import habit_census

    out = tmp_path / "census.json"
    result = habit_census.main(["--fronts", "loop", "--models", "resnet", "--habits", "plain", "--warmup", "1",
                                "--steps", "1", "--depths", "1", "2", "--no-calls", "--out", str(out)])  # fmt: skip
    saved = json.loads(out.read_text())
    assert [r["variant"] for r in saved["rows"]] == ["autocast", "core-O1", "core-O1-gpu", "core-O2"] == \
        [r["variant"] for r in result["rows"]]  # fmt: skip
    assert all({"syncs", "reads", "ops", "ops_per_param"} <= set(r) for r in saved["rows"])
    assert saved["rows"][3]["extra_syncs"] == 0 and isinstance(saved["findings"], list)
    assert "| loop | resnet | plain | core-O2 |" in out.with_suffix(".md").read_text()
