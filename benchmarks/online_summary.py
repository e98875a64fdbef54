"""Summarise `specroll bench online` JSON files side by side (BENCHMARKS.md).

  python benchmarks/online_summary.py FILE.json [FILE.json ...]

Per file: the online and frozen heads' accept length at the start, minimum, end (mean of the last 3 steps;
``specroll.bench.online.summarize``), the mean paired difference online - frozen over steps 1-10, 11-20 and 21-30, and the mean rollout seconds
over steps 2.. (step 1 carries first-use costs in files written before the bench's warm-up rollout); with the
fixed-prompt probe (``--probe``, files from session 32 on), its start, minimum and end per head too."""
import json
import statistics
import sys

from specroll.bench.online import conditions, conditions_line, summarize


def summary(path: str) -> dict:
    d = json.load(open(path))
    cur = {m: [r for r in d["rows"] if r["mode"] == m] for m in ("online", "frozen")}
    acc = {m: [r["accept_length"] for r in rs] for m, rs in cur.items()}
    out = {"file": path, "design": d["args"].get("design", "separate"), "seed": d["args"]["seed"],
           "draft_lr": d["config"]["online"]["draft"]["lr"], "steps": len(acc["online"])}
    summ = summarize(d["rows"])
    out["conditions"] = conditions(summ)
    for m, s in summ.items():
        out[m] = {"start": s["accept_length_start"], "min": s["accept_length_min"], "end": s["accept_length_end"],
                  "rollout_s": statistics.mean(r["rollout_s"] for r in cur[m][1:])}
        if "probe_accept_length_start" in s:
            out[m]["probe"] = (s["probe_accept_length_start"], s["probe_accept_length_min"],
                               s["probe_accept_length_end"])
    diff = [a - b for a, b in zip(acc["online"], acc["frozen"])]
    out["diff"] = [statistics.mean(diff[i:i + 10]) for i in range(0, len(diff), 10)]
    return out


if __name__ == "__main__":
    for f in sys.argv[1:]:
        s = summary(f)
        o, fr = s["online"], s["frozen"]
        print(f"{s['file']}: {s['design']}, seed {s['seed']}, draft lr {s['draft_lr']}, {s['steps']} steps")
        print(f"  online {o['start']:.2f} -> {o['end']:.2f} (min {o['min']:.2f}), rollout {o['rollout_s']:.2f} s")
        print(f"  frozen {fr['start']:.2f} -> {fr['end']:.2f} (min {fr['min']:.2f}), rollout {fr['rollout_s']:.2f} s")
        for m, v in (("online", o), ("frozen", fr)):
            if "probe" in v:
                print(f"  {m} on the probe prompts {v['probe'][0]:.2f} -> {v['probe'][2]:.2f} (min {v['probe'][1]:.2f})")
        print("  online - frozen by 10 steps: " + " / ".join(f"{x:+.2f}" for x in s["diff"]))
        print("  " + conditions_line(s["conditions"]))
