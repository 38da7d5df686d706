"""The embedded demo datasets: deterministic synthetic shape scenes, asking for the count (in the spirit of
CLEVR-Math) or for the colour of a single shape.

Each is written to disk as a real parquet dataset (image column = ``{bytes, path}``) and read back through
``datasets.load_dataset(..., streaming=True)``, so the default takes the same path as user data.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from datasets import Dataset, Features, Value
from datasets import Image as ImageFeature
from PIL import Image, ImageDraw

from stitch.config.data import BuiltinSource
from stitch.demo.tiny import CAPTION_QUESTION, COLORS, COUNT_QUESTION, MAX_OBJECTS, SHAPES, SIZES, answer_text
from stitch.plugins.snapshot_cache import ensure_snapshot

IMAGE_SIZE = 224
BACKGROUND = (235, 235, 235)
RGB = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 30),
    "purple": (140, 50, 180),
    "cyan": (40, 200, 210),
}
RADIUS = {"small": 14, "large": 28}
# Counting scenes put each object inside its own cell of the 7 x 7 grid of 32-px patches that a ViT-B/32-shaped
# tower cuts a 224-px image into: one object, one patch token. A random-init tower then hands the LM a count it
# can read off its tokens (free placement splits a shape over up to four patches and a size over one to six,
# which capped the demo near 55 %); a pre-trained CLIP needs no such help.
GRID = 7
CELL = IMAGE_SIZE // GRID
CELL_RADIUS = {"small": 9, "large": 13}
VERSION = 3  # bump when the rendering or the row layout changes: it keys the on-disk copy
COLORS_VERSION = 2  # the same for shape-colors


@dataclass(frozen=True)
class SceneObject:
    shape: str
    color: str
    size: str
    x: int
    y: int

    def phrase(self) -> str:
        return f"a {self.size} {self.color} {self.shape}"


def balanced_count(seed: int, index: int, most: int = MAX_OBJECTS) -> int:
    """Row ``index``'s object count: rows ``8k..8k+7`` hold the counts 1..8 in a seeded order, so a partition
    of a multiple of 8 rows is exactly balanced and always giving one answer scores exactly 1/8."""
    block = random.Random(f"counting-shapes:{seed}:counts:{index // most}").sample(range(1, most + 1), most)
    return block[index % most]


def sample_scene(rng: random.Random, count: int | None = None) -> list[SceneObject]:
    """``count`` (default: 1..MAX_OBJECTS at random) objects with random shape, color and size, each in its own
    grid cell (jittered inside it), listed in reading order: the order of the tower's patch tokens."""
    count = rng.randint(1, MAX_OBJECTS) if count is None else count
    objects: list[SceneObject] = []
    for cell in sorted(rng.sample(range(GRID * GRID), count)):
        size = rng.choice(SIZES)
        slack = CELL // 2 - CELL_RADIUS[size] - 1
        x = (cell % GRID) * CELL + CELL // 2 + rng.randint(-slack, slack)
        y = (cell // GRID) * CELL + CELL // 2 + rng.randint(-slack, slack)
        objects.append(SceneObject(rng.choice(SHAPES), rng.choice(COLORS), size, x, y))
    return objects


def render_scene(objects: list[SceneObject], radius: dict[str, int] | None = None) -> Image.Image:
    """The scene on a plain background; ``radius`` maps a size to pixels (the counting grid's by default)."""
    radius = CELL_RADIUS if radius is None else radius
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for o in objects:
        r, fill = radius[o.size], RGB[o.color]
        if o.shape == "circle":
            draw.ellipse((o.x - r, o.y - r, o.x + r, o.y + r), fill=fill)
        elif o.shape == "square":
            s = int(r * 0.85)
            draw.rectangle((o.x - s, o.y - s, o.x + s, o.y + s), fill=fill)
        else:
            # equilateral, inscribed in the object's circle so the spacing rule keeps shapes apart
            half = r * 0.866
            draw.polygon([(o.x, o.y - r), (o.x - half, o.y + r / 2), (o.x + half, o.y + r / 2)], fill=fill)
    return image


def caption_text(objects: list[SceneObject]) -> str:
    """A description that states the count first, then lists every object."""
    n = len(objects)
    head = "There is 1 object" if n == 1 else f"There are {n} objects"
    phrases = [o.phrase() for o in objects]
    listed = phrases[0] if n == 1 else ", ".join(phrases[:-1]) + " and " + phrases[-1]
    return f"{head}: {listed}."


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", compress_level=3)  # flat colours compress as well at 3 as at 6, twice as fast
    return buf.getvalue()


def annotated_count(count: int, rng: random.Random, undercount: float) -> int:
    """What a hurried annotator writes down: the true count, except that a scene of the most objects is
    called one fewer with probability ``undercount`` (crowded scenes are the ones people miscount)."""
    return count - 1 if count == MAX_OBJECTS and rng.random() < undercount else count


def make_rows(rows: int, caption_rows: int = 0, seed: int = 0, annotator_rows: tuple[int, int] | None = None,
              undercount: float = 0.0) -> list[dict]:
    """Rows ``0..caption_rows-1`` ask for a caption (alignment); the rest ask for the count (SFT/GRPO).

    Rows in ``annotator_rows`` ``[start, end)`` answer with ``annotated_count`` (the demo's SFT partition: a
    supervised stage learns the annotator's habit), every other row with the true count, which the ``count``
    column always holds. Each row's scene depends only on ``(seed, index)``, so a longer dataset extends a
    shorter one.
    """
    out = []
    for i in range(rows):
        rng = random.Random(f"counting-shapes:{seed}:{i}")
        objects = sample_scene(rng, balanced_count(seed, i))
        caption = i < caption_rows
        stated = len(objects)
        if annotator_rows is not None and annotator_rows[0] <= i < annotator_rows[1] and not caption:
            stated = annotated_count(stated, rng, undercount)
        out.append(
            {
                "id": f"shapes-{seed}-{i:06d}",
                "image": {"bytes": png_bytes(render_scene(objects)), "path": f"shapes-{seed}-{i:06d}.png"},
                "question": CAPTION_QUESTION if caption else COUNT_QUESTION,
                "answer": caption_text(objects) if caption else answer_text(stated),
                "count": len(objects),
                "task": "caption" if caption else "count",
            }
        )
    return out


def make_color_rows(rows: int, caption_rows: int = 0, seed: int = 0) -> list[dict]:
    """One object per scene; rows ``0..caption_rows-1`` ask for a caption (alignment), the rest ask for the
    object's colour, answered "The answer is red.": free text, not a number. (The tiny demo LM was pre-trained on
    "The answer is ..." sentences, where " red" is one token; a bare "red" splits into unfamiliar pieces.)

    Each row's scene depends only on ``(seed, index)``, so a longer dataset extends a shorter one.
    """
    out = []
    for i in range(rows):
        rng = random.Random(f"shape-colors:{seed}:{i}")
        size = rng.choice(SIZES)
        r = RADIUS[size]
        obj = SceneObject(rng.choice(SHAPES), rng.choice(COLORS), size,
                          rng.randint(r + 2, IMAGE_SIZE - r - 2), rng.randint(r + 2, IMAGE_SIZE - r - 2))
        caption = i < caption_rows
        out.append(
            {
                "id": f"colors-{seed}-{i:06d}",
                "image": {"bytes": png_bytes(render_scene([obj], RADIUS)), "path": f"colors-{seed}-{i:06d}.png"},
                "question": CAPTION_QUESTION if caption else color_question(obj.shape),
                "answer": caption_text([obj]) if caption else color_answer(obj.color),
                "color": obj.color,
                "shape": obj.shape,
                "task": "caption" if caption else "color",
            }
        )
    return out


def color_question(shape: str) -> str:
    return f"What color is the {shape}?"


def color_answer(color: str) -> str:
    return f"The answer is {color}."


# builtin name -> (row generator, version keying its on-disk copy); ``data.source.builtin`` picks one
BUILTIN_GENERATORS = {"counting-shapes": (make_rows, VERSION), "shape-colors": (make_color_rows, COLORS_VERSION)}


def _generator(builtin: str):
    if builtin not in BUILTIN_GENERATORS:
        raise KeyError(f"no builtin dataset {builtin!r} (data.source.builtin); builtins: {', '.join(BUILTIN_GENERATORS)}")
    return BUILTIN_GENERATORS[builtin]


def write_builtin(out_dir: Path, builtin: str, rows: int, caption_rows: int = 0, seed: int = 0,
                  **options: Any) -> Path:
    """Write a builtin dataset as ``out_dir/data/train-00000-of-00001.parquet``; returns that file.
    ``options`` go to the generator (``make_rows``'s annotator)."""
    table = _generator(builtin)[0](rows, caption_rows, seed, **options)
    features = Features({
        key: ImageFeature() if key == "image" else Value("int32") if isinstance(value, int) else Value("string")
        for key, value in table[0].items()
    })
    dataset = Dataset.from_list(table, features=features)
    target = out_dir / "data" / "train-00000-of-00001.parquet"
    target.parent.mkdir(parents=True, exist_ok=True)
    # the table's schema metadata carries the datasets features, so the image column streams back as Image
    pq.write_table(dataset.data.table, target)
    return target


def write_counting_shapes(out_dir: Path, rows: int, caption_rows: int = 0, seed: int = 0) -> Path:
    """The counting dataset written by ``write_builtin``."""
    return write_builtin(out_dir, "counting-shapes", rows, caption_rows, seed)


def ensure_builtin(builtin: str, rows: int, caption_rows: int = 0, seed: int = 0, **options: Any) -> Path:
    """The parquet file of a builtin dataset, generated once into the stitch cache (atomically)."""
    version = _generator(builtin)[1]
    key = f"{builtin}-v{version}-r{rows}-c{caption_rows}-s{seed}"
    if options:
        key += "-" + hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:12]
    root = ensure_snapshot(f"dataset-{key}", lambda d: write_builtin(d, builtin, rows, caption_rows, seed, **options))
    return root / "data" / "train-00000-of-00001.parquet"


def ensure_counting_shapes(rows: int, caption_rows: int = 0, seed: int = 0) -> Path:
    return ensure_builtin("counting-shapes", rows, caption_rows, seed)


def builtin_parquet(source: BuiltinSource) -> Path:
    """The parquet file of a recipe's built-in source (``data.source.builtin``): what ``stitch.data.prepare``
    streams in place of user data."""
    return ensure_builtin(source.builtin, source.rows, source.caption_rows, source.seed, **source.generator_options())
