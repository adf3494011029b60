"""What the subprocess scripts tests/parallel_*.py share."""

import re


def raises(fn, match):
    """fn() must raise a ValueError whose message matches `match` (re.search)."""
    try:
        fn()
    except ValueError as e:
        assert re.search(match, str(e)), str(e)
    else:
        raise AssertionError(f"no ValueError matching {match!r}")
