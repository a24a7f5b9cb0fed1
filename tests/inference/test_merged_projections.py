"""Tests for clew.models.merged_projections: q/k/v and gate/up as one product each, the
weights views of one buffer."""

from __future__ import annotations

import copy

import pytest
import torch
from rollout_support import assert_same_samples

from clew.config import load_config
from clew.data.rows import generate_rows
from clew.errors import ConfigError
from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.models import build_model, load_policy
from clew.models.chat import ChatFormat
from clew.models.merged_projections import (
    MergedLinear,
    merge_projections,
    projections_merged,
    saveable_state_dict,
)
from clew.rollout.loop import RolloutSettings, play
from clew.train.lora import apply_lora, merged_for_rollouts


def _build(tmp_path_factory, arch: str):
    path = tmp_path_factory.mktemp(arch)
    build_model("tiny", path, arch=arch, image_size=84, patch_size=14, overwrite=True)
    model, processor = load_policy(path)
    return model.eval(), ChatFormat(processor)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _build(tmp_path_factory, "qwen3_vl")


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):  # biases on q, k and v
    return _build(tmp_path_factory, "qwen2_vl")


def _ids(chat: ChatFormat) -> torch.Tensor:
    return torch.tensor([chat.encode_text("go left then down, then up") * 2])


def _logits(model, chat, merged: bool) -> torch.Tensor:
    with torch.no_grad(), projections_merged(merged):
        return model(input_ids=_ids(chat)).logits


def _attention(model):
    return next(m for m in model.modules() if hasattr(m, "q_proj"))


@pytest.mark.parametrize("arch", ["tiny", "tiny_qwen2"])
def test_merging_keeps_the_parameters_and_adds_no_memory(arch, request) -> None:
    model, chat = request.getfixturevalue(arch)
    merged = copy.deepcopy(model)
    params = dict(merged.named_parameters())
    state = {k: v.clone() for k, v in merged.state_dict().items()}
    layers = merged.config.get_text_config().num_hidden_layers
    assert merge_projections(merged) == 2 * layers
    assert merge_projections(merged) == 2 * layers  # once: a merged group stays as it is
    assert dict(merged.named_parameters()) == params  # the same Parameter objects
    for k, v in merged.state_dict().items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=0)
    attn = _attention(merged)
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    assert all(isinstance(m, MergedLinear) for m in (q, k, v))
    storage = q.weight.untyped_storage().data_ptr()
    assert k.weight.untyped_storage().data_ptr() == storage
    assert v.weight.untyped_storage().data_ptr() == storage
    if q.bias is not None:
        assert v.bias.untyped_storage().data_ptr() == q.bias.untyped_storage().data_ptr()
    want = _logits(model, chat, False)
    torch.testing.assert_close(_logits(merged, chat, False), want, rtol=0, atol=0)
    torch.testing.assert_close(_logits(merged, chat, True), want, rtol=1e-5, atol=1e-5)


def test_inside_the_block_each_group_computes_one_product(tiny, monkeypatch) -> None:
    model, chat = tiny
    merged = copy.deepcopy(model)
    layers = merge_projections(merged) // 2
    members = [m for m in merged.modules() if isinstance(m, MergedLinear)]
    buffers = {id(m._clew_group.weight) for m in members}
    own = {id(m.weight) for m in members}
    calls: list[str] = []
    linear = torch.nn.functional.linear

    def counted(x, w, b=None):
        calls.append("group" if id(w) in buffers else "member" if id(w) in own else "other")
        return linear(x, w, b)

    monkeypatch.setattr("clew.models.merged_projections.F.linear", counted)
    _logits(merged, chat, True)
    assert (calls.count("group"), calls.count("member")) == (2 * layers, 0)
    calls.clear()
    _logits(merged, chat, False)  # outside the block: each Linear on its own
    assert (calls.count("group"), calls.count("member")) == (0, 5 * layers)


@pytest.mark.parametrize("arch", ["tiny", "tiny_qwen2"])
def test_the_engine_with_merged_projections_samples_what_the_plain_engine_samples(
    arch, request
) -> None:
    model, chat = request.getfixturevalue(arch)
    rows = generate_rows("maze_2d/small", 2, env_options={"cell_px": 12})
    settings = RolloutSettings(2, 3, 4096, SamplingParams(temperature=1.0, max_tokens=6))

    def run(merged: bool):
        policy = copy.deepcopy(model)
        engine = InferenceEngine(policy, chat, cuda_graphs=True, merged_projections=merged)
        assert any(isinstance(m, MergedLinear) for m in policy.modules()) is merged
        return play(engine, rows, settings, seed=5)

    assert_same_samples(run(True), run(False), tol=1e-4)


def test_an_optimizer_step_and_a_lora_merge_reach_the_merged_products(tiny) -> None:
    model, chat = tiny
    plain, merged = copy.deepcopy(model), copy.deepcopy(model)
    merge_projections(merged)
    for m in (plain, merged):  # full fine-tuning: the trainer's forward and step
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        m(input_ids=_ids(chat)).logits.square().mean().backward()
        opt.step()
    grads = {n: p.grad for n, p in plain.named_parameters()}
    for n, p in merged.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-6)
    want = _logits(plain, chat, False)
    assert (want - _logits(model, chat, False)).abs().max() > 1e-3  # the step moved them
    torch.testing.assert_close(_logits(merged, chat, True), want, rtol=1e-4, atol=1e-5)

    lora = apply_lora(copy.deepcopy(model), rank=4, alpha=8)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    merge_projections(lora)
    with merged_for_rollouts(lora):  # peft merges in place: into the buffer
        separate = _logits(lora, chat, False)
        together = _logits(lora, chat, True)
    torch.testing.assert_close(together, separate, rtol=1e-4, atol=1e-5)
    assert (separate - _logits(model, chat, False)).abs().max() > 1e-3  # the adapter counts


def test_a_weight_given_new_memory_is_copied_back_into_the_buffer(tiny) -> None:
    model, chat = tiny
    merged = copy.deepcopy(model)
    merge_projections(merged)
    k = _attention(merged).k_proj
    storage = k.weight.untyped_storage().data_ptr()
    with torch.no_grad():
        k.weight.data = k.weight.detach() * 2  # as load_state_dict(assign=True) would
    want = _logits(merged, chat, False)
    torch.testing.assert_close(_logits(merged, chat, True), want, rtol=1e-5, atol=1e-5)
    assert k.weight.untyped_storage().data_ptr() == storage  # back in the buffer


def test_weights_moved_to_another_dtype_take_separate_products(tiny) -> None:
    model, chat = tiny
    merged = copy.deepcopy(model)
    merge_projections(merged)
    merged.to(torch.float64)
    want = copy.deepcopy(model).to(torch.float64)
    torch.testing.assert_close(
        _logits(merged, chat, True), _logits(want, chat, False), rtol=0, atol=0
    )


def test_a_merged_model_saves_and_reloads_every_weight(tiny, tmp_path) -> None:
    model, chat = tiny
    assert saveable_state_dict(model) is None  # nothing merged: save_pretrained's own
    merged = copy.deepcopy(model)
    merge_projections(merged)
    merged.save_pretrained(tmp_path / "full", state_dict=saveable_state_dict(merged))
    copy.deepcopy(merged).save_pretrained(tmp_path / "copy")  # an export's throwaway copy
    want = model.state_dict()
    for folder in ("full", "copy"):
        chat.processor.save_pretrained(tmp_path / folder)
        loaded, _ = load_policy(tmp_path / folder)
        got = loaded.state_dict()
        assert set(got) == set(want)
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)


def test_the_config_key_is_off_by_default_and_refused_with_sharded_weights() -> None:
    assert load_config(None).generator.inference_engine.merged_projections is False
    on = ["generator.inference_engine.merged_projections=true"]
    assert load_config(None, on).generator.inference_engine.merged_projections is True
    sharded = [
        *on,
        "trainer.strategy=fsdp",
        "trainer.placement.num_cpu_workers=2",
        "trainer.policy.model.lora.rank=0",
    ]
    with pytest.raises(ConfigError, match="merged_projections=true .* shards"):
        load_config(None, sharded)
    load_config(None, [*on, "trainer.strategy=ddp", "trainer.placement.num_cpu_workers=2"])


@pytest.mark.gpu
def test_on_cuda_merged_products_replay_in_graph_steps_and_keep_the_logits(tmp_path) -> None:
    build_model("tiny", tmp_path, arch="qwen3_vl", image_size=224, overwrite=True)
    model, processor = load_policy(tmp_path, dtype="bfloat16", device=torch.device("cuda"))
    model.eval()
    chat = ChatFormat(processor)
    merged = copy.deepcopy(model)
    merge_projections(merged)
    ids = _ids(chat).cuda()
    with torch.no_grad(), projections_merged():
        got = merged(input_ids=ids).logits.float()
    want = model(input_ids=ids).logits.float()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()  # bf16: the same products
    rows = generate_rows("maze_2d/small", 3, env_options={"cell_px": 32})
    settings = RolloutSettings(3, 3, 4096, SamplingParams(temperature=1.0, max_tokens=6))
    engine = InferenceEngine(merged, chat, cuda_graphs=True, merged_projections=True)
    trajs = play(engine, rows, settings, seed=5)
    assert all(t.turns >= 1 for t in trajs)


def test_a_forward_that_trains_the_weights_takes_separate_products_even_inside(tiny) -> None:
    model, chat = tiny
    plain, merged = copy.deepcopy(model), copy.deepcopy(model)
    merge_projections(merged)
    for m, inside in ((plain, False), (merged, True)):
        with projections_merged(inside):
            m(input_ids=_ids(chat)).logits.square().mean().backward()
    q = _attention(merged).q_proj.weight
    assert q.grad is not None
    torch.testing.assert_close(q.grad, _attention(plain).q_proj.weight.grad, rtol=1e-5, atol=1e-6)
