"""NemotronH causal LM whose ``generate`` accepts ``inputs_embeds`` (stitch's soft-token prompts need it)."""

from __future__ import annotations

from typing import Any

from transformers import NemotronHForCausalLM as StockNemotronHForCausalLM
from transformers.generation.utils import GenerationMixin


class NemotronHForCausalLM(StockNemotronHForCausalLM):
    """The stock class with a ``prepare_inputs_for_generation`` that forwards ``inputs_embeds``.

    The stock override takes ``(input_ids, **kwargs)``; ``generate`` inspects that signature, finds no
    ``inputs_embeds`` and refuses embeddings-only prompts. This one names the argument and otherwise does what
    the stock one does (keeps ``config.num_logits_to_keep`` logits). The class keeps the stock *name* so that
    ``save_pretrained`` writes ``architectures: ["NemotronHForCausalLM"]`` and exports load anywhere (stock
    transformers, vLLM) without stitch installed.
    """

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # transformers decides this by finding its experts decorator in the class's own module source, which is
        # this file: answer for the stock class, so MoE blocks get grouped_mm (one grouped GEMM over the routed
        # tokens) instead of the eager loop's host sync per expert
        return StockNemotronHForCausalLM._can_set_experts_implementation()

    def prepare_inputs_for_generation(self, input_ids: Any, inputs_embeds: Any = None, **kwargs: Any) -> dict:
        kwargs["logits_to_keep"] = self.config.num_logits_to_keep
        return GenerationMixin.prepare_inputs_for_generation(
            self, input_ids, inputs_embeds=inputs_embeds, **kwargs
        )
