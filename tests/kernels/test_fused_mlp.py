"""CLIP's fc1 + bias + quick-GELU as one quack GEMM (``stitch_clip.gemm``): which MLPs are switched, that off a
Hopper GPU they compute exactly what they did, the op's fake implementation (what a compiled tower traces), and on a
Hopper GPU with quack installed its accuracy, batch invariance, stream and the tower running it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("stitch_clip", reason="the CLIP encoder comes from the stitch-clip plugin")

from stitch_clip import gemm  # noqa: E402

ON_HOPPER = torch.cuda.is_available() and gemm.hopper("cuda")


@pytest.fixture(scope="module")
def clip_tiny():
    from stitch.host.host import load_plugins

    return load_plugins().get("encoders", "clip-tiny")


def tiny_tower(clip_tiny, **config):
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    base = CLIPVisionConfig.from_pretrained(**clip_tiny.source.pretrained_kwargs())
    for key, value in config.items():
        setattr(base, key, value)
    return CLIPVisionModel(base).eval()


def test_fusing_switches_every_quick_gelu_mlp_and_off_the_gpu_it_computes_the_same_bits(clip_tiny):
    model = tiny_tower(clip_tiny)
    pixels = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    keys = sorted(model.state_dict())
    with torch.no_grad():
        before = model(pixel_values=pixels).last_hidden_state
        assert gemm.fuse_quick_gelu(model) == 2  # both layers' MLPs
        after = model(pixel_values=pixels).last_hidden_state
    tower = getattr(model, "vision_model", model)  # transformers before 5.19 nest the tower one level down
    assert all(isinstance(layer.mlp, gemm.FusedQuickGeluMLP) for layer in tower.encoder.layers)
    assert sorted(model.state_dict()) == keys  # same weights, same names
    assert torch.equal(before, after)  # CPU fp32: transformers' own MLP
    assert gemm.fuse_quick_gelu(model) == 0  # already switched
    model = model.to(torch.bfloat16)  # half precision off the GPU: still transformers' MLP
    with torch.no_grad():
        switched = model(pixel_values=pixels.bfloat16()).last_hidden_state
        assert gemm.unfuse_quick_gelu(model) == 2 and gemm.fused_count(model) == 0  # back to the classes they had
        assert torch.equal(switched, model(pixel_values=pixels.bfloat16()).last_hidden_state)


@pytest.mark.parametrize("config", [{"hidden_act": "gelu"}, {"intermediate_size": 1020}])
def test_an_mlp_with_another_activation_or_a_width_tma_cannot_tile_is_not_switched(clip_tiny, config):
    model = tiny_tower(clip_tiny, **config)
    assert gemm.fuse_quick_gelu(model) == 0
    assert gemm.fused_count(model) == 0


def test_the_encoder_fuses_its_mlps_when_it_compiles_and_only_on_a_hopper_gpu(clip_tiny, monkeypatch):
    assert not gemm.hopper("cpu")
    encoder = clip_tiny.load(clip_tiny.source, "cpu", torch.bfloat16)
    encoder.compile(8)  # torch.compile wraps the tower; nothing compiles until a call
    assert encoder.fused_mlps == gemm.fused_count(encoder.model) == 0
    monkeypatch.setattr(gemm, "hopper", lambda device: True)
    checked = []
    monkeypatch.setattr(gemm, "check", checked.append)
    encoder = clip_tiny.load(clip_tiny.source, "cpu", torch.bfloat16)
    # loading alone (serving's one-image encodes, small prepares) fuses nothing
    assert gemm.fused_count(encoder.model) == 0 and not checked
    encoder.compile(8)
    # prepare keeps one of the tiny tower's two layers
    assert encoder.fused_mlps == gemm.fused_count(encoder.model) == encoder.model.config.num_hidden_layers == 1
    encoder.compile(8)  # again: nothing more to switch, the kernel checked once
    assert encoder.fused_mlps == 1 and len(checked) == 1


def test_where_the_fused_gemm_fails_its_check_fusing_warns_and_keeps_transformers_mlps(clip_tiny, monkeypatch):
    model = tiny_tower(clip_tiny)
    monkeypatch.setattr(gemm, "hopper", lambda device: True)

    def broken(fc1):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setattr(gemm, "check", broken)
    with pytest.warns(RuntimeWarning, match="no kernel image.*stay transformers' own"):
        assert gemm.fuse_where_it_runs(model, "cuda", torch.bfloat16) == 0
    assert gemm.fused_count(model) == 0
    checked = []
    monkeypatch.setattr(gemm, "check", checked.append)
    assert gemm.fuse_where_it_runs(model, "cuda", torch.float32) == 0  # fp32: not the kernel's
    assert gemm.fuse_where_it_runs(model, "cuda", torch.bfloat16) == 2 and len(checked) == 1


def test_the_check_refuses_a_fused_gemm_whose_output_is_not_quick_gelu(clip_tiny, monkeypatch):
    fc1 = torch.nn.Linear(64, 128).to(torch.bfloat16)
    monkeypatch.setattr(gemm, "linear_quick_gelu", gemm.quick_gelu_reference)  # right: passes
    gemm.check(fc1)
    monkeypatch.setattr(gemm, "linear_quick_gelu", lambda x, w, b: gemm.quick_gelu_reference(x, w, b * 0))
    with pytest.raises(RuntimeError, match=r"linear_quick_gelu on a \[128 x 64\] fc1 differs"):
        gemm.check(fc1)  # the check's random bias: a kernel that drops it fails


def test_quack_counts_as_installed_only_as_the_quack_kernels_distribution(monkeypatch):
    def missing(name):
        raise gemm.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(gemm.importlib.metadata, "version", missing)
    assert not gemm._installed("quack-kernels", "torch")  # a module of the name is there, the distribution not
    monkeypatch.setattr(gemm.importlib.metadata, "version", lambda name: "0.6.5")
    assert gemm._installed("quack-kernels", "torch") and not gemm._installed("quack-kernels", "no_such_module_x")


def test_the_fused_op_has_the_output_shape_a_compiled_tower_traces():
    x = torch.empty(3, 50, 768, device="meta", dtype=torch.bfloat16)
    weight = torch.empty(3072, 768, device="meta", dtype=torch.bfloat16)
    out = torch.ops.stitch_clip.linear_quick_gelu(x, weight, torch.empty(3072, device="meta", dtype=torch.bfloat16))
    assert out.shape == (3, 50, 3072) and out.dtype == torch.bfloat16


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    y = x.double() @ weight.double().t() + bias.double()  # fp64: what both bf16 paths are compared with
    return y * torch.sigmoid(1.702 * y)


@pytest.mark.skipif(not ON_HOPPER, reason="the fused GEMM runs on a Hopper GPU with quack installed")
def test_on_a_hopper_gpu_the_fused_fc1_is_as_close_to_fp64_as_the_unfused_one_and_batch_invariant():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(700, 50, 768, generator=g, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(3072, 768, generator=g, device="cuda") / 768**0.5).to(torch.bfloat16)
    bias = (torch.randn(3072, generator=g, device="cuda") * 0.5).to(torch.bfloat16)
    exact = reference(x, weight, bias)
    got = gemm.linear_quick_gelu(x, weight, bias)
    y = torch.nn.functional.linear(x, weight, bias)
    unfused = y * torch.sigmoid(1.702 * y)
    err, unfused_err = (got.double() - exact).abs().max().item(), (unfused.double() - exact).abs().max().item()
    assert got.shape == (700, 50, 3072) and got.dtype == torch.bfloat16
    assert err <= unfused_err + 1e-3, (err, unfused_err)  # one rounding, in fp32, instead of two
    assert (got.double() - exact.roll(1, 0)).abs().max().item() > 0.1  # another image's: the check can fail
    for n in (1, 7, 512):  # the first n images alone: the same bits as in the batch of 700
        assert torch.equal(gemm.linear_quick_gelu(x[:n], weight, bias), got[:n]), n


@pytest.mark.skipif(not ON_HOPPER, reason="the fused GEMM runs on a Hopper GPU with quack installed")
def test_on_a_hopper_gpu_the_fused_op_runs_on_the_callers_stream_and_passes_torch_library_checks():
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(1024, 768, generator=g, device="cuda") / 768**0.5).to(torch.bfloat16)
    bias = torch.zeros(1024, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    big = torch.randn(8192, 8192, generator=g, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        for _ in range(20):  # ~15 ms of work queued before the input is written, all on the side stream
            big = big @ big * 1e-2
        x = torch.ones(4096, 768, device="cuda", dtype=torch.bfloat16) + big[:4096, :768] * 0
        got = gemm.linear_quick_gelu(x, weight, bias)
    torch.cuda.synchronize()
    torch.testing.assert_close(got.double(), reference(x, weight, bias), atol=2e-2, rtol=2e-2)
    x = torch.randn(2, 10, 768, device="cuda", dtype=torch.bfloat16)
    report = torch.library.opcheck(gemm.linear_quick_gelu, (x, weight, bias), test_utils=(
        "test_schema", "test_faketensor", "test_aot_dispatch_static"))
    assert set(report.values()) == {"SUCCESS"}, report


@pytest.mark.skipif(not ON_HOPPER, reason="the fused GEMM runs on a Hopper GPU with quack installed")
def test_on_a_hopper_gpu_the_compiled_tower_runs_the_fused_mlp_and_gives_the_unfused_features(clip_tiny):
    encoder = clip_tiny.load(clip_tiny.source, "cuda", torch.bfloat16)
    encoder.compile(256)
    assert encoder.fused_mlps == encoder.model.config.num_hidden_layers == 1  # the layer prepare uses
    pixels = torch.randint(0, 256, (300, 3, 224, 224), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        features = encoder.encode(pixels).float()
    assert any("linear_quick_gelu" in e.name for e in prof.events()), "the compiled tower did not call the fused op"
    plain = clip_tiny.load(clip_tiny.source, "cuda", torch.bfloat16)
    plain._tower = torch.compile(plain._patches, dynamic=False)  # compiled as shipped, the MLPs transformers'
    plain.compiled_batch = 256
    want = plain.encode(pixels).float()
    relative = ((features - want).norm(dim=(1, 2)) / want.norm(dim=(1, 2))).max().item()
    assert relative <= 1e-2, relative  # bf16 towers: other kernels, the same features
