"""Checked exercises for the course notebooks.

Each notebook has one exercise: a code cell (tagged ``exercise``) with a function for you to
fill in, followed by a cell that checks it against the library or against one process (02 and
03 add a second such pair that builds on the earlier notebooks' answers)::

    with checking("the ring's reduce-scatter"):
        assert torch.equal(my_reduce_scatter(...), expected)

Until you fill the function in, it raises ``NotImplementedError`` and the check says the
exercise is still open; once filled in, a wrong answer fails the check's assertions. The
model answers are in ``course/solutions/`` (one file per notebook); the course's test run
puts them in place of the exercise cells and then the checks must pass.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

#: Set by the course's test run (``course/conftest.py``): the solutions are filled in, so
#: an exercise that is still open is an error there.
SOLUTIONS_ENV = "LIGHTNING_PAR_COURSE_SOLUTIONS"


@contextmanager
def checking(name: str) -> Iterator[None]:
    """Run the checks of exercise ``name``: say "open" while the function is not written
    (it raises ``NotImplementedError``), "correct" when every assertion holds."""
    try:
        yield
    except NotImplementedError:
        if os.environ.get(SOLUTIONS_ENV) == "1":
            raise
        print(f"Exercise ({name}): still open. Fill in the function above, run its cell, "
              "then run this cell again.")  # fmt: skip
        return
    print(f"Exercise ({name}): correct.")


@contextmanager
def borrowing_none(*modules: str) -> Iterator[None]:
    """Fail the check if code of ``modules`` (dotted prefixes such as
    ``"lightning_par.paramserver"``) ran inside the block: the exercise asks for the rule
    written out, not the library's helper called. Only this thread's Python calls are seen."""
    import sys

    called: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if any(name == m or name.startswith(m + ".") for m in modules):
                called.append(f"{name}.{frame.f_code.co_name}")

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(previous)
    assert not called, (
        f"your answer called the library's {called[0]}: the exercise is to write it yourself"
    )
