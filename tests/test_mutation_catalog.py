"""The mutation catalog (tests/mutations) stays applicable: a mutation whose snippet no longer occurs once in its file
cannot be run, so a refactor under it would leave its promise untested until someone runs the campaign. Two went
stale that way unnoticed (a changed return in the scheduler, a reworded rule in the search record)."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "mutations"))

from catalog import MUTATIONS, TESTS_FOR  # noqa: E402
from run import stale_snippets  # noqa: E402


def test_every_mutation_applies_to_the_code_and_names_its_killers():
    assert stale_snippets(MUTATIONS) == []
    assert all(TESTS_FOR.get(m.name) for m in MUTATIONS), [m.name for m in MUTATIONS if not TESTS_FOR.get(m.name)]
