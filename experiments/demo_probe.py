"""The main job's phases with other settings, to compare GRPO recipes from one SFT start.

    python experiments/demo_probe.py OUT sft NAME [FIELD=VALUE ...]   # data + SFT into OUT
    python experiments/demo_probe.py OUT grpo NAME [FIELD=VALUE ...] [o:KEY=VALUE ...]

FIELD is a ``clew.demo.DemoPlan`` field (``grpo_lr=4e-4``); ``o:KEY=VALUE`` adds a config
override (``o:trainer.policy_mini_batch_size=4``). The grpo phase starts from OUT's SFT
checkpoint and writes OUT/runs/NAME, printing the demo's summary as JSON.
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch

from clew.demo import DemoPlan, grpo_from, make_datasets, make_sft_start

torch.set_num_threads(2)
out, phase, name = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
fields: dict[str, object] = {}
extra: list[str] = []
for arg in sys.argv[4:]:
    key, value = arg.split("=", 1)
    if key.startswith("o:"):
        extra.append(f"{key[2:]}={value}")
        continue
    default = {f.name: f.default for f in dataclasses.fields(DemoPlan)}[key]
    if "," in value:  # image_mean=0.83,0.83,0.83
        fields[key] = tuple(float(v) for v in value.split(","))
        continue
    fields[key] = (
        None if value == "None" else type(default)(value) if default is not None else int(value)
    )
plan = DemoPlan(**fields, extra_overrides=tuple(extra))
print(plan, flush=True)
rows = make_datasets(out, plan)
if phase == "sft":
    make_sft_start(out, plan, rows)
else:
    print(json.dumps(grpo_from(out, plan, rows, out / "models" / "sft", run_name=name)))
