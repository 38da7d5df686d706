"""The plugin core: discovery through real entry points, stamping, refusals, env filters, docs."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stitch.host.host import PluginError, RegistryLookupError, load_plugins
from stitch.plugins import hookspecs
from stitch.plugins.hookspecs import HOOKS as HOOK_TABLE
from stitch.plugins.hookspecs import hookimpl
from stitch.plugins.specs import (
    EncoderSpec,
    ModelSource,
    ModelSpec,
    ProjectorSpec,
    RecipeSpec,
    RolloutEngineSpec,
    RolloutPayloadSpec,
    SentinelSpec,
    StateDictAdapterSpec,
    TaskSpec,
)

REPO = Path(__file__).resolve().parents[2]
HOOKS = sorted(name for name in dir(hookspecs) if name.startswith("register_"))


def write_distribution(root: Path, dist: str, module: str, source: str, ep_name: str | None = None,
                       provides: dict[str, list[str]] | None = None) -> None:
    """A real installed distribution on a sys.path entry: dist-info with an entry point (and, per registry kind,
    the names it declares it provides: group ``stitch.KIND``), plus its module."""
    info = root / f"{dist.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
    groups = "".join(f"[stitch.{kind}]\n" + "".join(f"{n} = {module}\n" for n in names) + "\n"
                     for kind, names in (provides or {}).items())
    (info / "entry_points.txt").write_text(f"[stitch]\n{ep_name or module} = {module}\n\n{groups}")
    (root / f"{module}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def site(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("STITCH_LOAD_PLUGINS", raising=False)
    monkeypatch.delenv("STITCH_DISABLED_PLUGINS", raising=False)
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("fake_")]:
        del sys.modules[name]


GOOD = """
from stitch.plugins.hookspecs import hookimpl
from stitch.plugins.specs import ProjectorSpec
@hookimpl
def register_projectors(register):
    register(ProjectorSpec(name="{name}", build=lambda w, h: None))
"""


def test_broken_plugin_is_reported_by_name_and_the_others_still_load(site):
    write_distribution(site, "fake-broken", "fake_broken", "raise ImportError('needs libfoo 9')\n")
    write_distribution(site, "fake-good", "fake_good", GOOD.format(name="good-proj"))
    host = load_plugins()
    assert [(f.distribution, f.name) for f in host.failures] == [("fake-broken", "fake_broken")]
    assert "needs libfoo 9" in host.failures[0].error
    assert host.get("projectors", "good-proj").name == "good-proj"
    assert "fake-good" in [p["name"] for p in host.describe()]


def test_duplicate_registration_is_refused_naming_both_plugins(site):
    write_distribution(site, "fake-one", "fake_one", GOOD.format(name="same"))
    write_distribution(site, "fake-two", "fake_two", GOOD.format(name="same"))
    with pytest.raises(PluginError) as err:
        load_plugins()
    assert "fake-one" in str(err.value) and "fake-two" in str(err.value) and "'same'" in str(err.value)


def test_misspelled_hook_implementation_fails_naming_the_plugin(site):
    write_distribution(
        site,
        "fake-typo",
        "fake_typo",
        """
        from stitch.plugins.hookspecs import hookimpl
        @hookimpl
        def register_encoder(register):
            pass
        """,
    )
    with pytest.raises(PluginError, match=r"fake-typo.*register_encoder"):
        load_plugins()


def test_hook_that_raises_is_reported_and_its_registrations_dropped(site):
    write_distribution(
        site,
        "fake-raises",
        "fake_raises",
        """
        from stitch.plugins.hookspecs import hookimpl
        from stitch.plugins.specs import ProjectorSpec
        @hookimpl
        def register_projectors(register):
            register(ProjectorSpec(name="half", build=lambda w, h: None))
            raise RuntimeError("config file missing")
        """,
    )
    host = load_plugins()
    assert "half" not in host.names("projectors")
    assert "config file missing" in host.failures[0].error and host.failures[0].name == "fake_raises"


def test_wrong_spec_type_is_refused_naming_plugin_and_expected_type(site):
    write_distribution(
        site,
        "fake-wrongtype",
        "fake_wrongtype",
        """
        from stitch.plugins.hookspecs import hookimpl
        @hookimpl
        def register_encoders(register):
            register({"name": "x"})
        """,
    )
    with pytest.raises(PluginError, match=r"fake-wrongtype.*expected a EncoderSpec"):
        load_plugins()


def test_allow_and_block_lists_filter_by_distribution_or_entry_point_name(site, monkeypatch):
    write_distribution(site, "fake-a", "fake_a", GOOD.format(name="proj-a"))
    write_distribution(site, "fake-b", "fake_b", GOOD.format(name="proj-b"))
    monkeypatch.setenv("STITCH_LOAD_PLUGINS", "fake-a")
    assert "proj-a" in load_plugins().names("projectors")
    assert "proj-b" not in load_plugins().names("projectors")
    monkeypatch.delenv("STITCH_LOAD_PLUGINS")
    monkeypatch.setenv("STITCH_DISABLED_PLUGINS", "fake_a")
    names = load_plugins().names("projectors")
    assert "proj-a" not in names and "proj-b" in names


def test_missing_first_party_name_says_which_plugin_provides_it_and_what_left_it_out(site, monkeypatch):
    monkeypatch.setenv("STITCH_DISABLED_PLUGINS", "stitch-clip")
    host = load_plugins()
    with pytest.raises(RegistryLookupError) as err:
        host.get("encoders", "clip-vit-base-patch32")
    message = str(err.value)
    assert "stitch-clip" in message and "STITCH_DISABLED_PLUGINS='stitch-clip'" in message


# -- a lookup miss names the distribution from declared metadata (group stitch.KIND), not from a core list ------

def test_missing_name_of_a_disabled_plugin_names_its_distribution_from_its_metadata(site, monkeypatch):
    write_distribution(site, "fake-provider", "fake_provider", GOOD.format(name="declared-proj"),
                       provides={"projectors": ["declared-proj"]})
    monkeypatch.setenv("STITCH_DISABLED_PLUGINS", "fake-provider")
    with pytest.raises(RegistryLookupError) as err:
        load_plugins().get("projectors", "declared-proj")
    assert "'fake-provider'" in str(err.value) and "STITCH_DISABLED_PLUGINS='fake-provider'" in str(err.value)


def test_missing_name_of_a_plugin_that_failed_to_import_gives_its_error(site):
    write_distribution(site, "fake-crashes", "fake_crashes", "raise ImportError('needs libbar 2')\n",
                       provides={"projectors": ["crash-proj"]})
    with pytest.raises(RegistryLookupError) as err:
        load_plugins().get("projectors", "crash-proj")
    assert "'fake-crashes', which failed to load" in str(err.value) and "needs libbar 2" in str(err.value)


def test_missing_name_declared_but_not_registered_by_a_loaded_plugin_is_called_its_bug(site):
    write_distribution(site, "fake-liar", "fake_liar", GOOD.format(name="other-proj"),
                       provides={"projectors": ["promised-proj"]})
    with pytest.raises(RegistryLookupError, match=r"'fake-liar' declares it in its metadata but did not register"):
        load_plugins().get("projectors", "promised-proj")


def test_missing_name_of_an_uninstalled_checkout_plugin_says_pip_install_from_its_pyproject(site, monkeypatch):
    from stitch.host import host as host_module

    plugin_dir = site / "plugins" / "stitch-fake-models"
    plugin_dir.mkdir(parents=True)
    (plugin_dir / "pyproject.toml").write_text(
        '[project]\nname = "stitch-fake-models"\n\n[project.entry-points.stitch]\nfake = "stitch_fake"\n\n'
        '[project.entry-points."stitch.models"]\n"fake-7b" = "stitch_fake"\n'
    )
    (site / "pyproject.toml").write_text('[project]\nname = "stitch-lm"\n')  # a checkout's root
    monkeypatch.setattr(host_module, "CHECKOUT_PLUGINS", site / "plugins")
    host = load_plugins()
    with pytest.raises(RegistryLookupError) as err:
        host.get("models", "fake-7b")
    assert "pip install ./plugins/stitch-fake-models" in str(err.value)
    with pytest.raises(RegistryLookupError) as err:  # a name nobody declares: no hint, just what is available
        host.get("models", "nobody-7b")
    assert "comes from" not in str(err.value) and "Available models:" in str(err.value)


def test_every_hook_is_documented_with_its_signature_and_has_a_test_of_the_core_using_it():
    """datasette's rule, kept honest: a section in docs/hooks.md per hook, and a ``test_hook_<name>`` in
    tests/plugins/test_hooks_used.py that shows a core code path using what was registered (not a round-trip)."""
    docs = (REPO / "docs" / "hooks.md").read_text()
    used = (REPO / "tests" / "plugins" / "test_hooks_used.py").read_text()
    assert HOOKS == sorted(hook.name for hook in HOOK_TABLE.values())
    for hook in HOOKS:
        params = inspect.signature(getattr(hookspecs, hook)).parameters
        signature = f"{hook}({', '.join(params)})"
        assert f"## {signature}" in docs, f"docs/hooks.md lacks a section '## {signature}'"
        assert getattr(hookspecs, hook).__doc__, f"{hook} has no docstring"
        assert re.search(rf"^def test_hook_{hook}\b", used, re.M), f"no test_hook_{hook} in tests/plugins/test_hooks_used.py"
    section = docs.split("## register_tasks(register)")[1]
    for name in TaskSpec.__dataclass_fields__:  # the TaskSpec fields each have their line
        assert f"- `{name}" in section, f"docs/hooks.md register_tasks section does not describe TaskSpec.{name}"


# -- per hook: an in-process plugin registers through it and the entry is stamped and listed -----------

def _single(kind: str, spec) -> None:
    hook = HOOK_TABLE[kind].name
    plugin = type("InProcess", (), {hook: staticmethod(hookimpl(lambda register: register(spec)))})
    host = load_plugins(extra={"in-process": plugin})
    (reg,) = [r for r in host.registrations(kind) if r.name == spec.name]
    assert reg.plugin == "in-process" and host.get(kind, spec.name) is spec
    assert spec.name in host.describe()[-1]["registered"][kind]
    assert hook in host.describe()[-1]["hooks"]


SOURCE = ModelSource(local_path="/nonexistent")


def test_stamped_register_encoders():
    _single("encoders", EncoderSpec("e", "image", 8, 4, SOURCE, load=print, decode_item=print))


def test_stamped_register_token_sentinels():
    _single("token_sentinels", SentinelSpec("fam", "<s>", "<p>", "</s>"))


def test_stamped_register_models():
    _single("models", ModelSpec("m", "Qwen3_5ForCausalLM", "fam", SOURCE, 64, ("q_proj",)))


def test_stamped_register_state_dict_adapters():
    _single("state_dict_adapters", StateDictAdapterSpec("a", "vlm", "text", convert=dict))


def test_stamped_register_rollout_payloads():
    _single("rollout_payloads", RolloutPayloadSpec("p", "image", ("p",), build=dict, validate=print))


def test_stamped_register_rollout_engines():
    _single("rollout_engines", RolloutEngineSpec("eng", factory=print))


def test_stamped_register_projectors():
    _single("projectors", ProjectorSpec("proj", build=lambda w, h: None))


def test_stamped_register_recipes():
    _single("recipes", RecipeSpec("r", Path("/nonexistent.yaml")))


def test_stamped_register_tasks():
    _single("tasks", TaskSpec("t", reward=lambda completion, row: 0.0))


def test_model_source_requires_a_pinned_revision_for_hub_ids():
    with pytest.raises(ValueError, match="revision"):
        ModelSource(repo_id="org/model")


def test_cli_list_plugins_json_lists_the_first_party_plugins_with_hooks_and_registrations():
    out = subprocess.run(
        [sys.executable, "-m", "stitch", "list-plugins", "--json"], capture_output=True, text=True, check=True
    ).stdout
    plugins = {p["name"]: p for p in json.loads(out)["plugins"]}
    assert "register_encoders" in plugins["stitch-clip"]["hooks"]
    assert "clip-vit-base-patch32" in plugins["stitch-clip"]["registered"]["encoders"]
    for dist in ("stitch-qwen", "stitch-nemotron"):
        assert "register_models" in plugins[dist]["hooks"], dist
        assert plugins[dist]["registered"]["models"], dist
    assert "stitch-lm" not in plugins  # built-ins only with --all


def test_cli_models_json_says_which_models_pack_on_this_machine_and_why_not():
    out = subprocess.run(
        [sys.executable, "-m", "stitch", "models", "--json"], capture_output=True, text=True, check=True
    ).stdout
    models = {m["name"]: m for m in json.loads(out)}
    assert models["qwen3.5-demo"]["packs_here"] is True
    if not __import__("torch").cuda.is_available():  # hybrids pack only on a GPU with fla
        for name in ("qwen3.5-4b", "nemotron-3-nano-4b"):
            assert models[name]["packs_here"] is False
            assert "flash-linear-attention" in models[name]["packing_note"]


def test_cli_with_only_qwen_enabled_lists_only_qwen_and_clip_lookup_names_the_plugin():
    env = {**__import__("os").environ, "STITCH_LOAD_PLUGINS": "stitch-qwen"}
    out = subprocess.run(
        [sys.executable, "-m", "stitch", "list-plugins", "--json"],
        capture_output=True, text=True, check=True, env=env,
    ).stdout
    assert [p["name"] for p in json.loads(out)["plugins"]] == ["stitch-qwen"]
    code = "from stitch.host.host import get_host; get_host().get('encoders', 'clip-vit-base-patch32')"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode != 0 and "'stitch-clip'" in res.stderr and "STITCH_LOAD_PLUGINS='stitch-qwen'" in res.stderr


def test_cli_user_error_is_one_clear_line_on_stderr_with_exit_code_2(tmp_path):
    res = subprocess.run([sys.executable, "-m", "stitch", "train", "sft", "--recipe", str(tmp_path / "missing.yaml")],
                         capture_output=True, text=True)
    assert res.returncode == 2
    assert "missing.yaml" in res.stderr and "does not exist" in res.stderr
    assert "Traceback" not in res.stderr + res.stdout


def test_cli_registry_lists_any_kind_of_the_hook_table_and_refuses_an_unknown_one():
    out = subprocess.run([sys.executable, "-m", "stitch", "registry", "state_dict_adapters", "--json"],
                         capture_output=True, text=True, check=True).stdout
    assert {"name": "qwen3.5-vlm-to-text", "plugin": "stitch-qwen"}.items() <= json.loads(out)[0].items()
    res = subprocess.run([sys.executable, "-m", "stitch", "registry", "adapterz"], capture_output=True, text=True)
    assert res.returncode != 0
    assert "adapterz" in res.stderr + res.stdout and "state_dict_adapters" in res.stderr + res.stdout
