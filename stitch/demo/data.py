"""The embedded demo datasets: deterministic synthetic shape scenes, asking for the count (in the spirit of
CLEVR-Math) or for the colour of a single shape.

Each is written to disk as a real parquet dataset (image column = ``{bytes, path}``) and read back through
``datasets.load_dataset(..., streaming=True)``, so the default takes the same path as user data.
"""

from __future__ import annotations

import io
import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

from stitch.demo.tiny import CAPTION_QUESTION, COLORS, COUNT_QUESTION, SHAPES, SIZES, answer_text

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
MAX_OBJECTS = 5
VERSION = 1  # bump when the rendering or the row layout changes: it keys the on-disk copy
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


def sample_scene(rng: random.Random) -> list[SceneObject]:
    """1-5 non-overlapping objects with random shape, color, size and position."""
    count = rng.randint(1, MAX_OBJECTS)
    objects: list[SceneObject] = []
    while len(objects) < count:
        size = rng.choice(SIZES)
        r = RADIUS[size]
        x, y = rng.randint(r + 2, IMAGE_SIZE - r - 2), rng.randint(r + 2, IMAGE_SIZE - r - 2)
        if all((x - o.x) ** 2 + (y - o.y) ** 2 > (r + RADIUS[o.size] + 4) ** 2 for o in objects):
            objects.append(SceneObject(rng.choice(SHAPES), rng.choice(COLORS), size, x, y))
    return objects


def render_scene(objects: list[SceneObject]) -> Image.Image:
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for o in objects:
        r, fill = RADIUS[o.size], RGB[o.color]
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
    image.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def make_rows(rows: int, caption_rows: int = 0, seed: int = 0) -> list[dict]:
    """Rows ``0..caption_rows-1`` ask for a caption (alignment); the rest ask for the count (SFT/GRPO).

    Each row's scene depends only on ``(seed, index)``, so a longer dataset extends a shorter one.
    """
    out = []
    for i in range(rows):
        objects = sample_scene(random.Random(f"counting-shapes:{seed}:{i}"))
        caption = i < caption_rows
        out.append(
            {
                "id": f"shapes-{seed}-{i:06d}",
                "image": {"bytes": png_bytes(render_scene(objects)), "path": f"shapes-{seed}-{i:06d}.png"},
                "question": CAPTION_QUESTION if caption else COUNT_QUESTION,
                "answer": caption_text(objects) if caption else answer_text(len(objects)),
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
                "image": {"bytes": png_bytes(render_scene([obj])), "path": f"colors-{seed}-{i:06d}.png"},
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


def write_builtin(out_dir: Path, builtin: str, rows: int, caption_rows: int = 0, seed: int = 0) -> Path:
    """Write a builtin dataset as ``out_dir/data/train-00000-of-00001.parquet``; returns that file."""
    import pyarrow.parquet as pq
    from datasets import Dataset, Features, Value
    from datasets import Image as ImageFeature

    table = _generator(builtin)[0](rows, caption_rows, seed)
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


def ensure_builtin(builtin: str, rows: int, caption_rows: int = 0, seed: int = 0) -> Path:
    """The parquet file of a builtin dataset, generated once into the stitch cache (atomically)."""
    from stitch.model.snapshots import ensure_snapshot

    version = _generator(builtin)[1]
    key = f"{builtin}-v{version}-r{rows}-c{caption_rows}-s{seed}"
    root = ensure_snapshot(f"dataset-{key}", lambda d: write_builtin(d, builtin, rows, caption_rows, seed))
    return root / "data" / "train-00000-of-00001.parquet"


def ensure_counting_shapes(rows: int, caption_rows: int = 0, seed: int = 0) -> Path:
    return ensure_builtin("counting-shapes", rows, caption_rows, seed)
