"""Inference on a new input: the encoder runs once, the projector makes soft tokens, the adapter is merged
into the base weights with safetensors alone, and a rollout engine generates from prompt embeddings."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stitch.model.merge import merge_adapter_into_model
from stitch.runs.checkpoint import latest_step_dir


@dataclass
class ResolvedCheckpoint:
    step_dir: Path
    adapter_dir: Path
    projector_dir: Path


def resolve_checkpoint(path: Path) -> ResolvedCheckpoint:
    """PATH is a checkpoints root (LATEST is followed), one step directory, or one PEFT adapter directory
    (its projector artifact is the sibling ``projector/``)."""
    path = Path(path)
    if (path / "LATEST").is_file():
        step = latest_step_dir(path)
    elif (path / "adapter_config.json").is_file():
        step = path.parent
    elif (path / "adapter").is_dir():
        step = path
    else:
        raise FileNotFoundError(
            f"{path} is neither a checkpoints root (with LATEST), a step directory (with adapter/), nor a PEFT "
            f"adapter directory (with adapter_config.json)"
        )
    adapter = path if (path / "adapter_config.json").is_file() else step / "adapter"
    projector = step / "projector"
    if not (projector / "manifest.json").is_file():
        raise FileNotFoundError(f"no projector artifact at {projector} (expected beside the adapter)")
    return ResolvedCheckpoint(step, adapter, projector)


class Stitched:
    """A servable model: encoder + projector + merged LM, with the rollout prompt renderer."""

    def __init__(self, checkpoint: Path, engine: str = "embedded", device: str | None = None) -> None:
        from stitch.data.sentinels import resolve_sentinels
        from stitch.model.loading import load_model, load_tokenizer
        from stitch.model.stitched import StitchedModel
        from stitch.plugins.host import get_host

        self.checkpoint = resolve_checkpoint(checkpoint)
        manifest = json.loads((self.checkpoint.projector_dir / "manifest.json").read_text())
        host = get_host()
        self.host = host
        self.model_spec = host.get("models", manifest["base_model"])
        self.encoder_spec = host.get("encoders", manifest["encoder"])
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer = load_tokenizer(self.model_spec)
        self.sentinel_ids = resolve_sentinels(host.get("token_sentinels", self.model_spec.sentinels), self.tokenizer)
        lm = load_model(self.model_spec)
        self.merged_weights = merge_adapter_into_model(lm, self.checkpoint.adapter_dir)
        lm.requires_grad_(False).eval()
        hidden = lm.config.get_text_config().hidden_size
        projector = host.get("projectors", manifest["projector_type"]).build(self.encoder_spec.feature_width, hidden)
        from stitch.model.artifacts import load_projector_artifact

        expected = {k: manifest[k] for k in ("encoder", "feature_width", "tokens_per_item", "base_model",
                                              "hidden_size", "sentinel_ids")}
        expected["hidden_size"] = hidden
        expected["sentinel_ids"] = self.sentinel_ids.as_dict()
        projector.load_state_dict(load_projector_artifact(self.checkpoint.projector_dir, expected))
        self.model = StitchedModel(lm, projector.eval(), self.sentinel_ids.placeholder).to(self.device)
        self.engine = host.get("rollout_engines", engine).factory(
            lm, pad_id=self._pad_id(), eos_id=self.tokenizer.eos_token_id,
            suppress_ids=list(self.sentinel_ids.as_dict().values()))
        self._encoder = None

    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.tokenizer.eos_token_id

    def prompt_text(self, question: str, num_items: int = 1) -> str:
        from stitch.data.collator import render_prompt

        return render_prompt(self.tokenizer, question, self.sentinel_ids, self.encoder_spec.tokens_per_item,
                             num_items)

    def encode(self, raw: Any) -> torch.Tensor:
        if self._encoder is None:
            self._encoder = self.encoder_spec.load(self.encoder_spec.source, device=self.device)
        return self._encoder.encode([self.encoder_spec.decode_item(raw)]).float().cpu()

    @torch.no_grad()
    def answer(self, raw: Any, question: str, max_new_tokens: int = 24) -> str:
        return self.answer_features(self.encode(raw), question, max_new_tokens)

    @torch.no_grad()
    def answer_features(self, features: torch.Tensor, question: str, max_new_tokens: int = 24) -> str:
        """Greedy answer from already-encoded features ``[items, tokens, width]`` (e.g. the feature cache)."""
        ids = self.tokenizer(self.prompt_text(question, features.shape[0]), add_special_tokens=False)["input_ids"]
        embeds = self.model.embed(torch.tensor([ids], device=self.device), features.to(self.device), ["input"])[0]
        (completion,) = self.engine.generate([embeds], 1, max_new_tokens, greedy=True)
        return self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
