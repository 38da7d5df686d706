"""How the CLIP tower is made fast: the patch embedding as one GEMM, host chunks copied to the GPU on a side stream
ahead of the tower, the compiled tower with fused MLPs (``stitch_clip.gemm``); each equals the plain tower's path."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from stitch_clip.gemm import fuse_where_it_runs


class PatchGemm(torch.nn.Conv2d):
    """CLIP's patch embedding (a Conv2d whose kernel equals its stride, no padding) computed as what it is: one
    GEMM of the [patches, channels x kernel] unfolded pixels with the [width, channels x kernel] weight.

    Why: cuDNN runs ViT-B/32's 32 x 32 / stride-32 conv as a generic convolution (``precomputed_convolve_sgemm``),
    a large share of the encode for FLOPs that a tensor-core GEMM does in a fraction of the time. Same weights and
    state-dict keys (the class is switched in place); any input whose size the kernel does not tile runs the
    stock conv."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        kh, kw = self.kernel_size
        if h % kh or w % kw:
            return super().forward(x)
        gh, gw = h // kh, w // kw
        patches = x.reshape(b, c, gh, kh, gw, kw).permute(0, 2, 4, 1, 3, 5).reshape(b * gh * gw, c * kh * kw)
        out = torch.nn.functional.linear(patches, self.weight.reshape(self.out_channels, -1), self.bias)
        return out.reshape(b, gh, gw, -1).permute(0, 3, 1, 2)  # [B, width, gh, gw], as the conv returns


def patch_embedding_as_gemm(model: Any) -> bool:
    """Switch the tower's patch embedding to ``PatchGemm`` where it is a non-overlapping conv; True when done."""
    tower = getattr(model, "vision_model", model)
    conv = getattr(getattr(tower, "embeddings", None), "patch_embedding", None)
    if (type(conv) is not torch.nn.Conv2d or conv.kernel_size != conv.stride or conv.padding != (0, 0)
            or conv.dilation != (1, 1) or conv.groups != 1):
        return False
    conv.__class__ = PatchGemm
    return True


class CopyAhead:
    """Host chunks to the encoder's GPU on a side stream, one chunk ahead of the tower."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: Any = None

    def __call__(self, chunks: tuple[torch.Tensor, ...]) -> Iterator[torch.Tensor]:
        """Each host chunk on the encoder's GPU, in order: the next chunk's copy is queued on a side stream before
        this one is handed over, so it runs while the caller encodes this one; the compute stream waits for a
        chunk's copy before using it, and the allocator keeps the chunk until that use is done."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        side, compute = self._stream, torch.cuda.current_stream(self.device)

        def copy(chunk: torch.Tensor) -> torch.Tensor:
            with torch.cuda.stream(side):
                return chunk.to(self.device, non_blocking=True)

        ahead = copy(chunks[0])
        for index in range(len(chunks)):
            compute.wait_stream(side)  # this chunk's copy (the only one queued so far) has landed
            current = ahead
            current.record_stream(compute)
            if index + 1 < len(chunks):
                ahead = copy(chunks[index + 1])
            yield current


def compile_tower(patches: Any, model: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """``patches`` (the tower's uint8-or-normalised pixels -> patch features) compiled for fixed-shape batches,
    after each MLP's fc1 + bias + quick-GELU became one GEMM where that kernel runs (``stitch_clip.gemm``)."""
    fuse_where_it_runs(model, device, dtype)
    return torch.compile(patches, dynamic=False)
