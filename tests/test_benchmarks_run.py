"""The suite's engine and training benchmarks run to the end on a CPU at tiny shapes.

They are written for a GPU, where time is scarce: a script that breaks after a change
should fail here, not on the device. Each runs as a user runs it (its own process, its
command line, ``python benchmarks/SCRIPT.py``) and must print its table's rows; the figures
themselves mean nothing on a CPU. The research probes (``benchmarks/research/``) are not run
here: they are not part of the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"
ATTENTION = ["--device", "cpu", "--batch", "2", "--min-width", "20", "--max-width", "60"]
SMALL_HEADS = ["--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--repeats", "2"]

RUNS = {
    "decode_attention": (
        ["decode_attention.py", *ATTENTION, *SMALL_HEADS],
        ["sdpa_mask", "engine_varlen", "triton_s4"],
    ),
    "prefill_attention": (
        ["prefill_attention.py", *ATTENTION, "--chunk", "8", *SMALL_HEADS],
        ["sdpa_mask", "engine_varlen", "triton"],
    ),
    "decode": (
        ["decode.py", "--preset", "tiny", "--batch", "2", "--min-width", "20"]
        + ["--max-width", "40", "--steps", "2", "--warmup", "1", "--caches"]
        + ["static,varlen,triton+fused", "--kernels"],
        ["static", "varlen", "triton+fused", "device time a decode step", "matmul"],
    ),
    "rollout": (
        ["rollout.py", "--preset", "tiny", "--env-id", "maze_2d/easy", "--prompts", "2"]
        + ["--samples", "2", "--max-turns", "2", "--skip-baseline", "--cuda-graphs"]
        + ["--varlen", "--fused", "--prefill-varlen", "--triton", "--defaults"]
        + ["--prefill-triton", "--profile"]
        + ["--prefill-kernels"]
        + ["--device", "cpu"],
        ["clew triton", "clew defaults", "clew triton prefill", "prefill forwards"]
        + ["whole rollout", "vision tower"]
        + ["images through the vision tower", "prefill kernels", "matmul"],
    ),
    "grpo_step": (
        ["grpo_step.py", "--preset", "tiny", "--prompts", "2", "--samples", "2"]
        + ["--max-turns", "2", "--steps", "1", "--micro-batch", "2", "--device", "cpu"]
        + ["--skip-baseline", "--compare-set", "generator.inference_engine.fused_pointwise=false"],
        ["generate", "lp diff mean", "floor of the last step", "the first run against the second"],
    ),
    "update": (
        ["update.py", "--preset", "tiny", "--env", "maze_2d/tiny", "--prompts", "2"]
        + ["--samples", "2", "--steps", "1"],
        ["peft_lora", "1.00x"],  # the last configuration's row and the baseline's speed-up
    ),
    "update_attention": (
        ["update_attention.py", "--rows", "8", "--micro-batch", "4", "--steps", "1"]
        + ["--warmup", "0"],
        ["blocks", "dense", "flex", "1.00x"],
    ),
    "update_inputs": (
        ["update_inputs.py", "--preset", "tiny", "--prompts", "2", "--samples", "2"]
        + ["--max-turns", "3", "--repeats", "1"],
        ["images (baseline)", "kept frames", "pixel diff 0", "collate"],
    ),
    "logprob_guard": (
        ["logprob_guard.py", "--preset", "tiny", "--device", "cpu", "--prompts", "2"]
        + ["--samples", "2", "--max-turns", "2"],
        ["engine old logprobs (baseline)", "use_tis"],
    ),
    "recipe_steps": (
        ["recipe_steps.py", "--recipe", "recipes/cpu-demo.yaml", "--steps", "2", "--device"]
        + ["cpu", "--set", "trainer.train_batch_size=2", "trainer.policy_mini_batch_size=2"]
        + ["generator.n_samples_per_prompt=2", "generator.max_turns=3"]
        + [
            "trainer.micro_train_batch_size_per_gpu=4",
            "trainer.micro_forward_batch_size_per_gpu=4",
        ]
        + ["--profile", "{tmp}/profile"],
        [
            "after",
            "eager",
            "speed-up",
            "eval s",
            "floor",
            "profile of step 2",
            "generate:",
            "update:",
        ],
    ),
    "sweep_jobs": (
        ["sweep_jobs.py", "--recipe", "recipes/cpu-demo.yaml", "--device", "cpu", "--runs", "2"]
        + ["--jobs", "1,2", "--steps", "1", "--warmup", "0", "--set"]
        + ["trainer.train_batch_size=2", "trainer.policy_mini_batch_size=2"]
        + ["generator.n_samples_per_prompt=2", "generator.max_turns=2"]
        + [
            "trainer.micro_train_batch_size_per_gpu=4",
            "trainer.micro_forward_batch_size_per_gpu=4",
        ],
        ["steps/min", "1.00x", "   2 "],  # the baseline's row and the side-by-side one's
    ),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_an_engine_benchmark_runs_to_its_table_on_a_cpu(name, tmp_path):
    argv, expected = RUNS[name]
    argv = [a.format(tmp=tmp_path) for a in argv]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / argv[0]), *argv[1:]],
        cwd=BENCHMARKS.parent,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    missing = [text for text in expected if text not in done.stdout]
    assert not missing, f"{missing} not in:\n{done.stdout[-3000:]}"
    # A kernel comparison prints a row for a candidate that raised too ("unavailable: ..."),
    # so its name alone does not say it ran: the expected ones must have been timed.
    unavailable = [
        line
        for line in done.stdout.splitlines()
        if "unavailable" in line and any(line.startswith(f"{text} ") for text in expected)
    ]
    assert not unavailable, "\n".join(unavailable)
    if name == "recipe_steps":  # a report per profiled phase, with its operators and functions
        for phase in ("generate", "update"):
            report = (tmp_path / "profile" / f"{phase}.txt").read_text()
            assert "Operators by own host time" in report and "Python functions by" in report
