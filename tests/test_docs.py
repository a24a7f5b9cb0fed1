import argparse
import contextlib
import io
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from clew.docs import config_page, metrics_page

DOCS = Path(__file__).parent.parent / "docs"
BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def test_generated_reference_pages_are_up_to_date():
    assert (DOCS / "config.md").read_text() == config_page(), "run `make docs`"
    assert (DOCS / "metrics.md").read_text() == metrics_page(), "run `make docs`"


def _index_tables(index: Path) -> dict[str, list[str]]:
    """The files an index's tables list (the first column's name), by section title."""
    tables: dict[str, list[str]] = {}
    title = ""
    for line in index.read_text().splitlines():
        if line.startswith("## "):
            title = line[3:]
        elif row := re.match(r"\| `([^`]+)` \|", line):
            tables.setdefault(title, []).append(row.group(1))
    return tables


@pytest.mark.parametrize("folder", [BENCHMARKS, BENCHMARKS / "research"], ids=lambda p: p.name)
def test_each_benchmarks_index_lists_every_file_of_its_folder_under_its_kind(folder):
    tables = _index_tables(folder / "README.md")
    listed = [name for names in tables.values() for name in names]
    present = {p.name for p in folder.glob("*.py")}
    index = folder.relative_to(BENCHMARKS.parent) / "README.md"
    assert not present - set(listed), f"list them in {index}: {sorted(present - set(listed))}"
    assert not set(listed) - present, f"{index} lists files not there: {set(listed) - present}"
    assert len(listed) == len(set(listed)), f"{index} lists a file twice: {sorted(listed)}"
    # A helper is imported by the scripts and never run; every other file is a script.
    helpers = {
        name for title, names in tables.items() if title.startswith("Helpers") for name in names
    }
    for name in listed:
        runs = 'if __name__ == "__main__":' in (folder / name).read_text()
        assert runs != (name in helpers), (
            f"{index}: {name} is {'a script' if runs else 'a helper'}; list it "
            + ("under a role" if runs else "under Helpers")
        )


def test_the_benchmarks_index_links_the_research_probes():
    assert "(research/README.md)" in (BENCHMARKS / "README.md").read_text()


# The serving manual's examples (docs/serving.md, and serving on Kubernetes in
# docs/kubernetes.md): every command parses with clew's own flags, the keyword flags come
# with the env option that reads keyword replies, and the adapter names are the ones a LoRA
# GRPO run exports.


def _section(page: str, title: str) -> str:
    text = (DOCS / page).read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def _serving() -> str:
    """docs/serving.md up to its limits and refusals, and docs/kubernetes.md's serving."""
    text = (DOCS / "serving.md").read_text()
    manual = text[: text.index("\n## Limits and refusals\n")]
    return manual + _section("kubernetes.md", "Serving")


def _commands(section: str) -> list[list[str]]:
    """Each command of the section's bash blocks as its argv (continued lines joined)."""
    import shlex

    out = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv and argv[-1] == "&":
                argv.pop()
            if argv:
                out.append(argv)
    return out


def _parse(argv: list[str]) -> argparse.Namespace:
    from clew.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(argv[1:])
    except SystemExit:
        raise AssertionError(f"docs: `{' '.join(argv)}` does not parse: {err.getvalue()}") from None


def test_every_clew_command_of_the_serving_section_parses_and_reads_its_replies():
    from clew.commands.registry import _env_options
    from clew.envs import make

    section = _serving()
    for paragraph in section.split("\n\n"):
        if "--reply-prefix '<action>'" in paragraph:  # keyword replies: the env must read them
            assert "action_format=keyword" in paragraph, paragraph
    clew = [argv for argv in _commands(section) if argv[0] == "clew"]
    assert {argv[1] for argv in clew} >= {"serve", "play", "eval"}
    for argv in clew:
        args = _parse(argv)
        if args.command != "play" or not args.reply_prefix:
            continue
        # A one-token reply between the prefix and the suffix, as --max-generate-length 1
        # writes it, is an action of the env these options make.
        env = make(args.env_id, **_env_options(args))
        env.reset(args.seed)
        _, _, _, info = env.step(args.reply_prefix + "up" + args.reply_suffix)
        assert not info["parse_error"], f"docs: `{' '.join(argv)}` cannot read its replies"


def test_the_serving_sections_adapter_names_are_the_ones_a_grpo_run_exports(tmp_path):
    from clew.checkpoint.state import Checkpointer
    from clew.serve.adapter_store import AdapterStore

    # What a LoRA GRPO run writes (clew/trainer/grpo.py: export every hf_save_interval steps and
    # at the end, export_best), listed as the server lists an adapter prefix.
    cfg = SimpleNamespace(trainer=SimpleNamespace(ckpt_path=None, export_path=None))
    exports = Checkpointer(cfg, tmp_path / "run")

    def write(folder: Path) -> None:
        (folder / "adapter_config.json").write_text("{}")
        (folder / "adapter_model.safetensors").write_bytes(b"")

    exports.export(write, 20)
    exports.export_best(write, 20, 0.5)
    exported = {re.sub(r"\d+", "N", n) for n in AdapterStore(exports.export_path).names()}
    assert exported == {"best", "global_step_N"}

    section = _serving()
    commands = _commands(section)
    model_ids = {_parse(a).model_id for a in commands if a[:2] == ["clew", "serve"]}
    model_ids |= set(re.findall(r"model_id=([\w.-]+)", section))
    # Adapters the section makes itself: a run's export copied under an adapter prefix.
    copied = {}
    for argv in commands:
        if "cp" in argv:
            source, dest = argv[-2:]
            copied[Path(dest).name] = source
    for source in copied.values():
        name = re.search(r"exports/([^/]+)/policy", source)
        assert name and re.sub(r"\d+", "N", name.group(1)) in exported, source
    names = {
        name
        for model_id in model_ids
        for name in re.findall(rf"{re.escape(model_id)}:([A-Za-z0-9][\w.-]*)", section)
        if not name.isupper()  # a placeholder: NAME, ADAPTER
    }
    assert names, "the section names no adapter"
    for name in names - set(copied):
        assert re.sub(r"\d+", "N", name) in exported, (
            f"docs/serving.md serves {name!r}, which a GRPO run does not export (it exports "
            f"{sorted(exported)}; an SFT run's final policy is full weights, served as --model)"
        )


def test_the_commands_tables_flags_exist():
    from clew.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    rows = re.findall(r"^\| `clew ([a-z][a-z-]*)(.*)$", _section("commands.md", "`clew`"), re.M)
    assert rows
    for command, rest in rows:
        flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", rest))
        missing = flags - set(sub.choices[command]._option_string_actions)
        assert not missing, f"docs/commands.md's table gives `clew {command}` {sorted(missing)}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_into_benchmarks_md_names_one_of_its_headings():
    root = DOCS.parent
    headings = re.findall(r"^#+ (.+)$", (root / "BENCHMARKS.md").read_text(), re.M)
    anchors = {_anchor(h) for h in headings}
    for page in [root / "README.md", *sorted(DOCS.glob("*.md"))]:
        for anchor in re.findall(r"BENCHMARKS\.md#([\w-]+)\)", page.read_text()):
            assert anchor in anchors, f"{page.name} links BENCHMARKS.md#{anchor}, no heading"
