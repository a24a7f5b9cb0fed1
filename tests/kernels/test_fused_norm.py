"""Tests for clew.kernels.fused_norm: Qwen-VL's RMSNorms as one fused kernel."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRMSNorm

from clew.kernels.fused_norm import fused_rms_norm
from clew.models import build_model, load_policy


def _norm(width: int = 64, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    norm = Qwen3VLTextRMSNorm(width, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2, generator=torch.Generator().manual_seed(0))
    return norm


def test_the_fused_norm_gives_the_original_values_and_gradients() -> None:
    original = _norm()
    fused = copy.deepcopy(original)
    assert fused_rms_norm(fused) == 1
    x = torch.randn(5, 7, 64, generator=torch.Generator().manual_seed(1)) * 3
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = original(xa), fused(xb)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    want.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fused.weight.grad, original.weight.grad, rtol=1e-4, atol=1e-5)


def test_float32_weights_over_bf16_inputs_keep_the_original_promotion() -> None:
    original = _norm()
    fused = copy.deepcopy(original)
    fused_rms_norm(fused)
    x = torch.randn(3, 64).to(torch.bfloat16)
    got = fused(x)
    assert got.dtype == original(x).dtype == torch.float32
    torch.testing.assert_close(got, original(x))


def test_each_norm_is_patched_once_and_other_modules_are_left_alone() -> None:
    model = torch.nn.Sequential(_norm(), torch.nn.LayerNorm(64), _norm())
    assert fused_rms_norm(model) == 2
    assert fused_rms_norm(model) == 0
    assert not hasattr(model[1], "_clew_fused_norm")


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen2_vl"])
def test_a_loaded_policy_computes_its_logits_as_the_unfused_one(tmp_path: Path, arch) -> None:
    path = build_model("tiny", tmp_path / "m", image_size=84, patch_size=14, arch=arch).path
    model, _ = load_policy(path)
    norms = [m for m in model.modules() if getattr(m, "_clew_fused_norm", False)]
    # Qwen3-VL: two a layer, a query and a key norm a layer, and the final norm.
    layers = model.config.get_text_config().num_hidden_layers
    assert len(norms) == (4 * layers + 1 if arch == "qwen3_vl" else 2 * layers + 1)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = model(input_ids=ids).logits
        for m in norms:
            del m.forward  # back to the class's own forward
        want = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_fused_norms_stay_through_train_and_eval_switches(tmp_path: Path) -> None:
    # Where the `kernels` package is installed, newer transformers "kernelize" a model on
    # every .train()/.eval(), which put the norms' own forward back (and would reach for the
    # Hub): load_policy turns that off.
    path = build_model("tiny", tmp_path / "m", image_size=84, patch_size=14).path
    model, _ = load_policy(path)
    fused = [m for m in model.modules() if getattr(m, "_clew_fused_norm", False)]
    assert fused
    assert not getattr(model, "use_kernels", False)
    model.train()
    model.eval()
    model.train()
    assert all("forward" in vars(m) for m in fused)


@pytest.mark.gpu
def test_on_cuda_the_fused_kernel_matches_the_original_to_bf16_rounding() -> None:
    original = _norm(4096, torch.bfloat16).cuda()
    fused = copy.deepcopy(original)
    fused_rms_norm(fused)
    x = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16) * 4
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = original(xa), fused(xb)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
    want.float().square().sum().backward()
    got.float().square().sum().backward()
    torch.testing.assert_close(xb.grad, xa.grad, rtol=5e-2, atol=5e-2)
