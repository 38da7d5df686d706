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

    # True once stitch_nemotron.kernels swapped in the boundary-aware Mamba-2 mixers (see load_nemotron_h)
    stitch_varlen = False

    def forward(self, *args: Any, attention_mask: Any = None, position_ids: Any = None, past_key_values: Any = None,
                use_cache: Any = None, **kwargs: Any) -> Any:
        """The stock forward; a packed call (no mask, no cache, reset position ids) also gets the sample starts.

        ``cu_seq_lens_q/k`` + ``max_length_q/k`` reach every block through transformers' kwargs: the kernel
        Mamba-2 mixers keep each sample's state to itself with them (flash-attention would too; sdpa ignores
        them and builds its block-causal mask from the position ids).
        """
        if (self.stitch_varlen and attention_mask is None and position_ids is not None and past_key_values is None
                and not use_cache and "cu_seq_lens_q" not in kwargs):
            from stitch.varlen import varlen_kwargs

            kwargs.update(varlen_kwargs(position_ids))
        return super().forward(*args, attention_mask=attention_mask, position_ids=position_ids,
                               past_key_values=past_key_values, use_cache=use_cache, **kwargs)

    def prepare_inputs_for_generation(self, input_ids: Any, inputs_embeds: Any = None, **kwargs: Any) -> dict:
        kwargs["logits_to_keep"] = self.config.num_logits_to_keep
        return GenerationMixin.prepare_inputs_for_generation(
            self, input_ids, inputs_embeds=inputs_embeds, **kwargs
        )
