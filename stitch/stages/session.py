"""Everything a stage resolves once from a recipe: specs, tokenizer, sentinels, prepared data, and how to
build, save and restore the trainable model (projector + optional LoRA adapter)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stitch.config.recipe import Recipe
from stitch.data.feature_cache import ManifestRow, PreparedData
from stitch.data.packing import Sample
from stitch.data.sentinels import SentinelIds, resolve_sentinels
from stitch.model.loading import load_model, load_tokenizer
from stitch.plugins.host import PluginHost, get_host
from stitch.plugins.specs import EncoderSpec, ModelSpec


@dataclass
class StitchSession:
    recipe: Recipe
    out_dir: Path
    host: PluginHost
    model_spec: ModelSpec
    encoder_spec: EncoderSpec
    tokenizer: Any
    sentinel_ids: SentinelIds
    data: PreparedData
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def open(cls, recipe: Recipe, out_dir: Path, dtype: torch.dtype = torch.float32,
             device: str | None = None) -> StitchSession:
        """Resolve the recipe's registrations and the prepared data before any model weights load."""
        host = get_host()
        model_spec = host.get("models", recipe.model)
        encoder_spec = host.get("encoders", recipe.encoder)
        host.get("projectors", recipe.projector)
        data_dir = Path(out_dir) / "data"
        if not (data_dir / "manifest.jsonl").is_file():
            raise FileNotFoundError(
                f"{data_dir / 'manifest.jsonl'} does not exist: run `stitch prepare --recipe {recipe.name} "
                f"--out {data_dir}` first"
            )
        tokenizer = load_tokenizer(model_spec)
        sentinel_ids = resolve_sentinels(host.get("token_sentinels", model_spec.sentinels), tokenizer)
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        return cls(recipe, Path(out_dir), host, model_spec, encoder_spec, tokenizer, sentinel_ids,
                   PreparedData(data_dir), dtype, dev)

    @property
    def manifest_path(self) -> Path:
        return self.data.manifest_path

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.tokenizer.eos_token_id

    # -- warm start --------------------------------------------------------------------------------
    def checked_sft_donor(self, stage: str, lora: dict[str, Any] | None = None) -> Path:
        """SFT's latest step, after the provenance gate (run before any model weights load).

        ``lora`` is what this stage restates (rank, alpha); by default the recipe's SFT adapter settings.
        """
        from stitch.model.provenance import check_warm_start
        from stitch.runs.checkpoint import latest_step_dir
        from stitch.stages.supervised import StageOptions

        donor = latest_step_dir(self.out_dir / "sft" / "checkpoints")
        if donor is None:
            raise FileNotFoundError(
                f"{stage} warm-starts from SFT, but {self.out_dir / 'sft' / 'checkpoints'} has no LATEST; "
                f"run `stitch train sft --recipe {self.recipe.name} --out {self.out_dir}` first"
            )
        lora = lora or StageOptions.from_recipe(self.recipe, "sft").lora
        check_warm_start(donor, {
            "lora_r": int(lora.get("r", 16)),
            "lora_alpha": int(lora.get("alpha", 32)),
            "target_modules": list(self.model_spec.lora_target_modules),
            "base_model": self.model_spec.name,
            "feature_width": self.encoder_spec.feature_width,
            "tokens_per_item": self.encoder_spec.tokens_per_item,
            "sentinel_ids": self.sentinel_ids.as_dict(),
            "projector_type": self.recipe.projector,
        })
        return donor

    # -- samples -----------------------------------------------------------------------------------
    def make_sample(self, record: dict[str, Any]) -> Sample:
        from stitch.data.collator import tokenize_example

        row = ManifestRow.from_json(record, str(self.manifest_path))
        input_ids, labels = tokenize_example(
            self.tokenizer, row.messages, self.sentinel_ids, self.encoder_spec.tokens_per_item, row.num_items
        )
        features = self.data.features(row)
        return Sample(row.id, input_ids, labels, features)

    def prompt_ids(self, question: str, num_items: int = 1) -> list[int]:
        from stitch.data.collator import render_prompt

        text = render_prompt(self.tokenizer, question, self.sentinel_ids, self.encoder_spec.tokens_per_item, num_items)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    # -- model -------------------------------------------------------------------------------------
    def build_model(
        self,
        *,
        stage: str,
        lora: dict[str, Any] | None = None,
        projector_from: Path | None = None,
        adapter_from: Path | None = None,
        train_projector: bool = True,
        train_adapter: bool = True,
    ):
        """Frozen LM (+ LoRA when ``lora`` or ``adapter_from``), projector (fresh or warm-started)."""
        from stitch.model.stitched import StitchedModel

        lm = load_model(self.model_spec, dtype=self.dtype)
        lm.requires_grad_(False)
        hidden = lm.config.get_text_config().hidden_size
        projector = self.host.get("projectors", self.recipe.projector).build(self.encoder_spec.feature_width, hidden)
        projector = projector.to(self.dtype)
        if projector_from is not None:
            self.load_projector(projector, projector_from, hidden)
        projector.requires_grad_(train_projector)
        if adapter_from is not None:
            from peft import PeftModel

            lm = PeftModel.from_pretrained(lm, str(adapter_from), is_trainable=train_adapter)
        elif lora is not None:
            from peft import LoraConfig, get_peft_model

            config = LoraConfig(
                r=int(lora.get("r", 16)),
                lora_alpha=int(lora.get("alpha", 32)),
                lora_dropout=float(lora.get("dropout", 0.0)),
                target_modules=list(self.model_spec.lora_target_modules),
                target_parameters=list(self.model_spec.lora_target_parameters) or None,
                bias="none",
            )
            lm = get_peft_model(lm, config)
        model = StitchedModel(lm, projector, self.sentinel_ids.placeholder).to(self.device)
        return model

    def projector_provenance(self, hidden: int, stage: str) -> dict[str, Any]:
        enc = self.encoder_spec.source.identity()
        base = self.model_spec.source.identity()
        return {
            "encoder": self.encoder_spec.name,
            "encoder_id": enc["id"],
            "encoder_revision": enc["revision"],
            "feature_width": self.encoder_spec.feature_width,
            "tokens_per_item": self.encoder_spec.tokens_per_item,
            "projector_type": self.recipe.projector,
            "base_model": self.model_spec.name,
            "base_model_id": base["id"],
            "base_model_revision": base["revision"],
            "hidden_size": hidden,
            "sentinel_ids": self.sentinel_ids.as_dict(),
            "stage": stage,
        }

    def load_projector(self, projector: torch.nn.Module, path: Path, hidden: int) -> None:
        from stitch.model.artifacts import load_projector_artifact

        expected = self.projector_provenance(hidden, stage="*")
        expected.pop("stage")
        state = load_projector_artifact(path, expected)
        projector.load_state_dict(state)

    def save_trainable(self, model: Any, step_dir: Path, stage: str) -> None:
        from stitch.model.artifacts import save_projector_artifact

        hidden = model.lm.config.get_text_config().hidden_size
        save_projector_artifact(step_dir / "projector", model.projector, self.projector_provenance(hidden, stage))
        if hasattr(model.lm, "peft_config"):
            model.lm.save_pretrained(str(step_dir / "adapter"), safe_serialization=True)
            # record the target set peft actually resolved (not a pattern), so a warm start can compare it
            cfg_path = step_dir / "adapter" / "adapter_config.json"
            cfg = json.loads(cfg_path.read_text())
            resolved = resolved_lora_targets(model.lm)
            configured = set(cfg.get("target_modules") or [])
            if configured and resolved != {t.split(".")[-1] for t in configured} and resolved != configured:
                raise RuntimeError(f"LoRA wrapped {sorted(resolved)}, but the model plugin asked for {sorted(configured)}")
            cfg_path.write_text(json.dumps(cfg, indent=2))

    def load_trainable(self, model: Any, step_dir: Path) -> None:
        """Restore projector and adapter tensors saved by ``save_trainable`` (for an exact resume)."""
        hidden = model.lm.config.get_text_config().hidden_size
        self.load_projector(model.projector, step_dir / "projector", hidden)
        if hasattr(model.lm, "peft_config"):
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            state = load_file(str(step_dir / "adapter" / "adapter_model.safetensors"))
            result = set_peft_model_state_dict(model.lm, state)
            if result.unexpected_keys:
                raise RuntimeError(f"{step_dir / 'adapter'}: unexpected adapter keys {result.unexpected_keys[:5]}")


def resolved_lora_targets(peft_model: Any) -> set[str]:
    """Module-name suffixes that actually carry LoRA weights (e.g. q_proj, in_proj)."""
    names = set()
    for name, _ in peft_model.named_parameters():
        if ".lora_A." in name:
            names.add(name.split(".lora_A.")[0].split(".")[-1])
    return names
