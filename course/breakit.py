"""Break it: show that a notebook's assertions would catch a wrong algorithm.

An assertion that passes whatever the algorithm does teaches nothing. Each notebook ends with
a "break it" cell that applies named mutations to what it taught (drop the 1/p, reverse the
ring, a wrong schedule order...) and re-runs the lesson's own check on the broken version::

    with broken("drop the 1/p", caught_by="the mean equals one process's gradient"):
        check_average(lambda grads: sum(grads))  # the lesson's check, given the mutant

The block must fail an assertion: then the cell prints which check caught the mutation. If
the block passes, the mutation survived, and ``broken`` raises :class:`MutationSurvived`, so
the notebook's run (and the course's test run) fails: the check no longer tests the lesson.
Only ``AssertionError`` counts as caught; any other exception is a bug in the mutation and
propagates as it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

#: Every mutation caught so far in this kernel: (mutation, the check that caught it).
CAUGHT: list[tuple[str, str]] = []


class MutationSurvived(AssertionError):
    """A mutated algorithm passed the lesson's check: the check cannot fail on a false lesson."""


@contextmanager
def broken(mutation: str, *, caught_by: str) -> Iterator[None]:
    """Expect the block, the lesson's check run on ``mutation``, to fail an assertion."""
    try:
        yield
    except MutationSurvived:
        raise
    except AssertionError as error:
        CAUGHT.append((mutation, caught_by))
        detail = str(error).splitlines()[0][:120] if str(error) else "assertion failed"
        print(f"Break it ({mutation}): caught by {caught_by}: {detail}")
        return
    raise MutationSurvived(
        f"mutation {mutation!r} passed {caught_by}: that check would also pass on a wrong "
        "algorithm; make it tighter"
    )
