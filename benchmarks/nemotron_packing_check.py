"""Nemotron-H through stitch's own session (load_nemotron_h swaps in the fla Mamba-2 mixers on a GPU): the loss of
one packed row equals the loss of the same samples unpadded one per row, pack by pack.

    python3 -P benchmarks/nemotron_packing_check.py RECIPE RUN_DIR   (RUN_DIR holds a prepared data/ folder)

On CPU (stock mixers) the two differ by ~1e-4 relative: the Mamba-2 state leaks across the packed samples.
"""

import sys
from pathlib import Path

import torch

from stitch.config.recipe import load_recipe
from stitch.data.packing import PackedStream, collate_packs
from stitch.stages.session import StitchSession

recipe = load_recipe(Path(sys.argv[1]))
session = StitchSession.open(recipe, Path(sys.argv[2]))
print("packs():", session.model_spec.packs())
model = session.build_model(stage="sft", lora={"r": 4, "alpha": 8})
print("varlen:", getattr(model.lm.get_base_model(), "stitch_varlen", None), "device:", model.device)
torch.manual_seed(1)
with torch.no_grad():
    for p in model.parameters():
        if p.requires_grad:
            p.normal_(0, 0.05)
stream = PackedStream(session.manifest_path, session.make_sample, token_budget=512, buffer_size=64, seed=0, pack=True,
                      rows=lambda row: row["partition"] == "train")
for _ in range(3):
    pack = stream.next_pack()
    packed = collate_packs([pack], session.pad_id, packed=True, length=512).to(session.device)
    unpacked = collate_packs([[s] for s in pack], session.pad_id, packed=False).to(session.device)
    with torch.no_grad():
        lp, n_p = model.loss(packed)
        lu, n_u = model.loss(unpacked)
    print(f"samples {len(pack)} labelled {n_p}/{n_u} packed {float(lp):.6f} unpacked {float(lu):.6f} rel {abs(float(lp)-float(lu))/float(lu):.2e}")
