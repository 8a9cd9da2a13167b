#!/usr/bin/env python3
"""One line of numbers from a bin/moe-train --metrics-file: what the course's run scripts
(tools/multigpu.sh, chapters/05-fp8-nvfp4/convergence.sh) put in their tables.

    tools/metrics_summary.py FILE [--after N | --after P%] [--tokens T] [--print LIST]

--after N leaves out the first N training steps (warm-up), --after P% the first P percent
of them (default: none). Then --print (default ms,tps,loss) writes, space-separated:

  ms    median step time of the steps kept, in milliseconds
  tps   median tokens/s of those steps, or with --tokens T, T / the median step time
  loss  the last step's loss
  tail  the mean loss of the last 10 steps
  val   the last evaluation's validation loss

Only Python's standard library. Exit status 1 with a message naming the file when it has no
training step (or none left after --after), no evaluation for `val`, or a bad line.
"""
import argparse
import json
import statistics
import sys


def summary(path, after="0", tokens=None, fields=("ms", "tps", "loss")):
    """The requested numbers, as strings, from the metrics file at path"""
    train, evals = [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e})")
            if rec.get("event") == "train":
                train.append(rec)
            elif rec.get("event") == "eval":
                evals.append(rec)
    if not train:
        raise ValueError(f"{path}: no training step")
    skip = len(train) * int(after[:-1]) // 100 if after.endswith("%") else int(after)
    kept = [r for r in train if r["step"] > skip] if not after.endswith("%") else train[skip:]
    if not kept:
        raise ValueError(f"{path}: no training step after --after {after} ({len(train)} in all)")
    ms = statistics.median(r["step_s"] for r in kept) * 1e3
    out = []
    for f in fields:
        if f == "ms":
            out.append(f"{ms:.3f}")
        elif f == "tps":
            tps = tokens / ms * 1e3 if tokens else statistics.median(r["tokens_per_s"] for r in kept)
            out.append(f"{tps:.0f}")
        elif f == "loss":
            out.append(f"{train[-1]['loss']:.4f}")
        elif f == "tail":
            tail = train[-10:]
            out.append(f"{sum(r['loss'] for r in tail) / len(tail):.4f}")
        elif f == "val":
            if not evals:
                raise ValueError(f"{path}: no evaluation (val asked for)")
            out.append(f"{evals[-1]['val_loss']:.4f}")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file", help="a moe-train --metrics-file (JSON lines)")
    p.add_argument("--after", default="0", help="leave out the first N steps, or P%% of them")
    p.add_argument("--tokens", type=int, help="tokens a step: tps = tokens / median step time")
    p.add_argument("--print", default="ms,tps,loss", help="comma-separated: ms, tps, loss, tail, val")
    a = p.parse_args(argv)
    fields = a.print.split(",")
    bad = [f for f in fields if f not in ("ms", "tps", "loss", "tail", "val")]
    if bad:
        p.error(f"--print: unknown {bad} (ms, tps, loss, tail, val)")
    body = a.after[:-1] if a.after.endswith("%") else a.after
    if not body.isdigit() or (a.after.endswith("%") and int(body) >= 100):
        p.error(f"--after {a.after!r}: a number of steps (N) or a percentage below 100 (P%)")
    if a.tokens is not None and a.tokens <= 0:
        p.error("--tokens must be > 0")
    try:
        print(" ".join(summary(a.file, a.after, a.tokens, fields)))
    except (OSError, ValueError, KeyError) as e:
        print(f"metrics_summary: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
