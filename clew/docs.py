"""The generated reference pages (configuration keys, metric names), kept in ``docs/``."""

from __future__ import annotations

from pathlib import Path

# Where clew's maths differs from SkyRL's on purpose, one line each (listed in config.md).
SKYRL_DEPARTURES: tuple[str, ...] = (
    "A group of one sample gets advantage 0 under `grpo` (SkyRL gives it its reward, taking "
    "mean 0 and std 1): one sample has nothing to be compared with.",
    "A group whose rewards are all equal gets exactly 0 (SkyRL computes `(r - mean) / (std + "
    "1e-6)`, where the rounding of the mean can leave a residue that the division magnifies).",
    "Dual clip is on whenever `trainer.algorithm.clip_ratio_c` is set; it defaults to null "
    "(SkyRL applies it only with `policy_loss_type: dual_clip`, with `clip_ratio_c` 3.0). "
    "With another built-in loss (`gspo`, `cispo`, `clip_cov`, `kl_cov`, `sapo`) setting it is "
    "an error (SkyRL ignores it).",
    "Every policy loss clamps each token's log-ratio to +-20 before `exp` (SkyRL: `regular`, "
    "`cispo` and `sapo` do; `clip_cov` and `kl_cov` do not; `gspo` clamps the sequence's "
    "log-ratio at +10 after averaging unclamped tokens).",
    "`trainer.algorithm.cispo` defaults to `cispo_eps_clip_low` 1 and `cispo_eps_clip_high` 4, "
    "the weight range [0, 5] of SkyRL's later releases (ScaleRL's; the paper sets no lower "
    "bound); SkyRL 0.4's 0 and 5 give [1, 6]. `clip_cov`'s `clip_fraction` counts the tokens PPO's "
    "clip drops as well as those the covariance drops (SkyRL's `clip_ratio`: the latter only).",
    "The KL penalty's log-ratio is clamped to +-20 for every estimator (SkyRL: `k3` only), and "
    "the `k3` estimate is not clamped to [-10, 10] afterwards, so a token far from the "
    "reference keeps the penalty's gradient.",
    "PPO's old logprobs are the engine's sampling logprobs unless "
    "`trainer.algorithm.recompute_old_logprobs` (or `use_tis`) is set (SkyRL always scores "
    "the batch with the trainer's forward first): clew's engine samples from the trainer's "
    "own weights, so the two differ by the kernels' rounding only, which "
    "`policy/logprob_diff_*` reports every step.",
)


def config_page() -> str:
    from clew.commands.stages import FLAG_ALIASES
    from clew.config import schema_markdown

    departures = [f"- {line}" for line in SKYRL_DEPARTURES]
    flags = [
        f"| `clew {command} {flag}` | `{key}` |"
        for command, table in FLAG_ALIASES.items()
        for flag, key in table.items()
    ]
    return (
        "# Configuration reference\n\nGenerated from the schema (`clew/config/schema.py` and its section modules) by "
        "`make docs`; every key takes a dotted `key=value` override on `clew train`.\n\n"
        + schema_markdown()
        + "\n## Command-line flags\n\nShort flags that stand for one key each; a `key=value` "
        "override given too wins.\n\n| flag | key |\n|---|---|\n"
        + "\n".join(flags)
        + "\n\n`clew train`, `clew sft` and `clew pipeline` take `--print-config`: the resolved "
        "configuration (the YAML a run saves as `config.yaml`) is printed once it passes the "
        "configuration's own checks (keys, types, ranges), and nothing runs.\n"
        + "\n## Departures from SkyRL\n\nWhere clew and SkyRL share a key or a loss, the "
        "maths is SkyRL's, except:\n\n" + "\n".join(departures) + "\n"
    )


def metrics_page() -> str:
    from clew.metrics import catalog_markdown

    return (
        "# Metrics\n\nGenerated from `clew/metrics/catalog.py` by `make docs`.\n\n"
        + catalog_markdown()
        + "\n"
    )


def write_docs(folder: str | Path) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.md").write_text(config_page())
    (folder / "metrics.md").write_text(metrics_page())
