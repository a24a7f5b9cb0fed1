from pathlib import Path

from clew.docs import config_page, metrics_page

DOCS = Path(__file__).parent.parent / "docs"


def test_generated_reference_pages_are_up_to_date():
    assert (DOCS / "config.md").read_text() == config_page(), "run `make docs`"
    assert (DOCS / "metrics.md").read_text() == metrics_page(), "run `make docs`"


def test_every_benchmark_script_is_listed_in_the_benchmarks_index():
    folder = Path(__file__).parent.parent / "benchmarks"
    index = (folder / "README.md").read_text()
    missing = [p.name for p in sorted(folder.glob("*.py")) if f"`{p.name}`" not in index]
    assert not missing, f"list them in benchmarks/README.md: {missing}"
