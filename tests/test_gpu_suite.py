"""The GPU suite runs every part's code path on CPU (``gpu_suite.py all --check``) and writes the fields that
``gpu_report.py`` reads; the report merges files, prefers later ones and judges targets from what it is given.

No test here asserts a timing: the figures in these files are either ``--check`` output (which measures nothing) or
the committed H100 results, of which only the report's bookkeeping (which file, which rows) is checked.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import fsdp_step  # noqa: E402
import gpu_report  # noqa: E402
import gpu_suite  # noqa: E402

from tests.warm_python import warm_python  # noqa: E402

H100 = ROOT / "benchmarks" / "results" / "gpu" / "2026-11-23-h100"
PART_FILES = ("tests", "unscale", "step_gpt", "step_resnet", "fidelity", "fsdp")
UNSCALE_FIELDS = {"set", "dtype", "variant", "tensors", "fused_ms", "torch_ms", "speedup", "fused_GBps",
                  "pct_of_copy_bandwidth", "copy_bandwidth_GBps"}  # fmt: skip
STEP_FIELDS = {"model", "variant", "step_ms_median", "samples_per_second", "peak_memory_bytes"}
FIDELITY_FIELDS = {"variant", "val_loss_mean", "ratio_to_O0", "verdict", "skipped_steps", "final_loss_scale"}
TARGETS = {
    "fused passes >= 80% of copy bandwidth",
    "unscale+clip >= 1.5x torch unscale_ + clip_grad_norm_",
    "O2 master-gradient path >= 2.5x torch ops",
    "never slower than torch on the small-tensor sweep (unscale+clip)",
    "O2 >= 1.05x \"16-mixed\" throughput",
    "O1 within 3% of \"16-mixed\" throughput",
    "O2 peak memory below FP32",
}


@pytest.fixture(scope="module")
def check_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One ``all --check`` run, shared by the tests that read its files: the script and each of its nine child
    processes start from the warm interpreter of ``tests/warm_python.py`` (a process of its own each, the imports of
    torch and Lightning already paid: the run took about a minute of mostly imports on two busy cores otherwise).
    That interpreter imported Triton in its interpreter mode, as every process of ``--check`` does; the script's own
    environment still lacks ``TRITON_INTERPRET``, and lightning_mpx's kernels (not preloaded) are decorated in each
    process from its own environment, so a suite that stopped setting it would still fail here."""
    out = tmp_path_factory.mktemp("gpu-suite-check")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the suite must set it itself
    done = subprocess.run(
        [warm_python(TRITON_INTERPRET="1"), str(ROOT / "benchmarks" / "gpu_suite.py"), "all", "--check",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def _suite(out: Path, name: str) -> dict[str, Any]:
    return json.loads((out / f"suite_{name}.json").read_text())


def test_all_check_writes_every_part_with_environment_and_commands(check_dir):
    for name in PART_FILES:
        data = _suite(check_dir, name)
        suite = data["suite"]
        assert suite["status"] == "complete" and suite["check"] is True, (name, suite["status"])
        env = suite["environment"]
        assert env["device"] == gpu_suite.CHECK_DEVICE and env["torch"] and env["triton"] and env["lightning"]
        assert suite["command"].startswith("python benchmarks/gpu_suite.py all --check")
        assert suite["commands"] and all(c["status"] == "ok" and c["command"] for c in suite["commands"])
        markdown = (check_dir / f"suite_{name}.md").read_text()
        assert "measure nothing" in markdown and "| command | status | seconds |" in markdown
    # unscale.py --check's own parity check (the fused pass against foreach, in triton's interpreter) passed
    assert "check passed" in (check_dir / "raw" / "unscale_check.log").read_text()


def test_all_check_rows_have_the_fields_the_report_reads(check_dir):
    unscale = _suite(check_dir, "unscale")["result"]
    assert {r["set"] for r in unscale["rows"]} >= {*gpu_report.TARGET_SETS, "sweep 3x4"}
    for row in unscale["rows"]:
        assert UNSCALE_FIELDS <= set(row), UNSCALE_FIELDS - set(row)
    assert {r["variant"] for r in unscale["rows"]} == set(gpu_report.VARIANT_ORDER)
    for model in ("gpt", "resnet"):
        step = _suite(check_dir, f"step_{model}")["result"]
        assert [r["variant"] for r in step["rows"]] == list(gpu_suite.STEP_CHECK[model])
        assert step["specs"][model] and not step["failed"] and not step["not_run"]
        for row in step["rows"]:
            assert STEP_FIELDS <= set(row) and row["model"] == model
    fidelity = _suite(check_dir, "fidelity")["result"]
    assert [r["variant"] for r in fidelity["rows"]] == ["O0", "O2-bfloat16"]
    assert all(FIDELITY_FIELDS <= set(r) for r in fidelity["rows"])


def test_all_check_tests_part_collects_and_passes_its_own_checks(check_dir):
    result = _suite(check_dir, "tests")["result"]
    assert "collected" in result["pytest"]["summary"] and result["pytest"]["returncode"] == 0
    names = [c["name"] for c in result["checks"]]
    assert len(names) == 8 and all(c["passed"] for c in result["checks"]), result["checks"]
    assert any("parity" in n for n in names) and any("MixedPrecisionPlugin" in n for n in names)
    assert set(result["syncs"]) == {"Amp O1 float16", "Amp O2 float16", "Amp O2 bfloat16",
                                    "torch autocast + GradScaler float16"}  # fmt: skip
    assert all(s["per_step"] is None and "no CUDA" in s["note"] for s in result["syncs"].values())


def test_plugin_part_check_writes_its_suite_file(tmp_path):
    """The ``plugin`` part (benchmarks/plugin_overhead.py on CUDA; not part of ``all``) runs its code path on CPU with
    ``--check`` and records the rows. From the same warm interpreter as ``all --check`` (one server for both: this
    test was a file of its own, tests/test_gpu_suite_plugin.py, whose worker could start a second one)."""
    done = subprocess.run(
        [warm_python(), str(ROOT / "benchmarks" / "gpu_suite.py"), "plugin", "--check", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((tmp_path / "suite_plugin.json").read_text())
    assert data["suite"]["part"] == "plugin" and data["suite"]["status"] == "complete" and data["suite"]["check"]
    rows = data["result"]["check"]["rows"]
    assert [r["variant"] for r in rows] == ["bf16-mixed", "plugin-O2", "core-O2"]
    assert data["suite"]["commands"][0]["command"].startswith("python benchmarks/plugin_overhead.py --out")
    assert "measure nothing" in (tmp_path / "suite_plugin.md").read_text()


def test_report_reads_the_check_output_and_fills_the_doc(check_dir, tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# intro\n\n{gpu_report.BEGIN}\nstale-body\n{gpu_report.END}\n\n## after\n")
    result = gpu_report.main([str(check_dir), "--doc", str(doc), "--json", str(tmp_path / "report.json")])
    assert {v["target"] for v in result["verdicts"]} >= TARGETS
    assert {s["kind"] for s in result["sources"]} == {"tests", "unscale", "step", "fidelity", "fsdp"}
    labels = {goal.label for goal in fsdp_step.GOALS}
    fsdp = [v for v in result["verdicts"] if v["target"] in labels]
    assert len(fsdp) == len(fsdp_step.GOALS) and all(v["status"] == gpu_report.NOT_MEASURED for v in fsdp)
    assert all(s["recorded_command"] and s["check"] for s in result["sources"])
    text = doc.read_text()
    assert text.startswith("# intro") and text.endswith("## after\n") and "stale-body" not in text
    assert "measure nothing" in text and "### Targets" in text and "### Training step, gpt" in text
    assert json.loads((tmp_path / "report.json").read_text())["verdicts"] == result["verdicts"]


def test_report_on_the_committed_h100_results_prefers_later_files():
    sources = gpu_report.load_sources([H100])
    merged = gpu_report.merge(sources)
    rows = {(r["set"], r["dtype"], r["variant"]): r["source"] for r in merged.unscale}
    assert rows[("gpt2-124m", "float32", "unscale+clip")] == "unscale_bind.json"  # re-run after the binding fix
    assert rows[("gpt-1.3b", "float16", "O2 grads")] == "unscale.json"  # not re-run: the earlier file stays
    assert rows[("gpt2-124m", "bfloat16", "unscale")] == "unscale_bf16_fix.json"  # same commit: name order
    assert rows[("sweep 10x4", "float32", "unscale+clip")] == "unscale_bind.json"
    assert merged.superseded["unscale.json"] == {"unscale_bind.json": 32}
    assert {s.path.name for s in sources.skipped} == {"host_profile.json", "host_profile_bind.json"}
    assert merged.tests is not None and merged.tests.name == "pytest_triton_cuda_bind.txt"
    verdicts = gpu_report.all_targets(merged)
    by_scope = {(v.target, v.scope): v for v in verdicts}
    # The newest committed file with the row wins (the O2 re-run after the master-weight redesign).
    assert by_scope[("O2 >= 1.05x \"16-mixed\" throughput", "gpt")].source == "step_cuda_gpt_mirror.json"
    assert by_scope[("O2 >= 1.05x \"16-mixed\" throughput", "resnet")].source == "step_cuda_resnet.json"
    measured = [v for v in verdicts if v.target in TARGETS]
    assert len(measured) == 13 and all(v.status in (gpu_report.MET, gpu_report.NOT_MET) for v in measured)
    assert gpu_report.environment(sources)["device"] == "NVIDIA H100 80GB HBM3"


def test_all_check_fsdp_part_has_every_group_with_paired_ratios_per_round(check_dir):
    result = _suite(check_dir, "fsdp")["result"]
    assert result["check"] is True and not result["failed"]
    assert list(result["groups"]) == list(fsdp_step.GROUPS)
    for name, group in fsdp_step.GROUPS.items():
        info = result["groups"][name]
        assert info["rounds_done"] == fsdp_step.CHECK_ROUNDS and info["reference"] == group.reference
        rows = [r for r in result["rows"] if r["group"] == name]
        assert [r["variant"] for r in rows] == list(group.check_variants)
        for row in rows:
            assert len(row["step_ms_rounds"]) == fsdp_step.CHECK_ROUNDS and row["steps_per_round"] == 2
            ratios = row["throughput_vs_reference_rounds"]
            ref = rows[0]["step_ms_rounds"]
            assert ratios == pytest.approx([b / a for a, b in zip(row["step_ms_rounds"], ref)])
            assert row["throughput_vs_reference"] == pytest.approx(statistics.median(ratios))
            assert row["peak_memory_bytes"] is None  # no memory is measured on CPU
    plugin_rows = [r for r in result["rows"] if "-mpx-" in r["variant"]]
    assert plugin_rows and all(r["skipped_steps"] == 0 for r in plugin_rows)
    assert "| gpt1b | fsdp2-mpx-O2-bf16 | 2 |" in (check_dir / "suite_fsdp.md").read_text()
    # the check's two rounds ran each group's rows in both orders (the rotation a GPU run's rounds take)
    log = (check_dir / "raw" / "fsdp.log").read_text()
    for name, group in fsdp_step.GROUPS.items():
        order = re.findall(rf"\[{name}\] round (\d) (\S+)", log)
        assert order == [("0", v) for v in group.check_variants] + [("1", v) for v in group.check_variants[::-1]]


def _fsdp_run(path: Path, check_dir: Path, factor: float) -> None:
    """The --check run's rows as if measured (``check`` off), the plugin rows' times divided by ``factor``; made-up
    figures for the verdicts, not a measurement."""
    data = json.loads((check_dir / "raw" / "fsdp_step_check.json").read_text())
    data["check"] = False
    for row in data["rows"]:
        ref = next(r for r in data["rows"] if r["group"] == row["group"] and r["variant"] == r["reference"])
        row["step_ms_rounds"] = [10.0 / (factor if row is not ref else 1.0)] * 3
        row["throughput_vs_reference_rounds"] = [r / m for m, r in zip(row["step_ms_rounds"], ref["step_ms_rounds"])]
    path.write_text(json.dumps(data))


def test_report_judges_the_fsdp_goals_on_per_round_ratios_and_asks_two_runs_to_agree(check_dir, tmp_path):
    def verdicts(*factors: float) -> dict[tuple[str, str], Any]:
        folder = tmp_path / "-".join(map(str, factors))
        folder.mkdir()
        for i, factor in enumerate(factors):
            _fsdp_run(folder / f"fsdp_{i}.json", check_dir, factor)
        merged = gpu_report.merge(gpu_report.load_sources([folder]))
        return {(v.target, v.scope.split(":")[0]): v for v in gpu_report.fsdp_targets(merged.fsdp_runs)}

    o2 = fsdp_step.Goal("gpt2", "fsdp2-mpx-O2-bf16", "throughput", 1.05).label
    once = verdicts(1.1)
    assert once[(o2, "gpt2")].status == gpu_report.ONE_RUN
    assert "per round 1.100x [1.100, 1.100] over 3 rounds" in once[(o2, "gpt2")].figure
    for group in ("gpt1b", "fsdp1", "accelerate"):
        judged = [v for (t, g), v in once.items() if g == group and v.status != gpu_report.NOT_MEASURED]
        assert [v.target.split()[0] for v in judged] == [fsdp_step.GROUPS[group].check_variants[1]]
    memory = fsdp_step.Goal("gpt2", "fsdp2-mpx-O2-bf16", "memory", 0.8).label
    assert once[(memory, "gpt2")].status == gpu_report.NOT_MEASURED  # no memory measured on CPU
    fp16 = fsdp_step.Goal("gpt2", "fsdp2-mpx-O2-fp16", "throughput", 1.05).label
    assert once[(fp16, "gpt2")].status == gpu_report.NOT_MEASURED  # not a --check row
    assert verdicts(1.1, 1.2)[(o2, "gpt2")].status == gpu_report.MET
    assert verdicts(1.0)[(o2, "gpt2")].status == gpu_report.NOT_MET
    assert verdicts(1.1, 1.0)[(o2, "gpt2")].status == gpu_report.DISAGREE
    latest = verdicts(1.0, 1.0, 1.1, 1.2)[(o2, "gpt2")]  # the latest two runs
    assert latest.status == gpu_report.MET and latest.source == "fsdp_2.json, fsdp_3.json"


def test_report_never_pairs_a_fused_adamw_fsdp_run_with_a_plain_one(check_dir, tmp_path):
    """``fsdp_step.py --fused`` (AdamW(fused=True) in every row) is judged apart: a plain run and a fused run that
    each meet a goal are two runs of one each, not two agreeing runs."""
    _fsdp_run(tmp_path / "fsdp_0.json", check_dir, 1.1)
    _fsdp_run(tmp_path / "fsdp_1.json", check_dir, 1.2)
    fused = json.loads((tmp_path / "fsdp_1.json").read_text())
    fused["optimizer"] = "AdamW(fused=True)"
    (tmp_path / "fsdp_1.json").write_text(json.dumps(fused))
    merged = gpu_report.merge(gpu_report.load_sources([tmp_path]))
    judged = {v.target: v for v in gpu_report.fsdp_targets(merged.fsdp_runs) if v.scope.startswith("gpt2:")}
    o2 = fsdp_step.Goal("gpt2", "fsdp2-mpx-O2-bf16", "throughput", 1.05).label
    assert judged[o2].status == gpu_report.ONE_RUN and judged[o2].source == "fsdp_0.json"
    assert judged[f"{o2}, both AdamW(fused=True)"].status == gpu_report.ONE_RUN
    assert judged[f"{o2}, both AdamW(fused=True)"].source == "fsdp_1.json"


def test_fsdp_step_pairs_each_round_with_the_reference_and_takes_each_rows_own_peak():
    group = fsdp_step.GROUPS["gpt2"]

    def rounds(ms: list[float], peak: int | None) -> list[dict[str, Any]]:
        return [{"times": [m / 1e3, m / 1e3], "peak": peak, "idle": 5, "precision": "p"} for m in ms]

    rows = fsdp_step.summarise(group, group.spec, {group.reference: rounds([10.0, 20.0, 10.0], 1000),
                                                   "fsdp2-mpx-O2-fp16": rounds([8.0, 20.0, 12.5], 700)})
    mine = rows[1]
    assert mine["throughput_vs_reference_rounds"] == pytest.approx([1.25, 1.0, 0.8])
    assert mine["throughput_vs_reference"] == pytest.approx(1.0)
    assert mine["throughput_vs_reference_range"] == pytest.approx([0.8, 1.25])
    assert mine["memory_vs_reference"] == pytest.approx(0.7) and mine["step_ms_median"] == pytest.approx(12.5)
    checked = {t["target"]: t["met"] for t in fsdp_step.check_targets(rows)}
    assert checked == {"fsdp2-mpx-O2-fp16 throughput >= 1.05x fsdp2-lightning-bf16-mixed": False,
                       "fsdp2-mpx-O2-fp16 memory <= 0.80x fsdp2-lightning-bf16-mixed": True}  # fmt: skip
    assert len(fsdp_step.GOALS) == 16 and {g.group for g in fsdp_step.GOALS} == set(fsdp_step.GROUPS)
    big = fsdp_step.GPT_1B
    assert 1.25e9 < 12 * big.dim**2 * big.layers + big.vocab * big.dim < 1.35e9 and big.seq >= 1024


def test_fsdp_step_argument_errors(capsys):
    for argv, message in ((["--check", "--variants", "fsdp2-mpx-O4-fp16"], "is not a row; valid choices"),
                          (["--check", "--rounds", "0"], "must be at least 1")):  # fmt: skip
        with pytest.raises(SystemExit):
            fsdp_step.main(argv)
        assert message in capsys.readouterr().err, argv


def _raw_unscale(rows: list[tuple[str, str, float]]) -> dict[str, Any]:
    """A raw unscale.py file with made-up rows (test data for the merge, not a measurement)."""
    return {"device": "test device", "torch": "t", "triton": "x", "copy_bandwidth_GBps": 100.0, "repeats": 1,
            "warmup": 0, "rows": [{"set": s, "dtype": "float32", "variant": v, "tensors": 1, "elements": 1,
                                   "fused_ms": 1.0, "torch_ms": x, "speedup": x, "fused_GBps": 50.0,
                                   "pct_of_copy_bandwidth": 50.0} for s, v, x in rows]}  # fmt: skip


def _suite_file(part: str, created: str, result: dict[str, Any]) -> dict[str, Any]:
    env = {"device": "test device", "torch": "t", "triton": "x"}
    return {"suite": {"part": part, "command": f"python benchmarks/gpu_suite.py {part}", "created": created,
                      "environment": env, "status": "complete"}, "result": result}  # fmt: skip


def _step_rows(model: str, values: dict[str, tuple[float, int]]) -> list[dict[str, Any]]:
    return [{"model": model, "variant": v, "step_ms_median": 1.0, "samples_per_second": sps,
             "peak_memory_bytes": mem} for v, (sps, mem) in values.items()]  # fmt: skip


def test_report_later_suite_file_wins_and_step_ratios_stay_within_one_file(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(_suite_file("unscale", "2026-01-01T00:00:00+00:00", _raw_unscale(
        [("gpt2-124m", "unscale+clip", 1.0), ("sweep 10x4", "unscale+clip", 1.0)]))))
    (tmp_path / "b.json").write_text(json.dumps(_suite_file("unscale", "2026-01-02T00:00:00+00:00", _raw_unscale(
        [("gpt2-124m", "unscale+clip", 2.0)]))))
    full = {"fp32": (10.0, 100), "lightning-16-mixed": (20.0, 90), "mpx-O2-fp16": (21.0, 80),
            "mpx-O1-fp16": (19.0, 95)}  # fmt: skip
    (tmp_path / "s1.json").write_text(json.dumps(_suite_file("step", "2026-01-01T00:00:00+00:00",
                                                             {"rows": _step_rows("gpt", full)})))
    subset = {"lightning-16-mixed": (10.0, 90), "mpx-O2-fp16": (12.0, 80)}
    (tmp_path / "s2.json").write_text(json.dumps(_suite_file("step", "2026-01-03T00:00:00+00:00",
                                                             {"rows": _step_rows("gpt", subset)})))
    merged = gpu_report.merge(gpu_report.load_sources([tmp_path]))
    (clip,) = [r for r in merged.unscale if r["set"] == "gpt2-124m"]
    assert clip["source"] == "b.json" and clip["speedup"] == 2.0
    assert merged.superseded == {"a.json": {"b.json": 1}}
    verdicts = {(v.target, v.scope): v for v in gpu_report.all_targets(merged)}
    o2 = verdicts[("O2 >= 1.05x \"16-mixed\" throughput", "gpt")]
    assert (o2.source, o2.value) == ("s2.json", pytest.approx(1.2))  # both rows in the later file
    memory = verdicts[("O2 peak memory below FP32", "gpt")]
    assert (memory.source, memory.value) == ("s1.json", pytest.approx(0.8))  # fp32 only in the earlier one
    o1 = verdicts[("O1 within 3% of \"16-mixed\" throughput", "gpt")]
    assert (o1.source, o1.value) == ("s1.json", pytest.approx(0.95))
    missing = verdicts[("fused passes >= 80% of copy bandwidth", "gpt-1.3b")]
    assert missing.status == gpu_report.NOT_MEASURED and missing.value is None
    assert verdicts[("O2 >= 1.05x \"16-mixed\" throughput", "resnet")].status == gpu_report.NOT_MEASURED


def test_report_refuses_two_devices_and_a_doc_without_markers(tmp_path, capsys):
    (tmp_path / "a.json").write_text(json.dumps(_raw_unscale([("gpt2-124m", "unscale", 1.0)])))
    other = {**_raw_unscale([("gpt2-124m", "unscale", 1.0)]), "device": "another device"}
    (tmp_path / "b.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit):
        gpu_report.main([str(tmp_path), "--no-doc"])
    assert "a report covers one device" in capsys.readouterr().err
    doc = tmp_path / "doc.md"
    doc.write_text("no markers\n")
    with pytest.raises(ValueError, match="markers"):
        gpu_report.fill_doc(doc, "body\n")


@pytest.mark.parametrize(
    ("text", "counts"),
    [
        ("FAILED tests/x.py::t[a]\n1 failed, 80 passed, 70 skipped, 697 deselected in 32.75s\n",
         {"failed": 1, "passed": 80, "skipped": 70, "deselected": 697}),
        ("82 passed, 71 skipped, 697 deselected in 37.81s\n", {"passed": 82, "skipped": 71, "deselected": 697}),
        ("========= 3 passed, 1 warning in 1.00s =========\n", {"passed": 3, "warning": 1}),
    ],
)  # fmt: skip
def test_pytest_summary_parsing(text, counts):
    parsed = gpu_report.parse_pytest_summary(text)
    assert parsed is not None and parsed["counts"] == counts
    assert parsed["failed_tests"] == (["tests/x.py::t[a]"] if "FAILED" in text else [])


def test_step_part_measures_the_fabric_rows_on_the_gpt_model_only():
    import step

    gpt, resnet = gpu_suite.step_variants("gpt"), gpu_suite.step_variants("resnet")
    assert set(gpt) == set(step.VARIANTS) and gpt[-2:] == ["fabric-16-mixed", "fabric-mpx-O2-fp16"]
    assert resnet == [v for v in gpt if not v.startswith("fabric-")]
    assert gpu_suite.step_variants("gpt", ["fabric-mpx-O2-fp16", "fp32"]) == ["fp32", "fabric-mpx-O2-fp16"]
    rows = [{"model": "gpt", "variant": v, "step_ms_median": ms, "samples_per_second": 8 / ms, "peak_memory_bytes": 1}
            for v, ms in (("fabric-16-mixed", 2.0), ("fabric-mpx-O2-fp16", 1.0))]  # fmt: skip
    step.add_ratios(rows)
    assert rows[1]["throughput_vs_fabric_16_mixed"] == pytest.approx(2.0)
    source = gpu_report.Source(Path("s.json"), "step", {"rows": rows}, 0.0, None)
    header, _, _, fabric_o2 = gpu_report.step_table(source, "gpt").splitlines()
    assert "throughput vs Fabric 16-mixed" in header and "| 2.000x |" in fabric_o2
    without = gpu_report.Source(Path("s.json"), "step", {"rows": _step_rows("gpt", {"fp32": (1.0, 1)})}, 0.0, None)
    assert "Fabric" not in gpu_report.step_table(without, "gpt")


def test_suite_argument_errors(capsys, monkeypatch):
    for argv, message in (
        (["bench"], "invalid choice"),
        (["tests", "--check", "--variants", "fp32"], "--variants applies to the step part"),
        (["step", "--check", "--steps", "0"], "--steps=0 must be at least 1"),
        (["step", "--check", "--timeout", "-1"], "--timeout=-1.0 must be a positive"),
    ):
        with pytest.raises(SystemExit):
            gpu_suite.main(argv)
        assert message in capsys.readouterr().err, argv
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit):
        gpu_suite.main(["unscale", "--out", "somewhere"])
    assert "needs a CUDA device" in capsys.readouterr().err


def test_docs_list_every_part_and_the_doc_has_the_markers():
    """The benchmarks page (linked from the README) gives every part's command; its GPU tables have their markers."""
    assert "(docs/benchmarks.md)" in (ROOT / "README.md").read_text()
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    section = doc[doc.index("## How to reproduce"):]
    for command in ("gpu_suite.py tests --out", "gpu_suite.py unscale --out", "gpu_suite.py step --model gpt --out",
                    "gpu_suite.py step --model resnet --out", "gpu_suite.py fidelity --out",
                    "gpu_suite.py plugin --out", "gpu_suite.py all --check", "gpu_report.py",
                    "gpu_suite.py fsdp --out"):  # fmt: skip
        assert command in section, command
    assert doc.count(gpu_report.BEGIN) == 1 and doc.count(gpu_report.END) == 1


def test_report_judges_issue_25s_o1_speed_goals_on_each_model():
    rows = _step_rows("gpt", {"torch-autocast-fp16": (100.0, 1), "core-O1-fp16": (96.0, 1),  # 0.96: not met
                              "torch-autocast-bf16": (100.0, 1), "core-O1-bf16-aligned": (99.0, 1),
                              "lightning-bf16-mixed": (50.0, 1), "mpx-O1-bf16": (49.0, 1)})  # fmt: skip
    source = gpu_report.Source(Path("s.json"), "step", {"rows": rows}, 0.0, None)
    verdicts = {(v.target, v.scope): v for v in gpu_report.step_targets([source])}
    assert verdicts[("core O1 fp16 >= 0.97x torch.autocast + GradScaler loop", "gpt")].status == gpu_report.NOT_MET
    assert verdicts[("core O1 aligned table bf16 >= 0.97x torch.autocast loop", "gpt")].status == gpu_report.MET
    assert verdicts[("O1 bf16 within 3% of \"bf16-mixed\" throughput", "gpt")].value == pytest.approx(0.98)
    assert verdicts[("core O1 bf16 >= 0.97x torch.autocast loop", "resnet")].status == gpu_report.NOT_MEASURED
    # The suite measures these rows first, so that a GPU run cut short by its budget still has the verdicts.
    first = gpu_suite.step_variants("resnet")[:13]
    assert {"lightning-16-mixed", "mpx-O1-fp16", "mpx-O2-fp16", "torch-autocast-fp16", "core-O1-fp16",
            "lightning-bf16-mixed", "mpx-O1-bf16", "torch-autocast-bf16", "core-O1-bf16"} <= set(first)


def test_report_judges_core_bf16_against_the_checked_loop_with_per_round_ratios(tmp_path):
    """Core O1 bf16 is judged twice: against the bare bf16 autocast loop (the goal as written) and against the same
    loop with torch's own skip check (the guarantee Amp gives); rows measured round by round in one process show the
    median and range of the per-round ratios. A file that records when it ran is ordered by that, not its mtime."""
    def rows(core_runs: list[float]) -> list[dict[str, Any]]:
        runs = {"torch-autocast-bf16": [10.0, 10.0, 20.0], "torch-autocast-checked-bf16": [11.0, 11.0, 22.0],
                "core-O1-bf16": core_runs}  # fmt: skip
        return [{"model": "gpt", "variant": v, "step_ms_median": statistics.median(r), "step_ms_runs": r,
                 "repeats": len(r), "samples_per_second": 8 / statistics.median(r) * 1e3, "peak_memory_bytes": 1}
                for v, r in runs.items()]  # fmt: skip

    newer = {"benchmark": "step", "created": "2026-01-02T00:00:00+00:00", "rows": rows([11.0, 11.0, 22.0])}
    older = {"benchmark": "step", "created": "2026-01-01T00:00:00+00:00", "rows": rows([10.0, 10.0, 20.0])}
    (tmp_path / "a_newer.json").write_text(json.dumps(newer))
    (tmp_path / "b_older.json").write_text(json.dumps(older))  # the later name, and the later mtime
    verdicts = {v.target: v for v in gpu_report.step_targets(gpu_report.load_sources([tmp_path]).items)
                if v.scope == "gpt"}  # fmt: skip
    bare = verdicts["core O1 bf16 >= 0.97x torch.autocast loop"]
    checked = verdicts["core O1 bf16 >= 0.97x torch.autocast loop with the same skip check"]
    assert bare.source == checked.source == "a_newer.json"
    assert bare.status == gpu_report.NOT_MET and bare.value == pytest.approx(10 / 11)
    assert checked.status == gpu_report.MET and checked.value == pytest.approx(1.0)
    assert "per round 0.909x [0.909, 0.909]" in bare.figure and "per round 1.000x" in checked.figure


def test_report_judges_rows_measured_round_by_round_on_their_paired_ratios(tmp_path):
    """A round that ran slow for one row only (the host's drift: round 2 below) moves the ratio of the two rows'
    medians (0.5x here) but not the median of the per-round ratios (0.98x), which the verdict follows; rows without
    rounds (separate processes) are judged on the medians."""
    runs = {"lightning-16-mixed": [10.0, 10.0, 20.0], "mpx-O1-fp16": [10.2, 20.0, 20.4]}
    rows = [{"model": "gpt", "variant": v, "step_ms_median": statistics.median(r), "step_ms_runs": r,
             "repeats": len(r), "samples_per_second": 8 / statistics.median(r) * 1e3, "peak_memory_bytes": 1}
            for v, r in runs.items()]  # fmt: skip
    (tmp_path / "rounds.json").write_text(json.dumps({"benchmark": "step", "rows": rows}))
    label = "O1 within 3% of \"16-mixed\" throughput"
    verdict = next(v for v in gpu_report.step_targets(gpu_report.load_sources([tmp_path]).items)
                   if v.scope == "gpt" and v.target == label)  # fmt: skip
    assert verdict.status == gpu_report.MET and verdict.value == pytest.approx(10 / 10.2)
    assert "ratio of the medians 0.500x" in verdict.figure
    for row in rows:
        del row["step_ms_runs"]
    (tmp_path / "rounds.json").write_text(json.dumps({"benchmark": "step", "rows": rows}))
    verdict = next(v for v in gpu_report.step_targets(gpu_report.load_sources([tmp_path]).items)
                   if v.scope == "gpt" and v.target == label)  # fmt: skip
    assert verdict.status == gpu_report.NOT_MET and verdict.value == pytest.approx(0.5)


def test_step_part_measures_the_goal_rows_together_before_the_rest():
    order = gpu_suite.step_variants("resnet")
    goals, others = gpu_suite.step_schedule(order, 3)
    assert goals == [v for v in order if v in gpu_suite.GOAL_ROWS] and others == [v for v in order if v not in goals]
    assert len(goals) == 10 and {"core-O1-fp16", "lightning-16-mixed", "torch-autocast-checked-bf16"} <= set(goals)
    assert gpu_suite.step_schedule(["fp32", "loop-fp32"], 2) == (["fp32", "loop-fp32"], [])


def test_report_judges_the_fused_adamw_rows_on_their_per_round_ratios():
    """The fused AdamW targets: the plugin with ``skip_on_device=True`` against Lightning's AMP of its dtype with the
    same ``AdamW(fused=True)``, the core O1 loop against torch's fused autocast loop; rows measured round by round are
    judged on the per-round ratios. The suite measures these rows right after the goal and ``-clip`` rows; given
    alone, they run round by round in one process."""
    import step

    runs = {
        "lightning-16-mixed-fused": [10.0, 10.0, 20.0],
        "mpx-O1-fp16-fused": [10.2, 20.0, 20.4],  # per round 0.98 (a slow round 2 for this row only), medians 0.5
        "mpx-O2-fp16-fused": [10.0, 10.0, 20.0],  # 1.00, below 1.05
        "lightning-bf16-mixed-fused": [30.0, 30.0, 30.0],
        "mpx-O1-bf16-fused": [27.0, 27.0, 27.0],
        "torch-autocast-fused-fp16": [10.0, 10.0, 10.0],
        "core-O1-devskip-fp16": [10.5, 10.5, 10.5],  # 0.952
        "torch-autocast-fused-bf16": [20.0, 20.0, 20.0],
        "core-O1-devskip-bf16": [20.2, 20.2, 20.2],  # 0.990
    }  # made-up rows (test data for the verdicts, not a measurement); each reference its own figures
    rows = [{"model": "gpt", "variant": v, "step_ms_median": statistics.median(r), "step_ms_runs": r,
             "repeats": len(r), "samples_per_second": 8 / statistics.median(r) * 1e3, "peak_memory_bytes": 1}
            for v, r in runs.items()]  # fmt: skip
    source = gpu_report.Source(Path("s.json"), "step", {"rows": rows}, 0.0, None)
    verdicts = {(v.target, v.scope): v for v in gpu_report.step_targets([source])}
    o1_fp16 = "plugin O1 fp16, fused AdamW + skip_on_device >= 0.97x \"16-mixed\" with fused AdamW"
    expected = {
        "plugin O1 bf16, fused AdamW + skip_on_device >= 0.97x \"bf16-mixed\" with fused AdamW": (True, 30 / 27),
        o1_fp16: (True, 10 / 10.2),
        "plugin O2 fp16, fused AdamW + skip_on_device >= 1.05x \"16-mixed\" with fused AdamW": (False, 1.0),
        "core O1 bf16 skip_on_device >= 0.97x bare bf16 autocast loop, both fused AdamW": (True, 20 / 20.2),
        "core O1 fp16 skip_on_device >= 0.97x torch.autocast + GradScaler loop, both fused AdamW": (False, 10 / 10.5),
    }
    for label, (met, value) in expected.items():
        verdict = verdicts[(label, "gpt")]
        status = gpu_report.MET if met else gpu_report.NOT_MET
        assert (verdict.status, verdict.value) == (status, pytest.approx(value)), label
        assert verdict.figure.startswith("per round") and verdicts[(label, "resnet")].status == gpu_report.NOT_MEASURED
    assert "ratio of the medians 0.500x" in verdicts[(o1_fp16, "gpt")].figure  # not what is judged
    # The report's table: a column per fused reference, with the ratios of the medians
    header, _, *lines = gpu_report.step_table(source, "gpt").splitlines()
    assert "throughput vs 16-mixed-fused" in header and "throughput vs bf16-mixed-fused" in header
    assert "16-mixed-clip" not in header and "| 1.111x |" in lines[list(runs).index("mpx-O1-bf16-fused")]
    # step.py's own GPU verdicts on the same rows (ratios of the medians)
    checks = {c["target"]: c["met"] for c in step.check_targets(rows, "cuda")}
    assert checks["mpx-O2-fp16-fused throughput >= 1.05x lightning-16-mixed-fused"] is False
    assert checks["core-O1-devskip-bf16 throughput >= 0.97x torch-autocast-fused-bf16"] is True
    # The suite: right after the goal and -clip rows, so a run with a budget reaches them; alone, one round-by-round
    # process holds every row of these targets.
    order = gpu_suite.step_variants("resnet")
    clip = order.index("mpx-O1-fp16-clip")
    assert order[clip + 1:clip + 1 + len(gpu_suite.DEVICE_SKIP_ROWS)] == list(gpu_suite.DEVICE_SKIP_ROWS)
    assert set(gpu_suite.DEVICE_SKIP_ROWS) == set(runs) == {v for pair in step.DEVICE_SKIP_PAIRS for v in pair[:2]}
    assert gpu_suite.step_schedule(list(gpu_suite.DEVICE_SKIP_ROWS), 6) == (list(gpu_suite.DEVICE_SKIP_ROWS), [])
