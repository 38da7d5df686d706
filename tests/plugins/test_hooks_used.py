"""Every hook is read by the core: for each one, an in-process plugin registers something and a core code path
(preparation, the session, load_model, prompt embeddings, inference, load_recipe, GRPO) is shown using it.

Also here: plugins and the template import only ``stitch.api`` (walked with ``ast``).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from stitch.config.recipe import load_recipe
from stitch.host import host as host_module
from stitch.host.host import RegistryLookupError, get_host, load_plugins
from stitch.model.loading import load_model, packs_loaded
from stitch.plugins.hookspecs import hookimpl
from stitch.plugins.specs import (
    EncoderSpec,
    ModelSource,
    ProjectorSpec,
    RecipeSpec,
    RolloutEngineSpec,
    RolloutPayloadSpec,
    SentinelSpec,
    StateDictAdapterSpec,
    TaskRow,
    TaskSpec,
)
from stitch.rollout.engines import Completion
from stitch.rollout.payloads import PayloadError, feature_payload_spec
from stitch.rollout.prompts import payload_for, prompt_embeddings
from stitch.stages.loop import run_stage
from tests.stitch_testing import BASE, write_recipe

REPO = Path(__file__).resolve().parents[2]
TOKENS, WIDTH = 3, 8  # the probe encoder's contract: small, and unlike any shipped encoder's
PROBE = "probe-encoder"


def plugin(**hooks: Any) -> type:
    """An in-process plugin class: ``register_x=[spec, ...]`` becomes a ``@hookimpl register_x``."""
    def impl(specs: list[Any]) -> Any:
        def register_all(register: Any) -> None:
            for spec in specs:
                register(spec)
        return staticmethod(hookimpl(register_all))

    return type("InProcessPlugin", (), {name: impl(specs) for name, specs in hooks.items()})


@pytest.fixture
def use_host(monkeypatch):
    """Install a host (built-ins, installed plugins, plus ``extra``) as the process-wide one the core reads."""
    def install(**extra: Any) -> Any:
        host = load_plugins(extra=extra)
        monkeypatch.setattr(host_module, "_HOST", host)
        return host

    return install


# -- a probe encoder: features that carry a fingerprint of the item, so a test can tell whose they are ---------


class ProbeEncoder:
    def __init__(self) -> None:
        self.encoded = 0

    def encode(self, items: list[Any]) -> torch.Tensor:
        self.encoded += len(items)
        return torch.stack([torch.arange(WIDTH, dtype=torch.float32).expand(TOKENS, WIDTH) + float(item)
                            for item in items])


LOADED: list[ProbeEncoder] = []


def load_probe(source: ModelSource, device: Any = "cpu", dtype: torch.dtype = torch.float32) -> ProbeEncoder:
    LOADED.append(ProbeEncoder())
    return LOADED[-1]


def decode_probe(value: Any) -> float:
    import numpy as np

    from stitch_clip.encoder import decode_image

    return float(np.asarray(decode_image(value)).mean() / 255.0)  # the item is one number: the image's mean


PROBE_SOURCE = ModelSource(local_path="/nonexistent/probe-encoder")
PROBE_ENCODER = EncoderSpec(PROBE, "image", WIDTH, TOKENS, PROBE_SOURCE, load=load_probe, decode_item=decode_probe,
                            payload="probe-payload")
PROBE_PAYLOAD = feature_payload_spec("probe-payload", "image", TOKENS, WIDTH)


def probe_recipe(path: Path, **overrides: Any) -> Any:
    overrides = {"encoder": PROBE, "data__source__rows": 12, "data__source__caption_rows": 0,
                 "data__partitions": {"alignment": [0, 4], "train": [4, 8], "eval": [8, 10], "grpo": [10, 12]},
                 **overrides}
    return load_recipe(write_recipe(path, **overrides))


@pytest.fixture(scope="module")
def probe_run(tmp_path_factory):
    """A run directory whose data/ was prepared by the probe encoder (through the core's prepare)."""
    from tests.stitch_testing import prepare_resolved

    root = tmp_path_factory.mktemp("probe-run")
    host = load_plugins(extra={"probe": plugin(register_encoders=[PROBE_ENCODER],
                                               register_rollout_payloads=[PROBE_PAYLOAD])})
    LOADED.clear()
    report = prepare_resolved(probe_recipe(root / "probe.yaml"), root / "run" / "data", host=host, progress=False)
    return root / "run", report, list(LOADED)


def test_hook_register_encoders(probe_run):
    """The registered encoder is the one prepare loads and runs, and its features are what the cache holds."""
    from stitch.data.feature_cache import PreparedData

    run, report, loaded = probe_run
    assert len(loaded) == 1 and loaded[0].encoded == sum(report.rows.values()) == 12
    data = PreparedData(run / "data")
    for row in data.rows():
        features = data.features(row).float()
        assert features.shape == (1, TOKENS, WIDTH)
        fingerprint = features - torch.arange(WIDTH, dtype=torch.float32)  # the item (an image mean) everywhere
        assert 0.0 < float(fingerprint[0, 0, 0]) < 1.0  # float16 cache: equal to its rounding
        assert torch.allclose(fingerprint, fingerprint[0, 0, 0], atol=4e-3)


# -- the session: sentinels, models and projectors resolved by name ---------------------------------------------

# The demo tokenizer's three sentinel tokens in another order: single tokens, and unmistakably not qwen3.5's set.
SHUFFLED = SentinelSpec("probe-family", start="<|vision_end|>", placeholder="<|vision_start|>", end="<|vision_pad|>")


def demo_spec(**changes: Any) -> Any:
    return dataclasses.replace(load_plugins().get("models", "qwen3.5-demo"), **changes)


def open_session(recipe: Any, run: Path) -> Any:
    from stitch.stages.session import StitchSession

    return StitchSession.open(recipe, run, device="cpu", registry=get_host())


def test_hook_register_token_sentinels(probe_run, use_host, tmp_path):
    """The model's sentinel set, resolved by its name, is what the collator renders around the soft tokens."""
    run, _, _ = probe_run
    use_host(probe=plugin(register_encoders=[PROBE_ENCODER], register_token_sentinels=[SHUFFLED],
                          register_models=[demo_spec(name="probe-lm", sentinels="probe-family")]))
    session = open_session(probe_recipe(tmp_path / "r.yaml", model="probe-lm"), run)
    ids = session.prompt_ids("How many shapes?")
    vocab = session.tokenizer.convert_tokens_to_ids
    start = ids.index(vocab(SHUFFLED.start))
    assert ids[start + 1:start + 1 + TOKENS] == [vocab(SHUFFLED.placeholder)] * TOKENS
    assert ids[start + 1 + TOKENS] == vocab(SHUFFLED.end)
    assert session.sentinel_ids.placeholder == vocab("<|vision_start|>")  # qwen3.5's placeholder is vision_pad


def test_hook_register_models(probe_run, use_host, tmp_path):
    """The registered binding's loader builds the LM the session's model carries."""
    run, _, _ = probe_run
    built: list[Any] = []

    def load(spec: Any, source: ModelSource, dtype: torch.dtype, trust_remote_code: bool) -> Any:
        import transformers

        built.append(transformers.Qwen3_5ForCausalLM.from_pretrained(**source.pretrained_kwargs(), dtype=dtype))
        return built[-1]

    use_host(probe=plugin(register_encoders=[PROBE_ENCODER],
                          register_models=[demo_spec(name="probe-lm", load=load, state_dict_adapter=None)]))
    model = open_session(probe_recipe(tmp_path / "r.yaml", model="probe-lm"), run).binding.build_model()
    assert len(built) == 1 and model.lm is built[0]


def test_hook_register_projectors(probe_run, use_host, tmp_path):
    """The recipe's projector name resolves to the registered architecture, built to the encoder's width and
    the LM's hidden size."""
    run, _, _ = probe_run
    calls: list[tuple[int, int]] = []

    def build(width: int, hidden: int) -> torch.nn.Module:
        calls.append((width, hidden))
        return torch.nn.Sequential(torch.nn.Linear(width, hidden))

    use_host(probe=plugin(register_encoders=[PROBE_ENCODER], register_projectors=[ProjectorSpec("probe-proj", build)]))
    model = open_session(probe_recipe(tmp_path / "r.yaml", projector="probe-proj"), run).binding.build_model()
    hidden = model.lm.config.get_text_config().hidden_size
    assert calls == [(WIDTH, hidden)]
    assert isinstance(model.projector, torch.nn.Sequential) and model.projector[0].in_features == WIDTH


# -- load_model: state-dict adapters by name, packing from the declared load outcome ------------------------------


def test_hook_register_state_dict_adapters(use_host, tmp_path):
    """load_model resolves the binding's adapter by name and reads a snapshot in the adapter's layout through it;
    a name nobody registered is refused before any weight is read."""
    from safetensors.torch import load_file, save_file

    from stitch.plugins.snapshot_cache import ensure_snapshot

    base = demo_spec()
    text_snapshot = ensure_snapshot(base.source.builder_key, base.source.builder)
    wrapped = tmp_path / "wrapped"
    shutil.copytree(text_snapshot, wrapped)
    weights = load_file(str(wrapped / "model.safetensors"))
    save_file({f"wrapper.{k}": v for k, v in weights.items()}, str(wrapped / "model.safetensors"))
    (wrapped / "WRAPPED").write_text("keys carry a 'wrapper.' prefix\n")
    converted: list[int] = []

    def unwrap(state: Any) -> dict[str, Any]:
        converted.append(len(state))
        return {k.removeprefix("wrapper."): state[k] for k in state}

    adapter = StateDictAdapterSpec("probe-unwrap", "wrapper.*", "text LM", convert=unwrap,
                                   applies_to=lambda snapshot: (Path(snapshot) / "WRAPPED").exists())
    host = use_host(probe=plugin(register_state_dict_adapters=[adapter]))
    spec = dataclasses.replace(base, state_dict_adapter="probe-unwrap")
    model = load_model(spec, source=ModelSource(local_path=str(wrapped)), registry=host)
    assert converted == [len(weights)]
    for name, tensor in model.state_dict().items():
        if name in weights:
            assert torch.equal(tensor, weights[name]), name
    plain = load_model(spec, registry=host)  # the preset's own snapshot is not in the adapter's layout: read as is
    assert converted == [len(weights)] and type(plain) is type(model)
    with pytest.raises(RegistryLookupError, match="no state-dict adapter named 'probe-misspelt'"):
        load_model(dataclasses.replace(base, state_dict_adapter="probe-misspelt"), registry=host)


def test_packing_of_a_loaded_model_comes_from_what_its_binding_installed_at_load():
    """``packs_loaded`` answers from the spec and the load outcome: native packing, or the binding's
    ``install_sample_starts`` having reported True for this very model (wrapped or not)."""
    installed: list[Any] = []

    def install(model: Any) -> bool:
        installed.append(model)
        return len(installed) == 2  # the first load "cannot", the second "can"

    spec = demo_spec(supports_packing=False, install_sample_starts=install)
    first, second = load_model(spec, registry=get_host()), load_model(spec, registry=get_host())
    assert installed == [first, second]
    assert not packs_loaded(spec, torch.nn.ModuleDict({"lm": first}))
    assert packs_loaded(spec, torch.nn.ModuleDict({"lm": second}))  # as inside StitchedModel / peft
    assert packs_loaded(demo_spec(), first)  # a binding that packs natively


# -- prompts: the encoder's payload builds and validates what reaches an engine ------------------------------------


class TinyStitched(torch.nn.Module):
    """What prompt_embeddings needs of a StitchedModel: lm, projector, placeholder_id, device."""

    def __init__(self, placeholder_id: int = 5, hidden: int = 4) -> None:
        super().__init__()
        self.lm = torch.nn.Module()
        self.lm.embed = torch.nn.Embedding(10, hidden)
        self.lm.get_input_embeddings = lambda: self.lm.embed
        self.projector = torch.nn.Linear(WIDTH, hidden)
        self.placeholder_id = placeholder_id

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")


def test_hook_register_rollout_payloads():
    """The encoder's named payload builds the soft tokens spliced into the prompt, and its validator runs before
    any embedding is returned: a rejecting validator stops prompt_embeddings."""
    seen: list[str] = []

    def build(row_id: str, features: torch.Tensor, projector: Any) -> dict[str, Any]:
        return {"row_id": row_id, "probe": features, "soft_tokens": torch.full((TOKENS, 4), 7.0)}

    def validate(payload: Any) -> None:
        seen.append(payload["row_id"])
        if payload["row_id"] == "bad-row":
            raise PayloadError("row bad-row: probe refuses it")

    spec = RolloutPayloadSpec("probe-payload", "image", ("probe",), build=build, validate=validate)
    host = load_plugins(extra={"probe": plugin(register_rollout_payloads=[spec])})
    payload = payload_for(host, PROBE_ENCODER)
    assert payload is spec
    model = TinyStitched()
    ids = [1, 2, 5, 5, 5, 3]
    (embeds,) = prompt_embeddings(payload, model, [("good-row", ids, torch.zeros(1, TOKENS, WIDTH))])
    assert seen == ["good-row"] and torch.equal(embeds[2:5], torch.full((TOKENS, 4), 7.0))
    with pytest.raises(PayloadError, match="bad-row"):
        prompt_embeddings(payload, model, [("bad-row", ids, torch.zeros(1, TOKENS, WIDTH))])


def test_payload_missing_a_declared_field_or_named_by_no_encoder_is_refused_by_name():
    spec = RolloutPayloadSpec("forgetful", "image", ("probe", "lengths"), validate=lambda p: None,
                              build=lambda r, f, p: {"row_id": r, "probe": f, "soft_tokens": torch.zeros(3, 4)})
    host = load_plugins(extra={"probe": plugin(register_rollout_payloads=[spec])})
    with pytest.raises(PayloadError, match=r"row r1: rollout payload 'forgetful' built no field\(s\) \['lengths'\]"):
        prompt_embeddings(spec, TinyStitched(), [("r1", [5, 5, 5], torch.zeros(1, TOKENS, WIDTH))])
    with pytest.raises(LookupError, match="names no rollout payload"):
        payload_for(host, dataclasses.replace(PROBE_ENCODER, payload=None))
    with pytest.raises(LookupError, match="modality 'audio'"):
        payload_for(host, dataclasses.replace(PROBE_ENCODER, modality="audio", payload="forgetful"))


def test_clip_encoders_name_the_clip_image_payload_registered_beside_them():
    host = load_plugins()
    for name in ("clip-vit-base-patch32", "clip-tiny"):
        assert payload_for(host, host.get("encoders", name)).name == "clip_image"


# -- inference: the registered engine generates ------------------------------------------------------------------


def test_hook_register_rollout_engines(probe_run, use_host, tmp_path):
    """Inference builds the engine the caller names from the registry, and the answer is what that engine
    generated from the prompt embeddings it was handed."""
    from stitch.runs.checkpoint import write_checksums
    from stitch.serve.inference import Stitched

    run, _, _ = probe_run
    made: list[Any] = []

    class ProbeEngine:
        def __init__(self, lm: Any, pad_id: int, eos_id: int, suppress_ids: Any = ()) -> None:
            self.prompts: list[torch.Tensor] = []
            made.append(self)

        def generate(self, prompt_embeds, n, max_new_tokens, temperature=1.0, greedy=False):
            self.prompts.extend(prompt_embeds)
            return [Completion(0, list(self.answer_ids), [0.0] * len(self.answer_ids))]

        def refit(self, state_dict=None) -> None:
            pass

    use_host(probe=plugin(register_encoders=[PROBE_ENCODER], register_rollout_payloads=[PROBE_PAYLOAD],
                          register_rollout_engines=[RolloutEngineSpec("probe-engine", ProbeEngine)]))
    session = open_session(probe_recipe(tmp_path / "r.yaml"), run)
    model = session.binding.build_model(lora={"r": 2, "alpha": 4})
    session.binding.save_trainable(model, tmp_path / "step-1", "sft")
    write_checksums(tmp_path / "step-1")  # as every checkpoint stitch writes: served steps are verified first
    served = Stitched(tmp_path / "step-1", engine="probe-engine", device="cpu", registry=get_host())
    assert made and served.engine is made[0]
    made[0].answer_ids = served.tokenizer("The answer is 3.", add_special_tokens=False)["input_ids"]
    from PIL import Image

    assert served.answer(Image.new("RGB", (32, 32), (200, 10, 10)), "How many shapes?") == "The answer is 3."
    hidden = model.lm.config.get_text_config().hidden_size
    assert len(made[0].prompts) == 1 and made[0].prompts[0].shape[-1] == hidden


# -- recipes and tasks ------------------------------------------------------------------------------------------


def test_hook_register_recipes(use_host, tmp_path):
    """``load_recipe(NAME)`` finds the file a plugin registered under NAME."""
    path = tmp_path / "shipped.yaml"
    path.write_text(yaml.safe_dump({**BASE, "name": "probe-shipped"}, sort_keys=False))
    host = load_plugins(extra={"probe": plugin(register_recipes=[RecipeSpec("probe-recipe", path)])})
    recipe = load_recipe("probe-recipe", host)
    assert recipe.name == "probe-shipped" and Path(recipe.path) == path.resolve()


def test_hook_register_tasks(sft_run, use_host, tmp_path):
    """GRPO's step rewards every sampled completion with the recipe's registered task."""
    calls: list[tuple[str, TaskRow]] = []

    def reward(completion: str, row: TaskRow) -> float:
        calls.append((completion, row))
        return 0.25

    use_host(probe=plugin(register_tasks=[TaskSpec("probe-task", reward=reward)]))
    run = tmp_path / "run"
    shutil.copytree(sft_run, run)
    recipe = load_recipe(write_recipe(tmp_path / "small.yaml", task="probe-task", stages__grpo__steps=1))
    run_stage(recipe, "grpo", run, registry=get_host(), max_steps=1)
    grpo = recipe.stages["grpo"]
    prompts, group = (grpo.prompts_per_step, grpo.group_size) if hasattr(grpo, "group_size") else (
        grpo["prompts_per_step"], grpo["group_size"])
    assert len(calls) == prompts * group and all(isinstance(row, TaskRow) for _, row in calls)
    log = [json.loads(line) for line in (run / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert log[-1]["reward"] == pytest.approx(0.25)


# -- the plugin API: plugins import stitch.api (and stitch.accel for kernels) and nothing else of stitch ---------

PLUGIN_PACKAGES = [REPO / "stitch_clip", REPO / "stitch_qwen", REPO / "stitch_nemotron",
                   REPO / "templates" / "stitch-plugin"]


def stitch_imports(path: Path) -> list[str]:
    """Every ``stitch`` / ``stitch.*`` module a Python file imports (in functions too), by ``ast``."""
    source = re.sub(r"\{\{.*?\}\}", "jinja_value", path.read_text())  # the template's Jinja, as a name
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
    return [name for name in found if name == "stitch" or name.startswith("stitch.")]


PLUGIN_API_MODULES = {"stitch.api", "stitch.accel"}


def test_plugins_and_the_template_import_only_stitch_api_and_stitch_accel():
    files = [p for root in PLUGIN_PACKAGES for p in sorted(root.rglob("*.py"))]
    assert len(files) >= 15, files  # the walk reaches the plugin packages and the template
    offenders = {str(p.relative_to(REPO)): bad for p in files
                 if (bad := [m for m in stitch_imports(p) if m not in PLUGIN_API_MODULES])}
    assert offenders == {}, f"plugins may import only stitch.api and stitch.accel (docs/plugin-api.md): {offenders}"


def test_stitch_api_exports_no_kernel_and_stitch_accel_only_kernels():
    import stitch.accel
    import stitch.api

    assert set(stitch.accel.__all__) & set(stitch.api.__all__) == set()
    homes = {name: getattr(stitch.accel, name).__module__ for name in stitch.accel.__all__}
    assert all(home.startswith("stitch.kernels.") for home in homes.values()), homes


def test_the_import_walk_catches_a_core_import_inside_a_function(tmp_path):
    sneaky = tmp_path / "sneaky.py"
    sneaky.write_text("def f():\n    from stitch.kernels.varlen import segments\n    import stitch.api\n")
    assert stitch_imports(sneaky) == ["stitch.kernels.varlen", "stitch.api"]


def test_plugin_api_doc_lists_every_name_stitch_api_and_stitch_accel_export():
    import stitch.accel
    import stitch.api

    doc = (REPO / "docs" / "plugin-api.md").read_text()
    api_part, _, accel_part = doc.partition("# stitch.accel")
    missing = [name for name in stitch.api.__all__ if f"`{name}`" not in api_part]
    missing += [f"stitch.accel.{name}" for name in stitch.accel.__all__ if f"`{name}`" not in accel_part]
    assert missing == [], f"docs/plugin-api.md does not describe {missing}"
