"""The training loop's optimizer: torch's AdamW, fused on a GPU, its default elsewhere."""

from __future__ import annotations

import pytest
import torch

from stitch.stages.loop import make_optimizer


def groups(device: str) -> list[dict]:
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(8, 4, device=device))
    b = torch.nn.Parameter(torch.randn(3, device=device))
    return [{"params": [a], "lr": 1e-2, "name": "projector"}, {"params": [b], "lr": 3e-2, "name": "adapter"}]


def test_cpu_parameters_keep_torchs_default_adamw_with_each_groups_learning_rate():
    opt = make_optimizer(groups("cpu"), 0.1)
    assert isinstance(opt, torch.optim.AdamW) and not opt.defaults.get("fused")
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 3e-2] and opt.defaults["weight_decay"] == 0.1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_parameters_get_the_fused_adamw_and_take_the_same_step_as_the_default():
    fused, plain = groups("cuda"), groups("cuda")
    opt = make_optimizer(fused, 0.1)
    assert opt.defaults.get("fused") is True
    ref = torch.optim.AdamW(plain, weight_decay=0.1)
    for g_fused, g_plain in zip(fused, plain, strict=True):
        for p, q in zip(g_fused["params"], g_plain["params"], strict=True):
            p.grad = torch.ones_like(p)
            q.grad = torch.ones_like(q)
    opt.step()
    ref.step()
    for g_fused, g_plain in zip(fused, plain, strict=True):
        for p, q in zip(g_fused["params"], g_plain["params"], strict=True):
            torch.testing.assert_close(p, q)
