"""moenb: run C in a stock Jupyter notebook, compiled against moe.c.

Load it in a notebook's first cell (with the notebook's folder or the repository root as
the working directory):

    import os, sys
    sys.path.insert(0, "notebooks-c" if os.path.isdir("notebooks-c") else ".")
    %load_ext moenb

Then:

    %%c [program arguments]
    #include <stdio.h>
    #include "cpu/router.h"      /* any header of lib/ or kernels/ */
    int main(int argc, char **argv) { ... }

    %moe ch01_moe_layer_bench --device cpu --shape small     # a built program from bin/

    %mpirun -np 2 ch02_dispatch_bench --device cpu           # the same, on 2 MPI ranks

    %moe_build                                                # show the compile command

    %moe_plot tools/plot_bench.py bars docs/results/03-grouped-gemm.md --table GEMM --out @out/g.png

A `%%c` cell is one complete C11 program. It is compiled with the project's own compiler
and flags, linked against the project's library (both asked from the Makefile once per
session with `make print-build-flags`, under the make variables in $MOE_NB_MAKEFLAGS, e.g.
"CUDA=0 BUILD=build/cpu"), and run from the repository root, so relative paths such as
data/tinyshakespeare.txt work. Its output (stdout and stderr, in order) appears in the
cell. A compile error or a non-zero exit raises an exception: the cell fails, and so does
a headless run (notebooks-c/run_notebooks.py). With MOE_NB_WERROR=1 (the runner sets it)
compiler warnings are errors too.

`%mpirun -np N PROGRAM args` runs `mpirun --oversubscribe --allow-run-as-root -np N
bin/PROGRAM args` from the repository root, with OMP_NUM_THREADS=1 (N ranks share the
cores) and Open MPI's permission to run as root (containers, CI); output and failures
are handled as for %moe. Where Open MPI is not installed it prints "skipped: ..." with the
install command and the notebook goes on.

`%moe_plot TOOL args` runs one of the plotting tools (tools/plot_metrics.py,
tools/plot_bench.py) with Debian's /usr/bin/python3, `@out` in args replaced by a fresh
temporary folder and an argument with `*` by the files it matches (from the repository root), and shows every PNG it wrote there inline, in file-name order (they are
saved in the notebook's output). Without matplotlib it prints "skipped: ..." with the
install command and the notebook goes on.
"""
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

#: The repository root: the parent of the folder that holds this file.
REPO = Path(__file__).resolve().parent.parent


class MoeNotebookError(Exception):
    """A cell failed. IPython shows only the message (no Python traceback)."""

    def _render_traceback_(self):
        return [f"{type(self).__name__}: {self}"]


class CompileError(MoeNotebookError):
    """The C cell did not compile (or link)."""


class RunError(MoeNotebookError):
    """The program exited with a non-zero status or was killed by a signal."""


_flags = {}  # `make print-build-flags`, per value of $MOE_NB_MAKEFLAGS


def build_flags():
    """CC, CFLAGS, LIB and LDLIBS from `make print-build-flags` (asked once per session)."""
    key = os.environ.get("MOE_NB_MAKEFLAGS", "")
    if key in _flags:
        return _flags[key]
    extra = shlex.split(key)
    cmd = ["make", "-s", "--no-print-directory", "-C", str(REPO), *extra, "print-build-flags"]
    r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise MoeNotebookError(f"`{shlex.join(cmd)}` failed:\n{r.stdout}{r.stderr}")
    flags = {}
    for line in r.stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep and key in ("CC", "CFLAGS", "LIB", "LDLIBS"):
            flags[key] = value.strip()
    missing = {"CC", "CFLAGS", "LIB", "LDLIBS"} - flags.keys()
    if missing:
        raise MoeNotebookError(f"`make print-build-flags` did not print {sorted(missing)}:\n{r.stdout}")
    # -MMD -MP would leave dependency files behind; they are for the Makefile only.
    flags["CFLAGS"] = [f for f in shlex.split(flags["CFLAGS"]) if f not in ("-MMD", "-MP")]
    flags["LDLIBS"] = shlex.split(flags["LDLIBS"])
    flags["CC"] = shlex.split(flags["CC"])
    flags["MAKEFLAGS"] = extra
    _flags[key] = flags
    return flags


def _make_hint():
    extra = " ".join(build_flags()["MAKEFLAGS"])
    return f"build it first, from {REPO}: make {extra}".rstrip()


def _run(argv, what, env=None):
    """Run argv from the repository root, streaming stdout+stderr into the cell; raise on failure.

    env: the program's environment (default: the kernel's)."""
    # Line-buffer the program's stdio (it writes to a pipe) so output appears as it comes,
    # and stdout and stderr interleave in the order they were written.
    if shutil.which("stdbuf"):
        argv = ["stdbuf", "-oL", "-eL", *argv]
    proc = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env)
    try:
        # (ipykernel sends what was written every 0.2 s, so output still appears live)
        for line in iter(proc.stdout.readline, b""):
            sys.stdout.write(line.decode("utf-8", "replace"))
        sys.stdout.flush()
        rc = proc.wait()
    except KeyboardInterrupt:  # Jupyter's "interrupt kernel" stops the program too
        proc.kill()
        proc.wait()
        raise
    finally:
        proc.stdout.close()
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        raise RunError(f"{what} was killed by {name}")
    if rc != 0:
        raise RunError(f"{what} exited with status {rc}")


def compile_c(source, workdir):
    """Compile one C program against the library; return the executable's path."""
    f = build_flags()
    lib = Path(f["LIB"])
    if not lib.is_file():
        raise CompileError(f"the library {lib} is not built: {_make_hint()}")
    src = Path(workdir) / "cell.c"
    exe = Path(workdir) / "cell"
    # #line makes the compiler's messages point at the cell's own lines, as Jupyter numbers
    # them (line 1 is the %%c line).
    src.write_text('#line 2 "cell.c"\n' + source)
    werror = ["-Werror"] if os.environ.get("MOE_NB_WERROR") == "1" else []
    cmd = [*f["CC"], *f["CFLAGS"], *werror, str(src), str(lib), *f["LDLIBS"], "-o", str(exe)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    msg = (r.stdout + r.stderr).replace(str(src), "cell.c")
    if r.returncode != 0:
        raise CompileError("the C cell did not compile:\n" + msg.rstrip())
    if msg.strip():  # warnings: show them, the program still runs
        sys.stderr.write(msg)
        sys.stderr.flush()
    return exe


def _program(name):
    """The path of bin/NAME, or a RunError that says how to build it."""
    exe = REPO / "bin" / name
    if not exe.is_file():
        have = sorted(p.name for p in (REPO / "bin").glob("*")) if (REPO / "bin").is_dir() else []
        raise RunError(f"bin/{name} not found (built: {', '.join(have) or 'nothing'}): "
                       f"{_make_hint()}")
    return exe


@magics_class
class MoeMagics(Magics):
    """%%c, %moe, %mpirun, %moe_plot and %moe_build."""

    @cell_magic
    def c(self, line, cell):
        """%%c [args]: compile the cell as a C11 program against moe.c and run it with args."""
        args = shlex.split(line)
        with tempfile.TemporaryDirectory(prefix="moenb-") as tmp:
            exe = compile_c(cell, tmp)
            _run([str(exe), *args], "the C cell")

    @line_magic
    def moe(self, line):
        """%moe PROGRAM [args]: run bin/PROGRAM from the repository root."""
        argv = shlex.split(line)
        if not argv:
            raise MoeNotebookError("usage: %moe PROGRAM [args]   (a program in bin/)")
        exe = _program(argv[0])
        _run([str(exe), *argv[1:]], f"bin/{argv[0]}")

    @line_magic
    def mpirun(self, line):
        """%mpirun -np N PROGRAM [args]: run bin/PROGRAM on N MPI ranks from the repository root."""
        argv = shlex.split(line)
        if len(argv) < 3 or argv[0] != "-np" or not argv[1].isdigit() or int(argv[1]) < 1:
            raise MoeNotebookError("usage: %mpirun -np N PROGRAM [args]   (a program in bin/)")
        launcher = shutil.which("mpirun")
        if launcher is None:
            # Open MPI is optional: without it the notebook's single-process cells still run,
            # so a multi-rank cell says why it did nothing instead of failing the notebook.
            print(f"skipped: mpirun -np {argv[1]} {argv[2]} needs Open MPI, which is not "
                  "installed here (sudo apt-get install openmpi-bin libopenmpi-dev, then make)")
            return
        _program(argv[2])  # a clear message when it is not built
        # N ranks share the machine's cores: one OpenMP thread each. Open MPI refuses to
        # start as root (containers, CI) unless both variables say it may.
        env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
                   OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   # containers often forbid Open MPI's single-copy (CMA) shared memory
                   OMPI_MCA_btl_vader_single_copy_mechanism="none")
        cmd = [launcher, "--oversubscribe", "--allow-run-as-root", "-np", argv[1],
               f"bin/{argv[2]}", *argv[3:]]
        _run(cmd, f"mpirun -np {argv[1]} bin/{argv[2]}", env=env)

    @line_magic
    def moe_plot(self, line):
        """%moe_plot TOOL [args]: run a plotting tool with @out a temporary folder; show its PNGs."""
        from IPython.display import Image, display
        argv = shlex.split(line)
        if not argv or not argv[0].startswith("tools/plot_") or "@out" not in line:
            raise MoeNotebookError("usage: %moe_plot tools/plot_NAME.py ARGS   "
                                   "(ARGS name the output as @out/...)")
        python = "/usr/bin/python3"
        has_mpl = subprocess.run([python, "-c", "import matplotlib"], capture_output=True,
                                 stdin=subprocess.DEVNULL).returncode == 0
        if not has_mpl:
            print(f"skipped: {argv[0]} needs matplotlib, which {python} does not have "
                  "(sudo apt-get install python3-matplotlib)")
            return
        args = []
        for a in argv[1:]:  # a shell's globbing, from the repository root: runs/*.jsonl
            found = sorted(p.relative_to(REPO).as_posix() for p in REPO.glob(a)) if "*" in a else []
            args.extend(found or [a])
        with tempfile.TemporaryDirectory(prefix="moenb-plot-") as tmp:
            _run([python, argv[0], *(a.replace("@out", tmp) for a in args)], argv[0])
            for png in sorted(Path(tmp).rglob("*.png")):
                display(Image(filename=str(png)))

    @line_magic
    def moe_build(self, line):
        """%moe_build: print how %%c cells are compiled and linked."""
        f = build_flags()
        lib = Path(f["LIB"])
        if lib.is_relative_to(REPO):
            lib = lib.relative_to(REPO)
        print("make flags:", " ".join(f["MAKEFLAGS"]) or "(none)")
        print("%%c cells :", shlex.join([*f["CC"], *f["CFLAGS"], "cell.c", str(lib), *f["LDLIBS"]]))
        print("run from  : the repository root")


def load_ipython_extension(ipython):
    """Called by %load_ext moenb."""
    ipython.register_magics(MoeMagics)
