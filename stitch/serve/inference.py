"""Inference on a new input: the encoder runs once, the projector makes soft tokens, the adapter is merged
into the base weights with safetensors alone (or the LM's own trained weights replace the base's), and a rollout
engine generates from prompt embeddings."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel

from stitch.data.collator import Messages
from stitch.model.binding import ModelBinding
from stitch.model.lm_weights import LM_DIR, load_lm_weights
from stitch.model.merge import merge_adapter_into_model
from stitch.plugins.registry import Registry
from stitch.rollout.prompts import payload_for, prompt_embeddings
from stitch.runs.checkpoint import latest_step_dir, verify_checksums


def encode_item(spec: Any, encoder: Any, preprocess: Any, raw: Any) -> torch.Tensor:
    """One raw item's features [1, tokens, width] (fp32, CPU), preprocessed as ``stitch prepare`` does: through the
    encoder's ``load_preprocess`` function when it has one (e.g. CLIP's uint8 geometry, JPEG decoded by draft()),
    else ``decode_item`` + the encoder's own preprocessing."""
    if preprocess is not None:
        return encoder.encode(preprocess(raw)[None]).float().cpu()
    return encoder.encode([spec.decode_item(raw)]).float().cpu()


@dataclass
class ResolvedCheckpoint:
    step_dir: Path
    adapter_dir: Path | None  # None: the LM trained its own weights (lm_dir)
    projector_dir: Path
    lm_dir: Path | None = None  # the LM's trained weights (train_lm: full)

    def trained_lm(self, binding: ModelBinding) -> torch.nn.Module:
        """The base LM with this checkpoint's trained weights in it (``lm_dir``), the adapter not yet merged."""
        lm = binding.load_lm()
        if self.lm_dir is not None:
            load_lm_weights(lm, self.lm_dir)
        return lm


def resolve_checkpoint(path: Path) -> ResolvedCheckpoint:
    """PATH is a checkpoints root (LATEST is followed), one step directory, or one PEFT adapter directory
    (its projector artifact is the sibling ``projector/``)."""
    path = Path(path)
    if (path / "LATEST").is_file():
        step = latest_step_dir(path)
    elif (path / "adapter_config.json").is_file():
        step = path.parent
    elif (path / "adapter").is_dir() or (path / LM_DIR).is_dir():
        step = path
    else:
        raise FileNotFoundError(
            f"{path} is neither a checkpoints root (with LATEST), a step directory (with adapter/ or {LM_DIR}/), nor "
            f"a PEFT adapter directory (with adapter_config.json)"
        )
    verify_checksums(step)
    adapter = path if (path / "adapter_config.json").is_file() else step / "adapter"
    projector = step / "projector"
    if not (projector / "manifest.json").is_file():
        raise FileNotFoundError(f"no projector artifact at {projector} (expected beside the adapter)")
    return ResolvedCheckpoint(step, adapter if adapter.is_dir() else None, projector,
                              step / LM_DIR if (step / LM_DIR).is_dir() else None)


def merged_lm(resolved: ResolvedCheckpoint, binding: ModelBinding) -> torch.nn.Module:
    """The checkpoint's LM as a plain transformers model for export: its trained weights in, its adapter merged
    (peft's ``merge_and_unload``)."""
    lm = resolved.trained_lm(binding)
    if resolved.adapter_dir is None:
        return lm
    return PeftModel.from_pretrained(lm, str(resolved.adapter_dir)).merge_and_unload()


class Stitched:
    """A servable model: encoder + projector + merged LM, with the rollout prompt renderer. The model binding is
    resolved from what the projector artifact records (names, and the local base snapshot the run read, checked
    against its fingerprint), the same one the stages trained with."""

    def __init__(self, checkpoint: Path, registry: Registry, engine: str = "embedded",
                 device: str | None = None) -> None:
        self.checkpoint = resolve_checkpoint(checkpoint)
        manifest = json.loads((self.checkpoint.projector_dir / "manifest.json").read_text())
        self.binding = ModelBinding.for_artifact(manifest, f"checkpoint {self.checkpoint.step_dir}", registry,
                                                 device=device)
        lm = self.checkpoint.trained_lm(self.binding)
        adapter = self.checkpoint.adapter_dir
        self.merged_weights = 0 if adapter is None else merge_adapter_into_model(lm, adapter)
        lm.eval()
        # the projector artifact's provenance is checked against this binding as it loads
        self.model = self.binding.build_model(lm=lm, projector_from=self.checkpoint.projector_dir,
                                              train_projector=False).eval()
        self.engine = self.binding.registry.get("rollout_engines", engine).factory(
            lm, pad_id=self.binding.pad_id, eos_id=self.tokenizer.eos_token_id, suppress_ids=self.binding.suppress_ids)
        self._encoder = None
        self._preprocess = None

    @property
    def tokenizer(self) -> Any:
        return self.binding.tokenizer

    @property
    def encoder_spec(self) -> Any:
        return self.binding.encoder_spec

    @property
    def model_spec(self) -> Any:
        return self.binding.model_spec

    @property
    def device(self) -> torch.device:
        return self.binding.device

    def prompt_text(self, question: str | Messages, num_items: int = 1) -> str:
        return self.binding.prompt_text(question, num_items)

    def encode(self, raw: Any) -> torch.Tensor:
        spec = self.encoder_spec
        if self._encoder is None:
            self._encoder = spec.load(spec.source, device=self.device)
            # the preprocessing stitch prepare ran for the training features (e.g. CLIP's uint8 geometry with
            # JPEG draft decoding), so a served image is encoded as the training images were
            self._preprocess = spec.preprocess()
        return encode_item(spec, self._encoder, self._preprocess, raw)

    @torch.no_grad()
    def answer(self, raw: Any, question: str | Messages, max_new_tokens: int = 24) -> str:
        """Greedy answer about one raw item, or a list of them (each goes where its ``<image>`` marker stands in
        ``question``, a text or a whole conversation history ending with the user's turn)."""
        items = list(raw) if isinstance(raw, list | tuple) else [raw]
        features = torch.cat([self.encode(item) for item in items])
        return self.answer_features(features, question, max_new_tokens)

    @torch.no_grad()
    def answer_features(self, features: torch.Tensor, question: str | Messages, max_new_tokens: int = 24) -> str:
        """Greedy answer from already-encoded features ``[items, tokens, width]`` (e.g. the feature cache), the
        prompt rendered from ``question`` (a text or a conversation history) as rollouts render it."""

        payload = payload_for(self.binding.registry, self.encoder_spec)
        ids = self.binding.prompt_ids(question, features.shape[0])
        (embeds,) = prompt_embeddings(payload, self.model, [("input", ids, features)])
        (completion,) = self.engine.generate([embeds], 1, max_new_tokens, greedy=True)
        return self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
