"""nbstamp: a stamp of the sources a notebook's saved outputs were produced from.

`make notebooks` (run_notebooks.py --update) records the stamp in the notebook's metadata
(key "moe_source_stamp"); `make test-notebooks` (--check) recomputes it and fails when a
stamped source has changed since, naming the files, so committed outputs cannot silently
go stale. The check reads files and hashes them: it needs no Jupyter and takes well under
a second.

What is stamped, and why (the trade-off: too broad a set and every commit invalidates
every notebook; too narrow and a real change slips through):

  - the notebook's own code cells: the programs that print the outputs;
  - notebooks-c/moenb.py: how %%c, %moe and %mpirun cells compile and run;
  - every .c and .h under lib/: the %%c cells link libmoe.a, and the programs they run
    (moe-train, the chapter benchmarks) are built on it. The trainer reaches almost all
    of lib/, so a per-function closure would exclude little and could miss a change;
  - the headers a %%c cell #includes from kernels/ (lib/ is already in);
  - the source of each program a %moe or %mpirun cell runs (programs/NAME.c or
    chapters/*/NAME.c);
  - every file under tools/ or docs/results/ that a code cell names (a folder named there:
    every file in it): the plotting tools a figure cell runs and the results it draws.

Not stamped: the Makefile (it changes with every new target, and the notebooks' outputs
almost never do), kernels/*.cu (the notebooks run on the CPU: no GPU code produces their
outputs), tests/, the rest of docs/, and data/. Timings in the outputs vary from run to
run anyway; the stamp says which code produced them, not that the numbers repeat.
"""
import hashlib
import json
import re
from pathlib import Path

#: The metadata key under which the stamp is stored.
KEY = "moe_source_stamp"
#: The pseudo-path under which the notebook's code cells are stamped.
CELLS = "(the notebook's code cells)"

_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
_PROGRAM = re.compile(r"^\s*%(?:moe|mpirun\s+-np\s+\d+)\s+(\S+)", re.M)
_NAMED = re.compile(r"(?<![\w/.])((?:tools|docs/results)/[\w./-]*)")


def _digest(data):
    # 16 hex digits (64 bits) per file: plenty to see a change, short enough for diffs.
    return hashlib.sha256(data).hexdigest()[:16]


def code_cells(nb):
    """The sources of a notebook's code cells (nb: the notebook as parsed JSON)."""
    out = []
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            src = cell.get("source", "")
            out.append("".join(src) if isinstance(src, list) else src)
    return out


def sources(nb, repo):
    """The repository-relative paths (sorted) whose content the notebook's outputs depend on."""
    repo = Path(repo)
    paths = {"notebooks-c/moenb.py"}
    paths.update(p.relative_to(repo).as_posix() for p in repo.glob("lib/**/*")
                 if p.suffix in (".c", ".h") and p.is_file())
    for src in code_cells(nb):
        for inc in _INCLUDE.findall(src):
            if (repo / "kernels" / inc).is_file():
                paths.add(f"kernels/{inc}")
        for prog in _PROGRAM.findall(src):
            cands = [repo / "programs" / f"{prog}.c", *repo.glob(f"chapters/*/{prog}.c")]
            paths.update(c.relative_to(repo).as_posix() for c in cands if c.is_file())
        for named in _NAMED.findall(src):
            target = repo / named.rstrip("/.")
            files = [target] if target.is_file() else (
                sorted(f for f in target.rglob("*") if f.is_file()) if target.is_dir() else [])
            paths.update(f.relative_to(repo).as_posix() for f in files)
    return sorted(paths)


def compute(nb, repo):
    """The stamp of nb's sources now: {path: digest}, with the code cells under CELLS."""
    stamp = {CELLS: _digest("\0".join(code_cells(nb)).encode())}
    for rel in sources(nb, repo):
        stamp[rel] = _digest((Path(repo) / rel).read_bytes())
    return stamp


def changed(nb, repo):
    """None when nb's saved stamp matches its sources now, else the list of what differs:
    the added, removed or edited paths, or ["no stamp"] when nb has none."""
    saved = nb.get("metadata", {}).get(KEY)
    if not isinstance(saved, dict):
        return ["no stamp"]
    now = compute(nb, repo)
    diff = sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k))
    return diff or None


def stale_message(name, diff):
    """The line --check prints for a notebook whose outputs come from older sources."""
    if diff == ["no stamp"]:
        why = "it has no source stamp (metadata." + KEY + ")"
    else:
        shown = ", ".join(diff[:6]) + (f" and {len(diff) - 6} more" if len(diff) > 6 else "")
        why = f"its saved outputs come from older sources (changed: {shown})"
    return f"{name}: {why}; run `make notebooks` and commit"


def load(path):
    """A notebook file as parsed JSON (no nbformat needed)."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)
