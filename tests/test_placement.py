"""Where a run's work goes, without Ray: rollout rows spread over workers by expected cost,
and a cluster address that does not answer refused within seconds."""

from __future__ import annotations

import json
import socket
import time

import pytest

from clew.cluster.balance import assign_rows, expected_cost
from clew.cluster.placement import connect_ray
from clew.data.rows import Row
from clew.errors import ClewError


def row(turns_needed: int | None, max_turns: int = 10) -> Row:
    facts = {} if turns_needed is None else {"turns_needed": turns_needed}
    return Row("test/digits", "{}", 0, "train", "", max_turns, json.dumps(facts))


def test_a_rows_expected_cost_is_the_turns_its_expert_needs_within_its_budget():
    assert expected_cost(row(3)) == 3
    assert expected_cost(row(30)) == 10  # an episode stops at its turn budget
    assert expected_cost(row(None)) == 10  # unknown: the whole budget


def test_rows_go_to_workers_longest_first_to_the_least_loaded():
    costs = [1, 9, 1, 1, 4, 4, 1, 1]
    parts = assign_rows(costs, 2)
    assert sorted(i for p in parts for i in p) == list(range(8))  # every row once
    assert all(p == sorted(p) for p in parts)
    loads = sorted(sum(costs[i] for i in p) for p in parts)
    assert loads == [11, 11]  # contiguous halves would load 12 and 10


def test_rows_of_equal_cost_go_in_contiguous_count_balanced_chunks():
    assert assign_rows([2.0] * 5, 2) == [[0, 1, 2], [3, 4]]
    assert assign_rows([1.0] * 2, 3) == [[0], [1]]  # fewer rows than workers: none left empty
    assert assign_rows([], 4) == []
    assert assign_rows([5.0, 1.0], 1) == [[0, 1]]


def test_a_ray_address_that_does_not_answer_fails_fast_saying_so(monkeypatch):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    begun = time.monotonic()
    with pytest.raises(ClewError, match=rf"RAY_ADDRESS=127.0.0.1:{port} does not answer"):
        connect_ray(None)
    assert time.monotonic() - begun < 15
