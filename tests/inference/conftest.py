"""Fixtures of this folder's tests (``tests/support``)."""

from support.engine_cases import maze_policy  # noqa: F401  (a fixture)
