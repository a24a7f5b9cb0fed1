"""Adapters: loading errors say what does not fit; `clew export --merge` gives the same model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from support.tiny import tiny_policy, wide_policy

from clew.cli import main
from clew.errors import ModelError
from clew.models import load_policy
from clew.models.adapter_loading import load_adapter
from clew.train.lora import apply_lora


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> SimpleNamespace:
    """Two tiny bases (``tiny``, and ``wide`` of another hidden size) and a LoRA ``adapter``
    of ``tiny``."""
    root = tmp_path_factory.mktemp("adapters")
    tiny = tiny_policy(image_size=56)
    model, processor = load_policy(tiny)
    peft_model = apply_lora(model, rank=4, alpha=8)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    peft_model.save_pretrained(root / "adapter")
    processor.save_pretrained(root / "adapter")
    return SimpleNamespace(tiny=tiny, wide=wide_policy(), adapter=root / "adapter")


def test_adapter_for_another_base_is_refused_with_its_shape(bases):
    model, _ = load_policy(bases.wide)
    with pytest.raises(ModelError, match="rank 4.*does not fit this base model"):
        load_adapter(model, bases.adapter)


def test_folder_without_adapter_config_is_refused(bases):
    model, _ = load_policy(bases.tiny)
    with pytest.raises(ModelError, match="adapter_config.json"):
        load_adapter(model, bases.tiny)


def test_export_merge_writes_full_weights_with_the_adapters_outputs(bases, tmp_path, capsys):
    out = tmp_path / "merged"
    argv = [
        "export",
        "--model",
        str(bases.tiny),
        "--adapter",
        str(bases.adapter),
        "--merge",
    ]
    assert main([*argv, "--output", str(out)]) == 0
    ids = torch.tensor([[3, 4, 5, 6]])
    merged, _ = load_policy(out)
    base, _ = load_policy(bases.tiny)
    adapted = load_adapter(base, bases.adapter)
    with torch.no_grad():
        torch.testing.assert_close(
            merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-5, rtol=1e-4
        )
