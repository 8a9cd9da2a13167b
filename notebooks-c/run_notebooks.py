#!/usr/bin/python3
"""Execute the notebooks of notebooks-c/ headlessly (nbclient, kernel "python3").

    /usr/bin/python3 notebooks-c/run_notebooks.py --check     # make test-notebooks
    /usr/bin/python3 notebooks-c/run_notebooks.py --update    # make notebooks

--check   first compares each notebook's source stamp (nbstamp.py) with the sources now
          and fails, naming the changed files, when the saved outputs come from older
          code; then executes each notebook in memory and never writes it; exit 1 on the
          first failing cell (a compile error, a non-zero exit, a Python error, a
          timeout), after printing that cell's source and output.
--stamps  only the stamp comparison of --check (fast; needs no Jupyter).
--update  executes each notebook and writes the outputs back into the .ipynb with a new
          source stamp, for committing; a notebook with a failing cell is left untouched
          (exit 1).

Notebooks run with the repository root as the working directory. Give notebook paths to
run only those (default: every notebooks-c/*.ipynb). The make variables of the build the
%%c cells link against come from $MOE_NB_MAKEFLAGS (e.g. "CUDA=0 BUILD=build/cpu"); the
kernel inherits it. Compiler warnings in %%c cells are errors here (MOE_NB_WERROR=1).
"""
import argparse
import os
import re
import sys
import time
from pathlib import Path

SKIP = ("notebooks: skipped: python3-nbclient / python3-ipykernel not installed "
        "(sudo apt-get install python3-nbclient python3-ipykernel)")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import nbstamp  # noqa: E402  (plain Python: the stamp check runs without Jupyter too)

try:
    import ipykernel  # noqa: F401  (the kernel the notebooks run in)
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellControlSignal, CellExecutionError, DeadKernelError
except ImportError:
    nbformat = None  # main() checks the stamps, then prints SKIP


def rel(path):
    """path relative to the repository root when it is inside it."""
    try:
        return path.relative_to(REPO)
    except ValueError:
        return path


def cell_output_text(cell):
    """The text of a code cell's outputs, as a terminal would show it."""
    parts = []
    for out in cell.get("outputs", []):
        kind = out.get("output_type")
        if kind == "stream":
            parts.append(out.get("text", ""))
        elif kind == "error":
            parts.append("\n".join(out.get("traceback", [])) + "\n")
        elif kind in ("execute_result", "display_data"):
            parts.append(out.get("data", {}).get("text/plain", "") + "\n")
    return re.sub(r"\x1b\[[0-9;]*m", "", "".join(parts))  # no terminal colours


def coalesce_streams(nb):
    """Merge each cell's consecutive stdout (stderr) outputs into one: smaller files, clean diffs."""
    for cell in nb.cells:
        merged = []
        for out in cell.get("outputs", []):
            prev = merged[-1] if merged else None
            if (out.get("output_type") == "stream" and prev is not None
                    and prev.get("output_type") == "stream" and prev.get("name") == out.get("name")):
                prev["text"] += out["text"]
            else:
                merged.append(out)
        if "outputs" in cell:
            cell.outputs = merged


def run_one(path, timeout, update):
    """Execute one notebook; return True when every cell ran without error."""
    nb = nbformat.read(path, as_version=4)
    stamp = nbstamp.compute(nb, REPO)  # of the sources this run executes
    started = {}
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(REPO)}},  # the kernel's working directory
        allow_errors=False,
        record_timing=False,  # no timestamps in the committed file
        on_cell_start=lambda cell, cell_index: started.update(index=cell_index, t=time.time()),
    )
    t0 = time.time()
    try:
        client.execute()
    except (CellControlSignal, CellExecutionError, DeadKernelError) as e:
        i = started.get("index")
        cell = nb.cells[i] if i is not None else None
        bar = "-" * 72
        print(f"notebooks: FAILED {rel(path)}"
              + (f", cell {i} (after {time.time() - started['t']:.1f} s)" if cell else ""))
        if cell is not None:
            print(f"{bar}\n{cell.source}\n{bar} output:\n{cell_output_text(cell)}{bar}")
        if isinstance(e, CellExecutionError):
            print(f"{e.ename}: {e.evalue.strip().splitlines()[0] if e.evalue.strip() else ''}")
        else:
            print(f"{type(e).__name__}: {str(e).strip()}")
        return False
    except Exception as e:  # the kernel did not start, the file is not a notebook, ...
        print(f"notebooks: FAILED {rel(path)}: {type(e).__name__}: {e}")
        return False
    dt = time.time() - t0
    ncode = sum(c.cell_type == "code" for c in nb.cells)
    if update:
        coalesce_streams(nb)
        nb.metadata[nbstamp.KEY] = stamp
        tmp = path.with_suffix(".ipynb.tmp")
        nbformat.write(nb, str(tmp))
        os.replace(tmp, path)
    print(f"notebooks: {'updated' if update else 'ok'} {rel(path)} "
          f"({ncode} code cells, {dt:.1f} s)")
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="execute, never write; exit 1 on error")
    mode.add_argument("--stamps", action="store_true",
                      help="only compare the source stamps (no execution); exit 1 when stale")
    mode.add_argument("--update", action="store_true", help="execute and write the outputs back")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per cell (default 300)")
    ap.add_argument("notebooks", nargs="*", type=Path, help="default: notebooks-c/*.ipynb")
    args = ap.parse_args()

    paths = [p.resolve() for p in args.notebooks] or sorted(HERE.glob("*.ipynb"))
    if not paths:
        print("notebooks: none found in notebooks-c/")
        return 0
    if not args.update:
        # Stale outputs fail before anything runs: the check is cheap, the run is not.
        stale = [(p, nbstamp.changed(nbstamp.load(p), REPO)) for p in paths]
        stale = [(p, d) for p, d in stale if d]
        for p, d in stale:
            print("notebooks: FAILED " + nbstamp.stale_message(rel(p), d))
        if stale:
            return 1
        print(f"notebooks: source stamps match ({len(paths)} notebook(s))")
        if args.stamps:
            return 0
    if nbformat is None:
        print(SKIP)
        return 0
    os.environ["MOE_NB_WERROR"] = "1"  # inherited by the kernel: warnings fail %%c cells
    # ipykernel's debugger otherwise warns about frozen modules on every kernel start
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    print(f"notebooks: {'updating' if args.update else 'checking'} {len(paths)} notebook(s)"
          f" (make flags: {os.environ.get('MOE_NB_MAKEFLAGS') or 'none'})", flush=True)
    ok = True
    for p in paths:
        ok = run_one(p, args.timeout, args.update) and ok
        sys.stdout.flush()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
