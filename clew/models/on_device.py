"""Random weights made where the model will run: meta-device construction, then init there.

The ordinary way (construct on the CPU in float32, then cast and move) costs an 8B policy
35 GB of host memory and minutes of single-threaded initialisation. Here the modules are
constructed on the meta device (shapes only, nothing allocated, nothing drawn), given
uninitialised storage on the target device in the target dtype (``to_empty``), and then
initialised in place by transformers' own ``initialize_weights``, on the device: normal
draws for the weights, ones and zeros for the norms, and the rotary ``inv_freq`` buffers
recomputed (``to_empty`` leaves them as garbage); the host does no work per weight.

The draws come from the target device's generator, so the weights differ from the
ordinary CPU build of the same seed; the same seed on the same device gives the same
weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["instantiate_on_device"]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def instantiate_on_device(
    model_class: type[PreTrainedModel],
    config: PretrainedConfig,
    device: str | torch.device,
    dtype: torch.dtype,
    seed: int,
) -> PreTrainedModel:
    """``model_class(config)`` with random weights in ``dtype``, allocated and drawn on ``device``.

    Parameters take ``dtype``; buffers keep the dtype their module computes them in (the
    rotary frequencies stay float32, as ``from_pretrained`` leaves them).
    """
    device = torch.device(device)
    # Parameters are created in the default dtype; the rotary buffers are computed with an
    # explicit .float(), so setting it here casts the weights and nothing else.
    with torch.device("meta"), _default_dtype(dtype):
        model = model_class(config)
    model.to_empty(device=device)
    for module in model.modules():  # initialize_weights skips modules marked as done
        if getattr(module, "_is_hf_initialized", False):
            module._is_hf_initialized = False
    forked = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked):
        torch.manual_seed(seed)
        model.initialize_weights()
    model.tie_weights()
    return model
