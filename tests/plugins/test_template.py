"""The modality-plugin template: rendered, installed, listed by the CLI, encoding to its contract, its own tests green.

The rendered project is pip-installed into a private ``--target`` directory put on ``PYTHONPATH``, never
into the shared environment, so nothing is left behind and concurrent tests never see it.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from stitch import scaffold
from stitch.cli import app
from stitch.config.recipe import parse_recipe
from stitch.host.host import load_plugins
from stitch.scaffold import ScaffoldError, find_template, render_plugin, template_candidates

MODALITY = "probe_spectrum"  # unusual on purpose: never collides with a real installed plugin
PLUGIN = "stitch-probe-spectrum"
PACKAGE = "stitch_probe_spectrum"
TOKENS, WIDTH = 6, 40  # not the template defaults, so the test proves the values reach the code
HAS_HATCHLING = importlib.util.find_spec("hatchling") is not None


def stitch_command() -> list[str]:
    script = Path(sysconfig.get_path("scripts")) / ("stitch.exe" if os.name == "nt" else "stitch")
    return [str(script)] if script.exists() else [sys.executable, "-m", "stitch"]


def env_with(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("STITCH_LOAD_PLUGINS", "STITCH_DISABLED_PLUGINS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(project dir, target site dir): the template rendered and pip-installed as a normal wheel."""
    root = tmp_path_factory.mktemp("template")
    project = render_plugin(root / "out", MODALITY, tokens_per_item=TOKENS, feature_width=WIDTH)
    site = root / "site"
    # With hatchling present (the test extra) the build is offline and fast; otherwise pip fetches it.
    isolation = ["--no-build-isolation", "--no-index"] if HAS_HATCHLING else []
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *isolation, "--target", str(site),
         str(project)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, f"pip install of the rendered plugin failed:\n{result.stderr[-3000:]}"
    return project, site


def test_rendered_plugin_is_listed_by_stitch_list_plugins_with_its_hooks_and_registrations(installed):
    _, site = installed
    result = subprocess.run(
        [*stitch_command(), "list-plugins", "--json"], capture_output=True, text=True, env=env_with(site),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    listing = json.loads(result.stdout)
    assert [f for f in listing["failed"] if f["name"] == PLUGIN] == []
    mine = [p for p in listing["plugins"] if p["name"] == PLUGIN]
    assert mine, f"{PLUGIN} not listed; listed: {[p['name'] for p in listing['plugins']]}"
    assert mine[0]["entry_point"] == MODALITY and mine[0]["version"] == "0.1.0"
    assert mine[0]["hooks"] == ["register_encoders", "register_recipes", "register_rollout_payloads"]
    assert mine[0]["registered"] == {"encoders": [f"{MODALITY}-encoder"], "recipes": [f"{MODALITY}-demo"],
                                     "rollout_payloads": [MODALITY]}


@pytest.fixture
def plugin_host(installed, monkeypatch):
    """A PluginHost loaded in this process with the rendered plugin's site directory on sys.path."""
    _, site = installed
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("STITCH_LOAD_PLUGINS", raising=False)
    monkeypatch.delenv("STITCH_DISABLED_PLUGINS", raising=False)
    yield load_plugins()
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        del sys.modules[name]


def test_rendered_encoder_from_the_registry_returns_its_declared_shape(plugin_host):
    spec = plugin_host.get("encoders", f"{MODALITY}-encoder")
    assert (spec.modality, spec.tokens_per_item, spec.feature_width) == (MODALITY, TOKENS, WIDTH)
    encoder = spec.load(spec.source, "cpu", torch.float32)
    features = encoder.encode([spec.decode_item(np.sin(np.arange(50.0))), spec.decode_item([1.0, 2.0, 4.0])])
    assert features.shape == (2, TOKENS, WIDTH) and features.dtype == torch.float32
    with pytest.raises(ValueError, match="cannot decode probe_spectrum item"):
        spec.decode_item(b"not a .npy file")
    payload = plugin_host.get("rollout_payloads", MODALITY)
    assert payload.build("r1", features, torch.nn.Linear(WIDTH, 12))["soft_tokens"].shape == (2 * TOKENS, 12)


def npy_bytes(values) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(values, dtype=np.float32))
    return buffer.getvalue()


def test_rendered_readme_recipe_parses_and_prepares_data_stored_as_it_says(installed, plugin_host, tmp_path):
    """The README's recipe is a shipped recipe in effect: every field must be known to the loader and the
    stages, and `prepare` must run the plugin over data stored as the README says, skipping a corrupt row."""
    from datasets import Dataset

    from stitch.host.validate import validate_recipe
    from tests.stitch_testing import prepare_resolved

    project, _ = installed
    block = re.search(r"```yaml\n(.*?)```", (project / "README.md").read_text(), re.S)
    assert block, "the rendered README has no yaml recipe block"
    mapping = yaml.safe_load(block.group(1))
    recipe = parse_recipe(mapping, path=tmp_path / "my.yaml")
    assert recipe.encoder == f"{MODALITY}-encoder"
    validate_recipe(recipe, host=plugin_host)  # every stage's options and the registrations it names

    rng = np.random.default_rng(0)
    media = [npy_bytes(rng.normal(size=int(rng.integers(20, 90))).cumsum()) for _ in range(11)]
    media[3] = b"corrupt"
    (tmp_path / "data").mkdir()
    Dataset.from_dict({
        "sample_id": [f"s{i}" for i in range(11)], MODALITY: media,
        "question": ["How many peaks?"] * 11, "answer": [f"The answer is {i % 4}." for i in range(11)],
    }).to_parquet(str(tmp_path / "data" / "train.parquet"))
    mapping["data"]["partitions"] = {"alignment": [0, 2], "train": [2, 6], "eval": [6, 8], "grpo": [8, 10]}
    mapping["data"]["scan_cap"] = 11
    # prepare tokenizes every row with the recipe model's tokenizer: the README's hub model cannot download here,
    # so its tiny preset of the same family (the same sentinels and chat template) stands in
    mapping["model"] = "qwen3.5-tiny" if mapping["model"].startswith("qwen") else "nemotron-nano-tiny"
    report = prepare_resolved(parse_recipe(mapping, path=tmp_path / "my.yaml"), tmp_path / "data-out", host=plugin_host,
                     progress=False)
    assert report.rows == {"alignment": 2, "train": 4, "eval": 2, "grpo": 2}
    assert [(s["id"], s["column"]) for s in report.skipped] == [("s3", MODALITY)]
    assert "no .npy header" in report.skipped[0]["reason"]
    rows = [json.loads(line) for line in (tmp_path / "data-out" / "manifest.jsonl").read_text().splitlines()]
    assert {(r["tokens"], r["width"]) for r in rows} == {(TOKENS, WIDTH)}


@pytest.mark.slow
def test_rendered_projects_own_tests_pass_including_stitch_run_on_its_shipped_recipe(installed):
    """The generated project's own suite, as its author runs it: among others, `stitch run` end to end on the
    demo recipe the plugin ships (its own data, this encoder, stitch-qwen's tiny Qwen3.5)."""
    project, site = installed
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider"], cwd=project, env=env_with(site),
        capture_output=True, text=True, timeout=1500,
    )
    assert result.returncode == 0, f"the rendered project's tests failed:\n{result.stdout[-6000:]}\n{result.stderr[-2000:]}"
    assert "skipped" not in result.stdout.lower()
    for name in ("test_stitch_run_trains_the_demo_recipe_end_to_end",
                 "test_packaging_metadata_declares_exactly_what_the_hooks_register"):
        assert re.search(rf"{name} PASSED", result.stdout), f"{name} did not pass:\n{result.stdout[-3000:]}"


def test_rendered_project_ships_its_demo_data_written_by_its_own_generator(installed):
    project, _ = installed
    data = project / "src" / PACKAGE / "recipes" / "data"
    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 48 and all((data / row[MODALITY]).is_file() for row in rows)
    recipe = yaml.safe_load((project / "src" / PACKAGE / "recipes" / f"{MODALITY}-demo.yaml").read_text())
    assert recipe["model"] == "qwen3.5-tiny" and recipe["encoder"] == f"{MODALITY}-encoder"
    assert recipe["data"]["source"] == {"path": "data/train.jsonl", "format": "json"}


def test_rendered_project_is_ruff_clean(installed):
    project, _ = installed
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (it is in the test extra)")
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=project,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout


@pytest.mark.skipif(not HAS_HATCHLING, reason="hatchling is not installed (it is in the test extra)")
def test_rendered_projects_editable_install_links_its_source(installed, tmp_path):
    project, _ = installed
    from hatchling.builders.wheel import WheelBuilder

    wheel = Path(next(WheelBuilder(str(project)).build(directory=str(tmp_path), versions=["editable"])))
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        pth = [n for n in names if n.endswith(".pth")]
        assert len(pth) == 1 and not any(n.startswith(PACKAGE + "/") for n in names), names
        assert archive.read(pth[0]).decode().strip() == str(project / "src")
        entry_points = archive.read(f"{PACKAGE}-0.1.0.dist-info/entry_points.txt").decode()
    assert f"{MODALITY} = {PACKAGE}" in entry_points


@pytest.mark.parametrize(
    ("modality", "extra", "says"),
    [
        ("Spectrum", {}, "modality 'Spectrum' is not a valid slug"),
        ("time-series", {}, "modality 'time-series' is not a valid slug"),
        ("1d", {}, "modality '1d' is not a valid slug"),
        ("spectrum", {"tokens_per_item": 0}, "tokens_per_item must be a positive integer, got 0"),
        ("spectrum", {"feature_width": "wide"}, "feature_width must be a positive integer, got 'wide'"),
        ("spectrum", {"package_name": "not-a-package"}, "package_name 'not-a-package'"),
        ("spectrum", {"tokens": 8}, "unknown template variable(s) ['tokens']"),
    ],
)
def test_render_plugin_refuses_invalid_values_naming_them_before_writing(tmp_path, modality, extra, says):
    with pytest.raises(ScaffoldError) as err:
        render_plugin(tmp_path / "out", modality, **extra)
    assert says in str(err.value)
    assert not (tmp_path / "out").exists()


def test_render_plugin_never_overwrites_an_existing_project(tmp_path):
    project = render_plugin(tmp_path, "spectrum")
    (project / "README.md").write_text("mine")
    with pytest.raises(ScaffoldError, match="already exists"):
        render_plugin(tmp_path, "spectrum")
    assert (project / "README.md").read_text() == "mine"


def test_new_plugin_command_renders_the_requested_contract(tmp_path):
    result = CliRunner().invoke(app, ["new-plugin", "time_series", "--out", str(tmp_path), "--tokens", "4",
                                      "--width", "16"])
    assert result.exit_code == 0, result.output
    encoder = (tmp_path / "stitch-time-series" / "src" / "stitch_time_series" / "encoder.py").read_text()
    assert "TOKENS_PER_ITEM = 4\n" in encoder and "FEATURE_WIDTH = 16\n" in encoder
    assert "class TimeSeriesEncoder:" in encoder
    refused = CliRunner().invoke(app, ["new-plugin", "Bad Name", "--out", str(tmp_path)])
    assert refused.exit_code == 2 and "modality 'Bad Name'" in refused.output


def test_template_is_found_as_wheel_package_data_first_then_in_the_checkout(tmp_path):
    package = Path(scaffold.__file__).resolve().parent
    package_data, checkout = template_candidates()
    assert package_data == package / "templates" / "stitch-plugin"  # a wheel (force-include of templates/)
    assert checkout == package.parent / "templates" / "stitch-plugin"  # an editable install of a checkout
    assert find_template() in (package_data, checkout)
    wheel, missing = tmp_path / "wheel", tmp_path / "missing"
    wheel.mkdir()
    (wheel / "cookiecutter.json").write_text("{}")
    assert find_template([wheel, checkout]) == wheel
    with pytest.raises(FileNotFoundError, match="looked in") as err:
        find_template([missing])
    assert str(missing) in str(err.value)


def _readme_check(project: Path, site: Path) -> subprocess.CompletedProcess:
    """The rendered project's own README test, importing the project's (possibly edited) source first."""
    env = env_with(site)
    env["PYTHONPATH"] = os.pathsep.join([str(project / "src"), env["PYTHONPATH"]])
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_readme.py"],
                          cwd=project, env=env, capture_output=True, text=True, timeout=600)


def test_scaffolded_readme_test_names_each_stale_line_after_the_encoder_changes_and_passes_once_fixed(
        installed, tmp_path):
    """The author renames the encoder, changes its width and rewrites the demo data with fewer rows: the rendered
    README's test fails naming each stale README line; updating those lines makes it pass."""
    import shutil

    rendered, site = installed
    project = Path(shutil.copytree(rendered, tmp_path / "edited"))
    package = project / "src" / PACKAGE
    encoder = package / "encoder.py"
    text = encoder.read_text()
    assert f'ENCODER_NAME = "{MODALITY}-encoder"\n' in text and f"FEATURE_WIDTH = {WIDTH}\n" in text
    encoder.write_text(text.replace(f'ENCODER_NAME = "{MODALITY}-encoder"', f'ENCODER_NAME = "{MODALITY}-wave"')
                       .replace(f"FEATURE_WIDTH = {WIDTH}\n", "FEATURE_WIDTH = 24\n"))
    subprocess.run([sys.executable, str(package / "demo_data.py"), "--rows", "30", "--out",
                    str(package / "recipes" / "data")], check=True, capture_output=True, timeout=120)

    stale = _readme_check(project, site)
    assert stale.returncode == 1, stale.stdout[-3000:]
    readme = (project / "README.md").read_text().splitlines()

    def line_of(fragment: str) -> int:
        return next(n for n, line in enumerate(readme, start=1) if fragment in line)

    expected = [
        f"README.md line {line_of('| encoder |')}: 'encoder' reads '{MODALITY}-encoder'; the plugin has "
        f"'{MODALITY}-wave'",
        f"README.md line {line_of('| feature width |')}: 'feature width' reads '{WIDTH}'; the plugin has '24'",
        f"README.md line {line_of('| demo rows |')}: 'demo rows' reads '48'; the plugin has '30'",
        f"README.md line {line_of('encoder: ' + MODALITY)}: the recipe example names encoder '{MODALITY}-encoder'",
    ]
    for message in expected:
        assert message in stale.stdout, f"{message!r} not in:\n{stale.stdout[-3000:]}"
    assert "tokens per item" not in stale.stdout  # an unchanged fact is not reported

    fixed = "\n".join(readme).replace(f"`{MODALITY}-encoder`", f"`{MODALITY}-wave`") \
        .replace(f"| feature width | `{WIDTH}` |", "| feature width | `24` |") \
        .replace("| demo rows | `48` |", "| demo rows | `30` |") \
        .replace(f"encoder: {MODALITY}-encoder", f"encoder: {MODALITY}-wave")
    (project / "README.md").write_text(fixed + "\n")
    passed = _readme_check(project, site)
    assert passed.returncode == 0, passed.stdout[-3000:]
    assert "2 passed" in passed.stdout


def test_rendered_encoder_declares_a_placeholder_content_part_for_serving(plugin_host, installed):
    project, _ = installed
    spec = plugin_host.get("encoders", f"{MODALITY}-encoder")
    assert spec.content_parts == ("input_audio",)
    assert "CONTENT_PARTS = (\"input_audio\",)" in (project / "src" / PACKAGE / "encoder.py").read_text()
