"""The fused LoRA forward (clew.kernels.fused_lora) computes what peft's does."""

from __future__ import annotations

import copy

import pytest
import torch
from peft.tuners.lora.layer import Linear as PeftLinear

from clew.kernels.fused_lora import FusedLoraLinear, fuse_lora
from clew.train.lora import apply_lora


class _Layer(torch.nn.Module):
    """Stands in for a decoder layer: its module names match clew's LoRA targets."""

    def __init__(self) -> None:
        super().__init__()
        self.self_attn = torch.nn.Module()
        self.self_attn.q_proj = torch.nn.Linear(16, 24)
        self.mlp = torch.nn.Module()
        self.mlp.down_proj = torch.nn.Linear(24, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp.down_proj(torch.relu(self.self_attn.q_proj(x)))


class _Policy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.language_model = torch.nn.Module()
        self.model.language_model.layers = torch.nn.ModuleList([_Layer()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.language_model.layers[0](x)


def _model(seed: int = 0, dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(seed)
    peft_model = apply_lora(_Policy(), rank=4, alpha=8.0, dropout=dropout)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:  # peft starts B at zero; a trained adapter is not
            torch.nn.init.normal_(p, std=0.5)
    return peft_model


def _grads(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    out = model(x)
    (out.square().sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads, x.grad


def test_lora_layers_take_the_fused_forward_and_give_peft_s_values_and_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []
    addmm = torch.addmm
    monkeypatch.setattr(torch, "addmm", lambda *a, **k: calls.append(1) or addmm(*a, **k))
    fused = _model()
    layers = [m for m in fused.modules() if isinstance(m, PeftLinear)]
    assert layers and all(type(m) is FusedLoraLinear for m in layers)
    plain = copy.deepcopy(fused)
    assert fuse_lora(plain, False) == len(layers)
    assert all(type(m) is PeftLinear for m in plain.modules() if isinstance(m, PeftLinear))
    x = torch.randn(3, 5, 16)
    out_f, grads_f, dx_f = _grads(fused, x)
    assert len(calls) == len(layers)  # one fused product a layer
    out_p, grads_p, dx_p = _grads(plain, x)
    assert torch.allclose(out_f, out_p, atol=1e-5)
    assert torch.allclose(dx_f, dx_p, atol=1e-5)
    assert grads_f.keys() == grads_p.keys() and any("lora_A" in n for n in grads_f)
    for name, g in grads_f.items():
        assert torch.allclose(g, grads_p[name], atol=1e-4), name


def test_merged_and_dropout_adapters_keep_peft_s_forward() -> None:
    model = _model()
    x = torch.randn(2, 16)
    before = model(x)
    model.merge_adapter()  # the merged weights run the base layer alone
    assert torch.allclose(model(x), before, atol=1e-5)
    model.unmerge_adapter()
    with model.disable_adapter():
        fuse_lora(model, False)
        base = model(x)
        fuse_lora(model, True)
        assert torch.equal(model(x), base)
    noisy = _model(dropout=0.5)
    noisy.train()
    torch.manual_seed(1)
    a = noisy(x)
    fuse_lora(noisy, False)
    torch.manual_seed(1)
    assert torch.equal(a, noisy(x))  # dropout: peft's own forward, the same draws


def _bf16_base_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A model whose base weights are bf16 and adapters float32, fused, and a copy with
    peft's own forward."""
    fused = _model()
    for name, p in fused.named_parameters():
        if "lora_" not in name:
            p.data = p.data.to(torch.bfloat16)
    plain = copy.deepcopy(fused)
    fuse_lora(plain, False)
    return fused, plain


@pytest.mark.parametrize("autocast", [False, True])
def test_a_float32_adapter_over_a_bf16_base_matches_peft(autocast: bool) -> None:
    fused, plain = _bf16_base_pair()
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        a, b = fused(x), plain(x)
    assert a.dtype == b.dtype
    assert torch.allclose(a.float(), b.float(), atol=5e-2, rtol=2e-2)


def test_under_autocast_the_activations_are_not_cast_to_the_adapter_s_dtype_and_back(
    monkeypatch,
) -> None:
    fused, plain = _bf16_base_pair()
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = plain(x)
        casts = []
        cast = PeftLinear._cast_input_dtype
        monkeypatch.setattr(
            PeftLinear, "_cast_input_dtype", lambda self, t, d: casts.append(d) or cast(self, t, d)
        )
        out = fused(x)
    assert casts == []
    assert torch.allclose(out.float(), reference.float(), atol=5e-2, rtol=2e-2)


@pytest.mark.gpu
def test_on_cuda_under_bf16_autocast_the_fused_update_matches_peft() -> None:
    fused = _model().cuda()
    for name, p in fused.named_parameters():
        if "lora_" not in name:
            p.data = p.data.to(torch.bfloat16)
    plain = copy.deepcopy(fused)
    fuse_lora(plain, False)
    x = torch.randn(64, 16, device="cuda", dtype=torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out_f, grads_f, _ = _grads(fused, x)
        out_p, grads_p, _ = _grads(plain, x)
    assert torch.allclose(out_f.float(), out_p.float(), atol=5e-2, rtol=2e-2)
    for name, g in grads_f.items():
        # bf16 gradients summed over 64 rows in another order: within 1% of the norm (a
        # wrong scale, transpose or missing term is off by the norm itself).
        ref = grads_p[name].float()
        assert (g.float() - ref).norm() <= 1e-2 * ref.norm(), name
