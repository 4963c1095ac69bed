"""Choose the drafter to ship by the main job's end-to-end speed (issue 51 item 4), not by tau alone.

    python scripts/choose_drafter.py runs/gpu-train/all-q8 runs/gpu-train/old-q8      # against the shipped one
    python scripts/choose_drafter.py CANDIDATE ... -- --num-prompts 2 --max-new-tokens 32   # benchmark options

Each drafter (the shipped one first) gets one run of the main job's benchmark (`ddtree.bench.benchmark`: HumanEval,
MT-Bench and GSM, T = 0, 8 prompts x 128 tokens, both CPU target modes, `ar`, `dflash`, `ddtree` at budgets 2, 3,
4, 8 and auto, and with the context lookup `ddtree:2+lookup` and `ddtree:auto+lookup` (a bare `ddtree` on a CPU),
2 repeats) into runs/choose/<name>. Speedups are ratios to `ar` within each run, so a machine
that drifts between runs moves both sides of each ratio; tau is exact (greedy). It prints, per mode and set, each
drafter's best fixed-budget `ddtree` speedup (and its method), the CPU default's (`ddtree:auto+lookup`), and the taus of
`dflash` and `ddtree:8`, then the drafter
whose best speedups have the highest geometric mean over modes and sets. Every method's tokens are checked against
`ar`'s in every run; a run with errors is not chosen.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

SHIPPED = Path("ddtree/assets/smollm2-135m-dflash")
DEFAULTS = ["--datasets", "humaneval,mt-bench,gsm", "--temperatures", "0", "--num-prompts", "8",
            "--max-new-tokens", "128", "--repeats", "2", "--quant", "float,gguf-int8",
            "--methods", "ar,dflash,ddtree:2,ddtree:3,ddtree:4,ddtree:8,ddtree:auto,ddtree:2+lookup,ddtree:auto+lookup",
            "--no-progress"]


def run(drafter: Path, out: Path, extra: list[str]) -> dict:
    """The benchmark's summary.json for `drafter` (run now unless out already holds one)."""
    summary = out / "summary.json"
    if not summary.is_file():
        cmd = [sys.executable, "-m", "ddtree.bench.benchmark", *DEFAULTS, *extra, "--draft", str(drafter),
               "--out", str(out)]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    return json.loads(summary.read_text())


def cells(summary: dict) -> dict:
    """(mode, dataset) -> {"best": (speedup, method), "auto": the CPU default's speedup, "tau_dflash", "tau_ddtree8",
    "errors"}; best: the fastest fixed budget, with or without the lookup."""
    out: dict = {}
    for r in summary["rows"]:
        c = out.setdefault((r["mode"], r["dataset"]), {"best": (0.0, "-"), "auto": None, "tau_dflash": None,
                                                        "tau_ddtree8": None, "errors": 0})
        c["errors"] += r.get("errors") or 0
        m = r["method"]
        if m == "dflash":
            c["tau_dflash"] = r["tau"]
        elif m == "ddtree:8":
            c["tau_ddtree8"] = r["tau"]
        if m == "ddtree:auto+lookup":
            c["auto"] = r["speedup"]
        elif m.startswith("ddtree:") and not m.startswith("ddtree:auto") and r["speedup"] > c["best"][0]:
            c["best"] = (r["speedup"], m)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("candidates", nargs="+", type=Path, help="drafter directories (published format)")
    ap.add_argument("--out", type=Path, default=Path("runs/choose"))
    args, extra = ap.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    for d in args.candidates:
        if not (d / "config.json").is_file():
            ap.error(f"{d} is not a drafter directory (no config.json): give an exported or unpacked drafter")
    drafters = [SHIPPED] + [d for d in args.candidates if d.resolve() != SHIPPED.resolve()]
    names = ["shipped"] + [d.name for d in drafters[1:]]
    if len(set(names)) != len(names):
        ap.error(f"the candidates' folder names must differ (they name the runs): {names[1:]}")
    results = {n: cells(run(d, args.out / n, extra)) for n, d in zip(names, drafters)}
    keys = sorted(results["shipped"])
    print(f"\n{'mode':10s} {'set':10s} " + " ".join(f"{n[:24]:>46s}" for n in names))
    for key in keys:
        row = []
        for n in names:
            c = results[n].get(key)
            row.append("-" if c is None else f"best {c['best'][0]:.2f}x {c['best'][1]:>16s} default "
                       f"{c['auto'] or 0:.2f}x tau {c['tau_dflash'] or 0:.2f}/{c['tau_ddtree8'] or 0:.2f}")
        print(f"{key[0]:10s} {key[1]:10s} " + " ".join(f"{x:>46s}" for x in row))
    print("(best: the fastest fixed ddtree budget's speedup over ar; default: ddtree:auto+lookup's; tau: dflash / "
          "ddtree:8)")
    score = {}
    for n in names:
        bests = [results[n][k]["best"][0] for k in keys if k in results[n]]
        errors = sum(c["errors"] for c in results[n].values())
        score[n] = math.exp(sum(map(math.log, bests)) / len(bests)) if bests and not errors else 0.0
        print(f"{n}: geometric mean of the best speedups {score[n]:.3f}" + (f" ({errors} errors)" if errors else ""))
    chosen = max(score, key=score.get)
    print(f"chosen: {chosen}" + (" (keep the shipped drafter)" if chosen == "shipped" else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
