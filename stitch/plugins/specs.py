"""What plugins register: one frozen dataclass per registry, each keyed by ``name``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from stitch.plugins.snapshot_cache import ensure_snapshot, snapshot_ready


@dataclass(frozen=True)
class ModelSource:
    """Where weights come from: a hub repo pinned to a revision, or a local snapshot directory."""

    repo_id: str | None = None
    revision: str | None = None
    local_path: str | None = None
    # A tiny preset: ``builder(dir)`` writes a random-init snapshot, built once into the stitch cache.
    builder: Callable[[Path], None] | None = None
    builder_key: str | None = None
    # Optional: writes only the tokenizer files ``builder`` writes (the same bytes), so that reading a preset's
    # tokenizer (prepare's row checks) does not build, or pre-train, its weights.
    tokenizer_builder: Callable[[Path], None] | None = None

    def __post_init__(self) -> None:
        if self.builder is not None:
            if not self.builder_key:
                raise ValueError("a ModelSource with a builder needs a builder_key (its cache directory name)")
        elif self.local_path is None and (self.repo_id is None or self.revision is None):
            raise ValueError(
                f"ModelSource needs a local_path, a builder, or a repo_id with a pinned revision; "
                f"got repo_id={self.repo_id!r} revision={self.revision!r}"
            )

    def describe(self) -> str:
        if self.builder is not None:
            return f"tiny preset {self.builder_key} (built locally)"
        return self.local_path or f"{self.repo_id}@{self.revision}"

    def identity(self) -> dict[str, str | None]:
        """What provenance records: the repo id and revision, or the local path / preset key."""
        if self.builder is not None:
            return {"id": f"tiny:{self.builder_key}", "revision": None}
        if self.local_path is not None:
            return {"id": self.local_path, "revision": None}
        return {"id": self.repo_id, "revision": self.revision}

    def pretrained_kwargs(self) -> dict[str, Any]:
        """Arguments for ``from_pretrained``: a local path, or a repo id with its pinned revision."""
        if self.builder is not None:
            return {"pretrained_model_name_or_path": str(ensure_snapshot(self.builder_key, self.builder))}
        if self.local_path is not None:
            return {"pretrained_model_name_or_path": self.local_path}
        return {"pretrained_model_name_or_path": self.repo_id, "revision": self.revision}

    def tokenizer_kwargs(self) -> dict[str, Any]:
        """``pretrained_kwargs`` for ``AutoTokenizer``: a preset's tokenizer-only snapshot when its weights are not
        built yet and it declares a ``tokenizer_builder``, else the full snapshot."""
        if self.builder is not None and self.tokenizer_builder is not None:
            if not snapshot_ready(self.builder_key):
                snapshot = ensure_snapshot(f"{self.builder_key}-tokenizer", self.tokenizer_builder)
                return {"pretrained_model_name_or_path": str(snapshot)}
        return self.pretrained_kwargs()

    def with_local_path(self, path: str) -> ModelSource:
        return ModelSource(local_path=path)


@dataclass(frozen=True)
class EncoderSpec:
    """A frozen encoder: declares its output contract and how to load it.

    ``load(source, device, dtype)`` returns an object with ``encode(items) -> Tensor[B, tokens, width]``;
    ``decode_item(value)`` turns one raw dataset value (bytes, path, PIL image...) into an item, raising
    ``ValueError`` on corrupt input. ``payload`` names the registered rollout payload (``RolloutPayloadSpec``)
    that carries this encoder's cached features to a rollout engine; GRPO, evaluation and inference build every
    prompt through it (``stitch.rollout.prompts``). A tiny preset is its own registration whose source has a
    builder.

    ``load_preprocess(source)`` (optional) returns a picklable ``preprocess(value) -> Tensor`` of one fixed shape
    (decode + resize to what the encoder consumes, e.g. uint8 pixels), or None where the snapshot's preprocessing
    has no such form. ``stitch prepare`` runs it in worker processes and hands ``encode`` the stacked batch
    (a Tensor [B, ...] instead of a list of decoded items); its ``identity`` string joins the shard keys, so a
    change of preprocessing never reuses features made the old way. A preprocess that declares ``item_shape``
    (and ``item_dtype``, default uint8) lets forked workers write their stacked chunks into shared slots mapped
    once per run (``stitch.kernels.shared_slots``) instead of a shared-memory segment each. A preprocess may offer
    ``on_device(device)``: the variant prepare uses for an encoder on ``device`` (``data.prepare.decode: device``),
    which may leave part of the work to the device: its worker call returns items of any kind (``stacks = False``:
    each travels as it is) and its ``device_batch(items, device)`` turns a batch of them into the encoder's input
    there (CLIP's decodes JPEGs with nvjpeg); its optional ``warm_up(device)`` runs in a thread of prepare's own,
    beside the encoder's loader thread. Such a variant may also declare ``slot_bytes_per_item`` and offer
    ``hand_over(items, put)`` (in a forked worker: ``put(bytes or path) -> SlotBytes | None`` puts a payload, a
    file's whole content, into the chunk's shared slot) and ``take_over(items, view)`` (in the main process:
    ``view(SlotBytes)`` is those bytes there), so what the workers read reaches the main process without a pipe
    or a second read. The loaded encoder may offer
    ``compile(batch_size)`` (``data.prepare.compile``) and ``warm_up(batch_size)`` (prepare's loader thread runs
    it after ``load``, while the first shard decodes, so the first encode does not pay for device set-up).
    """

    name: str
    modality: str
    feature_width: int
    tokens_per_item: int
    source: ModelSource
    load: Callable[..., Any]
    decode_item: Callable[[Any], Any]
    payload: str | None = None
    description: str = ""
    load_preprocess: Callable[[ModelSource], Callable[[Any], Any] | None] | None = None
    # The OpenAI chat content-part types whose value ``decode_item`` takes in ``stitch serve``: ``image_url``,
    # ``input_audio``, ``video_url`` or a part type the plugin names. Empty: the encoder cannot be served.
    content_parts: tuple[str, ...] = ()

    def preprocess(self) -> Callable[[Any], Any] | None:
        """This encoder's fixed-shape preprocessing for its own source (``load_preprocess``), or None: what
        ``stitch prepare`` runs for the training features and ``stitch serve`` for a served item."""
        return self.load_preprocess(self.source) if self.load_preprocess is not None else None


IMAGE_MARKER = "<image>"  # where an image stands in a turn's text (LLaVA's spelling; content parts map to it)
VIDEO_MARKER = "<video>"  # where a video clip stands


class SentinelLayoutError(ValueError):
    """A tokenizer family has no sentinel layout for an encoder's modality."""


@dataclass(frozen=True)
class SentinelSpec:
    """Single-token markers that bracket the soft tokens of one item, for one tokenizer family.

    ``video_start`` / ``video_end`` (optional) bracket a video clip's soft tokens instead, so the LM tells a clip
    from an image; the placeholder is shared. ``marker`` is the text marker an item of this layout stands at in a
    turn (``<image>``; ``for_modality("video")`` gives the ``<video>`` layout)."""

    name: str  # the tokenizer family, e.g. "qwen3.5"
    start: str
    placeholder: str
    end: str
    description: str = ""
    video_start: str | None = None
    video_end: str | None = None
    marker: str = IMAGE_MARKER

    @property
    def tokens(self) -> tuple[str, str, str]:
        return (self.start, self.placeholder, self.end)

    def for_modality(self, modality: str) -> SentinelSpec:
        """The layout an encoder of ``modality`` uses: a video's own start/end around the shared placeholder and
        the ``<video>`` marker; every other modality this set as registered."""
        if modality != "video":
            return self
        if self.video_start is None or self.video_end is None:
            raise SentinelLayoutError(
                f"sentinel set {self.name!r} declares no video_start/video_end tokens, so it cannot bracket a video "
                f"clip; use a model whose sentinel set declares them (e.g. 'qwen3.5', 'nemotron-h') or an image "
                f"encoder")
        return replace(self, start=self.video_start, end=self.video_end, marker=VIDEO_MARKER)


@dataclass(frozen=True)
class ModelBackend:
    """Another implementation of a binding's LM than its transformers class, chosen by ``model.backend``.

    ``load(spec, config, state_dict, dtype, device)`` builds the model from the snapshot's (text) ``config`` and a
    lazy read of its HF-layout ``state_dict`` (the core applies the binding's state-dict adapter first). ``requires``
    are the imports that must succeed, ``install`` the pip line that provides it; ``lora_target_modules`` are the
    spec's targets under this implementation's module names; ``refuses``: stitch features this backend cannot
    serve (``generate``, ``vllm``, ``export``, ``packing``) -> why; the core refuses them before any weight loads.
    """

    name: str
    load: Callable[..., Any]
    requires: tuple[str, ...]
    install: str
    lora_target_modules: tuple[str, ...]
    refuses: Mapping[str, str] = field(default_factory=dict)
    description: str = ""


@dataclass(frozen=True)
class ModelSpec:
    """A base LM binding: how to load it, its LoRA targets (and the exclusions, with reasons), its tiny preset.

    Loading (``stitch.model.loading.load_model``): ``load(spec, source, dtype, trust_remote_code)`` when given,
    else ``from_pretrained`` of the transformers class ``architecture``; a snapshot in another layout goes through
    the registered state-dict adapter named ``state_dict_adapter`` (resolved by the core, never by the plugin).

    Packing is declared: ``supports_packing`` means packed rows keep samples apart with the stock model
    (attention only); otherwise ``packing_when()`` says whether this machine can run the plugin's sample-start
    path, and ``install_sample_starts(model) -> bool``, called by the core on every freshly loaded model,
    installs it and returns whether it did. ``stitch.model.loading.packs_loaded`` combines the two.
    """

    name: str
    architecture: str  # the transformers class name, e.g. "Qwen3_5ForCausalLM"
    sentinels: str  # a SentinelSpec name
    source: ModelSource
    hidden_size: int
    lora_target_modules: tuple[str, ...]
    lora_exclusions: Mapping[str, str] = field(default_factory=dict)
    lora_target_parameters: tuple[str, ...] = ()
    # (ModelSpec, source, dtype, trust_remote_code) -> model; None means the class's from_pretrained
    load: Callable[..., Any] | None = None
    state_dict_adapter: str | None = None  # a StateDictAdapterSpec name
    supports_packing: bool = True
    packing_note: str = ""
    # whether this machine can run the sample-start path (e.g. the varlen kernels are importable)
    packing_when: Callable[[], bool] | None = None
    # installs the sample-start path on a freshly loaded model; True when it did (the model then trains packed)
    install_sample_starts: Callable[[Any], bool] | None = None
    # whether a packed GPU training step runs the model's shape-static blocks (LoRA layers, MLPs) as CUDA graphs
    # (stitch.kernels.graphs); False where measured slower than eager: the copies in and out of a graph cost more than
    # the launches it saves
    cuda_graphs: bool = True
    # optional fused kernels: import name -> pip package; without them transformers runs PyTorch reference code (the
    # plugin says so once on a GPU, naming its extra: stitch.accel.warn_kernel_fallback)
    kernels: Mapping[str, str] = field(default_factory=dict)
    # writes a random-init snapshot in the published checkpoint layout (`stitch snapshot`):
    # snapshot(out_dir, layers=None, width=None, dtype=None, progress=None, max_shard_bytes=...) -> None
    snapshot: Callable[..., None] | None = None
    # implementations other than the transformers class (``model.backend`` in a recipe): name -> ModelBackend
    backends: Mapping[str, ModelBackend] = field(default_factory=dict)
    # the backend this spec loads through; "transformers" is the class ``architecture`` (or ``load``)
    backend: str = "transformers"
    description: str = ""

    def packs(self) -> bool:
        """Whether training can pack samples for this model on this machine (see ``packing_note`` when not);
        for a loaded model, ``stitch.model.loading.packs_loaded`` is the answer."""
        if self.backend != "transformers":
            return False  # no other backend packs yet (ModelBackend.refuses says why)
        return self.supports_packing or (self.packing_when is not None and bool(self.packing_when()))


@dataclass(frozen=True)
class StateDictAdapterSpec:
    """A key mapping between two checkpoint layouts; ``convert`` must refuse keys it cannot place.

    A model names it in ``ModelSpec.state_dict_adapter``; ``load_model`` applies it to every snapshot for which
    ``applies_to(snapshot_dir)`` is true (None: every snapshot): the weights are read lazily through ``convert``
    and the model is built from ``convert_config(config, converted_state_dict)`` (None: the snapshot's config).
    """

    name: str
    source_layout: str
    target_layout: str
    convert: Callable[[Mapping[str, Any]], dict[str, Any]]
    applies_to: Callable[[Path], bool] | None = None
    convert_config: Callable[[Any, Mapping[str, Any]], Any] | None = None
    description: str = ""


@dataclass(frozen=True)
class RolloutPayloadSpec:
    """How one modality's rows reach a rollout engine: the fields (declared once), a builder, a validator.

    ``build(row_id, features, projector)`` returns ``{"row_id", *fields, "soft_tokens": [n, hidden]}``;
    ``validate(payload)`` raises on a payload whose declared fields are wrong. ``stitch.rollout.prompts``
    builds every engine prompt through both, validating before any embedding reaches an engine.
    """

    name: str
    modality: str
    fields: tuple[str, ...]
    build: Callable[..., dict[str, Any]]
    validate: Callable[[Mapping[str, Any]], None]
    description: str = ""


@dataclass(frozen=True)
class RolloutEngineSpec:
    """A generation backend: ``factory(lm, pad_id=, eos_id=, suppress_ids=)`` returns an engine with
    ``generate(prompt_embeds, n, max_new_tokens, temperature=1.0, greedy=False, seed=None)`` and ``refit(weights)``;
    given a ``seed``, ``generate`` samples from it alone (GRPO passes one per step: a resumed run replays its
    rollouts)."""

    name: str
    factory: Callable[..., Any]
    description: str = ""
    # refit(weights) takes the policy's merged state dict, which is what Ray-placed replicas receive; an engine
    # whose refit takes something else (only the adapter) is refused under stages.grpo.placement: ray
    merged_refit: bool = True


@dataclass(frozen=True)
class ProjectorSpec:
    """A projector architecture: ``build(feature_width, hidden_size)`` returns an ``nn.Module``."""

    name: str
    build: Callable[[int, int], Any]
    description: str = ""


@dataclass(frozen=True)
class RecipeSpec:
    """A shipped recipe file."""

    name: str
    path: Path
    description: str = ""


@dataclass(frozen=True)
class TaskRow:
    """What a task sees of one prepared row: its id, the question, the recorded answer, and any extra text
    columns the recipe kept (``data.columns.extra``), e.g. ``rejected`` for user preference pairs."""

    id: str
    question: str
    answer: str
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TaskSpec:
    """What a dataset is trained and judged on.

    - ``reward(completion, row) -> float``: GRPO's verifiable reward of one sampled completion.
    - ``grade(completion, row) -> float``: evaluation's score of one greedy answer (1.0 = correct); the held-out
      ``eval_accuracy`` is its mean. None: ``reward`` grades too.
    - ``accepts(row) -> bool``: whether a row can be rewarded and graded at all (a counting task skips caption
      rows); None accepts every row.
    - ``rejected(row, rng) -> str | None``: DPO's rejected answer for a row (chosen = the recorded answer); None
      means the pairs come from the dataset's ``rejected`` column (``data.columns.rejected``).
    """

    name: str
    reward: Callable[[str, TaskRow], float]
    grade: Callable[[str, TaskRow], float] | None = None
    accepts: Callable[[TaskRow], bool] | None = None
    rejected: Callable[[TaskRow, Any], str | None] | None = None
    description: str = ""

    def score(self, completion: str, row: TaskRow) -> float:
        return float((self.grade or self.reward)(completion, row))

    def takes(self, row: TaskRow) -> bool:
        return True if self.accepts is None else bool(self.accepts(row))
