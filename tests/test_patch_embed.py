"""Tests for clew.models.patch_embed: the patch convolution as one matrix product."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from clew.models import build_model, load_policy
from clew.models.patch_embed import linear_patch_embed


def _patch_embed(model: torch.nn.Module) -> torch.nn.Module:
    return next(m for m in model.modules() if isinstance(getattr(m, "proj", None), torch.nn.Conv3d))


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen2_vl"])
def test_the_linear_patch_embedding_gives_the_convolution_s_features(
    tmp_path: Path, arch: str
) -> None:
    built = build_model("tiny", tmp_path / "m", image_size=84, patch_size=14, arch=arch)
    conv = _patch_embed(built.model)
    linear = copy.deepcopy(conv)
    assert linear_patch_embed(linear) == 1
    assert linear_patch_embed(linear) == 0  # once is enough
    proj = conv.proj
    width = proj.in_channels * proj.kernel_size[0] * proj.kernel_size[1] * proj.kernel_size[2]
    patches = torch.randn(37, width, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = conv(patches), linear(patches)
    assert got.shape == want.shape == (37, proj.out_channels)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The parameters stay the convolution's: a checkpoint saves and loads as before.
    assert set(dict(linear.named_parameters())) == set(dict(conv.named_parameters()))


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
