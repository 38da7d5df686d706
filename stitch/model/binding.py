"""The model binding: what a recipe (or a checkpoint's manifest) resolves to once — model and encoder specs,
tokenizer, sentinel ids, projector type — and how to build, save and restore the trainable model (projector +
optional LoRA adapter, or the LM's own trained weights) with its provenance. Stages, distributed saving and
inference share it."""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file

from stitch.config.options import LoraOptions
from stitch.config.recipe import Recipe
from stitch.data.collator import Messages, prompt_token_ids, render_prompt
from stitch.data.sentinels import SentinelError, SentinelIds, resolve_sentinels
from stitch.model.artifacts import check_provenance, load_projector_artifact, save_projector_artifact
from stitch.model.lm_weights import (
    LM_DIR,
    load_lm_weights,
    save_lm_weights,
    selected_parameters,
    trained_lm_state,
    unfreeze,
)
from stitch.model.loading import (
    BackendError,
    SnapshotError,
    load_model,
    load_tokenizer,
    refused_by_backend,
    source_fingerprint,
    with_backend,
    with_local_snapshot,
)
from stitch.model.stitched import StitchedModel
from stitch.plugins.registry import Registry
from stitch.plugins.specs import EncoderSpec, ModelSpec


@contextlib.contextmanager
def _quiet_peft_wrap() -> Iterator[None]:
    """peft reads transformers' deprecated ``is_gradient_checkpointing`` while it wraps a model: that FutureWarning
    is peft's to act on, not the user's, so it is not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


@dataclass
class ModelBinding:
    registry: Registry  # the projectors, payloads and engines the stages build by name
    model_spec: ModelSpec
    encoder_spec: EncoderSpec
    projector_type: str
    tokenizer: Any
    sentinel_ids: SentinelIds
    dtype: torch.dtype
    device: torch.device
    # the local snapshot directory (a recipe's model.snapshot) the spec reads from instead of its registered source;
    # provenance records it, so serving, export and Ray workers read the same base
    snapshot: Path | None = None

    @classmethod
    def resolve(cls, registry: Registry, model: str, encoder: str, projector: str, dtype: torch.dtype = torch.float32,
                device: str | torch.device | None = None, snapshot: Path | str | None = None,
                backend: str = "transformers") -> ModelBinding:
        """Look up the registrations by name and load the tokenizer (no model weights load here); ``snapshot``: a
        local snapshot directory the model is read from instead of its source; ``backend``: the LM implementation
        (``ModelSpec.backends``); both checked here, before any load."""
        model_spec = with_backend(registry.get("models", model), backend)
        if snapshot is not None:
            model_spec = with_local_snapshot(model_spec, snapshot)
            snapshot = Path(snapshot).resolve()
        return cls.for_spec(registry, model_spec, encoder, projector, dtype, device, snapshot=snapshot)

    @classmethod
    def for_artifact(cls, manifest: dict[str, Any], where: str, registry: Registry,
                     dtype: torch.dtype = torch.float32, device: str | torch.device | None = None) -> ModelBinding:
        """The binding a projector artifact's ``manifest`` was trained with: its registered names and the local
        snapshot it recorded, which must still be at that path and hold the same base (its fingerprint); both are
        checked here, before any model weights load. ``where`` names the artifact in errors."""
        snapshot = manifest.get("base_model_snapshot")
        if snapshot is not None and not Path(snapshot).is_dir():
            raise SnapshotError(
                f"{where}: model {manifest['base_model']!r} was trained from the local snapshot {snapshot!r}, which "
                f"is not there any more (moved or deleted); put that snapshot back at {snapshot!r} to serve, export "
                f"or evaluate this checkpoint (another base would not match the trained projector and adapter)")
        backend = manifest.get("base_model_backend", "transformers")
        if backend != "transformers":
            raise BackendError(
                f"{where}: trained on model.backend {backend!r}; serving, export and evaluation load the checkpoint "
                f"on the transformers backend, which can generate, and this backend's adapter key names (e.g. "
                f"'shared_experts') are not mapped to it yet. Train on model.backend: transformers to serve or export "
                f"the result")
        binding = cls.resolve(registry, manifest["base_model"], manifest["encoder"], manifest["projector_type"], dtype,
                              device, snapshot=snapshot)
        check_provenance(manifest, binding.base_identity(), where)
        return binding

    @classmethod
    def for_spec(cls, registry: Registry, model_spec: ModelSpec, encoder: str, projector: str,
                 dtype: torch.dtype = torch.float32, device: str | torch.device | None = None,
                 snapshot: Path | None = None) -> ModelBinding:
        """``resolve`` for a model spec already in hand (e.g. one pointed at the local snapshot ``snapshot``)."""
        encoder_spec = registry.get("encoders", encoder)
        registry.get("projectors", projector)
        tokenizer = load_tokenizer(model_spec)
        # a video encoder's clips are bracketed by the family's video sentinels, behind the <video> marker
        layout = registry.get("token_sentinels", model_spec.sentinels).for_modality(encoder_spec.modality)
        sentinel_ids = resolve_sentinels(layout, tokenizer)
        control = {"pad": tokenizer.pad_token_id, "eos": tokenizer.eos_token_id}
        clash = {role: name for role, i in sentinel_ids.as_dict().items() for name, c in control.items() if i == c}
        if clash:  # a placeholder equal to pad would be masked as padding; equal to eos, it would end every prompt
            raise SentinelError(f"model {model_spec.name!r}: sentinel(s) {clash} are the tokenizer's own control "
                                f"tokens (ids {control}) in {model_spec.source.describe()}; this tokenizer redefined "
                                f"them, so pick other sentinels or restore its pad/eos tokens")
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        return cls(registry, model_spec, encoder_spec, projector, tokenizer, sentinel_ids, dtype, dev, snapshot)

    @classmethod
    def for_recipe(cls, recipe: Recipe, registry: Registry, dtype: torch.dtype = torch.float32,
                   device: str | torch.device | None = None) -> ModelBinding:
        """``resolve`` for a recipe's model, encoder, projector, local snapshot and backend; refuses a stage the
        backend cannot run."""
        backend = getattr(recipe, "model_backend", "transformers")
        binding = cls.resolve(registry, recipe.model, recipe.encoder, recipe.projector, dtype, device,
                              snapshot=getattr(recipe, "model_snapshot", None), backend=backend)
        check_stages_fit_backend(recipe, binding.model_spec)
        return binding

    # -- text --------------------------------------------------------------------------------------
    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.tokenizer.eos_token_id

    @property
    def suppress_ids(self) -> list[int]:
        """Media sentinels: an engine must never sample them."""
        return list(self.sentinel_ids.as_dict().values())

    def prompt_text(self, question: str | Messages, num_items: int = 1) -> str:
        return render_prompt(self.tokenizer, question, self.sentinel_ids, self.encoder_spec.tokens_per_item, num_items)

    def prompt_ids(self, question: str | Messages, num_items: int = 1) -> list[int]:
        """The prompt's token ids of a question or a whole conversation history: its text stays text (a sentinel it
        spells is not a control token)."""
        return prompt_token_ids(self.tokenizer, question, self.sentinel_ids, self.encoder_spec.tokens_per_item,
                                num_items)

    # -- model -------------------------------------------------------------------------------------
    def load_lm(self) -> torch.nn.Module:
        """The frozen base LM in the binding's dtype."""
        lm = load_model(self.model_spec, dtype=self.dtype, registry=self.registry)
        lm.requires_grad_(False)
        return lm

    def build_projector(self, hidden: int) -> torch.nn.Module:
        projector = self.registry.get("projectors", self.projector_type).build(self.encoder_spec.feature_width, hidden)
        return projector.to(self.dtype)

    def build_model(
        self,
        *,
        lora: LoraOptions | dict[str, Any] | None = None,
        projector_from: Path | None = None,
        adapter_from: Path | None = None,
        train_projector: bool = True,
        train_adapter: bool = True,
        lm: torch.nn.Module | None = None,
        full_lm: bool = False,
        lm_layers: list[int | str] | None = None,
        lm_layers_field: str = "train_lm_layers",
        place: bool = True,
    ) -> Any:
        """Frozen LM (+ a new LoRA from ``lora`` or the PEFT adapter at ``adapter_from``), projector (fresh or from
        the artifact at ``projector_from``), on the binding's device (``place``; else left where it loaded).
        ``full_lm``: the LM's own weights train, all of them or ``lm_layers`` (``selected_parameters``; refusals
        name ``lm_layers_field``). ``lm``: an already loaded base (inference passes one with the adapter merged
        in)."""
        lm = self.load_lm() if lm is None else lm
        if full_lm:
            unfreeze(lm, selected_parameters(lm, lm_layers, lm_layers_field))
        hidden = hidden_size(lm)
        projector = self.build_projector(hidden)
        projector.requires_grad_(train_projector)
        if adapter_from is not None:
            with _quiet_peft_wrap():
                lm = PeftModel.from_pretrained(lm, str(adapter_from), is_trainable=train_adapter)
        elif lora is not None:
            lora = lora if isinstance(lora, LoraOptions) else LoraOptions.model_validate(lora)
            config = LoraConfig(
                r=lora.r,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=list(self.model_spec.lora_target_modules),
                target_parameters=list(self.model_spec.lora_target_parameters) or None,
                bias="none",
            )
            with _quiet_peft_wrap():
                lm = get_peft_model(lm, config)
        model = StitchedModel(lm, projector, self.sentinel_ids.placeholder, self.model_spec.cuda_graphs)
        if projector_from is not None:  # after StitchedModel gave a half-precision projector its fp32 master weights,
            # so a saved fp32 master loads exactly instead of rounded to the LM's dtype
            self.load_projector(model.projector, projector_from, hidden)
        if not place or any(p.is_meta for p in model.parameters()):  # meta: a rank that receives its shards later
            return model
        return model.to(self.device)

    # -- provenance --------------------------------------------------------------------------------
    @cached_property
    def base_fingerprint(self) -> str | None:
        """The base snapshot's identity (``stitch.model.loading.snapshot_fingerprint``; None for a hub source, whose
        pinned revision is its identity). Computing it may build a tiny preset, as loading it would."""
        return source_fingerprint(self.model_spec.source)

    def base_identity(self) -> dict[str, Any]:
        """What provenance records about the base LM beyond its registered name: where it was read from and what
        it held."""
        base = self.model_spec.source.identity()
        return {
            "base_model_id": base["id"],
            "base_model_revision": base["revision"],
            "base_model_snapshot": str(self.snapshot) if self.snapshot is not None else None,
            "base_model_fingerprint": self.base_fingerprint,
            # the LM implementation the adapter was trained on: its module names are the adapter's key names
            "base_model_backend": self.model_spec.backend,
        }

    def provenance(self, hidden: int, stage: str) -> dict[str, Any]:
        """What a projector artifact records about the run that wrote it."""
        enc = self.encoder_spec.source.identity()
        return {
            "encoder": self.encoder_spec.name,
            "encoder_id": enc["id"],
            "encoder_revision": enc["revision"],
            "feature_width": self.encoder_spec.feature_width,
            "tokens_per_item": self.encoder_spec.tokens_per_item,
            "projector_type": self.projector_type,
            "base_model": self.model_spec.name,
            **self.base_identity(),
            "hidden_size": hidden,
            "sentinel_ids": self.sentinel_ids.as_dict(),
            "stage": stage,
        }

    def warm_start_expectations(self, lora: LoraOptions) -> dict[str, Any]:
        """What the provenance gate (stitch.model.provenance.check_warm_start) compares a donor against."""
        return {
            "lora_r": lora.r,
            "lora_alpha": lora.alpha,
            "target_modules": list(self.model_spec.lora_target_modules),
            "base_model": self.model_spec.name,
            "base_model_fingerprint": self.base_fingerprint,
            "feature_width": self.encoder_spec.feature_width,
            "tokens_per_item": self.encoder_spec.tokens_per_item,
            "sentinel_ids": self.sentinel_ids.as_dict(),
            "projector_type": self.projector_type,
        }

    # -- artifacts ---------------------------------------------------------------------------------
    def load_projector(self, projector: torch.nn.Module, path: Path, hidden: int) -> None:
        """Projector weights from an artifact whose provenance matches this binding (any stage wrote it)."""
        expected = self.provenance(hidden, stage="*")
        expected.pop("stage")
        projector.load_state_dict(load_projector_artifact(path, expected))

    def save_trainable(self, model: Any, step_dir: Path, stage: str,
                       state: dict[str, torch.Tensor] | None = None) -> None:
        """``step_dir/projector`` (artifact + provenance) and, with LoRA, ``step_dir/adapter`` (plain PEFT).

        ``state``: full tensors keyed like ``model.named_parameters()`` (gathered from FSDP shards); None reads the
        live module."""
        hidden = hidden_size(model.lm)
        projector: Any = model.projector
        if state is not None:
            projector = {k.removeprefix("projector."): v for k, v in state.items() if k.startswith("projector.")}
        save_projector_artifact(step_dir / "projector", projector, self.provenance(hidden, stage))
        lm_state = None if state is None else {k.removeprefix("lm."): v for k, v in state.items() if k.startswith("lm.")}
        own = trained_lm_state(model.lm)  # the live tensors, or under FSDP the names of the gathered ones
        if lm_state is not None:  # the gathered state also holds buffers: keep the trained weights only
            own = {k: v for k, v in lm_state.items() if k in own}
        if own:  # train_lm: full: the LM's trained weights, beside the projector
            save_lm_weights(own, step_dir / LM_DIR)
        if not hasattr(model.lm, "peft_config"):
            return
        model.lm.save_pretrained(str(step_dir / "adapter"), safe_serialization=True, state_dict=lm_state)
        # the warm-start gate compares target sets: the resolved one must be what the model plugin asked for
        cfg = json.loads((step_dir / "adapter" / "adapter_config.json").read_text())
        if isinstance(cfg.get("target_modules"), list):  # peft writes a set in hash order: bytes varied per process
            cfg["target_modules"] = sorted(cfg["target_modules"])
            (step_dir / "adapter" / "adapter_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
        resolved = resolved_lora_targets(model.lm)
        configured = set(cfg.get("target_modules") or [])
        if configured and resolved != {t.split(".")[-1] for t in configured} and resolved != configured:
            raise RuntimeError(f"LoRA wrapped {sorted(resolved)}, but the model plugin asked for {sorted(configured)}")

    def load_trainable(self, model: Any, step_dir: Path) -> None:
        """Restore the projector, LM and adapter tensors saved by ``save_trainable`` (for an exact resume)."""
        self.load_projector(model.projector, step_dir / "projector", hidden_size(model.lm))
        if trained_lm_state(model.lm) or (step_dir / LM_DIR).is_dir():
            load_lm_weights(model.lm, step_dir / LM_DIR, resume=True)
        if hasattr(model.lm, "peft_config"):
            state = load_file(str(step_dir / "adapter" / "adapter_model.safetensors"))
            result = set_peft_model_state_dict(model.lm, state)
            if result.unexpected_keys:
                raise RuntimeError(f"{step_dir / 'adapter'}: unexpected adapter keys {result.unexpected_keys[:5]}")


def check_stages_fit_backend(recipe: Recipe, spec: ModelSpec) -> None:
    """Refuse, before any weight loads, a recipe whose stages need what ``spec``'s backend cannot do: generation
    (GRPO rollouts, a stage's ``eval_partition``)."""
    why = refused_by_backend(spec, "generate")
    if why is None:
        return
    stages = getattr(recipe, "stages", {}) or {}
    needing = [f"stages.{name}" for name in stages if name == "grpo"]
    needing += [f"stages.{name}.eval_partition" for name, opts in stages.items()
                if name != "grpo" and getattr(opts, "eval_partition", None) is not None]
    if needing:
        raise BackendError(f"model.backend: {spec.backend!r} cannot generate, which {', '.join(needing)} need(s): "
                           f"{why}")


def hidden_size(lm: Any) -> int:
    return lm.config.get_text_config().hidden_size


def resolved_lora_targets(peft_model: Any) -> set[str]:
    """Module-name suffixes that actually carry LoRA weights (e.g. q_proj, in_proj)."""
    names = set()
    for name, _ in peft_model.named_parameters():
        if ".lora_A." in name:
            names.add(name.split(".lora_A.")[0].split(".")[-1])
    return names
