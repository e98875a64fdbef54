"""Pool `specroll bench spec` runs: total tokens over total seconds on each side, and the ratio.

    python benchmarks/spec_pool.py benchmarks/spec/b1_d6_t5_r32_seed*_s18.json [--batch 1]

Each run is one draw of prompts and one stretch of machine time, so the spread is taken over runs: a
leave-one-run-out jackknife of the pooled ratio gives its standard error, and the per-run ratios are
printed beside it. Only rows of the given batch size (and ``--plan``) are read, and runs of different
settings (plan, head, dtype, chain stop, head weights, plan size) are refused rather than pooled.
"""
import argparse
import json
import math
import sys


def pooled(rows):
    vt = sum(r["vanilla_tokens"] for r in rows)
    vs = sum(r["vanilla_s"] for r in rows)
    st = sum(r["spec_tokens"] for r in rows)
    ss = sum(r["spec_s"] for r in rows)
    return (st / ss) / (vt / vs), vt / vs, st / ss


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--plan", default=None, help="the plan whose rows to pool (needed when the files hold several)")
    a = ap.parse_args(argv)
    rows = []
    for f in a.files:
        try:
            with open(f) as fh:
                data = json.load(fh)
        except (OSError, json.JSONDecodeError) as e:
            sys.exit(f"{f}: cannot read a bench spec JSON ({e})")
        got = [r for r in data.get("rows", []) if r.get("batch") == a.batch and a.plan in (None, r.get("plan"))]
        if not got:
            sys.exit(f"{f}: no row with batch {a.batch}" + (f" and plan {a.plan}" if a.plan else ""))
        for r in got:
            rows.append((f, {**r, "draft": data.get("draft"), "dtype": data.get("dtype")}))
    plans = sorted({r.get("plan") for _, r in rows})
    if len(plans) > 1:
        sys.exit(f"rows of several plans ({', '.join(map(str, plans))}): choose one with --plan")
    settings = {(r["draft"], r["dtype"], r.get("chain_stop"), r.get("head_weights"),
                 json.dumps(r.get("plan_max"), sort_keys=True)) for _, r in rows}
    if len(settings) > 1:
        sys.exit("rows of several settings (head, dtype, chain stop, head weights, plan size): "
                 "pool one setting's files at a time")
    for f, r in rows:
        print(f"{f}: {r['speedup']:.3f}x  accept {r['accept_length']:.2f}")
    ratio, v, s = pooled([r for _, r in rows])
    n = len(rows)
    line = f"pooled over {n} runs: vanilla {v:.1f} tok/s, spec {s:.1f} tok/s, {ratio:.3f}x"
    if n >= 3:
        loo = [pooled([r for j, (_, r) in enumerate(rows) if j != i])[0] for i in range(n)]
        m = sum(loo) / n
        se = math.sqrt((n - 1) / n * sum((x - m) ** 2 for x in loo))
        line += f", jackknife s.e. {se:.3f} (95% interval {ratio - 1.96 * se:.3f}-{ratio + 1.96 * se:.3f})"
    print(line)


if __name__ == "__main__":
    main()
