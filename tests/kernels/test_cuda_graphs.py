"""stitch.kernels.graphs: a shape-static block (an MLP, a LoRA layer) replays one captured CUDA graph per forward and
backward instead of its launches one by one. The CPU tests check what a captured graph is keyed on and that nothing is captured
off a GPU; the GPU tests check that a replayed block trains exactly as the eager one does (losses and gradients over
optimizer steps that change the adapter in place) and that a second forward before its backward runs eagerly."""

from __future__ import annotations

import copy

import pytest
import torch

from stitch.kernels import graphs
from stitch.kernels.precision import lora_in_half_compute

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def tiny_lora_lm(device: str = "cpu", dtype=torch.float32):
    import transformers
    from peft import LoraConfig, get_peft_model

    cfg = transformers.Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    lm = transformers.Qwen3ForCausalLM._from_config(cfg, dtype=dtype, attn_implementation="sdpa").to(device)
    lm = get_peft_model(lm, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                          "gate_proj", "up_proj", "down_proj"]))
    with torch.no_grad():  # B away from its zero init, so the adapter's path carries a gradient to A
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    lora_in_half_compute(lm)
    return lm


def mlps(lm) -> list:
    return [m for name, m in lm.named_modules() if name.endswith(".mlp")]


@pytest.fixture
def counts(monkeypatch) -> dict[str, int]:
    """This test's graph captures (tried and failed) and replays, counted where they happen: BlockGraph's
    constructor captures, its call replays."""
    seen = {"captured": 0, "failed": 0, "replayed": 0}
    init, call = graphs.BlockGraph.__init__, graphs.BlockGraph.__call__

    def counted_init(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        except Exception:
            seen["failed"] += 1
            raise
        seen["captured"] += 1

    def counted_call(self, *xs):
        seen["replayed"] += 1
        return call(self, *xs)

    monkeypatch.setattr(graphs.BlockGraph, "__init__", counted_init)
    monkeypatch.setattr(graphs.BlockGraph, "__call__", counted_call)
    return seen


def test_a_blocks_graph_is_keyed_on_its_input_shape_parameter_storage_and_adapter_state():
    lm = tiny_lora_lm()
    mlp = mlps(lm)[0]
    x = torch.randn(1, 8, 64)
    layout = graphs.Layout((mlp,))  # read once, as static_block keeps it

    def signature(x):
        return layout.signature((x,))

    first = signature(x)
    assert first is not None and signature(x.clone()) == first
    assert signature(torch.randn(1, 9, 64)) != first  # another shape: another graph
    assert signature(x.requires_grad_()) != first  # a gradient for the input or not
    weight = mlp.gate_proj.base_layer.weight
    weight.data = weight.data.clone()  # new storage: a graph captured on the old one would read stale weights
    moved = signature(x.detach())
    assert moved is not None and moved != first
    with lm.disable_adapter():  # peft's own forward (no adapter) must run: nothing to capture
        assert signature(x.detach()) is None
    handle = mlp.up_proj.register_forward_hook(lambda *a: None)  # a graph would skip the hook
    assert signature(x.detach()) is None
    handle.remove()
    assert signature(x.detach()) == moved


def test_off_a_gpu_a_static_block_runs_its_eager_forward_and_captures_nothing(counts):
    lm = tiny_lora_lm()
    mlp = mlps(lm)[0]
    x = torch.randn(1, 8, 64, requires_grad=True)
    for _ in range(graphs.REPEATS + 2):
        out = graphs.static_block(mlp, x, mlp.forward)
        torch.testing.assert_close(out, mlp.forward(x), rtol=0, atol=0)
    assert counts == {"captured": 0, "failed": 0, "replayed": 0}
    assert mlp not in graphs._STATES or graphs._STATES[mlp].graph is None


def _graphed_pair():
    from stitch_qwen.kernels import liger_functions, use_fused_kernels

    if liger_functions() is None:
        pytest.skip("needs liger-kernel (the fused MLP is what calls static_block)")
    eager = tiny_lora_lm("cuda", torch.bfloat16)
    use_fused_kernels(eager)
    graphed = copy.deepcopy(eager)
    return graphed, eager


KEPT: list[torch.Tensor] = []  # every step's loss, graph and all, as a trainer that logs losses may keep them


def _step(lm, optimizer, ids, use_graphs: bool, monkeypatch) -> tuple[float, list[torch.Tensor]]:
    monkeypatch.setattr(graphs, "ENABLED", use_graphs)
    loss = lm(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    KEPT.append(loss)  # keeps the parameters' gradient accumulators of the eager first step alive into the capture
    grads = [p.grad.detach().clone() for p in lm.parameters() if p.requires_grad]
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss), grads


@gpu
def test_on_a_gpu_replayed_mlps_give_the_eager_losses_and_gradients_across_optimizer_steps(monkeypatch, counts):
    graphed, eager = _graphed_pair()
    graphed.train(), eager.train()
    opt_g = torch.optim.AdamW([p for p in graphed.parameters() if p.requires_grad], lr=1e-2)
    opt_e = torch.optim.AdamW([p for p in eager.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    replayed = counts["replayed"]
    for step in range(6):
        ids = torch.randint(0, 96, (1, 48), generator=gen).cuda()  # new tokens each step, one shape
        loss_g, grads_g = _step(graphed, opt_g, ids, True, monkeypatch)
        loss_e, grads_e = _step(eager, opt_e, ids, False, monkeypatch)
        assert abs(loss_g - loss_e) <= 1e-3 * abs(loss_e), (step, loss_g, loss_e)
        for g, e in zip(grads_g, grads_e, strict=True):
            torch.testing.assert_close(g, e, rtol=2e-2, atol=1e-5)
    # captured on the second identical call, replayed from then on: per step 2 MLPs (their LoRA layers inside their
    # graphs) and 2 x 4 attention LoRA layers, 5 steps
    assert counts["replayed"] - replayed == 10 * (6 - graphs.REPEATS + 1)
    first, second = (graphs._STATES[m].graph for m in mlps(graphed))
    assert first.static_grad_outs[0] is second.static_grad_outs[0]  # one gradient-in buffer for blocks of one shape
    assert graphs.drop_graphs(graphed) == 10 and counts["failed"] == 0
    KEPT.clear()


@gpu
def test_on_a_gpu_a_second_forward_before_its_backward_runs_eagerly_with_the_right_gradients(monkeypatch, counts):
    graphed, eager = _graphed_pair()
    graphed.train(), eager.train()
    opt = torch.optim.SGD([p for p in graphed.parameters() if p.requires_grad], lr=0.0)
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 96, (1, 48), generator=gen).cuda() for _ in range(2)]
    for _ in range(graphs.REPEATS):  # captured
        _step(graphed, opt, ids[0], True, monkeypatch)
    replayed = counts["replayed"]
    grads = {}
    for name, lm, on in (("graphed", graphed, True), ("eager", eager, False)):
        monkeypatch.setattr(graphs, "ENABLED", on)
        total = lm(input_ids=ids[0], labels=ids[0]).loss + lm(input_ids=ids[1], labels=ids[1]).loss
        total.backward()
        grads[name] = [p.grad.clone() for p in lm.parameters() if p.requires_grad]
        lm.zero_grad(set_to_none=True)
    assert counts["replayed"] - replayed == 10  # the first forward replays its 10 blocks; the second runs eager
    for g, e in zip(grads["graphed"], grads["eager"], strict=True):
        torch.testing.assert_close(g, e, rtol=2e-2, atol=1e-5)


@gpu
def test_on_a_gpu_a_packed_qwen35_step_replays_its_projections_and_mlps_with_the_eager_losses_and_gradients(
        monkeypatch, counts):
    """Qwen3.5 on fla (one Gated DeltaNet, one attention layer), LoRA on every projection, bf16, packed rows of three
    samples: the Gated DeltaNet's four input projections, its gated norm + output projection and both MLPs replay as
    graphs from the second step on; the conv, rule and attention between them stay eager on each step's sample
    starts."""
    import transformers
    from peft import LoraConfig, get_peft_model

    from stitch.kernels.varlen import varlen_kernels_ready
    from stitch_qwen import kernels

    if not varlen_kernels_ready() or kernels.fla_gdn_functions() is None or kernels.liger_functions() is None:
        pytest.skip("needs flash-linear-attention and liger-kernel")
    cfg = transformers.Qwen3_5TextConfig(
        vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, tie_word_embeddings=True,
        layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64)
    torch.manual_seed(0)
    base = transformers.Qwen3_5ForCausalLM._from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    base.requires_grad_(False)
    eager = get_peft_model(base.cuda(), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj",
        "gate_proj", "up_proj", "down_proj"]))
    lora_in_half_compute(eager)
    kernels.use_varlen(eager.base_model.model)
    assert kernels.use_fused_kernels(eager)["gated_deltanet"] == 1
    graphed = copy.deepcopy(eager)
    eager.train(), graphed.train()
    opt_g = torch.optim.AdamW([p for p in graphed.parameters() if p.requires_grad], lr=1e-2)
    opt_e = torch.optim.AdamW([p for p in eager.parameters() if p.requires_grad], lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    replayed = counts["replayed"]
    for step, lengths in enumerate(([7, 11, 14], [12, 12, 8], [5, 20, 7], [16, 9, 7], [7, 11, 14])):
        ids = torch.randint(1, 96, (1, sum(lengths)), generator=gen).cuda()
        positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0).cuda()
        losses, grads = [], []
        for lm, opt, on in ((graphed, opt_g, True), (eager, opt_e, False)):
            monkeypatch.setattr(graphs, "ENABLED", on)
            loss = lm(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss
            loss.backward()
            KEPT.append(loss)
            losses.append(float(loss))
            grads.append([p.grad.detach().clone() for p in lm.parameters() if p.requires_grad])
            opt.step()
            opt.zero_grad(set_to_none=True)
        assert abs(losses[0] - losses[1]) <= 1e-3 * abs(losses[1]), (step, losses)
        for g, e in zip(*grads, strict=True):
            torch.testing.assert_close(g, e, rtol=2e-2, atol=1e-5)
    # from the second step: the Gated DeltaNet's projections and its gated norm + out_proj, two MLPs, the attention
    # layer's four LoRA projections; four steps
    assert counts["replayed"] - replayed == 8 * 4 and counts["failed"] == 0
    KEPT.clear()


def test_a_block_of_a_model_kept_eager_never_heads_for_a_capture(monkeypatch):
    """keep_eager(model): every block of it runs its forward directly, even where a capture could happen (eligible
    stubbed true, as on a GPU in a training step); another model's blocks still head for one."""
    kept, other = tiny_lora_lm(), tiny_lora_lm()
    monkeypatch.setattr(graphs, "eligible", lambda module, x: True)
    x = torch.randn(1, 8, 64, requires_grad=True)
    graphs.keep_eager(kept)
    for lm in (kept, other):
        mlp = mlps(lm)[0]
        out = graphs.static_block(mlp, x, mlp.forward)  # a first call: eager either way
        torch.testing.assert_close(out, mlp.forward(x), rtol=0, atol=0)
    assert mlps(kept)[0] not in graphs._STATES  # never followed toward a capture
    assert graphs._STATES[mlps(other)[0]].seen == 1  # one identical call more and it would be captured
    graphs.drop_graphs(other)


def test_a_backward_graphs_outputs_are_read_through_tensors_that_do_not_keep_their_memory():
    """A backward graph's outputs stay in the shared pool only by address (graphs._unowned), so the next capture
    reuses their memory; the same reading kept the memory allocated for every block (4 GiB on a dense 4B step)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    out = torch.arange(12.0).view(3, 4)[1:]
    alias = graphs._unowned(out)
    assert alias.data_ptr() == out.data_ptr() and alias.stride() == out.stride()
    torch.testing.assert_close(alias, out, rtol=0, atol=0)
    memory = StorageWeakRef(out.untyped_storage())
    del out
    assert memory.expired()  # freed though the alias lives


def test_a_block_is_captured_only_with_room_for_its_graphs_buffers(monkeypatch):
    """room_for: free memory (the driver's plus torch's reserved but unallocated) against 8x the inputs' bytes + 1 GiB;
    checked with the CUDA memory calls stubbed, so it runs on any machine."""
    x = torch.empty(4096, 2560, dtype=torch.bfloat16)  # 20 MiB: a capture asks for 160 MiB + 1 GiB
    need = graphs.ROOM_FACTOR * 20 * 2**20 + graphs.ROOM_MARGIN
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 3 * 2**30 - 2**20)  # 1 MiB unused
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (need - 2**20, 80 * 2**30))
    assert graphs.room_for((x,))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (need - 2**20 - 1, 80 * 2**30))
    assert not graphs.room_for((x,))
