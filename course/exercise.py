"""Checked exercises for the course notebooks.

Each notebook has one exercise: a code cell (tagged ``exercise``) with a function for you to
fill in, followed by a cell that checks it against an answer computed another way (one
process, a brute force, a count of the messages in a trace, the simulator run by the check)
and fails an answer that only calls the library's own helper (:func:`own_work`); 02, 03 and
06 add further parts that build on the earlier answers::

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
from typing import Any

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
def own_work(*modules: Any, what: str = "the library's answer") -> Iterator[None]:
    """Fail the check if code of ``modules`` ran inside the block (module objects, or dotted
    names such as ``"lightning_par.paramserver"``; each with its submodules): the exercise
    is to compute the answer, not to borrow the helper the notebook imports
    (``plan_shards``, ``balance_by_cost``, ``device_schedule``, the simulator...). Only
    this thread's Python calls are seen."""
    import sys

    names = [m if isinstance(m, str) else m.__name__ for m in modules]
    borrowed: list[str] = []

    def note(frame, event, arg):  # a Python function starting: is it one of theirs?
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            if any(name == m or name.startswith(m + ".") for m in names):
                borrowed.append(f"{name}.{frame.f_code.co_name}")

    previous = sys.getprofile()
    sys.setprofile(note)
    try:
        yield
    finally:
        sys.setprofile(previous)
    assert not borrowed, (
        f"your answer called {borrowed[0]} ({what}): the exercise is to compute it yourself"
    )
