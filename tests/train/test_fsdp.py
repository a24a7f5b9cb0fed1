"""trainer.strategy=fsdp: two workers sharding a fully fine-tuned policy with FSDP2 (gloo, CPU)
take one worker's steps, sample what it samples, and move their state to and from it.

The two ranks are ``DataParallelWorker``s in two spawned processes (a process group needs
one process per rank; ``support.fsdp.Ranks``), started once for the module and driven over
pipes; the one worker they are compared with runs in the test's process.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from support.fsdp import ATOL, FULL, Ranks, assert_same_weights

from clew.config import load_config
from clew.config.ignored import IgnoredKeyWarning, reset_ignored_warnings
from clew.data.rows import generate_rows
from clew.errors import ClewError
from clew.inference.engine import InferenceEngine
from clew.inference.sampling import SamplingParams
from clew.models import load_policy
from clew.rollout.loop import RolloutSettings, play
from clew.train import PolicyWorker, PPOSettings
from clew.train.fsdp import shards_policy
from clew.train.model_batch import Sample
from clew.train.training_batch import TrainingBatch

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = RolloutSettings(2, 2, 4096, SamplingParams(temperature=0.0, max_tokens=6))
SAMPLED = RolloutSettings(2, 2, 4096, SamplingParams(temperature=1.0, max_tokens=6))


@pytest.fixture(scope="module")
def ranks(model_dir):
    group = Ranks(2, model_dir, FULL, num_threads=1, strategy="fsdp")
    yield group
    group.close()


@pytest.fixture(scope="module")
def start(model_dir) -> dict:
    return PolicyWorker.from_pretrained(model_dir, FULL).state_dict()


def fresh(model_dir, start: dict) -> PolicyWorker:
    worker = PolicyWorker.from_pretrained(model_dir, FULL)
    worker.load_state_dict(start)
    return worker


@pytest.fixture(scope="module")
def rows():
    return generate_rows("maze_2d/tiny", 2, env_options={"cell_px": 28, "action_format": "keyword"})


def one_worker_rollouts(worker: PolicyWorker, rows, settings: RolloutSettings, seed: int):
    worker.model.eval()
    return play(InferenceEngine(worker.model, worker.chat), rows, settings, seed=seed)


def moved(weights: dict, start: dict) -> float:
    return max((weights[k] - start["trainable"][k]).abs().max().item() for k in weights)


def sharded_update(ranks: Ranks, batch: TrainingBatch, settings: PPOSettings) -> list[dict]:
    """PPO on ``batch`` by the two ranks, each on its share of every mini-batch."""
    per_worker = PPOSettings(
        **{**settings.__dict__, "mini_batch_size": settings.mini_batch_size // 2}
    )
    shares = batch.split(2, settings.mini_batch_size)
    return ranks.call("update", per_rank=[(s, per_worker) for s in shares])


@pytest.fixture(scope="module")
def episodes(model_dir, start, rows) -> TrainingBatch:
    """4 sampled maze episodes (images in every sequence) with advantages."""
    trajs = one_worker_rollouts(fresh(model_dir, start), rows, SAMPLED, seed=3)
    return TrainingBatch.from_trajectories(trajs, torch.tensor([1.0, -1.0, 0.5, -0.5]))


@pytest.fixture(scope="module")
def texts(chat) -> TrainingBatch:
    """8 text sequences; with mini-batches of 4, rank 1's share of the second (sequences 6
    and 7) has no loss token at all, so it only joins rank 0's passes."""
    tok = chat.processor.tokenizer
    seqs = []
    for i in range(8):
        ids = tok(f"go {'left ' * (i % 3)}then up {i}", add_special_tokens=False)["input_ids"]
        n_reply = 0 if i >= 6 else 1 + i % 3
        seqs.append(Sample(ids, [0] * (len(ids) - n_reply) + [1] * n_reply))
    old = [torch.full((len(s.token_ids) - 1,), -2.0) for s in seqs]
    return TrainingBatch(seqs, torch.tensor([1.0, -1.0, 0.5, 2.0, -0.5, 1.5, 1.0, -2.0]), old)


def test_the_strategy_shards_only_full_fine_tuning_on_several_workers():
    assert shards_policy("fsdp", 2, 0) and shards_policy("fsdp2", 4, 0)
    assert not shards_policy("fsdp", 2, 8)  # LoRA: the base stays whole
    assert not shards_policy("fsdp", 1, 0)
    assert not shards_policy("ddp", 2, 0) and not shards_policy("none", 2, 0)
    with pytest.raises(ClewError, match="accepted: fsdp, fsdp2, ddp, none"):
        shards_policy("zero3", 2, 0)


def test_fsdp2_is_accepted_and_the_strategy_is_no_longer_an_ignored_key():
    reset_ignored_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(None, ["trainer.strategy=fsdp2"])
        load_config(None, ["trainer.strategy=ddp"])
    assert cfg.trainer.strategy == "fsdp2"
    assert not [w for w in caught if issubclass(w.category, IgnoredKeyWarning)]


def test_sharded_workers_sample_what_one_whole_worker_samples(ranks, model_dir, start, rows):
    assert ranks.call("sharded") == [True, True]
    ranks.call("load_state_dict", start)
    expected = one_worker_rollouts(fresh(model_dir, start), rows, GREEDY, seed=0)
    for played in ranks.call("generate", rows, GREEDY, 0):
        assert [t.token_ids for t in played] == [t.token_ids for t in expected]
        for got, want in zip(played, expected, strict=True):
            torch.testing.assert_close(
                torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0
            )


def test_a_sharded_worker_with_no_rows_still_joins_the_gathering(ranks, model_dir, start, rows):
    """Gathering the weights is a collective: a group with fewer rows than workers must still
    call every worker, the idle ones with no rows."""
    ranks.call("load_state_dict", start)
    expected = one_worker_rollouts(fresh(model_dir, start), rows[:1], GREEDY, seed=0)
    played, idle = ranks.call("generate", per_rank=[(rows[:1], GREEDY, 0), ([], GREEDY, 0)])
    assert idle == []
    assert [t.token_ids for t in played] == [t.token_ids for t in expected]


def test_gathering_inside_a_gathered_block_keeps_the_weights_whole(ranks):
    assert ranks.call("module:gathered_inside_gathered") == [[True, False]] * 2


@pytest.mark.parametrize("kl", [False, True], ids=["ppo", "ppo+kl"])
def test_two_sharded_workers_take_the_step_of_one_worker_on_images(
    ranks, model_dir, start, episodes, kl
):
    settings = PPOSettings(
        mini_batch_size=4, micro_batch_size=1, use_kl_loss=kl, kl_loss_coef=0.5 if kl else 0.0
    )
    worker = fresh(model_dir, start)
    metrics = worker.train_batch(episodes, settings)
    expected = worker.state_dict()["trainable"]
    assert moved(expected, start) > 10 * ATOL
    ranks.call("load_state_dict", start)
    got = sharded_update(ranks, episodes, settings)
    state, rest = ranks.call("state_dict")
    assert rest == {}  # rank 0 holds the whole state
    assert_same_weights(state["trainable"], expected)
    for m in got:
        assert m["policy/loss"] == pytest.approx(metrics["policy/loss"], abs=1e-6)
        assert m["policy/grad_norm"] == pytest.approx(metrics["policy/grad_norm"], rel=1e-5)
        if kl:
            assert m["policy/kl_loss"] == pytest.approx(metrics["policy/kl_loss"], abs=1e-6)


def test_a_worker_with_nothing_to_learn_joins_the_others_passes(ranks, model_dir, start, texts):
    settings = PPOSettings(loss_reduction="sequence_mean", mini_batch_size=4, micro_batch_size=2)
    worker = fresh(model_dir, start)
    metrics = worker.train_batch(texts, settings)
    ranks.call("load_state_dict", start)
    got = sharded_update(ranks, texts, settings)
    state = ranks.call("state_dict")[0]
    assert_same_weights(state["trainable"], worker.state_dict()["trainable"])
    assert got[0]["policy/optimizer_steps"] == metrics["policy/optimizer_steps"] == 2
    assert got[1]["policy/loss"] == pytest.approx(metrics["policy/loss"], abs=1e-6)


def test_a_worker_with_fewer_images_to_learn_from_joins_the_others_passes(
    ranks, model_dir, start, episodes
):
    """Rank 0 takes 3 episodes, rank 1 one: rank 1's last two passes have no image while
    rank 0's have, and every weight still gets the one-worker gradient."""
    settings = PPOSettings(micro_batch_size=1)
    worker = fresh(model_dir, start)
    metrics = worker.train_batch(episodes, settings)
    ranks.call("load_state_dict", start)
    got = ranks.call(
        "update",
        per_rank=[(episodes.select([0, 1, 2]), settings), (episodes.select([3]), settings)],
    )
    state = ranks.call("state_dict")[0]
    assert_same_weights(state["trainable"], worker.state_dict()["trainable"])
    assert got[1]["policy/grad_norm"] == pytest.approx(metrics["policy/grad_norm"], rel=1e-5)


def test_state_moves_between_two_sharded_workers_and_one(ranks, model_dir, start, episodes):
    settings = PPOSettings(mini_batch_size=4, micro_batch_size=2)
    ranks.call("load_state_dict", start)
    sharded_update(ranks, episodes, settings)
    saved = ranks.call("state_dict")[0]
    assert saved["optimizer"]["state"]  # AdamW's moments, whole
    one = fresh(model_dir, start)
    one.load_state_dict(saved)
    assert_same_weights(one.state_dict()["trainable"], saved["trainable"], atol=0)
    # The second step depends on the optimizer state: both continue from the checkpoint.
    one.train_batch(episodes, settings)
    sharded_update(ranks, episodes, settings)
    after = ranks.call("state_dict")[0]
    assert_same_weights(after["trainable"], one.state_dict()["trainable"])
    # And back: one worker's state loads into the sharded workers as it is.
    ranks.call("load_state_dict", one.state_dict())
    back = ranks.call("state_dict")[0]
    assert_same_weights(back["trainable"], one.state_dict()["trainable"], atol=0)
    for i, s in one.state_dict()["optimizer"]["state"].items():
        for k, v in s.items():
            torch.testing.assert_close(back["optimizer"]["state"][i][k], v, atol=0, rtol=0)
    assert back["optimizer_steps"] == one.optimizer_steps == 2


def test_sharded_workers_export_the_whole_policy(ranks, start, tmp_path):
    ranks.call("load_state_dict", start)
    ranks.call("export", str(tmp_path / "policy"))
    model, _ = load_policy(tmp_path / "policy")
    exported = dict(model.named_parameters())
    assert exported.keys() == start["trainable"].keys()
    for k, v in start["trainable"].items():
        torch.testing.assert_close(exported[k].detach(), v, atol=0, rtol=0)
    a, b = ranks.call("trainable_fingerprint")
    assert a == b
