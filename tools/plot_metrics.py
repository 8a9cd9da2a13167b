#!/usr/bin/python3
"""Turn `moe-train --metrics-file` JSONL into PNG figures.

    tools/plot_metrics.py --out DIR [--title T] [--label L ...] [--prefix P] FILE.jsonl ...

One line per input file in each figure, labelled with --label (in file order) or, by
default, the file's name without its extension. Figures written:

  PREFIXloss.png         train cross-entropy per step (thin) and validation loss (also
                         cross-entropy) at each evaluation (markers), one colour per file
  PREFIXexpert_load.png  tokens per expert over steps: the band runs from the least to the
                         most loaded expert of any MoE layer (lib/trainer.c takes the extremes
                         over every layer's experts), the line is the mean (what a perfectly
                         balanced router gives every expert); only MoE runs, only when there is one
  PREFIXdropped.png      (only with --figure dropped) runs that differ in their capacity factor
                         and drop policy: the dropped (token, expert) assignments per step over
                         the steps; their mean over the second half of each run against the
                         capacity factor, one line per drop policy; and the last validation
                         loss against the capacity factor, dropless runs (factor 0) as a
                         dashed line. Each run's factor and policy come from its "config" record

The records are those lib/metrics.c writes and programs/moe-train.c fills: one JSON object
a line with an "event" key: "config" (the flags), "train" (step, loss, ce, aux_loss,
expert_load_min/mean/max, ...), "eval" (step, train_loss, val_loss) and "error" (step,
message). A resumed run appends to its file, so a step can appear twice; the later record
wins, as it is the one the run continued from.

Only Python's standard library and matplotlib (Debian: python3-matplotlib); no network.
Exit status: 0 written, 1 bad input (the message says which file and line), 2 a usage
error (argparse's message) or no matplotlib.
"""

import argparse
import json
import os
import sys


class InputError(Exception):
    """A metrics file that cannot be plotted; the message names the file and the fix."""


def read_metrics(path):
    """Return {"train": {step: record}, "eval": {step: record}, "errors": [records],
    "config": the last "config" record (the flags as strings) or {}}."""
    if not os.path.exists(path):
        raise InputError(f"{path}: no such file (write one with bin/moe-train --metrics-file {path})")
    runs = {"train": {}, "eval": {}, "errors": [], "config": {}}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{lineno}: not a JSON object ({e.msg}); is this a "
                                 "--metrics-file written by bin/moe-train?") from None
            if not isinstance(rec, dict) or "event" not in rec:
                raise InputError(f"{path}:{lineno}: a record without an \"event\" key; is this a "
                                 "--metrics-file written by bin/moe-train?")
            event = rec["event"]
            if event in ("train", "eval"):
                if "step" not in rec:
                    raise InputError(f"{path}:{lineno}: a \"{event}\" record without a \"step\"")
                runs[event][int(rec["step"])] = rec
            elif event == "error":
                runs["errors"].append(rec)
            elif event == "config":
                runs["config"] = rec  # a resumed run writes it again; the last one holds
            # events added later carry nothing these figures draw
    if not runs["train"] and not runs["eval"]:
        raise InputError(f"{path}: no \"train\" or \"eval\" records (an empty file, or a run that "
                         "stopped before its first step)")
    return runs


def series(records, key):
    """The (steps, values) of one key, in step order, skipping records without a number."""
    steps, values = [], []
    for step in sorted(records):
        v = records[step].get(key)
        if isinstance(v, (int, float)):
            steps.append(step)
            values.append(v)
    return steps, values


def moving_average(values, n):
    """Trailing mean over the last n values (fewer at the start), so step s shows s's past."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= n:
            total -= values[i - n]
        out.append(total / min(i + 1, n))
    return out


def plot_loss(plt, runs, labels, title, smooth, path):
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, (run, label) in enumerate(zip(runs, labels)):
        colour = f"C{i}"
        # cross-entropy, not the total: a dense run has no aux or z loss to add, so only ce
        # compares runs (and matches the validation loss); files without "ce" give "loss"
        steps, loss = series(run["train"], "ce")
        if not steps:
            steps, loss = series(run["train"], "loss")
        if steps:
            name = f"{label} train" + (f" (mean of {smooth} steps)" if smooth > 1 else "")
            ax.plot(steps, moving_average(loss, smooth), color=colour, lw=1, alpha=0.6, label=name)
        steps, val = series(run["eval"], "val_loss")
        if steps:
            ax.plot(steps, val, color=colour, lw=1.5, marker="o", ms=4, label=f"{label} validation")
        for err in run["errors"]:
            ax.axvline(err.get("step", 0), color=colour, ls=":", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(title or "loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_expert_load(plt, runs, labels, title, path):
    """Return False (and write nothing) when no run has expert-load numbers (dense runs)."""
    moe = []
    for i, (run, label) in enumerate(zip(runs, labels)):
        steps, mean = series(run["train"], "expert_load_mean")
        if steps and max(mean) > 0:
            moe.append((i, run, label))
    if not moe:
        return False
    # one panel per run, side by side on one y scale: overlapping bands would hide each other
    fig, axes = plt.subplots(1, len(moe), figsize=(3.2 * len(moe) + 1.5, 4.2), sharey=True,
                             squeeze=False)
    for ax, (i, run, label) in zip(axes[0], moe):
        colour = f"C{i}"
        steps, lo = series(run["train"], "expert_load_min")
        _, hi = series(run["train"], "expert_load_max")
        _, mean = series(run["train"], "expert_load_mean")
        if len(lo) == len(hi) == len(steps):
            ax.fill_between(steps, lo, hi, color=colour, alpha=0.3, lw=0,
                            label="least to most loaded expert")
        ax.plot(steps, mean, color="black", lw=1, ls="--", label="mean (perfect balance)")
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[0][0].set_ylabel("tokens routed to an expert per step")
    fig.suptitle(title or "expert load")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


CAPACITY, POLICY = "moe-expert-capacity-factor", "moe-token-drop-policy"


def capacity_of(run, path):
    """(capacity factor, drop policy) of a run, from its "config" record."""
    cfg = run["config"]
    try:
        return float(cfg[CAPACITY]), cfg.get(POLICY, "probs")
    except (KeyError, ValueError):
        raise InputError(f"{path}: no \"config\" record with a number for {CAPACITY} (written by "
                         "bin/moe-train since its metrics files have one)") from None


def plot_dropped(plt, runs, paths, title, path):
    caps = [capacity_of(r, p) for r, p in zip(runs, paths)]
    fig, (ax_t, ax_cf, ax_loss) = plt.subplots(1, 3, figsize=(15, 4.4))
    factors = sorted({cf for cf, _ in caps if cf > 0})
    colour = {cf: f"C{i % 10}" for i, cf in enumerate(factors)}
    # the default policy first: it gets the solid line
    policies = sorted({pol for cf, pol in caps if cf > 0}, key=lambda p: (p != "probs", p))
    dash = {pol: ("-", "o") if i == 0 else (":", "^") for i, pol in enumerate(policies)}
    for run, (cf, pol) in zip(runs, caps):
        if cf > 0:
            steps, dropped = series(run["train"], "dropped_tokens")
            ax_t.plot(steps, dropped, color=colour[cf], ls=dash[pol][0], lw=1,
                      label=f"factor {cf:g}, {pol}")
    ax_t.set_xlabel("step")
    ax_t.set_ylabel("dropped (token, expert) assignments per step")
    ax_t.set_title("over the steps", fontsize=10)
    ax_t.legend(fontsize=7)
    for pol in policies:
        xs, ys, ls = [], [], []
        for run, (cf, p) in zip(runs, caps):
            if cf > 0 and p == pol:
                steps, dropped = series(run["train"], "dropped_tokens")
                half = dropped[len(dropped) // 2:]
                if half:
                    xs.append(cf)
                    ys.append(sum(half) / len(half))
                _, val = series(run["eval"], "val_loss")
                if val:
                    ls.append((cf, val[-1]))
        order = sorted(range(len(xs)), key=xs.__getitem__)
        ax_cf.plot([xs[i] for i in order], [ys[i] for i in order], ls=dash[pol][0],
                   marker=dash[pol][1], color="C0" if dash[pol][0] == "-" else "C3",
                   label=f"--moe-token-drop-policy {pol}")
        ls.sort()
        ax_loss.plot([c for c, _ in ls], [v for _, v in ls], ls=dash[pol][0], marker=dash[pol][1],
                     color="C0" if dash[pol][0] == "-" else "C3",
                     label=f"--moe-token-drop-policy {pol}")
    for run, (cf, _) in zip(runs, caps):
        _, val = series(run["eval"], "val_loss")
        if cf == 0 and val:
            ax_loss.axhline(val[-1], color="black", ls="--", lw=1, label="dropless")
    ax_cf.set_xlabel("capacity factor")
    ax_cf.set_ylabel("dropped assignments per step (mean, 2nd half)")
    ax_cf.set_title("against the capacity factor", fontsize=10)
    ax_cf.set_ylim(bottom=0)
    ax_loss.set_xlabel("capacity factor")
    ax_loss.set_ylabel("validation loss at the last evaluation")
    ax_loss.set_title("what the drops cost", fontsize=10)
    for ax in (ax_t, ax_cf, ax_loss):
        ax.grid(alpha=0.3)
    for ax in (ax_cf, ax_loss):
        ax.set_xticks(factors)
        ax.margins(x=0.3, y=0.15)
        ax.legend(fontsize=7, loc="best")
    ax_cf.set_ylim(0, ax_cf.get_ylim()[1] * 1.3)  # room for the legend above the points
    fig.suptitle(title or "dropped tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def pyplot(tool):
    """matplotlib.pyplot drawing to files only, or None (with the install command printed
    under the tool's name) when matplotlib is missing. tools/plot_bench.py uses it too."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display needed, none opened
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"{tool}: matplotlib is missing; install it with "
              "`sudo apt-get install python3-matplotlib` (and run /usr/bin/python3)",
              file=sys.stderr)
        return None
    return plt


def main(argv=None):
    p = argparse.ArgumentParser(
        description="Plot moe-train --metrics-file JSONL as PNGs (loss curves, expert load).")
    p.add_argument("files", nargs="+", metavar="FILE.jsonl", help="metrics files, one line each")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for the PNGs (created)")
    p.add_argument("--label", action="append", default=[], metavar="L",
                   help="legend label, once per file in order (default: the file name)")
    p.add_argument("--title", default="", help="title prefix of every figure")
    p.add_argument("--prefix", default="", help="prefix of the PNG names, e.g. 'ch01_'")
    p.add_argument("--figure", action="append", choices=("loss", "expert_load", "dropped"),
                   default=[], help="draw only this figure (repeatable; default: loss and "
                   "expert_load; dropped is drawn only when named)")
    p.add_argument("--smooth", type=int, default=1, metavar="N",
                   help="draw the train loss as a trailing mean of N steps (default 1: raw)")
    a = p.parse_args(argv)

    if a.label and len(a.label) != len(a.files):
        p.error(f"{len(a.label)} --label for {len(a.files)} files: give one per file, or none")
    if a.smooth < 1:
        p.error(f"--smooth must be >= 1 (got {a.smooth})")
    labels = a.label or [os.path.splitext(os.path.basename(f))[0] for f in a.files]

    try:
        runs = [read_metrics(f) for f in a.files]
        if "dropped" in a.figure:
            for run, f in zip(runs, a.files):
                capacity_of(run, f)
    except (InputError, OSError, UnicodeDecodeError) as e:
        print(f"plot_metrics: {e}", file=sys.stderr)
        return 1
    plt = pyplot("plot_metrics")
    if plt is None:
        return 2

    os.makedirs(a.out, exist_ok=True)
    title = (a.title + ": ") if a.title else ""
    figures = a.figure or ["loss", "expert_load"]
    written = []
    if "loss" in figures:
        written.append(os.path.join(a.out, a.prefix + "loss.png"))
        plot_loss(plt, runs, labels, title + "loss", a.smooth, written[-1])
    load = os.path.join(a.out, a.prefix + "expert_load.png")
    if "expert_load" in figures:
        if plot_expert_load(plt, runs, labels, title + "expert load", load):
            written.append(load)
        else:
            print("plot_metrics: no MoE run among the files (no expert load): expert_load.png "
                  "not written", file=sys.stderr)
    if "dropped" in figures:
        written.append(os.path.join(a.out, a.prefix + "dropped.png"))
        plot_dropped(plt, runs, a.files, title + "dropped tokens", written[-1])
    for run, f in zip(runs, a.files):
        for err in run["errors"]:
            print(f"plot_metrics: note: {f} ends with an error at step {err.get('step')}: "
                  f"{err.get('message', '')} (dotted line)", file=sys.stderr)
    for w in written:
        print(w)
    return 0


if __name__ == "__main__":
    sys.exit(main())
