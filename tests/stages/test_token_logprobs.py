"""GRPO's and DPO's log-probs through the LM head on labelled positions only, in chunks, equal the full fp32 logits'.

``StitchedModel.token_logprobs`` (what ``stitch.stages.logprobs.token_logprobs`` calls for a stitched model) runs the
head on the hidden states of labelled positions, a chunk at a time, with the suppressed ids at -inf and the temperature
applied; its backward recomputes each chunk. The reference is what the stage computed before: full logits in fp32,
masked, scaled, ``log_softmax``, gathered.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from stitch.data.packing import collate_packs
from stitch.kernels import cross_entropy
from stitch.rollout.engines import mask_suppressed
from stitch.stages import logprobs as logprobs_module
from tests.kernels.test_fast_paths import build, samples

SUPPRESS = (0, 7, 11)
TEMPERATURE = 0.7


def full_logits_logprobs(model, batch, temperature: float, suppress_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: what ``token_logprobs`` computed before the chunked head."""
    logits = mask_suppressed(model.logits(batch)[:, :-1].float(), suppress_ids) / temperature
    target = batch.labels[:, 1:]
    mask = target != -100
    lp = torch.log_softmax(logits, dim=-1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(mask, lp, 0.0), mask


def values_and_grads(model, fn, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``fn``'s log-probs and the gradients of a weighted sum of them (a different weight per token, as GRPO's
    advantages give) for every trainable parameter."""
    model.zero_grad(set_to_none=True)
    lp, mask = fn(model, batch)
    weights = torch.linspace(-1.0, 2.0, lp.numel()).view_as(lp)
    (lp * mask * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads.values())
    return lp.detach(), grads


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float) -> bool:
    return all(float((a[k] - b[k]).abs().max()) <= tol * float(b[k].abs().max()) for k in b)


@pytest.mark.parametrize("host_copy", [True, False], ids=["host_index", "no_host_copy"])
def test_chunked_head_logprobs_and_gradients_equal_full_fp32_logits_with_temperature_and_suppressed_ids(
        host_copy, monkeypatch):
    monkeypatch.setattr(cross_entropy, "CHUNK_TOKENS", 5)  # several chunks, the last one short
    model = build("qwen3.5-demo")
    batch = collate_packs([[s] for s in samples(model, n=4)], pad_id=0, packed=False).to("cpu")
    assert batch.host is not None
    if not host_copy:
        batch = dataclasses.replace(batch, host=None)
    assert (model.host_index(batch) is not None) == host_copy

    def ours(m, b):
        return logprobs_module.token_logprobs(m, b, TEMPERATURE, suppress_ids=SUPPRESS)

    lp, grads = values_and_grads(model, ours, batch)
    ref, ref_grads = values_and_grads(model, lambda m, b: full_logits_logprobs(m, b, TEMPERATURE, SUPPRESS), batch)
    mask = batch.labels[:, 1:] != -100
    assert lp.shape == ref.shape and mask.sum() > 20
    assert torch.allclose(lp, ref, atol=1e-5, rtol=0)
    assert torch.equal(lp[~mask], torch.zeros_like(lp[~mask]))
    assert close(grads, ref_grads, 1e-4)
    # the suppressed ids and the temperature matter: leaving either out changes the log-probs
    plain, _ = full_logits_logprobs(model, batch, 1.0, ())
    assert float((plain - ref)[mask].abs().max()) > 1e-2


def test_reference_weights_substituted_by_functional_call_reach_the_chunked_head():
    """GRPO's reference log-probs substitute the warm-start adapter and projector for the live ones."""
    model = build("qwen3.5-demo")
    batch = collate_packs([[s] for s in samples(model, n=3, seed=2)], pad_id=0, packed=False).to("cpu")
    reference = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
        live, _ = logprobs_module.token_logprobs(model, batch, TEMPERATURE, suppress_ids=SUPPRESS)
        substituted, _ = logprobs_module.token_logprobs(model, batch, TEMPERATURE, reference, SUPPRESS)
        want_live, mask = full_logits_logprobs(model, batch, TEMPERATURE, SUPPRESS)
        for n, p in model.named_parameters():
            if n in reference:
                p.copy_(reference[n])
        want_reference, _ = full_logits_logprobs(model, batch, TEMPERATURE, SUPPRESS)
    assert torch.allclose(live, want_live, atol=1e-5, rtol=0)
    assert torch.allclose(substituted, want_reference, atol=1e-5, rtol=0)
    assert float((live - substituted)[mask].abs().max()) > 1e-3  # the substitution changed something


def test_chunked_logprobs_function_gives_autograds_gradients_for_hidden_head_weight_and_bias():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(8, 19, dtype=torch.float64)
    target = torch.randint(0, 19, (13,), generator=gen)
    assert 2 in target  # a suppressed target: log-prob -inf, and no gradient through its masked logit
    grad_out = torch.randn(13, generator=gen, dtype=torch.float64)

    def reference():
        logits = head(hidden).float().double()
        logits = mask_suppressed(logits, [7, 2]) / TEMPERATURE
        return torch.log_softmax(logits, -1).gather(1, target[:, None]).squeeze(1)

    got = cross_entropy.linear_token_logprobs(hidden, head, target, TEMPERATURE, [7, 2], chunk=4)
    want = reference()
    assert got.dtype == torch.float32 and torch.allclose(got.double(), want, atol=1e-5, rtol=0)
    ours = torch.autograd.grad(got, [hidden, head.weight, head.bias], grad_out.float())
    theirs = torch.autograd.grad(want, [hidden, head.weight, head.bias], grad_out)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype and torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_packed_rows_and_a_batch_without_labels_score_as_their_full_logits_do():
    """qwen3.5-tiny takes the packed path (several samples a row, sample starts instead of a mask)."""
    model = build("qwen3.5-tiny")
    pack = samples(model, n=4, seed=3)
    packed = collate_packs([pack[:3], pack[3:]], pad_id=0, packed=True).to("cpu")
    assert model._packed(packed) and model.host_index(packed) is not None
    with torch.no_grad():
        lp, mask = logprobs_module.token_logprobs(model, packed, TEMPERATURE, suppress_ids=SUPPRESS)
        want, _ = full_logits_logprobs(model, packed, TEMPERATURE, SUPPRESS)
    assert mask.sum() > 20 and torch.allclose(lp, want, atol=1e-5, rtol=0)
    unlabelled = dataclasses.replace(packed, labels=torch.full_like(packed.labels, -100), host=None)
    lp, mask = logprobs_module.token_logprobs(model, unlabelled, TEMPERATURE, suppress_ids=SUPPRESS)
    assert not mask.any() and torch.equal(lp, torch.zeros_like(lp))


def test_with_id_0_suppressed_unlabelled_positions_hold_0_and_the_grpo_loss_is_finite_on_both_paths(monkeypatch):
    """Off the labels the gather reads id 0; suppressed, its log-prob is -inf, and -inf * 0 in the masked GRPO loss is
    NaN. The full-logits path (models whose logits are more than head(hidden)) zeroes those positions too."""
    from stitch.stages.grpo import grpo_loss

    model = build("qwen3.5-demo")
    batch = collate_packs([[s] for s in samples(model, n=3, seed=4)], pad_id=0, packed=False).to("cpu")
    chunked, mask = logprobs_module.token_logprobs(model, batch, TEMPERATURE, suppress_ids=SUPPRESS)
    monkeypatch.setattr(type(model), "_plain_head", lambda self: None)
    full, _ = logprobs_module.token_logprobs(model, batch, TEMPERATURE, suppress_ids=SUPPRESS)
    assert 0 in SUPPRESS and (~mask).any()
    assert torch.allclose(chunked, full, atol=1e-5, rtol=0)
    for lp in (chunked, full):
        assert torch.equal(lp[~mask], torch.zeros_like(lp[~mask]))
        loss, _ = grpo_loss(lp, lp.detach(), lp.detach(), torch.ones(lp.shape[0]), mask, 0.2, 0.04)
        assert torch.isfinite(loss)
        loss.backward()


def test_suppressed_ids_first_asked_for_under_inference_mode_still_serve_a_training_call():
    cross_entropy._id_tensor.cache_clear()
    hidden = torch.randn(6, 8, requires_grad=True)
    head = torch.nn.Linear(8, 11)
    target = torch.tensor([1, 2, 3, 4, 5, 6])
    with torch.inference_mode():
        cross_entropy.linear_token_logprobs(hidden, head, target, 1.0, [9, 10])
    lp = cross_entropy.linear_token_logprobs(hidden, head, target, 1.0, [9, 10])
    lp.sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0
