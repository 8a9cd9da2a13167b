#!/usr/bin/python3
"""Tests of the notebooks' source stamp (nbstamp.py), so the stale-output check cannot
silently pass. Run by `make test-notebooks`; needs only the Python standard library.

    /usr/bin/python3 notebooks-c/test_nbstamp.py
"""
import json
import shutil
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import nbstamp  # noqa: E402

# A notebook with every kind of cell the stamp looks into.
CELLS = ['%%c\n#include "cpu/router.h"\n#include "cuda_ops.h"\nint main(void) { return 0; }\n',
         "%moe ch01_demo --device cpu\n",
         "%mpirun -np 2 moe-train --device cpu\n",
         'run(["tools/plot_bench.py", "bars", "docs/results/03-x.md"])\n'
         'R = "docs/results/runs/"  # a folder: every file in it\n']


def notebook(cells):
    return {"cells": [{"cell_type": "code", "source": c, "outputs": [], "metadata": {}}
                      for c in cells] + [{"cell_type": "markdown", "source": "text"}],
            "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


class FakeRepo(unittest.TestCase):
    """The stamp logic on a small made-up repository, one change at a time."""

    def setUp(self):
        self.repo = Path(tempfile.mkdtemp(prefix="nbstamp-"))
        self.addCleanup(shutil.rmtree, self.repo)
        for rel in ("lib/cpu/router.h", "lib/cpu/router.c", "lib/moe/dispatch_alltoall.c",
                    "kernels/cuda_ops.h", "kernels/router.cu", "programs/moe-train.c",
                    "chapters/01-x/ch01_demo.c", "notebooks-c/moenb.py", "Makefile",
                    "tests/test_router.c", "tools/plot_bench.py", "tools/other.py",
                    "docs/results/03-x.md", "docs/results/04-y.md", "docs/results/runs/a.jsonl",
                    "docs/results/runs/b/c.jsonl"):
            self.write(rel, "v1\n")
        self.nb = notebook(CELLS)
        self.nb["metadata"][nbstamp.KEY] = nbstamp.compute(self.nb, self.repo)

    def write(self, rel, text):
        path = self.repo / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    def test_fresh_stamp_matches(self):
        self.assertIsNone(nbstamp.changed(self.nb, self.repo))

    def test_stamped_sources(self):
        self.assertEqual(nbstamp.sources(self.nb, self.repo), [
            "chapters/01-x/ch01_demo.c", "docs/results/03-x.md", "docs/results/runs/a.jsonl",
            "docs/results/runs/b/c.jsonl", "kernels/cuda_ops.h", "lib/cpu/router.c",
            "lib/cpu/router.h", "lib/moe/dispatch_alltoall.c", "notebooks-c/moenb.py",
            "programs/moe-train.c", "tools/plot_bench.py"])

    def test_each_stamped_source_is_noticed(self):
        for rel in nbstamp.sources(self.nb, self.repo):
            with self.subTest(rel=rel):
                self.write(rel, "v2\n")
                self.assertEqual(nbstamp.changed(self.nb, self.repo), [rel])
                self.write(rel, "v1\n")

    def test_new_and_removed_library_files_are_noticed(self):
        self.write("lib/moe/new.c", "v1\n")
        self.assertEqual(nbstamp.changed(self.nb, self.repo), ["lib/moe/new.c"])
        (self.repo / "lib/moe/new.c").unlink()
        (self.repo / "lib/cpu/router.c").unlink()
        self.assertEqual(nbstamp.changed(self.nb, self.repo), ["lib/cpu/router.c"])

    def test_edited_code_cell_is_noticed(self):
        self.nb["cells"][1]["source"] = "%moe ch01_demo --device cpu --repeats 9\n"
        self.assertEqual(nbstamp.changed(self.nb, self.repo), [nbstamp.CELLS])

    def test_unstamped_files_and_markdown_do_not_invalidate(self):
        for rel in ("Makefile", "kernels/router.cu", "tests/test_router.c", "tools/other.py",
                    "docs/results/04-y.md"):
            self.write(rel, "v2\n")
        self.nb["cells"][-1]["source"] = "other text"
        self.nb["cells"][0]["outputs"] = [{"output_type": "stream", "name": "stdout",
                                           "text": "new output\n"}]
        self.assertIsNone(nbstamp.changed(self.nb, self.repo))

    def test_missing_or_tampered_stamp(self):
        del self.nb["metadata"][nbstamp.KEY]
        self.assertEqual(nbstamp.changed(self.nb, self.repo), ["no stamp"])
        self.nb["metadata"][nbstamp.KEY] = nbstamp.compute(self.nb, self.repo)
        self.nb["metadata"][nbstamp.KEY]["lib/cpu/router.c"] = "0" * 16
        self.assertEqual(nbstamp.changed(self.nb, self.repo), ["lib/cpu/router.c"])

    def test_message(self):
        msg = nbstamp.stale_message("notebooks-c/02-x.ipynb",
                                    ["lib/moe/dispatch_alltoall.c", "notebooks-c/moenb.py"])
        self.assertEqual(msg, "notebooks-c/02-x.ipynb: its saved outputs come from older "
                         "sources (changed: lib/moe/dispatch_alltoall.c, notebooks-c/moenb.py); "
                         "run `make notebooks` and commit")


class CommandLine(unittest.TestCase):
    """run_notebooks.py --stamps on copies of the real notebooks: exit status and message."""

    def run_stamps(self, path):
        return subprocess.run([sys.executable, str(HERE / "run_notebooks.py"), "--stamps",
                               str(path)], capture_output=True, text=True)

    def test_fresh_copy_then_a_stale_copy(self):
        # Whether the committed stamps are current is the job of --check itself (with its
        # own message); here each copy is stamped afresh, then one stamped file "changes".
        for real in sorted(HERE.glob("*.ipynb")):
            with self.subTest(notebook=real.name), tempfile.TemporaryDirectory() as tmp:
                copy = Path(tmp) / real.name
                nb = nbstamp.load(real)
                nb["metadata"][nbstamp.KEY] = nbstamp.compute(nb, HERE.parent)
                copy.write_text(json.dumps(nb))
                r = self.run_stamps(copy)
                self.assertEqual(r.returncode, 0, f"fresh {real.name}: {r.stdout}{r.stderr}")
                victim = next(k for k in nb["metadata"][nbstamp.KEY] if k.startswith("lib/"))
                nb["metadata"][nbstamp.KEY][victim] = "0" * 16  # as if lib/ changed since
                copy.write_text(json.dumps(nb))
                r = self.run_stamps(copy)
                self.assertEqual(r.returncode, 1, r.stdout + r.stderr)
                self.assertIn(f"{real.name}: its saved outputs come from older sources "
                              f"(changed: {victim}); run `make notebooks` and commit", r.stdout)


if __name__ == "__main__":
    unittest.main(verbosity=1)
