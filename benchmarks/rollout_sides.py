"""The sides ``benchmarks/rollout.py`` plays: transformers' re-encoding ``model.generate``
(the baseline, also ``benchmarks/grpo_step.py``'s) and clew's engine under each set of its
switches. Each side plays ``rows`` x ``n_samples`` episodes and returns their counts of
episodes, env steps, generated and prefilled tokens."""

from __future__ import annotations

import torch

from clew.envs import make
from clew.inference.engine import (
    EngineOptions,
    resolve_decode_attention,
    resolve_prefill_attention,
)
from clew.inference.sampling import SamplingParams
from clew.kernels.fused_pointwise import fuse_pointwise
from clew.rollout.loop import RolloutSettings, play


def baseline(policy, rows, n_samples: int, max_turns: int, max_tokens: int) -> dict[str, float]:
    model, processor = policy.model, policy.processor
    tok = processor.tokenizer
    episodes = []
    for row in rows:
        for _ in range(n_samples):
            env = make(row.env_id, **row.options())
            obs = env.reset(row.seed)
            episodes.append(
                {"env": env, "msgs": [_user(obs)], "images": list(obs.images), "done": False}
            )
    steps = gen_tokens = prefill_tokens = 0
    torch.manual_seed(0)
    for _ in range(max_turns):
        active = [e for e in episodes if not e["done"]]
        if not active:
            break
        texts = [
            processor.apply_chat_template(e["msgs"], add_generation_prompt=True) for e in active
        ]
        inputs = processor(
            text=texts, images=[e["images"] for e in active], padding=True, return_tensors="pt"
        ).to(model.device)
        prefill_tokens += int(inputs["attention_mask"].sum())
        with torch.no_grad():
            out = model.generate(
                **inputs,
                max_new_tokens=max_tokens,
                do_sample=True,
                temperature=1.0,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
            )
        new = out[:, inputs["input_ids"].shape[1] :]
        for e, ids in zip(active, new, strict=True):
            ids = [int(t) for t in ids if int(t) != tok.pad_token_id]
            gen_tokens += len(ids)
            reply = tok.decode(ids, skip_special_tokens=True)
            obs, _, done, _ = e["env"].step(reply)
            steps += 1
            e["msgs"].append({"role": "assistant", "content": [{"type": "text", "text": reply}]})
            e["msgs"].append(_user(obs))
            e["images"] += obs.images
            e["done"] = done or e["env"].turn >= max_turns
    return {"episodes": len(episodes), "steps": steps, "gen": gen_tokens, "prefill": prefill_tokens}


def _user(obs) -> dict:
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": obs.text}]}


ENV_WORKERS = [0]  # generator.env_workers of the clew sides (--env-workers)


def clew_side(policy, rows, n_samples: int, max_turns: int, max_tokens: int) -> dict[str, float]:
    settings = RolloutSettings(
        n_samples,
        max_turns,
        32768,
        SamplingParams(1.0, max_tokens=max_tokens),
        env_workers=ENV_WORKERS[0],
    )
    trajs = play(policy.engine, rows, settings, seed=0)
    prefill = sum(len(t.token_ids) - t.generated_tokens for t in trajs)
    return {
        "episodes": len(trajs),
        "steps": sum(t.turns for t in trajs),
        "gen": sum(t.generated_tokens for t in trajs),
        "prefill": prefill,
    }


def graphs_side(policy, rows, n_samples: int, max_turns: int, max_tokens: int) -> dict:
    """``clew_side`` with decode steps replayed from CUDA graphs (their captures included)."""
    policy.engine.cuda_graphs = True
    try:
        return clew_side(policy, rows, n_samples, max_turns, max_tokens)
    finally:
        policy.engine.cuda_graphs = False


def attention_side(attention: str, fused: bool = False, prefill: str = "sdpa"):
    """``graphs_side`` with ``decode_attention=attention`` (sdpa, varlen, triton), with
    ``fused`` the engine's fused rotary and gate (``fused_pointwise``) and
    ``prefill_attention=prefill``."""

    def side(policy, rows, n_samples: int, max_turns: int, max_tokens: int) -> dict:
        engine = policy.engine
        keys = ("decode_attention", "fused_pointwise", "prefill_attention")
        before = [getattr(engine, k) for k in keys]
        for k, v in zip(keys, (attention, fused, prefill), strict=True):
            setattr(engine, k, v)
        if fused:
            fuse_pointwise(engine.model)
        try:
            return graphs_side(policy, rows, n_samples, max_turns, max_tokens)
        finally:
            for k, v in zip(keys, before, strict=True):
                setattr(engine, k, v)

    return side


def defaults_side(policy, prefill: str | None = None):
    """``attention_side`` with the engine's defaults (``EngineOptions``: what ``clew train``
    runs), ``decode_attention=auto`` resolved as the engine resolves it on this device;
    ``prefill`` instead of the default prefill attention if given."""
    d = EngineOptions()
    attention = resolve_decode_attention(d.decode_attention, policy.engine.device)
    prefill = resolve_prefill_attention(prefill or d.prefill_attention, policy.engine.device)
    return attention_side(attention, d.fused_pointwise, prefill)
