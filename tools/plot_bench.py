#!/usr/bin/python3
"""Turn the benchmarks' Markdown tables into PNG figures.

    tools/plot_bench.py dispatch --out FILE.png [--title T] BENCH_OUTPUT.txt
    tools/plot_bench.py bars     --out FILE.png --table CELL [--ceiling X] [...] FILE.md
    tools/plot_bench.py stages   --out FILE.png --table CELL [--title T] FILE.md

The input format is the one every benchmark of moe.c prints and every results page
quotes: Markdown pipe tables (`| a | b |`, a `|---|` rule under the header). Cells may
carry bold (`**619**`), a second number in brackets (`375 (9.91 ms)`) or a unit
(`0.42 ms (2%)`): the first number of a cell is its value.

Figures:

  dispatch  chapter 02's bin/ch02_dispatch_bench output: GB/s against tokens per rank
            for the raw all-to-all, the collective and the fused path, one panel per
            table (each table follows its "H=..., E=..." line, which titles the panel).
  bars      grouped bars from one table: a group per row (the first cell names it), a bar
            per column; columns whose header holds '%' are left out (shares, not values).
            A header "Name: series" starts a new panel named Name, so one table holding
            two shapes side by side (chapter 03's GEMM table) gives two panels.
            --ceiling X draws a horizontal line at X (the dense GEMM ceiling).
  stages    stacked horizontal bars from one table: a bar per row, a segment per column
            whose cells are times ("0.42 ms ..."); other columns are left out. A row
            named "Panel, bar" goes into panel Panel, so each shape gets its own time axis.

The PNG's path is printed, then the numbers read from the table (one line per panel).
--table CELL picks the first table whose header's first cell is CELL (bold and spaces
ignored). Only Python's standard library and matplotlib (Debian: python3-matplotlib).
Exit status: 0 written, 1 bad input (the message names the file and what is missing),
2 a usage error or no matplotlib.
"""

import argparse
import os
import re
import sys

from plot_metrics import pyplot  # the same matplotlib set-up (tools/ is the script's folder)


class InputError(Exception):
    """A file that does not hold the table a figure needs; the message says which."""


_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


def clean(cell):
    """A cell's text without Markdown emphasis or code marks, stripped."""
    return cell.replace("**", "").replace("`", "").strip()


def number(cell):
    """The first number of a cell ("375 (9.91 ms)" -> 375.0), or None."""
    m = _NUMBER.search(clean(cell).replace(",", ""))
    return float(m.group()) if m else None


def read_tables(path):
    """Every pipe table of a file: a list of {"before": the nearest non-blank line above the
    table that is not a table line, "header": [cells], "rows": [[cells]]}."""
    if not os.path.exists(path):
        raise InputError(f"{path}: no such file")
    with open(path, encoding="utf-8") as f:
        lines = [l.rstrip("\n") for l in f]
    tables, before, i = [], "", 0
    while i < len(lines):
        line = lines[i].strip()
        nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if line.startswith("|") and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", nxt):
            header = [c.strip() for c in line.strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            tables.append({"before": before, "header": header, "rows": rows})
            continue
        if line:
            before = line
        i += 1
    return tables


def find_table(tables, path, first_cell):
    """The first table whose header starts with first_cell."""
    for t in tables:
        if clean(t["header"][0]) == clean(first_cell):
            return t
    heads = ", ".join(repr(clean(t["header"][0])) for t in tables) or "none"
    raise InputError(f"{path}: no table whose header starts with {first_cell!r} "
                     f"(the tables start with: {heads})")


def dispatch_series(tables, path):
    """[(title, {"tokens": [...], "raw": [...], "collective": [...], "fused": [...]})] from
    ch02_dispatch_bench output: the GB/s column after each "... ms" column names a path."""
    panels = []
    for t in tables:
        head = [clean(h) for h in t["header"]]
        if "raw GB/s" not in head:
            continue
        cols = {"raw": head.index("raw GB/s")}
        for name in ("collective", "fused", "dispatch+combine"):
            if f"{name} ms" in head:
                j = head.index(f"{name} ms") + 1
                if j < len(head) and head[j] == "GB/s":
                    cols["collective" if name == "dispatch+combine" else name] = j
        data = {"tokens": [number(r[0]) for r in t["rows"]]}
        for name, j in cols.items():
            data[name] = [number(r[j]) for r in t["rows"]]
        title = t["before"].split(";")[0] if t["before"].startswith("H=") else ""
        panels.append((title, data))
    if not panels:
        raise InputError(f"{path}: no table with a 'raw GB/s' column; is this the output of "
                         "bin/ch02_dispatch_bench?")
    return panels


def bar_panels(table):
    """[(panel name, [series names], [row labels], {series: [values]})] of a bars table."""
    panels, cur = [], None
    for j, h in enumerate(table["header"][1:], 1):
        h = clean(h)
        if "%" in h:
            continue
        if ":" in h:
            name, h = (s.strip() for s in h.split(":", 1))
            cur = (name, [], {})
            panels.append(cur)
        elif cur is None:
            cur = ("", [], {})
            panels.append(cur)
        cur[1].append(h)
        cur[2][h] = [number(r[j]) if j < len(r) else None for r in table["rows"]]
    labels = [clean(r[0]) for r in table["rows"]]
    return [(name, series, labels, values) for name, series, values in panels]


def stage_panels(table, path):
    """[(panel, [bar labels], [stage names], [[ms per stage] per bar])] of a stages table."""
    stages = [j for j in range(1, len(table["header"]))
              if all(re.search(r"\d\s*ms\b", r[j]) for r in table["rows"] if j < len(r))]
    if not stages or not table["rows"]:
        raise InputError(f"{path}: the table {clean(table['header'][0])!r} has no column of "
                         "times ('0.42 ms' cells) to stack")
    names = [clean(table["header"][j]) for j in stages]
    panels = {}
    for r in table["rows"]:
        panel, _, bar = clean(r[0]).rpartition(", ")
        p = panels.setdefault(panel, ([], []))
        p[0].append(bar)
        p[1].append([number(r[j]) for j in stages])
    return [(panel, bars, names, ms) for panel, (bars, ms) in panels.items()]


def fmt(values):
    return " ".join("-" if v is None else f"{v:g}" for v in values)


def describe(figure, panels):
    """What was read, one line per panel and series, printed after the PNG's path: the
    numbers a figure draws can be checked against the table by eye or by a test."""
    out = []
    for panel in panels:
        if figure == "dispatch":
            title, data = panel
            out.append(f"  {title}: " + " | ".join(f"{k} {fmt(v)}" for k, v in data.items()))
        elif figure == "bars":
            name, series, labels, values = panel
            out.append(f"  {name or 'bars'}: rows {' / '.join(labels)}: "
                       + " | ".join(f"{k} {fmt(values[k])}" for k in series))
        else:
            name, bars, stages, ms = panel
            out.append(f"  {name or 'stages'}: " + " | ".join(
                f"{b} " + " ".join(f"{st}={fmt([v])}" for st, v in zip(stages, row))
                for b, row in zip(bars, ms)))
    return "\n".join(out)


def save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_dispatch(plt, panels, title):
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels) + 1, 4.2), sharey=True,
                             squeeze=False)
    style = {"raw": ("raw all-to-all (the baseline)", "black", "--", "s"),
             "collective": ("dispatcher, collective path", "C0", "-", "o"),
             "fused": ("dispatcher, fused NVLink path", "C3", "-", "^")}
    for ax, (sub, data) in zip(axes[0], panels):
        for name, (label, colour, ls, marker) in style.items():
            if name in data:
                ax.plot(data["tokens"], data[name], color=colour, ls=ls, marker=marker, ms=5,
                        label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(data["tokens"], [f"{int(t):,}" for t in data["tokens"]])
        ax.minorticks_off()
        ax.set_xlabel("tokens per rank")
        ax.set_title(sub, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("GB/s per rank (dispatch + combine)")
    axes[0][0].legend(fontsize=8, loc="upper left")
    fig.suptitle(title or "dispatcher vs raw all-to-all")
    return fig


def plot_bars(plt, panels, title, ylabel, ceiling, ceiling_label):
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels) + 1, 4.4), sharey=True,
                             squeeze=False)
    for ax, (name, series, labels, values) in zip(axes[0], panels):
        width = 0.8 / len(series)
        for s, key in enumerate(series):
            xs = [i + (s - (len(series) - 1) / 2) * width for i in range(len(labels))]
            ys = [v if v is not None else 0 for v in values[key]]
            ax.bar(xs, ys, width, color=f"C{s}", label=key)
        if ceiling:
            ax.axhline(ceiling, color="black", ls="--", lw=1,
                       label=ceiling_label or f"ceiling {ceiling:g}")
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(name, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    top = max([v for _, s, _, vals in panels for k in s for v in vals[k] if v is not None]
              + [ceiling or 0])
    axes[0][0].set_ylim(0, top * 1.25)  # room above the bars and the line for the legend
    axes[0][0].set_ylabel(ylabel)
    axes[0][0].legend(fontsize=8, loc="upper left", ncol=2)
    fig.suptitle(title)
    return fig


def plot_stages(plt, panels, title):
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 1.1 + 0.55 * sum(len(p[1]) for p in panels)
                                                      + 0.5 * len(panels)), squeeze=False)
    for ax, (panel, bars, names, ms) in zip(axes[:, 0], panels):
        left = [0.0] * len(bars)
        for s, name in enumerate(names):
            width = [row[s] or 0 for row in ms]
            ax.barh(range(len(bars)), width, left=left, color=f"C{s}", label=name)
            left = [a + b for a, b in zip(left, width)]
        for y, total in enumerate(left):
            ax.text(total, y, f" {total:.2f} ms", va="center", fontsize=8)
        ax.set_yticks(range(len(bars)), bars)
        ax.invert_yaxis()
        ax.set_xlim(0, max(left) * 1.15)
        ax.set_title(panel, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    axes[-1][0].set_xlabel("ms per forward + backward (stages timed with a sync at each boundary)")
    axes[0][0].legend(fontsize=7, ncol=len(panels[0][2]), loc="lower center",
                      bbox_to_anchor=(0.5, 1.12))
    fig.suptitle(title)
    return fig


def main(argv=None):
    p = argparse.ArgumentParser(description="Plot the Markdown tables of moe.c's benchmarks as PNGs.")
    p.add_argument("figure", choices=("dispatch", "bars", "stages"))
    p.add_argument("file", help="benchmark output or results page holding the table(s)")
    p.add_argument("--out", required=True, metavar="FILE.png", help="the PNG to write")
    p.add_argument("--table", metavar="CELL", help="the table whose header starts with CELL "
                   "(bars, stages)")
    p.add_argument("--title", default="", help="the figure's title (name the run: device, commit)")
    p.add_argument("--ylabel", default="TFLOP/s", help="bars: the y axis (default TFLOP/s)")
    p.add_argument("--ceiling", type=float, metavar="X", help="bars: a dashed line at X")
    p.add_argument("--ceiling-label", default="", metavar="L", help="bars: the line's legend")
    a = p.parse_args(argv)
    if a.figure in ("bars", "stages") and not a.table:
        p.error(f"{a.figure} needs --table CELL (the first header cell of the table to plot)")
    if a.ceiling is not None and a.figure != "bars":
        p.error("--ceiling applies to the bars figure only")

    try:
        tables = read_tables(a.file)
        if a.figure == "dispatch":
            panels = dispatch_series(tables, a.file)
        elif a.figure == "bars":
            panels = bar_panels(find_table(tables, a.file, a.table))
            if not any(v is not None for _, s, _, vals in panels for k in s for v in vals[k]):
                raise InputError(f"{a.file}: the table {a.table!r} has no numbers to plot")
        else:
            panels = stage_panels(find_table(tables, a.file, a.table), a.file)
    except (InputError, OSError, UnicodeDecodeError) as e:
        print(f"plot_bench: {e}", file=sys.stderr)
        return 1
    plt = pyplot("plot_bench")
    if plt is None:
        return 2

    if a.figure == "dispatch":
        fig = plot_dispatch(plt, panels, a.title)
    elif a.figure == "bars":
        fig = plot_bars(plt, panels, a.title, a.ylabel, a.ceiling, a.ceiling_label)
    else:
        fig = plot_stages(plt, panels, a.title)
    if os.path.dirname(a.out):
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
    save(fig, a.out)
    plt.close(fig)
    print(a.out)
    print(describe(a.figure, panels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
