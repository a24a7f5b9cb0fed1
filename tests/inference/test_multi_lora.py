"""Per-row LoRA adapters in the engine (clew.inference.multi_lora) on tiny Qwen2-VL and
Qwen3-VL policies: a batch mixing the base and two adapters of different ranks samples, row
for row, what each adapter samples alone through peft, across turns and finished rows."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from PIL import Image

from clew.errors import ModelError
from clew.inference.engine import InferenceEngine
from clew.inference.multi_lora import RowLoRALinear
from clew.inference.sampling import SamplingParams
from clew.models import build_model, load_policy
from clew.models.chat import ChatFormat
from clew.train.lora import LANGUAGE_MODEL_TARGETS

# peft asks transformers a deprecated question when it wraps a model.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")

IMAGE_SIZE = {"qwen2_vl": 56, "qwen3_vl": 64}
# Row i runs MIX[i]; "a" is rank 2, "b" rank 4 (rsLoRA scaling), None the bare base.
MIX: list[str | None] = [None, "a", "b", "a", "b", None]
DROPPED = 1  # leaves after the first turn, so the last row moves into its slot
MAX_TOKENS = 6


def _adapter(base_dir, out, rank: int, alpha: float, seed: int, **extra) -> str:
    model, _ = load_policy(base_dir)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=LANGUAGE_MODEL_TARGETS, **extra)
    peft = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:  # peft starts B at zero: an adapter that changes nothing
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    peft.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl"])
def setup(request, tmp_path_factory, one_thread):
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    build_model("tiny", root / "base", arch=arch, image_size=IMAGE_SIZE[arch], overwrite=True)
    adapters = {
        "a": _adapter(root / "base", root / "a", rank=2, alpha=16, seed=1),
        "b": _adapter(root / "base", root / "b", rank=4, alpha=8, seed=2, use_rslora=True),
    }
    _, processor = load_policy(root / "base")
    return root / "base", adapters, ChatFormat(processor), arch


def _base(base_dir) -> torch.nn.Module:
    model, _ = load_policy(base_dir)
    return model.eval()


def _turn(chat: ChatFormat, arch: str, seqs: list[int], first: bool) -> dict:
    out = {}
    for s in seqs:
        shade = (40 * s % 256, 90, 200 - 20 * s)
        image = Image.new("RGB", (IMAGE_SIZE[arch],) * 2, shade)
        text = "move " + "left " * (1 + s % 3) + ("first" if first else "again")
        out[s] = chat.user_turn(text, [image], first=first)
    return out


def _episode(engine, chat, arch, params, adapters, seed: int = 7):
    """Two turns of a batch of len(adapters) rows, row DROPPED leaving after the first."""
    batch = engine.open_batch(len(adapters), seed=seed, adapters=adapters)
    seqs = list(range(len(adapters)))
    first = batch.extend_and_generate(_turn(chat, arch, seqs, True), params)
    batch.drop([DROPPED])
    kept = [s for s in seqs if s != DROPPED]
    second = batch.extend_and_generate(_turn(chat, arch, kept, False), params)
    return first, second


def _alone(setup, params, stop_token_ids=None):
    """Each row's generations as its adapter samples them alone (peft, unmerged)."""
    base_dir, adapters, chat, arch = setup
    peft = PeftModel.from_pretrained(_base(base_dir), adapters["a"], adapter_name="a")
    peft.load_adapter(adapters["b"], adapter_name="b")
    peft.eval()
    engine = InferenceEngine(peft, chat, stop_token_ids=stop_token_ids)
    runs = {}
    for name in ("a", "b"):
        peft.set_adapter(name)
        runs[name] = _episode(engine, chat, arch, params, [None] * len(MIX))
    with peft.disable_adapter():
        runs[None] = _episode(engine, chat, arch, params, [None] * len(MIX))
    return runs


def _mixed(setup, params, stop_token_ids=None, strategy: str = "grouped"):
    base_dir, adapters, chat, arch = setup
    engine = InferenceEngine(_base(base_dir), chat, stop_token_ids=stop_token_ids)
    engine.lora.strategy = strategy
    engine.add_adapter("a", adapters["a"])
    engine.add_adapter("b", adapters["b"])
    return _episode(engine, chat, arch, params, MIX)


def _assert_rows_match(mixed, alone, tol: float = 1e-4) -> None:
    for turn in (0, 1):
        for seq, gen in mixed[turn].items():
            ref = alone[MIX[seq]][turn][seq]
            assert gen.token_ids == ref.token_ids, f"turn {turn} row {seq} ({MIX[seq]})"
            assert gen.finish_reason == ref.finish_reason
            diff = (torch.tensor(gen.logprobs) - torch.tensor(ref.logprobs)).abs().max()
            assert float(diff) < tol, f"turn {turn} row {seq}: logprobs differ by {diff:.2e}"


def _stop_id_ending_rows_apart(turn: dict) -> int:
    """A token that, as a stop token, ends the rows of ``turn`` at different steps."""
    gens = list(turn.values())
    for token in dict.fromkeys(t for g in gens for t in g.token_ids):
        ends = {g.token_ids.index(token) if token in g.token_ids else MAX_TOKENS for g in gens}
        if len(ends) > 1:
            return token
    pytest.skip("no sampled token ends the rows at different steps")


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
def test_a_mixed_batch_samples_what_each_adapter_samples_alone(setup, temperature):
    chat = setup[2]
    params = SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS)
    # A stop token chosen so rows end at different decode steps of the first turn.
    stop = _stop_id_ending_rows_apart(_mixed(setup, params)[0])
    stops = (chat.im_end_id, stop)
    mixed = _mixed(setup, params, stops)
    alone = _alone(setup, params, stops)
    _assert_rows_match(mixed, alone)
    assert len({len(g.token_ids) for g in mixed[0].values()}) > 1
    # The adapters matter: each changes some row's reply from the base's.
    for name in ("a", "b"):
        assert any(alone[name][0][s].token_ids != alone[None][0][s].token_ids for s in range(6))


def test_the_gather_strategy_samples_what_the_grouped_one_does(setup):
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS)
    grouped = _mixed(setup, params)
    gathered = _mixed(setup, params, strategy="gather")
    for turn in (0, 1):
        for seq, gen in grouped[turn].items():
            assert gen.token_ids == gathered[turn][seq].token_ids
            diff = (torch.tensor(gen.logprobs) - torch.tensor(gathered[turn][seq].logprobs)).abs()
            assert float(diff.max()) < 1e-4


def test_adapters_leave_the_weights_alone_and_can_be_removed_and_reloaded(setup):
    base_dir, adapters, chat, arch = setup
    model = _base(base_dir)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    params_before = [id(p) for p in model.parameters()]
    engine = InferenceEngine(model, chat)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    bare = _episode(engine, chat, arch, greedy, [None] * len(MIX))

    engine.add_adapter("a", adapters["a"])
    engine.add_adapter("b", adapters["b"])
    assert any(isinstance(m, RowLoRALinear) for m in model.modules())
    assert [id(p) for p in model.parameters()] == params_before
    assert list(model.state_dict()) == list(state)
    mixed = _episode(engine, chat, arch, greedy, MIX)
    # Base rows of a mixed batch are the bare model's rows.
    for turn in (0, 1):
        for seq, gen in mixed[turn].items():
            if MIX[seq] is None:
                assert gen.token_ids == bare[turn][seq].token_ids

    # "a" leaves; a batch still naming it fails at its next forward, not silently.
    open_batch = engine.open_batch(1, adapters=["a"])
    engine.remove_adapter("a")
    with pytest.raises(ModelError, match="no adapter 'a' is loaded"):
        open_batch.extend_and_generate(_turn(chat, arch, [0], True), greedy)
    # Its slot is reused by "a2" (the same weights), and "b" is untouched.
    with pytest.raises(ModelError, match="no adapter 'a' is loaded"):
        engine.open_batch(2, adapters=["a", None])
    engine.add_adapter("a2", adapters["a"])
    again = _episode(engine, chat, arch, greedy, [{"a": "a2"}.get(m, m) for m in MIX])
    assert again[0] == mixed[0] and again[1] == mixed[1]

    engine.remove_adapter("a2")
    engine.remove_adapter("b")
    assert _episode(engine, chat, arch, greedy, [None] * len(MIX)) == bare
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_bad_adapters_are_refused_and_change_nothing(setup, tmp_path):
    base_dir, adapters, chat, _ = setup
    engine = InferenceEngine(_base(base_dir), chat)
    engine.add_adapter("a", adapters["a"])
    from safetensors.torch import load_file

    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 16}
    tensors = load_file(f"{adapters['a']}/adapter_model.safetensors")
    wrong = {k: (v[:, :-1] if "lora_A" in k else v) for k, v in tensors.items()}
    with pytest.raises(ModelError, match="the base layer needs"):
        engine.add_adapter("wrong", (config, wrong))
    with pytest.raises(ModelError, match="no DoRA"):
        engine.add_adapter("dora", ({**config, "use_dora": True}, tensors))
    stray = {"base_model.model.model.nowhere.lora_A.weight": torch.zeros(2, 4), **tensors}
    with pytest.raises(ModelError, match="no Linear layer"):
        engine.add_adapter("stray", (config, stray))
    with pytest.raises(ModelError, match="is not a PEFT adapter folder"):
        engine.add_adapter("missing", tmp_path)
    with pytest.raises(ModelError, match="loaded already"):
        engine.add_adapter("a", adapters["a"])
    with pytest.raises(ModelError, match=r"no adapter 'c' is loaded \(loaded: a\)"):
        engine.open_batch(1, adapters=["c"])
    assert engine.lora.names() == ["a"]

    peft = PeftModel.from_pretrained(_base(base_dir), adapters["a"])
    with pytest.raises(ModelError, match="wrapped by peft"):
        InferenceEngine(peft, chat).add_adapter("b", adapters["b"])


def test_vision_tower_adapters_are_refused(setup, tmp_path):
    base_dir, _, chat, _ = setup
    model, _ = load_policy(base_dir)
    vision = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    vision = [n for n in vision if ".visual." in f".{n}."][:1]
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=vision))
    peft.save_pretrained(tmp_path)
    engine = InferenceEngine(_base(base_dir), chat)
    with pytest.raises(ModelError, match="language model only"):
        engine.add_adapter("eyes", tmp_path)
