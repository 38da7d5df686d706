"""CPU check: how far CLIP features move when a JPEG is decoded by ``draft()`` (what ``stitch prepare``'s workers do,
``stitch_clip.encoder.ClipGeometry``) rather than in full, on a ViT-B/32-shaped random tower (12 layers, width 768)
in fp32, against CLIPImageProcessor (PIL backend) on the full decode -> ``hidden_states[-2]``. The same geometry
without draft is printed as the control (it must give 0).

    PYTHONPATH=. python benchmarks/jpeg_draft_check.py        # ~20 s on one core
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_prepare_fast import photo_bytes  # noqa: E402

from stitch_clip.encoder import ClipGeometry, clip_geometry, decode_image  # noqa: E402


class FullDecode(ClipGeometry):
    """ClipGeometry's resize and crop on the full decode (no draft)."""

    def __call__(self, value: object) -> torch.Tensor:
        image = decode_image(value)
        w, h = image.size
        edge = self.shortest_edge
        size = (edge, int(edge * h / w)) if w <= h else (int(edge * w / h), edge)
        image = image.resize(size, resample=self.resample)
        (ch, cw), (w, h) = self.crop, size
        top, left = (h - ch) // 2, (w - cw) // 2
        image = image.crop((left, top, left + cw, top + ch))
        return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).contiguous()


def main() -> None:
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    config = CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                              image_size=224, patch_size=32)
    model = CLIPVisionModel(config).eval()
    processor = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224},
                                   image_mean=[0.48145466, 0.4578275, 0.40821073],
                                   image_std=[0.26862954, 0.26130258, 0.27577711])
    draft = clip_geometry(processor)
    full = FullDecode(draft.shortest_edge, draft.crop, draft.resample)
    raws = [photo_bytes(640, 480, "JPEG", seed=i) for i in range(6)]
    mean = torch.tensor(processor.image_mean)[:, None, None]
    std = torch.tensor(processor.image_std)[:, None, None]

    def features(pixels: torch.Tensor) -> torch.Tensor:
        return model(pixel_values=pixels, output_hidden_states=True).hidden_states[-2][:, 1:]

    with torch.no_grad():
        reference = features(processor(images=[decode_image(r) for r in raws], return_tensors="pt")["pixel_values"])
        for name, geometry in (("draft", draft), ("full decode", full)):
            got = features(torch.stack([(geometry(r).float() / 255 - mean) / std for r in raws]))
            rel = ((got - reference).flatten(1).norm(dim=1) / reference.flatten(1).norm(dim=1)).max()
            cos = torch.nn.functional.cosine_similarity(got.flatten(1), reference.flatten(1)).min()
            print(f"{name:12s} max relative L2 {float(rel):.5f}  min cosine {float(cos):.6f}")


if __name__ == "__main__":
    main()
