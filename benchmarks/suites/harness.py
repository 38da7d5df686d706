"""What every suite shares: the shapes, the benchmark's own plugin (registered through the public plugin API),
generated datasets, recipes written as YAML, and driving the product's prepare and stages in this process."""

from __future__ import annotations

import dataclasses
import io
import json
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import log
from stitch.api import ModelSource, hookimpl, load_plugins

# A Qwen3-4B-shaped dense LM (attention only, so it packs on every backend): the shape of the SFT/GRPO figures.
DENSE_4B = {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1_000_000}


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmarked model + encoder pair, as recipe names, with the stage dtype it trains in."""

    model: str
    encoder: str
    dtype: str
    feature_width: int


SHAPES = {
    "tiny": Shape("qwen3.5-demo", "clip-demo", "float32", 256),
    "dense4b": Shape("bench-dense-4b", "clip-b32-random", "bfloat16", 768),
}


def build_dense_4b(out_dir: Path) -> None:
    """Tokenizer of the Qwen tiny presets + a seeded random-init Qwen3ForCausalLM at the 4B shape, in bf16."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from stitch.api import padded_vocab_size
    from stitch_qwen.tiny import write_tokenizer

    write_tokenizer(out_dir)
    tok = AutoTokenizer.from_pretrained(out_dir)
    config = Qwen3Config(vocab_size=max(151936, padded_vocab_size(out_dir)), tie_word_embeddings=True,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None, **DENSE_4B)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_dir)


def build_b32_random(out_dir: Path) -> None:
    """CLIP ViT-B/32's config (12 layers, 768 wide) with seeded random weights and CLIP's own preprocessing."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    CLIPVisionModel(CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                     num_attention_heads=12, image_size=224, patch_size=32, projection_dim=512)
                    ).save_pretrained(out_dir, safe_serialization=True)
    CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224},
                       image_mean=[0.48145466, 0.4578275, 0.40821073],
                       image_std=[0.26862954, 0.26130258, 0.27577711]).save_pretrained(out_dir)


class BenchPlugin:
    """The benchmark's own registrations: the dense 4B shape (no plugin ships it) and the real CLIP B/32 contract
    on random weights (nothing is downloaded). Handed to the plugin host like any plugin object."""

    @staticmethod
    @hookimpl
    def register_models(register: Any) -> None:
        from stitch_qwen.kernels import install_fused_kernels
        from stitch_qwen.models import FULL_ATTENTION, qwen_demo_spec

        register(dataclasses.replace(
            qwen_demo_spec(), name="bench-dense-4b", architecture="Qwen3ForCausalLM", hidden_size=2560,
            source=ModelSource(builder=build_dense_4b, builder_key="bench-dense-4b-v1"),
            lora_target_modules=FULL_ATTENTION, install_sample_starts=install_fused_kernels,
            description="Qwen3-4B-shaped dense LM, random init (benchmarks)"))

    @staticmethod
    @hookimpl
    def register_encoders(register: Any) -> None:
        from stitch_clip.encoder import CLIP_B32

        register(dataclasses.replace(CLIP_B32, name="clip-b32-random", description="ViT-B/32, random weights",
                                     source=ModelSource(builder=build_b32_random, builder_key="clip-b32-random-v1")))


class ExtraModels:
    """More model registrations (e.g. a published model narrowed for a CPU run, under its own name and width)."""

    def __init__(self, specs: tuple[Any, ...]) -> None:
        self.specs = specs

    @hookimpl
    def register_models(self, register: Any) -> None:
        for spec in self.specs:
            register(spec)


_HOST: Any = None  # the host the last install_host built: prepare() and train() resolve names through it


def install_host(models: tuple[Any, ...] = ()) -> Any:
    """The plugin host the suites resolve names through: installed plugins plus ``BenchPlugin`` (and ``models``),
    built as the CLI builds it and handed to prepare and the stages as their registry."""
    global _HOST
    _HOST = load_plugins(extra={"stitch-bench": BenchPlugin, "stitch-bench-extra": ExtraModels(models)})
    return _HOST


def jpeg_bytes(seed: int, size: tuple[int, int] = (560, 420)) -> bytes:
    """A photo-like JPEG (smooth colour fields, shapes, sensor noise): decodes and resizes like a real photo."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    chans = [np.sin(xx / rng.uniform(6, 60) + rng.uniform(0, 6)) * np.cos(yy / rng.uniform(6, 60)) * 90 + 128
             for _ in range(3)]
    img = Image.fromarray(np.stack(chans, -1).clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(4, 12))):
        x0, y0 = int(rng.integers(0, w - 20)), int(rng.integers(0, h - 20))
        draw.ellipse((x0, y0, x0 + int(rng.integers(10, w // 2)), y0 + int(rng.integers(10, h // 2))),
                     fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    noisy = np.asarray(img).astype(np.int16) + rng.normal(0, 7, (h, w, 3)).astype(np.int16)
    buf = io.BytesIO()
    Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


WORDS = ("red", "blue", "circle", "square", "left", "right", "above", "below", "green", "small", "large", "shape")


def write_jpeg_rows(root: Path, n: int, unique: int = 256, words: tuple[int, int] = (0, 0)) -> Path:
    """``n`` JPEG files (``unique`` contents, each file's bytes distinct) and a JSON-lines table naming them; each
    question carries a uniform random ``words`` range of extra words (caption-length rows)."""
    import random

    rng = random.Random(0)
    (root / "imgs").mkdir(parents=True, exist_ok=True)
    contents = [jpeg_bytes(i) for i in range(min(unique, n))]
    rows = root / "rows.jsonl"
    with rows.open("w") as fh:
        for i in range(n):
            base = contents[i % len(contents)]
            text = f"stitch-bench {i}".encode()  # a JPEG comment segment: same pixels, different file hash
            Path(root, "imgs", f"{i:07d}.jpg").write_bytes(base[:2] + b"\xff\xfe" + (len(text) + 2).to_bytes(2, "big")
                                                           + text + base[2:])
            fh.write(json.dumps({"id": f"img{i}", "image": f"imgs/{i:07d}.jpg",
                                 "question": " ".join(rng.choices(WORDS, k=rng.randint(*words)))
                                 + " How many objects are there?", "answer": f"The answer is {i % 8 + 1}."})
                     + "\n")
    return rows


def write_recipe(root: Path, shape: Shape, rows: Path, n: int, stages: dict[str, dict], snapshot: Path | None = None,
                 **data: Any) -> Path:
    """A recipe over ``rows`` (partitions: alignment, train, grpo, eval) for ``shape``, its model read from the local
    ``snapshot`` when given; ``data`` adds data fields."""
    import yaml

    quarter = max(8, n // 4 // 8 * 8)
    recipe = {
        "name": f"bench-{shape.model}", "encoder": shape.encoder, "task": "counting",
        "model": shape.model if snapshot is None else {"name": shape.model, "snapshot": str(snapshot)},
        "data": {"source": {"path": str(rows), "format": "json"},
                 "columns": {"id": "id", "media": "image", "question": "question", "answer": "answer"},
                 "partitions": {"alignment": [0, quarter], "train": [quarter, 2 * quarter],
                                "grpo": [2 * quarter, 3 * quarter], "eval": [3 * quarter, 4 * quarter]},
                 "scan_cap": n, "budgets": {"transient_mib": 8192, "retained_mib": 64 + n * 49 * 768 * 2 * 1.2 / 2**20},
                 "feature_dtype": "bfloat16" if shape.dtype == "bfloat16" else "float16", **data},
        "stages": {name: {"eval_partition": None, "dtype": shape.dtype, "save_every": 10**6, **opts}
                   for name, opts in stages.items()},
    }
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@contextmanager
def logged_phase(what: str) -> Iterator[None]:
    """Log a product phase's start and wall time: a GPU call cut off by its limit shows which phase it was in."""
    t0 = time.perf_counter()
    log(f"{what} ...")
    yield
    log(f"{what}: {time.perf_counter() - t0:.1f} s")


def prepare(recipe_path: Path, run_dir: Path) -> Any:
    """`stitch prepare` in this process: the recipe's rows encoded once into run_dir/data."""
    from stitch.config.recipe import load_recipe
    from stitch.model.binding import ModelBinding
    from stitch.stages.chain import prepare_data

    recipe = load_recipe(str(recipe_path), _HOST)
    binding = ModelBinding.for_recipe(recipe, _HOST, device="cpu")
    with logged_phase(f"stitch prepare {recipe_path.stem}"):
        return prepare_data(recipe, binding, run_dir / "data", device=device(), progress=False)


def train(recipe_path: Path, stage: str, run_dir: Path) -> list[dict[str, Any]]:
    """`stitch train STAGE` in this process; returns the stage's per-step metrics lines."""
    from stitch.config.recipe import load_recipe
    from stitch.stages.loop import run_stage

    with logged_phase(f"stitch train {stage}"):
        summary = run_stage(load_recipe(str(recipe_path), _HOST), stage, run_dir, registry=_HOST, progress=False)
    lines = Path(summary["metrics"]).read_text().splitlines()
    return [r for r in map(json.loads, lines) if not r.get("final")]


def median_after(records: list[dict[str, Any]], key: str, warmup: int) -> float:
    """The median of ``key`` over the steps after the first ``warmup`` (all steps when there are no more)."""
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values[warmup:] or values)
