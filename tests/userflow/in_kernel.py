"""Runs ``flow.py`` in a Jupyter kernel, the way a student runs a notebook: its code pasted
into a cell (the LightningModule defined in the kernel's ``__main__``), Lightning choosing
the launcher a notebook allows. ``python in_kernel.py ARGS`` takes ``flow.py``'s arguments.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

if __name__ == "__main__":
    args = sys.argv[1:]
    code = Path(__file__).with_name("flow.py").read_text()
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [
        nbformat.v4.new_code_cell(f"import sys\nsys.argv = {['flow.py', *args]!r}"),
        nbformat.v4.new_code_cell(code),  # ends by calling main(), as __name__ is __main__
    ]
    client = NotebookClient(notebook, timeout=240, kernel_name="python3",
                            resources={"metadata": {"path": args[2]}})  # fmt: skip
    client.execute()
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            text = output.get("text") or "".join(output.get("traceback", []))
            print(text, end="" if text.endswith("\n") else "\n")
