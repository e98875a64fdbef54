"""Pool `specroll bench spec` runs: total tokens over total seconds on each side, and the ratio.

    python benchmarks/spec_pool.py benchmarks/spec/b1_d6_t5_r32_seed*_s18.json [--batch 1]

Each run is one draw of prompts and one stretch of machine time, so the spread is taken over runs: a
leave-one-run-out jackknife of the pooled ratio gives its standard error, the two-sided 95% interval and the
one-sided 95% lower bound take Student's t with n - 1 degrees of freedom (few runs), and the per-run
ratios are printed beside it. Only rows of the given batch size (and ``--plan``) are read, a file named twice
counts once, and runs of different settings (plan, head, dtype, chain stop, head weights, plan size) are
refused rather than pooled (``--verify`` picks one chain verification's rows of a side-by-side run; rows from
before ``bench spec --verify`` were verified token by token).
"""
import argparse
import json
import math
import sys

# two-sided 95% quantiles of Student's t by degrees of freedom (n runs give n - 1); 1.96 past 30
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
        20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
        29: 2.045, 30: 2.042}
# one-sided 95% quantiles (the lower bound a ">= target" claim needs); 1.645 past 30
T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833, 10: 1.812,
       11: 1.796, 12: 1.782, 13: 1.771, 14: 1.761, 15: 1.753, 16: 1.746, 17: 1.740, 18: 1.734, 19: 1.729,
       20: 1.725, 21: 1.721, 22: 1.717, 23: 1.714, 24: 1.711, 25: 1.708, 26: 1.706, 27: 1.703, 28: 1.701,
       29: 1.699, 30: 1.697}
NEEDED = ("vanilla_tokens", "vanilla_s", "spec_tokens", "spec_s", "speedup", "accept_length")


def pooled(rows):
    vt = sum(r["vanilla_tokens"] for r in rows)
    vs = sum(r["vanilla_s"] for r in rows)
    st = sum(r["spec_tokens"] for r in rows)
    ss = sum(r["spec_s"] for r in rows)
    return (st / ss) / (vt / vs), vt / vs, st / ss


def jackknife_se(runs) -> float:
    """Leave-one-run-out jackknife standard error of the pooled ratio."""
    n = len(runs)
    loo = [pooled(runs[:i] + runs[i + 1:])[0] for i in range(n)]
    m = sum(loo) / n
    return math.sqrt((n - 1) / n * sum((x - m) ** 2 for x in loo))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--plan", default=None, help="the plan whose rows to pool (needed when the files hold several)")
    ap.add_argument("--verify", default=None, help="the chain verification whose rows to pool (block or token)")
    a = ap.parse_args(argv)
    rows = []
    for f in dict.fromkeys(a.files):
        try:
            with open(f) as fh:
                data = json.load(fh)
        except (OSError, json.JSONDecodeError) as e:
            sys.exit(f"{f}: cannot read a bench spec JSON ({e})")
        got = [r for r in data.get("rows", []) if r.get("batch") == a.batch and a.plan in (None, r.get("plan"))
               and a.verify in (None, r.get("verify", "token"))]
        if not got:
            sys.exit(f"{f}: no row with batch {a.batch}" + (f" and plan {a.plan}" if a.plan else "")
                     + (f" and verify {a.verify}" if a.verify else ""))
        for r in got:
            missing = [k for k in NEEDED if k not in r]
            if missing:
                sys.exit(f"{f}: a batch-{a.batch} row lacks {', '.join(missing)} (written by an older bench spec?)")
            rows.append((f, {**r, "draft": data.get("draft"), "dtype": data.get("dtype")}))
    settings = {(r.get("plan"), r["draft"], r["dtype"], r.get("chain_stop"), r.get("head_weights"),
                 r.get("verify", "token"), json.dumps(r.get("plan_max"), sort_keys=True)) for _, r in rows}
    if len(settings) > 1:
        sys.exit("rows of several settings (plan, head, dtype, chain stop, head weights, verification, plan size): "
                 "pool one setting's files at a time (--plan / --verify pick one plan's / verification's rows)")
    for f, r in rows:
        print(f"{f}: {r['speedup']:.3f}x  accept {r['accept_length']:.2f}")
    runs = [r for _, r in rows]
    ratio, v, s = pooled(runs)
    n = len(runs)
    line = f"pooled over {n} runs: vanilla {v:.1f} tok/s, spec {s:.1f} tok/s, {ratio:.3f}x"
    if n >= 3:
        se = jackknife_se(runs)
        t = T975.get(n - 1, 1.96)
        line += (f", jackknife s.e. {se:.3f}, 95% interval {ratio - t * se:.3f}-{ratio + t * se:.3f} (t = {t}), "
                 f"one-sided 95% lower bound {ratio - T95.get(n - 1, 1.645) * se:.3f}")
    print(line)


if __name__ == "__main__":
    main()
