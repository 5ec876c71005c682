"""Execute the research notebooks top to bottom with their committed settings; fail when a cell fails.

    python notebooks/execute.py                 # every notebook, in memory: the committed files stay as they are
    python notebooks/execute.py 02_loss_variants.ipynb --write   # store the outputs in the notebook (to commit)

Each notebook runs in a fresh kernel of this interpreter, with `notebooks/` as its working directory (as when
opened in Jupyter), so each one runs standalone. Prints the wall time of each notebook and the total.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

HERE = os.path.dirname(os.path.abspath(__file__))


def execute(path: str, timeout_s: int) -> nbformat.NotebookNode:
    """The notebook at `path`, executed in a fresh kernel; raises `CellExecutionError` at the first failing cell."""
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=timeout_s, kernel_name="python3", shutdown_kernel="immediate",
                            resources={"metadata": {"path": HERE}})
    client.execute()
    for cell in notebook.cells:  # wall-clock stamps would change every run: keep the stored files stable
        cell.get("metadata", {}).pop("execution", None)
    return notebook


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", help="file names in notebooks/ (default: all, in order)")
    parser.add_argument("--write", action="store_true", help="store the outputs back into the notebook files")
    parser.add_argument("--timeout", type=int, default=600, help="seconds one cell may take")
    args = parser.parse_args(argv)
    names = args.notebooks or sorted(n for n in os.listdir(HERE) if n.endswith(".ipynb"))
    total, failed = 0.0, []
    for name in names:
        path = os.path.join(HERE, os.path.basename(name))
        start = time.perf_counter()
        try:
            notebook = execute(path, args.timeout)
        except CellExecutionError as e:
            failed.append(name)
            print(f"{name}: FAILED after {time.perf_counter() - start:.0f} s\n{e}", file=sys.stderr, flush=True)
            continue
        seconds = time.perf_counter() - start
        total += seconds
        if args.write:
            nbformat.write(notebook, path)
        print(f"{name}: {seconds:.0f} s{' (outputs written)' if args.write else ''}", flush=True)
    print(f"total: {total:.0f} s for {len(names) - len(failed)} notebook(s)"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
