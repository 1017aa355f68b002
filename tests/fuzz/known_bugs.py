"""The bugs the fuzzer still finds, by signature (``runner.signature``: outcome | the child's
signature | generator | subject), each naming the issue-35 item that fixes it. A CI campaign
fails on any bug not listed here; fixing one makes its signature disappear: delete its line
(``tests/test_fuzz.py`` reports listed signatures that no longer occur in a long run).
A value is the item; a key may end in ``*`` to match any rest."""

from __future__ import annotations

KNOWN: dict[str, str] = {
}


def item_of(signature: str) -> str | None:
    """The issue-35 item a bug's signature is known under, or None for a new bug."""
    for key, item in KNOWN.items():
        if signature == key or (key.endswith("*") and signature.startswith(key[:-1])):
            return item
    return None
