"""The trainable composite: a base LM (optionally with a LoRA adapter) plus a projector whose soft tokens
are scattered into the LM's input embeddings at placeholder positions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stitch.data.packing import to_device
from stitch.kernels.attention import causal_lm, packed_call, use_varlen_attention
from stitch.kernels.cross_entropy import linear_cross_entropy, linear_token_logprobs, logprobs_from_logits
from stitch.kernels.graphs import keep_eager
from stitch.kernels.precision import HALF, lora_in_half_compute, projector_in_half_compute
from stitch.kernels.varlen import attach_host_copy, varlen_kwargs
from stitch.model.scatter import scatter_soft_tokens

# config fields that make logits more than ``lm_head(hidden)``: such models take the full-logits loss
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_softcapping", "logit_scale", "logits_scaling",
                     "output_multiplier_scale")


@dataclass(frozen=True)
class HostIndex:
    """Positions of one batch found on the host (from ``Batch.host``) and moved with it, so the training step
    asks the device for nothing: each ``int(tensor)``, boolean-mask index or ``nonzero`` on a GPU tensor is a sync
    that drains the launch queue and idles the GPU while the host catches up."""

    placeholders: torch.Tensor  # flat positions over [rows * length] of the placeholder tokens
    n_placeholders: int
    labels: torch.Tensor  # flat positions p over [rows * length] whose next token (p + 1) is labelled
    n_labels: int
    varlen: dict[str, Any] | None  # packed rows: ``varlen_kwargs`` on the device (int32 starts, longest sample)


class StitchedModel(nn.Module):
    """``loss`` is the training path: packed rows attend within their sample (``stitch.kernels.attention``) and the
    LM head + cross-entropy run in chunks (``stitch.kernels.cross_entropy``); ``logits`` gives the full logits. With a
    bf16/fp16 LM the LoRA adapter and the projector compute in that dtype on fp32 master weights
    (``stitch.kernels.precision``)."""

    def __init__(self, lm: nn.Module, projector: nn.Module, placeholder_id: int, cuda_graphs: bool = True) -> None:
        super().__init__()
        self.lm = lm
        self.projector = projector
        self.placeholder_id = placeholder_id
        # packed rows cost the sum of squared sample lengths, not the row length squared; padded batches and
        # generation run the SDPA they ran before
        self.varlen_attention = use_varlen_attention(lm)
        lm_dtype = lm.get_input_embeddings().weight.dtype
        self.half_compute = {"lora_layers": 0, "projector": False}
        if lm_dtype in HALF:
            self.half_compute = {"lora_layers": lora_in_half_compute(lm), "projector": projector_in_half_compute(projector)}
        self._projector_input_dtype = lm_dtype if self.half_compute["projector"] else None
        if not cuda_graphs:  # the model's spec says its blocks stay eager (ModelSpec.cuda_graphs)
            keep_eager(self)

    @property
    def device(self) -> torch.device:
        return next(self.projector.parameters()).device

    def host_index(self, batch: Any) -> HostIndex | None:
        """The batch's ``HostIndex`` (made once per batch), or None for a batch without its host copy."""
        host = getattr(batch, "host", None)
        if host is None:
            return None
        cached = batch.__dict__.get("_stitch_index")
        if cached is not None and cached[0] == self.placeholder_id:
            return cached[1]
        device = batch.input_ids.device
        ids = host.input_ids
        width = ids.shape[1]
        placeholders = (ids.reshape(-1) == self.placeholder_id).nonzero().squeeze(1)
        rows, cols = (host.labels[:, 1:] != -100).nonzero(as_tuple=True)
        labels = rows * width + cols
        varlen = None
        if self._packed(batch):
            found = varlen_kwargs(host.position_ids)  # on the host: no sync
            cu, wide = found["cu_seq_lens_q"], found["cu_seq_lens_q"].long()
            on_device = to_device(cu, device)
            attach_host_copy(on_device, wide, to_device(wide, device))
            varlen = {**found, "cu_seq_lens_q": on_device, "cu_seq_lens_k": on_device}
        index = HostIndex(to_device(placeholders, device), len(placeholders), to_device(labels, device),
                          len(labels), varlen)
        batch.__dict__["_stitch_index"] = (self.placeholder_id, index)
        return index

    def embed(self, input_ids: torch.Tensor, features: torch.Tensor, row_ids: list[str] | None = None,
              index: HostIndex | None = None) -> torch.Tensor:
        """Text embeddings with each placeholder replaced by the projector's soft tokens, in order."""
        embeds = self.lm.get_input_embeddings()(input_ids)
        if features.numel() == 0:
            return embeds
        dtype = self._projector_input_dtype or next(self.projector.parameters()).dtype
        soft = self.projector(features.to(device=embeds.device, dtype=dtype))
        return scatter_soft_tokens(
            embeds, input_ids, soft.reshape(-1, soft.shape[-1]).to(embeds.dtype), self.placeholder_id,
            row_ids=row_ids, positions=None if index is None else (index.placeholders, index.n_placeholders),
        )

    def forward(self, batch: Any, logprobs: tuple[float, Sequence[int]] | None = None) -> Any:
        """The logits, or with ``logprobs=(temperature, suppress_ids)`` ``token_logprobs`` (so that
        ``torch.func.functional_call`` can score with substituted weights)."""
        return self.logits(batch) if logprobs is None else self.token_logprobs(batch, *logprobs)

    def _causal_lm(self) -> nn.Module:
        return causal_lm(self.lm)

    def _packed(self, batch: Any) -> bool:
        """Whether the batch runs as packed rows: sample starts instead of a mask, one flattened row."""
        pos = batch.position_ids
        return self.varlen_attention and batch.attention_mask is None and pos is not None and pos.dim() == 2

    def _run(self, module: nn.Module, batch: Any) -> tuple[Any, tuple[int, int] | None]:
        """``module`` (the LM or its decoder) on the batch; packed rows go as one row carrying the sample starts."""
        index = self.host_index(batch)
        embeds = self.embed(batch.input_ids, batch.features, batch.row_ids, index=index)
        pos = batch.position_ids
        if not self._packed(batch):
            out = module(inputs_embeds=embeds, attention_mask=batch.attention_mask, position_ids=pos, use_cache=False)
            return out, None
        rows, width = pos.shape
        found = index.varlen if index is not None and index.varlen is not None else varlen_kwargs(pos)
        with packed_call():
            out = module(inputs_embeds=embeds.reshape(1, rows * width, -1), attention_mask=None,
                         position_ids=pos.reshape(1, rows * width), use_cache=False, **found)
        return out, (rows, width)

    def logits(self, batch: Any) -> torch.Tensor:
        out, shape = self._run(self.lm, batch)
        return out.logits if shape is None else out.logits.reshape(*shape, -1)

    def hidden_states(self, batch: Any) -> torch.Tensor:
        """The decoder's last hidden states (after its final norm), [rows, length, hidden]."""
        out, shape = self._run(self._causal_lm().get_decoder(), batch)
        hidden = out.last_hidden_state
        return hidden if shape is None else hidden.reshape(*shape, -1)

    def _plain_head(self) -> nn.Linear | None:
        """The LM head when logits are exactly ``head(hidden)`` (so the chunked loss applies), else None."""
        causal = self._causal_lm()
        head = causal.get_output_embeddings() if hasattr(causal, "get_output_embeddings") else None
        config = causal.config.get_text_config() if hasattr(causal, "config") else None
        if type(head) is not nn.Linear or config is None or not hasattr(causal, "get_decoder"):
            return None
        if any(getattr(config, field, None) not in (None, 1, 1.0) for field in _LOGIT_TRANSFORMS):
            return None
        return head

    def token_logprobs(self, batch: Any, temperature: float = 1.0,
                       suppress_ids: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 log-prob of each next label token [rows, length - 1], 0 where unlabelled; the label mask) under the
        distribution an engine samples from: ``suppress_ids`` at -inf, ``temperature`` applied.

        The head runs on labelled positions only, one chunk at a time (``linear_token_logprobs``): no [rows, length,
        vocab] logits, and none for prompt positions. Models whose logits are more than ``head(hidden)`` take the
        full logits."""
        head = self._plain_head()
        if head is None:
            return logprobs_from_logits(self.logits(batch), batch.labels, temperature, suppress_ids)
        where, hidden, picked = self._labelled(batch, self.host_index(batch))
        lp = linear_token_logprobs(hidden, head, picked, temperature, suppress_ids)
        rows, length = batch.labels.shape
        out = torch.zeros(rows * length, dtype=lp.dtype, device=lp.device).index_add(0, where, lp)
        return out.view(rows, length)[:, :-1], batch.labels[:, 1:] != -100

    def _labelled(self, batch: Any, index: HostIndex | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(flat positions p over [rows * length] whose next token is labelled, the decoder's last hidden states at
        them, those next tokens), in row-major order. The positions come from the batch's host copy (no sync) or,
        without one, are found on the device."""
        hidden = self.hidden_states(batch)
        if index is not None:
            where = index.labels
        else:
            found = (batch.labels[:, 1:] != -100).nonzero()
            where = found[:, 0] * batch.labels.shape[1] + found[:, 1]
        picked = batch.labels.reshape(-1).index_select(0, where + 1)
        return where, hidden.reshape(-1, hidden.shape[-1]).index_select(0, where), picked

    def loss(self, batch: Any) -> tuple[torch.Tensor, int]:
        """Mean next-token cross-entropy over labelled tokens; returns (loss, labelled token count).

        Logits are fp32 as before, but only for labelled tokens and one chunk at a time. With the batch's host copy
        (``Batch.to``) the labelled positions come from the host: the same tokens in the same order, no sync."""
        index = self.host_index(batch)
        head = self._plain_head()
        if head is None:
            target = batch.labels[:, 1:]
            n = index.n_labels if index is not None else int((target != -100).sum())
            logits = self.logits(batch)[:, :-1].float()
            loss = nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100, reduction="sum"
            )
            return loss / max(n, 1), n
        where, hidden, picked = self._labelled(batch, index)
        n = index.n_labels if index is not None else where.numel()
        return linear_cross_entropy(hidden, head, picked) / max(n, 1), n
