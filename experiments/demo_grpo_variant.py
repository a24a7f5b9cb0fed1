"""The main job's GRPO stage again, from its SFT start, with extra `clew train` overrides.

    python experiments/demo_grpo_variant.py DEMO_DIR OUT_DIR [OVERRIDE ...]

DEMO_DIR is a finished `make demo RUN_DIR=...` (its data and SFT checkpoint are copied into
OUT_DIR, so the SFT start and the eval mazes are the same); the GRPO stage runs with the
demo's settings plus the overrides (e.g. the forced reply format, dynamic sampling) and
prints the same summary line, so a variant compares with the main job's figures directly.
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import replace
from pathlib import Path

from clew.data.rows import read_rows
from clew.demo import DemoPlan, grpo_from

demo, out, overrides = Path(sys.argv[1]), Path(sys.argv[2]), tuple(sys.argv[3:])
out.mkdir(parents=True, exist_ok=True)
for part in ("data", "models/sft"):
    shutil.copytree(demo / part, out / part, dirs_exist_ok=True)
rows = {split: read_rows(out / "data" / f"{split}.parquet") for split in ("train", "eval")}
grpo_from(out, replace(DemoPlan(), extra_overrides=overrides), rows, out / "models" / "sft")
