#!/usr/bin/env python3
"""Which kernels' device code changed between two trees, without a GPU.

    tools/device_code_diff.py BASE_TREE [--arch sm_90a] [FILE.cu ...]

Device time is scarce, so a session that edits kernels/ wants to know which kernels a GPU
must run again. This compiles every kernels/*.cu of this tree and of BASE_TREE (for example
`git archive <verified-commit> | tar -x -C /tmp/base`) to PTX for one architecture and
compares them kernel by kernel (each `.entry`), after removing what changes without the
code changing: comments, line information, the hash nvcc puts in anonymous-namespace and
internal names, and the numbering of branch labels and of local stacks (__local_depotN). A template that gained a parameter
whose value is 0 in the old instantiations is matched by dropping that trailing 0.

It prints one line per kernel: `same`, `CHANGED`, `new` or `removed`, and a summary; the
exit status is 1 when any kernel that exists in both trees changed. Identical PTX means
identical machine code from the same ptxas, so a kernel reported `same` keeps the GPU
verification of BASE_TREE. Host code is not compared: the CPU tests cover it.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

NVCC = os.environ.get("NVCC", "nvcc")


def ptx(tree, source, arch, out):
    cmd = [NVCC, "-std=c++17", "-O3", f"-arch={arch}", "-Ilib", "-Ikernels", "-DMOE_HAVE_CUDA",
           "-ptx", source, "-o", out]
    r = subprocess.run(cmd, cwd=tree, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"device_code_diff: nvcc failed on {tree}/{source}:\n{r.stderr[-2000:]}")
    with open(out) as f:
        return f.read()


def kernels(text):
    """{entry name: normalized body} of one PTX file."""
    text = re.sub(r"_GLOBAL__N__[0-9a-f]+_", "G_", text)
    text = re.sub(r"_INTERNAL_[0-9a-f]+_", "I_", text)
    lines = [l for l in text.split("\n")
             if not l.strip().startswith("//") and ".loc" not in l and ".file" not in l]
    out = {}
    for part in re.split(r"\n(?=\.(?:visible |weak )?\.?entry )", "\n".join(lines)):
        m = re.match(r"\.(?:visible |weak )?\.?entry (\S+?)\(", part)
        if m:  # the kernel's own name recurs in its parameters' and static variables' names
            name = m.group(1)
            body = part.replace(name[2:] if name.startswith("_Z") else name, "<self>")
            body = re.sub(r"\$L__BB\d+_", "$L__BB_", body)
            # the local stack's name counts the entries before it, like the labels
            # (rstrip: the file's last entry ends in the file's trailing blank lines)
            out[m.group(1)] = re.sub(r"__local_depot\d+", "__local_depot", body).rstrip()
    return out


def strip_zero_param(name):
    """foo<a, b, 0> -> foo<a, b> in Itanium mangling (…ELi0EE -> …EE)."""
    return re.sub(r"ELi0EE", "EE", name, count=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base", help="the older tree (a copy of a verified commit)")
    ap.add_argument("files", nargs="*", help="kernels/*.cu files (default: all of this tree)")
    ap.add_argument("--arch", default="sm_90a")
    a = ap.parse_args()
    here = os.getcwd()
    if not os.path.isdir(os.path.join(a.base, "kernels")):
        sys.exit(f"device_code_diff: {a.base} has no kernels/ (give the root of a tree)")
    files = a.files or sorted("kernels/" + f for f in os.listdir("kernels") if f.endswith(".cu"))
    changed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for src in files:
            new = kernels(ptx(here, src, a.arch, os.path.join(tmp, "new.ptx")))
            if not os.path.exists(os.path.join(a.base, src)):
                for k in new:
                    print(f"new      {src}: {k}")
                continue
            old = kernels(ptx(a.base, src, a.arch, os.path.join(tmp, "old.ptx")))
            renamed = {strip_zero_param(k): v for k, v in new.items() if k not in old}
            for k, body in old.items():
                mine = new.get(k, renamed.get(k))
                if mine is None:
                    print(f"removed  {src}: {k}")
                elif mine == body:
                    print(f"same     {src}: {k}")
                else:
                    print(f"CHANGED  {src}: {k}")
                    changed += 1
            matched = set(old) | {k for k in new if strip_zero_param(k) in old}
            for k in new:
                if k not in matched:
                    print(f"new      {src}: {k}")
    print(f"device_code_diff: {changed} kernel(s) of the base tree changed")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
