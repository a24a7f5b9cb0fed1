"""Rows joining a running engine batch (``CacheBatch.add_rows``) on tiny Qwen2-VL and
Qwen3-VL policies: a row that joins samples what it samples alone, greedy and seeded, the
running rows sample what they would without it, and freed slots are reused."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from peft import LoraConfig, get_peft_model
from PIL import Image

from clew.errors import ConfigError
from clew.inference import cache_batch as batch_module
from clew.inference.engine import InferenceEngine
from clew.inference.kv_cache import kv_bytes_per_token
from clew.inference.sampling import SamplingParams
from clew.models import build_model, load_policy
from clew.models.chat import ChatFormat, Chunk
from clew.train.lora import LANGUAGE_MODEL_TARGETS

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")

IMAGE_SIZE = {"qwen2_vl": 56, "qwen3_vl": 64}
PER_CALL = 2  # tokens each extend_and_generate samples per row
NEVER = (-1,)  # no stop token: every row runs to its own limit


@dataclass(frozen=True)
class Arrival:
    """Row ``name`` arrives before call ``call`` and leaves after ``limit`` tokens."""

    name: str
    call: int
    limit: int
    adapter: str | None = None
    seed: int | None = None  # its own seed, if it joins


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl"])
def setup(request, tmp_path_factory, one_thread):
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    build_model("tiny", root / "base", arch=arch, image_size=IMAGE_SIZE[arch], overwrite=True)
    model, processor = load_policy(root / "base")
    peft = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=LANGUAGE_MODEL_TARGETS)
    )
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    peft.save_pretrained(root / "a")
    model, _ = load_policy(root / "base")
    # A budget, so the slots take a batch's capacity hint at once and never move after.
    budget = 64 * 256 * kv_bytes_per_token(model)
    engine = InferenceEngine(
        model.eval(), ChatFormat(processor), stop_token_ids=NEVER, max_cache_bytes=budget
    )
    engine.add_adapter("a", root / "a")
    return engine, arch


def _prompt(engine: InferenceEngine, arch: str, name: str) -> Chunk:
    k = ord(name[0])
    image = Image.new("RGB", (IMAGE_SIZE[arch],) * 2, (37 * k % 256, 90, 200 - k))
    return engine.chat.user_turn("go " + "left " * (k % 4), [image], first=True)


def _serve(engine, arch, arrivals: list[Arrival], params: SamplingParams, seed: int = 5):
    """Runs ``arrivals`` as a server would: the first call's rows open the batch, later ones
    join it; every call feeds new rows their prompt and the others their pending token.
    Returns each row's (tokens, logprobs) and the batch."""
    batch, seq_of, out = None, {}, {}
    for call in range(max(a.call for a in arrivals) + 64):
        come = [a for a in arrivals if a.call == call]
        if come and batch is None:
            adapters = [a.adapter for a in come]
            batch = engine.open_batch(len(come), seed=seed, adapters=adapters, capacity_hint=96)
            ids = list(range(len(come)))
        elif come:
            seeds = None if come[0].seed is None else [a.seed for a in come]
            ids = batch.add_rows(len(come), [a.adapter for a in come], seeds, tokens=96)
        for a, s in zip(come, ids if come else [], strict=True):
            seq_of[s] = a
            out[a.name] = ([], [])
        if batch is None or not batch.rows:
            if call > max(a.call for a in arrivals):
                break
            continue
        fresh = {s for s in batch.rows if batch.lengths[batch.rows.index(s)] == 0}
        chunks = {
            s: _prompt(engine, arch, seq_of[s].name) if s in fresh else Chunk([])
            for s in batch.rows
        }
        gens = batch.extend_and_generate(chunks, params)
        ended = []
        for s, g in gens.items():
            tokens, logprobs = out[seq_of[s].name]
            tokens += g.token_ids
            logprobs += g.logprobs
            if len(tokens) >= seq_of[s].limit:
                ended.append(s)
        batch.drop(ended)
    return out, batch


def _alone(engine, arch, arrival: Arrival, params) -> tuple[list[int], list[float]]:
    seed = 5 if arrival.seed is None else arrival.seed
    row = Arrival(arrival.name, 0, arrival.limit, arrival.adapter)
    return _serve(engine, arch, [row], params, seed=seed)[0][arrival.name]


def _assert_same(a, b, tol: float = 1e-4) -> None:
    # float32 rounding: a row's products are summed in another order in a batch of another
    # width (1.3e-5 seen with transformers 5.25)
    assert a[0] == b[0]
    assert max(abs(x - y) for x, y in zip(a[1], b[1], strict=True)) < tol


# A, B and C open the batch; B leaves after two calls, so D takes its slot; E and F need
# more slots than the batch has.
RUNNING = [Arrival("A", 0, 16), Arrival("B", 0, 4, "a"), Arrival("C", 0, 14)]


def _joining(seeded: bool) -> list[Arrival]:
    return [
        Arrival("D", 2, 8, "a", 11 if seeded else None),
        Arrival("E", 4, 6, None, 12 if seeded else None),
        Arrival("F", 4, 10, "a", 13 if seeded else None),
    ]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_a_joining_row_samples_what_it_samples_alone_and_leaves_the_others_as_they_were(
    setup, temperature
):
    engine, arch = setup
    params = SamplingParams(temperature=temperature, top_p=0.95, max_tokens=PER_CALL)
    joining = _joining(seeded=temperature > 0)
    together, _ = _serve(engine, arch, RUNNING + joining, params)
    without, _ = _serve(engine, arch, RUNNING, params)
    for row in RUNNING:
        _assert_same(together[row.name], without[row.name])
    for row in joining:
        _assert_same(together[row.name], _alone(engine, arch, row, params))
    assert {len(together[r.name][0]) for r in joining} == {6, 8, 10}


def test_freed_slots_are_reused_and_joining_rows_are_prefilled_on_their_own(setup, monkeypatch):
    engine, arch = setup
    shapes: list[tuple[int, int]] = []
    slots: list[tuple[int, tuple[int, ...]]] = []
    forward = batch_module.CacheBatch._forward

    def recording(batch, input_ids, *args, **kwargs):
        shapes.append(tuple(input_ids.shape))
        logits = forward(batch, input_ids, *args, **kwargs)
        slots.append((batch.kv.slots, tuple(t.data_ptr() for t in batch.kv.buffers())))
        return logits

    monkeypatch.setattr(batch_module.CacheBatch, "_forward", recording)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    _serve(engine, arch, RUNNING + [Arrival("D", 4, 3, "a")], params)
    # B left after its fourth token; D took its slot: three slots, buffers never moved.
    assert {s for s, _ in slots} == {3}
    assert len({ptrs for _, ptrs in slots}) == 1
    # D's call: the two running rows fed one token each, then D's prompt on its own.
    d_prompt = len(_prompt(engine, arch, "D").token_ids)
    assert shapes[4:6] == [(2, 1), (1, d_prompt)]
    # E and F need a fourth and fifth slot: the slots double.
    shapes.clear()
    slots.clear()
    _serve(engine, arch, RUNNING + _joining(seeded=False), params)
    assert max(s for s, _ in slots) == 6


def test_a_row_that_joins_after_another_left_below_it_samples_the_same(setup):
    engine, arch = setup
    params = SamplingParams(temperature=0.0, max_tokens=PER_CALL)
    batch = engine.open_batch(2, seed=5)
    rows = {0: _prompt(engine, arch, "A"), 1: _prompt(engine, arch, "C")}
    batch.extend_and_generate(rows, params)
    (d,) = batch.add_rows(1, ["a"])
    batch.drop([0])  # D moves into A's slot, below C: one padded forward prefills it
    assert batch.rows == [d, 1]
    first = batch.extend_and_generate({d: _prompt(engine, arch, "D"), 1: Chunk([])}, params)[d]
    second = batch.extend_and_generate({d: Chunk([]), 1: Chunk([])}, params)[d]
    joined = (first.token_ids + second.token_ids, first.logprobs + second.logprobs)
    _assert_same(joined, _alone(engine, arch, Arrival("D", 0, 4, "a"), params))


def test_joining_is_refused_past_the_budget(setup):
    engine, arch = setup
    prompt = _prompt(engine, arch, "A")
    tight = InferenceEngine(engine.model, engine.chat, max_cache_bytes=100 * engine.bytes_per_token)
    batch = tight.open_batch(1)
    batch.extend_and_generate({0: prompt}, SamplingParams(temperature=0.0, max_tokens=2))
    assert batch.can_add(1, 40) and not batch.can_add(1, 60)
    with pytest.raises(ConfigError, match="do not fit"):
        batch.add_rows(1, tokens=60)
    assert batch.add_rows(1, tokens=40) == [1]
