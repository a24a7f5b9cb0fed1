"""Commands on policies: init-model, eval, export."""

from __future__ import annotations

import argparse
import difflib
import json
from collections.abc import Sequence
from typing import Any

from clew.agent.flags import add_generation_args, positive_int, rollout_settings
from clew.commands.agent import add_endpoint_args, eval_through_endpoint
from clew.commands.registry import Handler, command
from clew.errors import ClewError

# Fields of the language / vision config a user sets with --text / --vision; the rest (ids,
# vocabulary, output width) follow from the tokenizer and the other fields.
TEXT_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_parameters",
    "max_position_embeddings",
)
VISION_FIELDS = (
    "depth",
    "hidden_size",
    "intermediate_size",
    "num_heads",
    "hidden_act",
    "deepstack_visual_indexes",
    "num_position_embeddings",
)


def parse_fields(pairs: Sequence[str], accepted: Sequence[str], flag: str) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as a dict; VALUE is read as JSON (16, [3, 7], "gelu"), else text."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ClewError(f"{flag} takes KEY=VALUE, got {pair!r} (e.g. {flag} depth=16)")
        if key not in accepted:
            near = difflib.get_close_matches(key, accepted, n=1, cutoff=0.5)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ClewError(f"{flag} does not set {key!r}{hint} accepted: {', '.join(accepted)}")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def _three_floats(flag: str, text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) != 3:
        raise ClewError(f"{flag} expected three numbers R,G,B (e.g. 0.83,0.83,0.83), got {text!r}")
    return values


@command("init-model", "build a Qwen-VL policy with random weights, offline")
def _init_model(p: argparse.ArgumentParser) -> Handler:
    p.add_argument(
        "--preset",
        default="tiny",
        help="tiny | small | deep | medium | base | qwen3vl-8b (see clew.models.presets)",
    )
    p.add_argument("--output", required=True, help="folder for the Hugging Face checkpoint")
    p.add_argument("--image-size", type=positive_int, default=None, help="largest image side in px")
    p.add_argument(
        "--arch",
        default=None,
        help="qwen2_vl | qwen3_vl (default: the preset's own, qwen3_vl for qwen3vl-8b; else "
        "qwen2_vl)",
    )
    p.add_argument(
        "--device",
        default=None,
        help="make the weights directly on this device (cuda, cuda:N, cpu), in bfloat16 on "
        "CUDA (qwen3vl-8b: no 35 GB float32 host copy); default: on the host in float32",
    )
    p.add_argument(
        "--dtype",
        default=None,
        help="float32 | bfloat16 | float16 (default: bfloat16 with --device cuda, else float32)",
    )
    p.add_argument(
        "--vocab-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="exactly N tokenizer entries: the task tokenizer padded with entries no text "
        "encodes to (151936: a real Qwen vocabulary, e.g. to measure its output layer)",
    )
    p.add_argument("--patch-size", type=positive_int, default=None, help="vision patch in px")
    p.add_argument("--merge-size", type=positive_int, default=2, help="patches merged per side")
    p.add_argument("--seed", type=int, default=0)
    for flag, part, fields in (
        ("--text", "language-model", TEXT_FIELDS),
        ("--vision", "vision-tower", VISION_FIELDS),
    ):
        p.add_argument(
            flag,
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help=f"replace one {part} field of the preset ({', '.join(fields)})",
        )
    p.add_argument(
        "--image-mean",
        default=None,
        metavar="R,G,B",
        help="pixel normalization mean per channel, in [0, 1] (default: the architecture's)",
    )
    p.add_argument("--image-std", default=None, metavar="R,G,B")
    p.add_argument(
        "--position-table",
        default="sincos",
        help="qwen3_vl vision position table at start: sincos | centered (less its mean, "
        "0.3x: see clew.models.qwen3.init_position_table)",
    )
    p.add_argument("--overwrite", action="store_true")

    def run(args: argparse.Namespace) -> int:
        from clew.envs.base import text_corpus
        from clew.models import PRESETS, build_model

        if args.preset not in PRESETS:
            raise ClewError(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
        built = build_model(
            args.preset,
            args.output,
            corpus=text_corpus(),
            seed=args.seed,
            image_size=args.image_size,
            arch=args.arch,
            device=args.device,
            dtype=args.dtype,
            padded_vocab_size=args.vocab_size,
            patch_size=args.patch_size,
            merge_size=args.merge_size,
            text_overrides=parse_fields(args.text, TEXT_FIELDS, "--text"),
            vision_overrides=parse_fields(args.vision, VISION_FIELDS, "--vision"),
            image_mean=_three_floats("--image-mean", args.image_mean),
            image_std=_three_floats("--image-std", args.image_std),
            position_table=args.position_table,
            overwrite=args.overwrite,
        )
        where = f" on {args.device}" if args.device else ""
        print(
            f"wrote {args.preset} model ({built.num_parameters:,} parameters, "
            f"{len(built.processor.tokenizer):,} vocabulary entries; weights made{where} in "
            f"{built.build_s:.1f} s, saved in {built.save_s:.1f} s) to {built.path}"
        )
        return 0

    return run


@command(
    "eval", "play every maze of a dataset (greedily, or n sampled times) and report the solve rate"
)
def _eval(p: argparse.ArgumentParser) -> Handler:
    p.add_argument(
        "--model",
        required=True,
        help="checkpoint directory; with --endpoint, the served model ID or ID:ADAPTER",
    )
    p.add_argument("--adapter", help="LoRA adapter directory (adapter_config.json)")
    p.add_argument("--data", required=True, help="eval parquet from `clew dataset --split eval`")
    p.add_argument(
        "--output-dir", default="runs/eval", help="metrics.json, trajectories.jsonl, gifs/"
    )
    add_generation_args(p)
    p.add_argument("--device", default="auto")
    p.add_argument("--num-gifs", type=int, default=4)
    add_endpoint_args(p, required=False)
    p.add_argument(
        "--concurrency",
        type=positive_int,
        default=16,
        help="with --endpoint: episodes played at once (their requests batched by the server)",
    )
    p.add_argument(
        "--n-samples-per-prompt",
        type=positive_int,
        default=1,
        help="episodes per maze (as generator.eval_n_samples_per_prompt); above 1 reports "
        "eval/all/pass_at_<n> and needs --temperature > 0",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument(
        "--prompt-format",
        help="as environment.prompt_format: play the rows under this format (a name: clew, "
        "visgym, skyrl-visgym) instead of the one they were made with",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="step every decode eagerly (by default a GPU replays decode steps from CUDA graphs)",
    )

    def run(args: argparse.Namespace) -> int:
        if args.temperature < 0:
            raise ClewError(f"--temperature must be >= 0 (0: greedy), got {args.temperature}")
        if args.n_samples_per_prompt > 1 and args.temperature == 0:
            raise ClewError(
                f"--n-samples-per-prompt {args.n_samples_per_prompt} needs --temperature > 0: "
                "greedy episodes of one maze are all the same"
            )
        if args.endpoint and args.adapter:
            raise ClewError(
                "--adapter is for a local checkpoint; through --endpoint name the served "
                "adapter in --model ID:ADAPTER"
            )
        from clew.data.rows import read_rows
        from clew.inference.runtime import open_policy
        from clew.rollout.evaluation import evaluate

        rows = read_rows(args.data)
        if args.prompt_format is not None:
            from clew.data.rows import with_env_option
            from clew.envs.prompt_format import resolve_format

            resolve_format(args.prompt_format)  # an unknown name fails here, listing them
            rows = with_env_option(rows, "prompt_format", args.prompt_format)
        settings = rollout_settings(args, max(r.max_turns for r in rows), args.n_samples_per_prompt)
        if args.endpoint:
            return eval_through_endpoint(args, rows, settings, _print_eval)
        policy = open_policy(
            args.model, args.adapter, device=args.device, cuda_graphs=not args.enforce_eager
        )
        if settings.sampling.allowed_tokens:
            # A text that is not one token fails here.
            policy.engine.allowed_ids(settings.sampling.allowed_tokens)
        metrics, _ = evaluate(
            policy.engine,
            rows,
            settings,
            output_dir=args.output_dir,
            num_gifs=args.num_gifs,
            seed=args.seed,
        )
        _print_eval(metrics, args.output_dir)
        return 0

    return run


def _print_eval(metrics: dict[str, float], output_dir: str) -> None:
    """Every metric on its own line, then the walkthrough's pass rule and clew's solve rate
    together on one line."""
    from clew.rollout.evaluation import headline

    for k, v in metrics.items():
        print(f"{k}: {v:.4f}")
    print(headline(metrics))
    print(f"trajectories and GIFs in {output_dir}")


@command(
    "export",
    "merge a run's LoRA adapter into its base: a standard Hugging Face checkpoint that plain "
    "transformers and vLLM load",
)
def _export(p: argparse.ArgumentParser) -> Handler:
    p.add_argument("--model", required=True, help="the base checkpoint the adapter was trained on")
    p.add_argument(
        "--adapter",
        required=True,
        help="an exported adapter folder (export_path/global_step_N/policy)",
    )
    p.add_argument("--output", required=True)
    p.add_argument(
        "--merge",
        action="store_true",
        help="merge the adapter into full weights (required: the adapter folder itself is "
        "already the adapter export, loadable with peft and vLLM)",
    )
    p.add_argument(
        "--max-shard-size",
        default=None,
        metavar="SIZE",
        help="largest weight file; bigger models are split into model-0000N-of-0000M.safetensors "
        "with model.safetensors.index.json (bytes, or a number with KB/MB/GB/TB; default 5GB)",
    )

    def run(args: argparse.Namespace) -> int:
        from clew.models import load_policy
        from clew.models.adapter_loading import load_adapter
        from clew.models.hf_export import DEFAULT_MAX_SHARD_SIZE, parse_shard_size, write_export

        if not args.merge:
            raise ClewError(
                "only --merge is supported: an adapter folder is already an adapter export"
            )
        shard_size = args.max_shard_size or DEFAULT_MAX_SHARD_SIZE
        try:
            parse_shard_size(shard_size)
        except ClewError as error:
            raise ClewError(f"--max-shard-size: {error}") from None
        model, processor = load_policy(args.model)
        merged = load_adapter(model, args.adapter).merge_and_unload()
        out = write_export(
            merged,
            processor,
            args.output,
            base_dir=args.model,
            owned=True,
            max_shard_size=shard_size,
        )
        dtype = str(next(merged.parameters()).dtype).removeprefix("torch.")
        print(f"wrote merged weights ({dtype}) to {out}")
        return 0

    return run
