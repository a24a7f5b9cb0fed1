from pathlib import Path

from clew.docs import config_page, metrics_page

DOCS = Path(__file__).parent.parent / "docs"


def test_generated_reference_pages_are_up_to_date():
    assert (DOCS / "config.md").read_text() == config_page(), "run `make docs`"
    assert (DOCS / "metrics.md").read_text() == metrics_page(), "run `make docs`"
