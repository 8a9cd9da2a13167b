#!/usr/bin/python3
"""Turn the benchmarks' Markdown tables into PNG figures.

    tools/plot_bench.py dispatch --out FILE.png [--title T] BENCH_OUTPUT.txt
    tools/plot_bench.py bars     --out FILE.png --table CELL [--ceiling X] [...] FILE.md
    tools/plot_bench.py stages   --out FILE.png --table CELL [--title T] FILE.md
    tools/plot_bench.py sweep    --out FILE.png [--shapes RE] [--title T] CH03_BENCH.txt
    tools/plot_bench.py roofline --out FILE.png [--shapes RE] [--bandwidth GBS] CH03_BENCH.txt
    tools/plot_bench.py folding  --out FILE.png [--title T] CH04_FOLDING_BENCH.txt
    tools/plot_bench.py lines    --out FILE.png --table CELL [--columns RE] [--by CELL]
                                 [--where CELL=RE] [--title T] FILE.md

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
  sweep     chapter 03's bench.sh output (bin/ch03_grouped_gemm_bench, then the layer
            against PyTorch): against rows per expert (the "NAME: T=.. E=.. -> N rows"
            line above each GEMM table: N / E), for the shapes whose NAME matches --shapes
            (default "sweep[0-9]+"), three panels: forward + dgrad TFLOP/s per backend
            (sum of the four GEMMs' GFLOP over the sum of their ms), wgrad TFLOP/s per
            backend and mode (+=, =, bf16), each with the dense ceiling of the run's
            "dense GEMM 8192^3" line; and the layer's ratio to PyTorch from the two tables
            at the end ("ours +=" / "ours bf16"), with a line at 1.
  roofline  the same output: every wgrad row of every GEMM table whose shape matches
            --shapes (default: all), as achieved TFLOP/s against arithmetic intensity
            (FLOP per byte moved = TFLOP/s / the GB/s of the same cell), one colour per
            mode of our kernel and grey for the cuBLAS loop; the roof is
            min(bandwidth x intensity, the dense ceiling), the bandwidth being the
            highest wgrad GB/s of the run unless --bandwidth says otherwise.
  folding   chapter 04's bin/ch04_folding_bench output (its own tables, not Markdown): one
            stacked bar per folding (the "folding tp=..." lines), a segment per group kind
            and collective of rank 0 (the "counted B" column, host control data left out;
            a communicator serving several kinds is named by them all, "tp=edp").

  lines     one table against its first column (a size: sequence length, tokens): a
            panel per column that holds numbers (log-log, the y axis linear where the
            values span less than a decade) (chapter 07's step time, tokens/s
            and memory against the sequence length); rows whose first cell is not a number
            are left out; --columns RE keeps the columns whose header matches RE.
            --by CELL draws one line per value of that column (chapter 07's GPUs under
            context parallelism); --where CELL=RE keeps the rows whose CELL matches RE.

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
    table that is not a table line, "above": every such line since the previous table,
    "header": [cells], "rows": [[cells]]}."""
    if not os.path.exists(path):
        raise InputError(f"{path}: no such file")
    with open(path, encoding="utf-8") as f:
        lines = [l.rstrip("\n") for l in f]
    tables, before, above, i = [], "", [], 0
    while i < len(lines):
        line = lines[i].strip()
        nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
        if line.startswith("|") and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", nxt):
            header = [c.strip() for c in line.strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].strip().startswith("|"):
                rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            tables.append({"before": before, "above": above,
                           "header": header, "rows": rows})
            above = []
            continue
        if line:
            before = line
            above.append(line)
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


_SHAPE = re.compile(r"^(\S+): T=\d+ H=\d+ F=\d+ E=(\d+) k=\d+ -> (\d+) rows")
_DENSE = re.compile(r"dense GEMM 8192\^3[^:]*: [\d.]+ ms, ([\d.]+) TFLOP/s")
_GBS = re.compile(r"\(([\d.]+) GB/s\)")
#: the GEMMs of the expert MLP that each aggregate of the sweep figure sums
FWD_DGRAD = ("fc1 forward", "fc2 forward", "fc1 dgrad", "fc2 dgrad")
WGRAD_MODES = ("+=", "=", "bf16")


def gemm_tables(tables, path, shapes):
    """[(shape name, rows per expert, table)] for chapter 03's per-shape GEMM tables whose
    shape name fully matches the regular expression `shapes`, in file order."""
    out = []
    for t in tables:
        if clean(t["header"][0]) != "GEMM":
            continue
        m = next((m for m in map(_SHAPE.match, t["above"]) if m), None)
        if m and re.fullmatch(shapes, m.group(1)):
            out.append((m.group(1), int(m.group(3)) / int(m.group(2)), t))
    if not out:
        raise InputError(f"{path}: no GEMM table under a 'NAME: T=.. E=.. -> N rows' line with a "
                         f"NAME matching {shapes!r}; is this the output of chapter 03's bench.sh?")
    return out


def dense_ceiling(path):
    """The TFLOP/s of the first "dense GEMM 8192^3 ...: X ms, Y TFLOP/s" line of a file."""
    with open(path, encoding="utf-8") as f:
        m = _DENSE.search(f.read())
    if not m:
        raise InputError(f"{path}: no 'dense GEMM 8192^3 ...: X ms, Y TFLOP/s' line (the ceiling)")
    return float(m.group(1))


def backends(table):
    """{backend: column of its ms} of a GEMM table ("loop ms", "grouped ms", ...)."""
    return {clean(h)[:-3]: j for j, h in enumerate(table["header"]) if clean(h).endswith(" ms")}


def aggregate(table, names, col):
    """TFLOP/s of the rows named `names` together: their GFLOP summed over their ms summed
    (column col); None where a row is missing or has no time ('-')."""
    rows = {clean(r[0]): r for r in table["rows"]}
    gj = [clean(h) for h in table["header"]].index("GFLOP")
    try:
        gflop = sum(number(rows[n][gj]) for n in names)
        ms = sum(number(rows[n][col]) for n in names)
    except (KeyError, TypeError):
        return None
    return gflop / ms if ms else None


def sweep_series(tables, path, shapes):
    """(rows per expert, {panel: {series: [values]}}) for the sweep figure."""
    found = gemm_tables(tables, path, shapes)
    xs = [x for _, x, _ in found]
    fwd, wgrad = {}, {}
    for name, _, t in found:
        for b, col in backends(t).items():
            fwd.setdefault(b, []).append(aggregate(t, FWD_DGRAD, col))
            for mode in WGRAD_MODES:
                wgrad.setdefault(f"{b} {mode}", []).append(
                    aggregate(t, (f"fc1 wgrad {mode}", f"fc2 wgrad {mode}"), col))
    wgrad = {k: v for k, v in wgrad.items() if any(x is not None for x in v)}
    layer = {}
    names = [n for n, _, _ in found]
    for t in tables:
        head = [clean(h) for h in t["header"]]
        if head[0] != "shape" or not ({"ours +=", "ours bf16"} & set(head)):
            continue
        rows = {clean(r[0]): r for r in t["rows"]}
        for j, h in enumerate(head[1:], 1):
            if not re.search(r"\bvs\b", h):
                continue
            key = f"(a) {h}" if "ours +=" in head else f"(b) bf16 {h}"
            layer[key] = [number(rows[n][j]) if n in rows else None for n in names]
    panels = {"forward + dgrad": fwd, "wgrad": wgrad}
    if layer:
        panels["layer vs PyTorch"] = layer
    return xs, panels


def roofline_points(tables, path, shapes):
    """{series: [(shape, GEMM, intensity FLOP/B, TFLOP/s, GB/s)]}: our kernel's wgrad per
    mode, and the cuBLAS loop's (+=), from the cells "TFLOP/s (GB/s)"."""
    series = {}
    for name, _, t in gemm_tables(tables, path, shapes):
        cols = backends(t)
        for r in t["rows"]:
            gemm = clean(r[0])
            if " wgrad " not in gemm:
                continue
            mode = gemm.split(" wgrad ")[1]
            for b, key in (("grouped", f"ours {mode}"), ("loop", f"loop {mode}")):
                if b not in cols or cols[b] + 1 >= len(r):
                    continue
                cell = r[cols[b] + 1]
                tflops, gbs = number(cell), _GBS.search(cell)
                if tflops is None or not gbs:
                    continue
                gbs = float(gbs.group(1))
                series.setdefault(key, []).append((name, gemm.split()[0], tflops * 1e3 / gbs,
                                                   tflops, gbs))
    if not series:
        raise InputError(f"{path}: no wgrad cell of the form 'TFLOP/s (GB/s)' to plot")
    return series


def folding_bars(path):
    """ch04_folding_bench's output: [(folding, [(group collective, bytes), ...]), ...]."""
    bars, cur = [], None
    row = re.compile(r"^\s+(\S+)\s+(\d+)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|send)"
                     r"\s+(\d+)\s+(\d+)\s+\d+ calls")
    with open(path, encoding="utf-8") as f:
        for line in f:
            m = re.match(r"^folding (\S+(?: \+ SP)?(?:,zero=1)?):", line)
            if m:
                cur = (m.group(1), [])
                bars.append(cur)
                continue
            m = row.match(line)
            if m and cur is not None:
                # a communicator may serve several kinds ("tp=tp-cp=edp"): keep its main
                # kinds ("tp=edp": one collective may be either's); the tokens' all-to-all
                # is EP's. Segments landing on one name add up.
                kind = "ep" if m.group(3) == "all-to-all" else "=".join(
                    k for k in m.group(1).split("=") if k in ("tp", "dp", "ep", "etp", "edp"))
                key = f"{kind} {m.group(3)}"
                segs = dict(cur[1])
                segs[key] = segs.get(key, 0) + int(m.group(4))
                cur[1][:] = list(segs.items())
    if not bars:
        raise InputError(f"{path}: no 'folding tp=...' table (is it ch04_folding_bench's output?)")
    return bars


def column_index(table, path, cell, option):
    """The index of the column whose header is `cell` (emphasis ignored), or InputError."""
    heads = [clean(h) for h in table["header"]]
    if clean(cell) not in heads:
        raise InputError(f"{path}: {option} {cell!r}: the table {heads[0]!r} has no such column "
                         f"(its columns: {', '.join(heads)})")
    return heads.index(clean(cell))


def line_panels(table, path, columns, by=None, where=None):
    """lines: x = the first column's numbers, a panel (header, series) per numeric column
    whose header matches the regular expression `columns`; series maps a label to (xs, ys):
    one series, or with `by` one per value of that column (in the order they appear).
    `where` = (column, regular expression) keeps the rows whose cell matches."""
    rows = [r for r in table["rows"] if r and number(r[0]) is not None]
    if where:
        w = column_index(table, path, where[0], "--where")
        rows = [r for r in rows if w < len(r) and re.search(where[1], clean(r[w]))]
    if len(rows) < 2:
        raise InputError(f"{path}: the table {clean(table['header'][0])!r} has fewer than two "
                         "rows with a number in the first column" + (" that --where keeps" if where else ""))
    b = column_index(table, path, by, "--by") if by else None
    keys = []
    for r in rows:
        k = clean(r[b]) if b is not None and b < len(r) else ""
        if k not in keys:
            keys.append(k)
    panels = []
    for c, head in enumerate(table["header"][1:], start=1):
        if c == b or not re.search(columns, clean(head)):
            continue
        series = {}
        for k in keys:
            sel = [r for r in rows if b is None or (b < len(r) and clean(r[b]) == k)]
            label = f"{clean(by)} {k}" if b is not None else ""
            series[label] = ([number(r[0]) for r in sel],
                             [number(r[c]) if c < len(r) else None for r in sel])
        if any(y is not None for xs, ys in series.values() for y in ys):
            panels.append((clean(head), series))
    if not panels:
        raise InputError(f"{path}: the table {clean(table['header'][0])!r} has no numeric column "
                         f"matching {columns!r}")
    return clean(table["header"][0]), panels


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
        elif figure == "sweep":
            xs, data = panel
            out.append("  rows per expert: " + fmt(xs))
            for name, series in data.items():
                out.append(f"  {name}: " + " | ".join(f"{k} {fmt(v)}" for k, v in series.items()))
        elif figure == "roofline":
            for key, pts in panel.items():
                out.append(f"  {key}: " + " ".join(f"{s}/{g}={i:.0f}:{t:g}" for s, g, i, t, _ in pts))
        elif figure == "folding":
            name, segs = panel
            out.append(f"  {name}: " + " | ".join(f"{k} {v}" for k, v in segs))
        elif figure == "lines":
            name, series = panel
            out.append(f"  {name}: " + " | ".join(
                (f"{label}: " if label else "") + " ".join(
                    f"{x:g}:{'-' if y is None else f'{y:g}'}" for x, y in zip(xs, ys))
                for label, (xs, ys) in series.items()))
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


def plot_lines(plt, xname, panels, title):
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels) + 0.5, 4.0),
                             squeeze=False)
    for ax, (name, series) in zip(axes[0], panels):
        allx = sorted({x for xs, _ in series.values() for x in xs})
        top, bottom = 0.0, float("inf")
        for i, (label, (xs, ys)) in enumerate(series.items()):
            pts = [(x, y) for x, y in zip(xs, ys) if y is not None and y > 0]
            if not pts:
                continue  # (a series without numbers in this column: no legend entry)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=5,
                    color=f"C{i % 10}", label=label or None)
            top, bottom = max(top, *(p[1] for p in pts)), min(bottom, *(p[1] for p in pts))
        ax.set_xscale("log", base=2)
        # log where the values span a decade or more (time, memory), else linear, whose
        # ticks stay readable (an efficiency of 91-98%)
        ax.set_yscale("log" if top >= 10 * bottom else "linear")
        if top >= 10 * bottom:  # labels at 1, 2 and 5 of each decade, as plain numbers
            from matplotlib.ticker import FuncFormatter, LogLocator
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
        ax.set_xticks(allx, [f"{x / 1024:g}K" if x >= 1024 else f"{x:g}" for x in allx],
                      fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel(xname)
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3, which="both")
        if any(series) and ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    return fig


def plot_folding(plt, bars, title):
    keys = sorted({k for _, segs in bars for k, _ in segs})
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(bars) + 3), 4.6))
    bottom = [0.0] * len(bars)
    for c, key in enumerate(keys):
        ys = [dict(segs).get(key, 0) / 1e3 for _, segs in bars]
        ax.bar(range(len(bars)), ys, 0.6, bottom=bottom, color=f"C{c % 10}", label=key)
        bottom = [b + y for b, y in zip(bottom, ys)]
    ax.set_xticks(range(len(bars)), [n for n, _ in bars], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("kB sent by rank 0 per step")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.suptitle(title or "bytes per group and collective, per folding")
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


_LABEL = {"loop": "cuBLAS loop (ch. 01)", "cublas-grouped": "cuBLAS grouped", "grouped": "ours"}
_COLOUR = {"loop": "C0", "cublas-grouped": "C1", "grouped": "C2"}
_MODE_STYLE = {"+=": ("-", "o"), "=": ("--", "s"), "bf16": (":", "^")}


def plot_sweep(plt, xs, panels, title, ceiling):
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels) + 1, 4.4), squeeze=False)
    for ax, (name, series) in zip(axes[0], panels.items()):
        for key, ys in series.items():
            if name == "layer vs PyTorch":
                comp = "eager" not in key
                colour = "C2" if key.startswith("(a) +=") else "C4" if key.startswith("(a) =") else "C3"
                ax.plot(xs, ys, color=colour, ls="-" if comp else ":", marker="o" if comp else ".",
                        ms=4, label=key)
                continue
            backend, _, mode = key.partition(" ")
            ls, marker = _MODE_STYLE.get(mode, ("-", "o"))
            ax.plot(xs, ys, color=_COLOUR.get(backend, "C5"), ls=ls, marker=marker, ms=4,
                    label=f"{_LABEL.get(backend, backend)} {mode}".strip())
        if name == "layer vs PyTorch":
            ax.axhline(1.0, color="black", lw=1)
            ax.set_ylabel("PyTorch ms / ours ms (> 1: ours faster)")
        else:
            ax.axhline(ceiling, color="black", ls="--", lw=1, label=f"dense bf16 8192³: {ceiling:g}")
            ax.set_ylim(0, ceiling * 1.12)
            ax.set_ylabel("TFLOP/s")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x:g}" for x in xs], fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel("rows per expert (average)")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right" if name == "layer vs PyTorch" else "lower right")
    fig.suptitle(title or "chapter 03: rows per expert against TFLOP/s")
    return fig


def plot_roofline(plt, series, title, ceiling, bandwidth):
    fig, ax = plt.subplots(figsize=(7.5, 5))
    style = {"ours +=": ("C2", "o"), "ours =": ("C4", "s"), "ours bf16": ("C3", "^"),
             "loop +=": ("0.6", "x")}
    xs = [p[2] for pts in series.values() for p in pts]
    lo, hi = min(xs) / 2, max(xs) * 2
    ridge = ceiling * 1e3 / bandwidth
    grid = sorted({lo, hi, max(lo, min(hi, ridge))})
    ax.plot(grid, [min(ceiling, bandwidth * x / 1e3) for x in grid], color="black", lw=1.5,
            label=f"roof: {bandwidth:g} GB/s x intensity, capped at the dense {ceiling:g} TFLOP/s")
    for key, pts in series.items():
        colour, marker = style.get(key, ("C5", "o"))
        ax.scatter([p[2] for p in pts], [p[3] for p in pts], color=colour, marker=marker, s=22,
                   label=f"{key} (fc1 and fc2 wgrad of every shape)", zorder=3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ys = [p[3] for pts in series.values() for p in pts]
    ticks = [t for t in (12.5, 25, 50, 100, 200, 400, 800) if min(ys) / 2 <= t <= ceiling * 1.5]
    ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("arithmetic intensity: FLOP per byte moved (activations + dw)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(title or "the wgrad roofline", fontsize=10)
    return fig


def main(argv=None):
    p = argparse.ArgumentParser(description="Plot the Markdown tables of moe.c's benchmarks as PNGs.")
    p.add_argument("figure", choices=("dispatch", "bars", "stages", "sweep", "roofline",
                                      "folding", "lines"))
    p.add_argument("file", help="benchmark output or results page holding the table(s)")
    p.add_argument("--out", required=True, metavar="FILE.png", help="the PNG to write")
    p.add_argument("--table", metavar="CELL", help="the table whose header starts with CELL "
                   "(bars, stages, lines)")
    p.add_argument("--title", default="", help="the figure's title (name the run: device, commit)")
    p.add_argument("--ylabel", default="TFLOP/s", help="bars: the y axis (default TFLOP/s)")
    p.add_argument("--ceiling", type=float, metavar="X", help="bars: a dashed line at X")
    p.add_argument("--ceiling-label", default="", metavar="L", help="bars: the line's legend")
    p.add_argument("--shapes", metavar="RE", help="sweep, roofline: the shape names to read "
                   "(a regular expression; default 'sweep[0-9]+' for sweep, every shape for roofline)")
    p.add_argument("--columns", metavar="RE", help="lines: the columns to plot (a regular "
                   "expression on the header; default: every numeric column)")
    p.add_argument("--by", metavar="CELL", help="lines: one line per value of this column")
    p.add_argument("--where", metavar="CELL=RE", help="lines: keep the rows whose CELL "
                   "matches the regular expression RE")
    p.add_argument("--bandwidth", type=float, metavar="GBS", help="roofline: the roof's GB/s "
                   "(default: the highest wgrad GB/s of the run)")
    a = p.parse_args(argv)
    if a.figure in ("bars", "stages", "lines") and not a.table:
        p.error(f"{a.figure} needs --table CELL (the first header cell of the table to plot)")
    if a.ceiling is not None and a.figure != "bars":
        p.error("--ceiling applies to the bars figure only (sweep and roofline read it from the run)")
    if a.shapes is not None and a.figure not in ("sweep", "roofline"):
        p.error("--shapes applies to the sweep and roofline figures only")
    if a.bandwidth is not None and (a.figure != "roofline" or a.bandwidth <= 0):
        p.error("--bandwidth applies to the roofline figure only, and must be > 0 (GB/s)")
    for name, v in (("--columns", a.columns), ("--by", a.by), ("--where", a.where)):
        if v is not None and a.figure != "lines":
            p.error(f"{name} applies to the lines figure only")
    where = None
    if a.where is not None:
        if "=" not in a.where:
            p.error(f"--where {a.where!r}: expected CELL=RE (a column's header, '=', a regular expression)")
        where = tuple(a.where.split("=", 1))
    for name, rx in (("--shapes", a.shapes), ("--columns", a.columns),
                     ("--where", where[1] if where else None)):
        if rx is None:
            continue
        try:
            re.compile(rx)
        except re.error as e:
            p.error(f"{name} {rx!r} is not a regular expression: {e}")

    try:
        tables = [] if a.figure == "folding" else read_tables(a.file)
        if a.figure == "folding":
            panels = folding_bars(a.file)
        elif a.figure == "dispatch":
            panels = dispatch_series(tables, a.file)
        elif a.figure == "bars":
            panels = bar_panels(find_table(tables, a.file, a.table))
            if not any(v is not None for _, s, _, vals in panels for k in s for v in vals[k]):
                raise InputError(f"{a.file}: the table {a.table!r} has no numbers to plot")
        elif a.figure == "stages":
            panels = stage_panels(find_table(tables, a.file, a.table), a.file)
        elif a.figure == "lines":
            xname, panels = line_panels(find_table(tables, a.file, a.table), a.file,
                                        a.columns or ".*", a.by, where)
        elif a.figure == "sweep":
            panels = [sweep_series(tables, a.file, a.shapes or r"sweep[0-9]+")]
            ceiling = dense_ceiling(a.file)
        else:
            panels = [roofline_points(tables, a.file, a.shapes or r".*")]
            ceiling = dense_ceiling(a.file)
            bandwidth = a.bandwidth or max(p[4] for pts in panels[0].values() for p in pts)
    except (InputError, OSError, UnicodeDecodeError) as e:
        print(f"plot_bench: {e}", file=sys.stderr)
        return 1
    plt = pyplot("plot_bench")
    if plt is None:
        return 2

    if a.figure == "folding":
        fig = plot_folding(plt, panels, a.title)
    elif a.figure == "dispatch":
        fig = plot_dispatch(plt, panels, a.title)
    elif a.figure == "bars":
        fig = plot_bars(plt, panels, a.title, a.ylabel, a.ceiling, a.ceiling_label)
    elif a.figure == "stages":
        fig = plot_stages(plt, panels, a.title)
    elif a.figure == "lines":
        fig = plot_lines(plt, xname, panels, a.title)
    elif a.figure == "sweep":
        fig = plot_sweep(plt, *panels[0], a.title, ceiling)
    else:
        fig = plot_roofline(plt, panels[0], a.title, ceiling, bandwidth)
    if os.path.dirname(a.out):
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
    save(fig, a.out)
    plt.close(fig)
    print(a.out)
    print(describe(a.figure, panels))
    if a.figure in ("sweep", "roofline"):
        print(f"  dense ceiling {ceiling:g}" + (f", roof bandwidth {bandwidth:g} GB/s"
                                                 if a.figure == "roofline" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
