"""A new user follows the docs literally (stop 62): what they cite exists, what they link resolves, and litgpt's
``config_hub`` YAMLs (which set ``precision: bf16-true``) run through ``python -m lightning_mpx.litgpt`` as
docs/fabric.md says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

# at collection, as tests/test_fabric_litgpt_finetune_cli.py does: under xdist every worker has imported litgpt already
try:
    from litgpt.finetune import lora
except ImportError:
    lora = None

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Paths the docs cite that are not in this repository, on purpose: Apex's and transformers' own files, benchmarks
# retired (each named as retired where cited), a record's traceback line, a test a stop decided not to write.
ELSEWHERE = {
    "examples/imagenet/main_amp.py": "NVIDIA Apex's example (apex.md)",
    "examples/dcgan/main_amp.py": "NVIDIA Apex's example (apex.md)",
    "examples/simple/distributed/distributed_data_parallel.py": "NVIDIA Apex's example (apex.md)",
    "tests/L0/run_amp": "NVIDIA Apex's test folder (apex.md)",
    "tests/trainer": "transformers' test folder (testing.md)",
    "tests/trainer/test_trainer.py": "transformers' test file (testing.md)",
    "tests/trainer/test_trainer_more.py": "transformers' test file (testing.md)",
    "tests/trainer/test_trainer_callback.py": "transformers' test file (testing.md)",
    "tests/test_upstream61.py": "testing.md: not written (no user break found)",
    "benchmarks/policy_backward.py": "retired (benchmarks_history.md)",
    "benchmarks/triton_host.py": "retired (benchmarks_history.md, unscale.md)",
    "benchmarks/forensics_overhead.py": "merged into engine_overhead.py (benchmarks_history.md)",
    "benchmarks/mirror_check.py": "merged into engine_overhead.py (benchmarks_history.md)",
    "lightning_mpx/_step_machine.py": "a recorded GPU run's source line, before the package layout (benchmarks.md)",
    "examples/text_to_image/train_text_to_image.py": "diffusers' training script (accelerate.md)",
    "examples/unconditional_image_generation/train_unconditional.py": "diffusers' training script (accelerate.md)",
}
CITED = re.compile(r"\b(?:tests|benchmarks|examples|lightning_mpx)/[\w./*{},-]*[\w*}]")


def _cited_paths() -> dict[str, str]:
    cited: dict[str, str] = {}
    for doc in DOCS:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for path in CITED.findall(line):
                path = re.sub(r"\.py[:\w]*$", ".py", path)  # tests/x.py::test_name, module.py:296
                cited.setdefault(path, f"{doc.name}:{number}")
    return cited


def _exists(path: str) -> bool:
    """A path, a glob (``results/step_cpu*.json``) or a brace pair (``run{1,2}``) that names something here."""
    brace = re.search(r"\{([^}]*)\}", path)
    if brace:
        return all(_exists(path[: brace.start()] + part + path[brace.end() :]) for part in brace.group(1).split(","))
    return any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()


def test_every_repository_path_the_docs_cite_exists():
    """A ``tests/...py``, ``benchmarks/...py``, ``examples/...py`` or package path in README.md or docs/ is a file or
    folder of this checkout (or one of the few cited on purpose from elsewhere, listed above with why)."""
    cited = _cited_paths()
    assert len(cited) > 100
    missing = {p: where for p, where in cited.items() if not _exists(p) and p not in ELSEWHERE}
    assert not missing, f"docs cite paths that do not exist: {missing}"
    # the list above stays true: each entry is still cited and still absent
    stale = [p for p in ELSEWHERE if p not in cited or _exists(p)]
    assert not stale, f"ELSEWHERE entries no longer cited or now present: {stale}"


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_and_anchor_in_the_docs_resolves():
    anchors = {
        doc.resolve(): {_slug(h) for h in re.findall(r"^#+\s+(.*)$", doc.read_text(), re.M)} for doc in DOCS
    }
    broken = []
    checked = 0
    for doc in DOCS:
        for link in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if link.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, fragment = link.partition("#")
            target = (doc.parent / path).resolve() if path else doc.resolve()
            checked += 1
            if not target.exists():
                broken.append(f"{doc.name}: {link} (no such file)")
            elif fragment and target in anchors and fragment not in anchors[target]:
                broken.append(f"{doc.name}: {link} (no such heading)")
    assert checked > 30
    assert not broken, broken


def test_documented_benchmark_flags_exist():
    """Every ``--flag`` of a ``python benchmarks/X.py`` command in the docs is one the script declares (the examples'
    and the CLI's are checked in test_docs_examples.py)."""
    checked = 0
    bad = []
    for doc in DOCS:
        text = re.sub(r"\\\n\s*", " ", doc.read_text())  # a command continued over lines
        for m in re.finditer(r"python (?:-m [\w.]+ )?(benchmarks/\w+\.py)([^`\n]*)", text):
            script = ROOT / m.group(1)
            if not script.exists():
                continue  # retired: the test above holds the list
            source = script.read_text()
            flags = re.findall(r"(?<=\s)(--[\w-]+)", re.split(r"#|;|&&|\|", m.group(2))[0])
            missing = [f for f in flags if f'"{f}"' not in source and f"'{f}'" not in source]
            if missing:
                bad.append(f"{doc.name}: {m.group(0).strip()[:100]} -> {missing}")
            checked += 1
    assert checked > 50
    assert not bad, bad


def test_a_config_hub_yaml_with_precision_is_refused_naming_the_override_and_runs_with_it(tmp_path, monkeypatch,
                                                                                         capsys):
    """docs/fabric.md: litgpt's config_hub YAMLs set ``precision: bf16-true``; the command line refuses it with the
    fix (``--precision null`` after ``--config``), and with that flag the run gets past the refusal."""
    if lora is None:
        pytest.skip("litgpt is not installed")
    from lightning_mpx.integrations import litgpt as ours

    config = tmp_path / "lora.yaml"
    config.write_text("precision: bf16-true\nlora_r: 4\n")
    argv = ["finetune_lora", str(tmp_path / "checkpoint"), "--opt_level", "O2", "--config", str(config),
            "--out_dir", str(tmp_path / "out")]  # fmt: skip
    with pytest.raises(SystemExit) as refused:
        ours.main(argv)
    assert refused.value.code == 2
    assert re.search(r"--precision bf16-true with --opt_level O2.*add --precision null after --config",
                     capsys.readouterr().err)  # fmt: skip
    assert not (tmp_path / "out").exists()

    seen = {}

    def bind_only(checkpoint_dir, opt_level, mpx_kwargs, settings, rest):
        seen.update(ours._bind(lora.setup, checkpoint_dir, settings))

    monkeypatch.setattr(ours, "_finetune_lora", bind_only)
    ours.main([*argv, "--precision", "null"])
    assert seen["precision"] is None and seen["lora_r"] == 4
