"""The bugs the fuzzer still finds, by signature (``runner.signature``: outcome | the child's
signature | generator | subject), each naming the issue-35 item that fixes it. A CI campaign
fails on any bug not listed here; fixing one makes its signature disappear: delete its line
(``tests/test_fuzz.py`` reports listed signatures that no longer occur in a long run).
A value is the item; a key is an ``fnmatch`` pattern (``*`` matches any run of characters)."""

from __future__ import annotations

from fnmatch import fnmatchcase

KNOWN: dict[str, str] = {
}


def item_of(signature: str) -> str | None:
    """The issue-35 item a bug's signature is known under, or None for a new bug."""
    for key, item in KNOWN.items():
        if fnmatchcase(signature, key):
            return item
    return None
