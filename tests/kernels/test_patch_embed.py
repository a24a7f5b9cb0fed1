"""Tests for clew.kernels.patch_embed: the patch convolution as one matrix product."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from clew.kernels.patch_embed import linear_patch_embed
from clew.models import build_model, load_policy


def _patch_embed(model: torch.nn.Module) -> torch.nn.Module:
    return next(m for m in model.modules() if isinstance(getattr(m, "proj", None), torch.nn.Conv3d))


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen2_vl"])
def test_the_linear_patch_embedding_gives_the_convolution_s_features(
    tmp_path: Path, arch: str
) -> None:
    built = build_model("tiny", tmp_path / "m", image_size=84, patch_size=14, arch=arch)
    embed = _patch_embed(built.model)
    assert getattr(embed, "_clew_linear_patch", False)  # built as load_policy loads it
    proj = embed.proj
    shape = (proj.in_channels, *proj.kernel_size)
    patches = torch.randn(37, proj.weight[0].numel(), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = proj(patches.view(-1, *shape)).view(37, -1)  # the convolution itself
        got = embed(patches)
    assert got.shape == want.shape == (37, proj.out_channels)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert set(dict(embed.named_parameters())) == {"proj.weight", "proj.bias"} or set(
        dict(embed.named_parameters())
    ) == {"proj.weight"}  # Qwen2-VL's has no bias


def test_a_patch_convolution_gets_the_linear_forward_once() -> None:
    module = torch.nn.Module()
    module.proj = torch.nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(2, 4, 4))
    module.patch_size, module.temporal_patch_size = 4, 2
    assert linear_patch_embed(module) == 1
    assert linear_patch_embed(module) == 0


def test_a_loaded_policy_embeds_patches_with_the_linear_path(tmp_path: Path) -> None:
    path = build_model("tiny", tmp_path / "m", image_size=84, patch_size=14).path
    model, _ = load_policy(path)
    embed = _patch_embed(model)
    assert getattr(embed, "_clew_linear_patch", False)
    assert "proj.weight" in dict(embed.named_parameters())


def test_a_module_that_is_not_a_patch_convolution_is_left_alone() -> None:
    strided = torch.nn.Module()
    strided.proj = torch.nn.Conv3d(3, 8, kernel_size=2, stride=1)  # overlapping windows
    strided.patch_size, strided.temporal_patch_size = 2, 2
    assert linear_patch_embed(strided) == 0
