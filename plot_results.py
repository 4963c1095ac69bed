#!/usr/bin/env python
"""Plots for a `python -m ddtree.bench.benchmark` results directory (PNG + PDF into RESULTS/plots/):

    speedup_vs_budget  speedup over AR vs DDTree budget, one panel per dataset x target mode x temperature
                       (DFlash as a dashed horizontal reference, AR at 1)
    tau_vs_budget      mean accepted tokens per verify pass vs budget (same layout)
    acceptance_hist    distribution of accepted lengths per step, DFlash and DDTree budgets
    stage_time         stacked per-stage time per method, ms per generated token
  from RESULTS/traces.jsonl (a `--traces` run), one panel per temperature, one line per method:
    trace_depth        how deep the accepted path gets: P(reaches depth d) and P(reaches d | reached d - 1)
    trace_rank         how often the drafter's k-th choice among siblings is the accepted one
    trace_calibration  drafter calibration: a path's draft probability vs how often it is accepted, and the
                       accepted path's draft probability by its length

Speedups are the benchmark's own rows (ddtree.bench.runner: method tokens/s / ar tokens/s on the same prompts), end to
end and decode only (dashed), medians over the timed repeats with their range as error bars; a cell the benchmark
flagged (a busy machine, or repeats that disagree) is ringed in red and marked †.

By default only the records of the last benchmark run (RESULTS/last_run.json) are plotted; --all plots every
record in the directory (mixing configurations is then your responsibility).
"""
from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display needed (servers, CI)
import matplotlib.pyplot as plt  # noqa: E402

from ddtree.engine import traces as tr  # noqa: E402
from ddtree.bench.benchmark import load_records, load_traces, record_mode, summarize  # noqa: E402
from ddtree.base.config import ConfigError  # noqa: E402
from ddtree.base.files import output_dir  # noqa: E402
from ddtree.engine.method_spec import REFERENCE, MethodSpec  # noqa: E402
from ddtree.engine.stats import STAGES  # noqa: E402

STAGE_COLORS = dict(prefill="#9e9e9e", draft="#4c72b0", tree_build="#55a868", tree_compile="#8172b2",
                    verify="#dd8452", commit="#c44e52")


def read_results(results: Path, everything: bool) -> tuple[list[dict], dict]:
    records = load_records(results)
    manifest = results / "last_run.json"
    env = {}
    if manifest.is_file():
        try:
            last = json.loads(manifest.read_text())
            keys, env = list(last["keys"]), dict(last.get("env", {}))
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{manifest} is damaged ({type(e).__name__}: {e}); run the benchmark again to rewrite "
                              f"it, or plot every record with --all") from None
        if not everything:
            kept = {k: records[k] for k in keys if k in records}
            if records and not kept:
                raise ConfigError(f"{results} holds {len(records)} records, but none of the last run's "
                                  f"({manifest} names {len(keys)} others, from a run whose records are gone): plot "
                                  f"them all with --all, or run the benchmark again")
            records = kept
    recs = list(records.values())
    if not env and recs:
        env = recs[-1].get("env", {})
    return recs, env


def method_order(records: list[dict]) -> list[MethodSpec]:
    specs = {MethodSpec.parse(r["method"]) for r in records}
    return sorted(specs, key=lambda s: (s.info.rank, s.label, s.budget if isinstance(s.budget, int) else 1 << 30))


def cell_of(r: dict) -> tuple[str, str]:
    """The panel of a record or summary row: its dataset's column, and a row per target mode and temperature."""
    return r["dataset"], f"{r.get('mode') or record_mode(r)}, T = {r['temperature']:g}"


def grid(cells: list[tuple[str, str]], title: str, width: float = 4.6, height: float = 3.6):
    datasets = list(dict.fromkeys(d for d, _ in cells))
    temps = sorted({t for _, t in cells})
    fig_width = max(6.5, width * len(datasets))  # one panel alone still needs room for the title
    fig, axes = plt.subplots(len(temps), len(datasets), figsize=(fig_width, height * len(temps) + 0.9),
                             squeeze=False)
    # Wrap each title line to the figure width (~9 characters per inch at this font size).
    lines = [wrapped for line in title.split("\n") for wrapped in textwrap.wrap(line, int(fig_width * 9))]
    fig.suptitle("\n".join(lines), fontsize=12)
    panels = {(d, t): axes[temps.index(t)][datasets.index(d)] for d in datasets for t in temps}
    for (d, t), ax in panels.items():
        ax.set_title(f"{d}, {t}", fontsize=11)
        if (d, t) not in cells:
            ax.set_visible(False)
    return fig, panels


FLAG_COLOR = "#d62728"  # flagged cells: the machine was busy or the repeats disagreed (summary.md says why)


def _flag(r: dict) -> str:
    return " †" if r.get("flagged") else ""


def _error_bars(tree: list[dict], key: str):
    """[[below], [above]] the medians: the range over the repeats (zero for tau, which does not vary)."""
    spans = [r.get(f"{key}_range") or [r[key], r[key]] for r in tree]
    return [[max(0.0, r[key] - lo) for r, (lo, _) in zip(tree, spans)],
            [max(0.0, hi - r[key]) for r, (_, hi) in zip(tree, spans)]]


def budget_curve(rows, cells, key: str, ylabel: str, title: str, ar_value: float | None):
    """One panel per cell: DDTree over its fixed budgets (medians, bars: the range over the repeats; with
    key="speedup" also the decode-only speedup, dashed), the other methods as level lines, flagged cells in red."""
    fig, panels = grid(cells, title)
    for cell, ax in panels.items():
        cell_rows = [r for r in rows if cell_of(r) == cell]
        specs = {r["method"]: MethodSpec.parse(r["method"]) for r in cell_rows}
        lookup = sorted((r for r in cell_rows if isinstance(specs[r["method"]].budget, int)
                         and specs[r["method"]].lookup), key=lambda r: r["budget"])
        if lookup:  # ddtree:N+lookup: its own curve beside DDTree's
            ax.errorbar([r["budget"] for r in lookup], [r[key] for r in lookup], yerr=_error_bars(lookup, key),
                        fmt="D-", color="#9467bd", lw=2, capsize=3, ms=5, label="DDTree + context lookup")
        tree = sorted((r for r in cell_rows if isinstance(specs[r["method"]].budget, int)
                       and not specs[r["method"]].lookup), key=lambda r: r["budget"])
        if tree:
            budgets = [r["budget"] for r in tree]
            ax.errorbar(budgets, [r[key] for r in tree], yerr=_error_bars(tree, key), fmt="o-", color="#dd8452",
                        lw=2, capsize=3, label="DDTree, end to end" if key == "speedup" else "DDTree")
            if key == "speedup" and all(r.get("decode_speedup") is not None for r in tree):
                ax.errorbar(budgets, [r["decode_speedup"] for r in tree], yerr=_error_bars(tree, "decode_speedup"),
                            fmt="s--", color="#8c564b", lw=1.5, capsize=3, ms=4, label="DDTree, decode only")
            for r in tree:
                if r.get("flagged"):  # a red ring: the machine may have made this point
                    ax.plot([r["budget"]], [r[key]], "o", ms=13, mfc="none", mec=FLAG_COLOR, mew=2)
                ax.annotate(f"{r[key]:.2f}{_flag(r)}", (r["budget"], r[key]), textcoords="offset points",
                            xytext=(0, 7), ha="center", fontsize=8, color=FLAG_COLOR if r.get("flagged") else "black")
            if any(r.get("flagged") for r in tree):
                ax.plot([], [], "o", ms=10, mfc="none", mec=FLAG_COLOR, mew=2, label="† flagged (busy or spread)")
        if tree or lookup:
            budgets = sorted({r["budget"] for r in tree + lookup})
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.minorticks_off()
        for r in cell_rows:
            spec = specs[r["method"]]
            if spec.name == REFERENCE or isinstance(spec.budget, int):  # ar: ar_value's line; budgets: the curve
                continue
            if not spec.info.takes_budget and (key == "speedup" or not spec.peer):  # peers: speed only
                name, color = spec.info.style(spec.variant)
                ax.axhline(r[key], color=color, ls=spec.info.linestyle, lw=1.5,
                           label=f"{name} ({r[key]:.2f}{_flag(r)})")
            if r["budget"] == "auto":  # adaptive: a line at its value, a star at its mean chosen budget
                chosen = max(1.0, r.get("mean_nodes", 2.0) - 1)
                color = "#17becf" if spec.lookup else "#55a868"
                ax.axhline(r[key], color=color, ls="-.", lw=1.5,
                           label=f"DDTree auto{' + lookup' if spec.lookup else ''} ({r[key]:.2f}{_flag(r)}, "
                                 f"mean budget {chosen:.0f})")
                ax.plot([chosen], [r[key]], "*", color=color, ms=13)
        if ar_value is not None:
            ax.axhline(ar_value, color="black", ls=":", lw=1.2, label=f"AR ({ar_value:g})")
        ax.set_xlabel("DDTree budget (draft nodes per step, log scale)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0, top=max([ax.get_ylim()[1]] + [r[key] * 1.15 for r in cell_rows]))
        if any(r.get("flagged") for r in cell_rows):
            ax.set_title(ax.get_title() + "  († flagged)", fontsize=11, color=FLAG_COLOR)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    return fig


def acceptance_hist(records, specs, cells, title: str):
    """Grouped bars (not overlaid histograms): methods with identical distributions stay visible."""
    fig, panels = grid(cells, title)
    shown = [s for s in specs if s.info.uses_drafter]
    colors = plt.cm.viridis([i / max(1, len(shown) - 1) * 0.9 for i in range(len(shown))])
    width = 0.8 / max(1, len(shown))
    for cell, ax in panels.items():
        recs = [r for r in records if cell_of(r) == cell]
        longest = max([max(r["acceptance_lengths"], default=1) for r in recs] + [2])
        for i, (spec, color) in enumerate(zip(shown, colors)):
            lengths = [a for r in recs if r["method"] == spec.label for a in r["acceptance_lengths"]]
            if not lengths:
                continue
            xs = list(range(1, longest + 1))
            fractions = [lengths.count(x) / len(lengths) for x in xs]
            ax.bar([x - 0.4 + width * (i + 0.5) for x in xs], fractions, width=width, color=color,
                   label=f"{spec.info.display}{f' {spec.budget}' if spec.budget else ''}"
                         f"{' + lookup' if spec.lookup else ''} (tau {sum(lengths) / len(lengths):.2f})")
        ax.set_xlabel("tokens accepted per verify step (bonus included)")
        ax.set_ylabel("fraction of steps")
        ax.set_xticks(range(1, longest + 1, max(1, longest // 12)))
        ax.set_xlim(0.5, longest + 0.5)
        ax.set_ylim(0, 1.05)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def stage_bars(rows, cells, title: str):
    fig, panels = grid(cells, title, width=5.2)
    for cell, ax in panels.items():
        cell_rows = [r for r in rows if cell_of(r) == cell
                     and not MethodSpec.parse(r["method"]).peer]  # peers have no stages
        names = [r["method"] for r in cell_rows]
        bottom = [0.0] * len(cell_rows)
        for stage in STAGES:
            values = [r["stage_ms_per_token"].get(stage, 0.0) for r in cell_rows]
            ax.bar(names, values, bottom=bottom, color=STAGE_COLORS[stage], label=stage)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_ylabel("time per generated token (ms)")
        ax.set_xlabel("method")
        ax.tick_params(axis="x", labelrotation=35, labelsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.set_ylim(top=max(bottom + [1.0]) * 1.08)
    handles, labels = next(iter(panels.values())).get_legend_handles_labels()
    # One legend for the figure, below the panels, so it never covers a bar.
    fig.legend(handles, labels, loc="lower center", ncols=len(STAGES), fontsize=9,
               title="stage (stacked bottom to top, left to right here)", title_fontsize=9)
    fig.legend_margin = 0.6 / fig.get_figheight()  # fraction of the height kept free for that legend
    return fig


def read_traces(results: Path, keys: set[str]) -> dict[tuple[str, float], list[dict]]:
    """The drafted steps (trees with draft nodes) of the plotted runs, by (method, temperature): each record's own
    run's steps (load_traces)."""
    by = {}
    for key, steps in load_traces(results).items():
        for step in steps if key in keys else ():
            if len(step.get("parents", ())) > 1:
                by.setdefault((step["method"], step["temperature"]), []).append(step)
    return by


def trace_figures(by: dict, title: str) -> dict:
    """trace_depth, trace_rank, trace_calibration: one row of panels per temperature, one line per method."""
    temps = sorted({t for _, t in by})
    methods = [s.label for s in method_order([{"method": m} for m, _ in by])]
    colors = dict(zip(methods, plt.cm.viridis([i / max(1, len(methods) - 1) * 0.9 for i in range(len(methods))])))
    figs = {name: plt.subplots(len(temps), cols, figsize=(6.5 * cols, 3.8 * len(temps) + 0.9), squeeze=False)
            for name, cols in (("trace_depth", 1), ("trace_rank", 1), ("trace_calibration", 2))}
    for row, t in enumerate(temps):
        ax_depth, ax_rank = figs["trace_depth"][1][row][0], figs["trace_rank"][1][row][0]
        ax_rel, ax_len = figs["trace_calibration"][1][row]
        for m in (m for m in methods if (m, t) in by):
            steps, color = by[(m, t)], colors[m]
            depth = tr.acceptance_by_depth(steps)
            ds = list(depth)
            ax_depth.plot(ds, [depth[d][0] for d in ds], "o-", color=color, label=f"{m}: reaches depth d")
            ax_depth.plot(ds, [depth[d][1] for d in ds], "x--", color=color, label=f"{m}: given d - 1")
            rank = {r: v for r, v in tr.acceptance_by_rank(steps).items() if r < 12}
            ax_rank.plot(list(rank), [v[0] for v in rank.values()], "o-", color=color, label=m)
            cal = tr.calibration(steps)
            if cal["reliability"]:
                ax_rel.plot(*zip(*[(p, f) for p, f, _ in cal["reliability"]]), "o-", color=color, label=m)
            ax_len.plot(list(cal["by_length"]), [p for p, _ in cal["by_length"].values()], "o-", color=color, label=m)
        ax_rel.plot([0, 1], [0, 1], ":", color="black", lw=1, label="calibrated")
        panels = [(ax_depth, "accepted path depth d", "fraction of drafted steps"),
                  (ax_rank, "rank among siblings by draft probability (0 = first choice)",
                   "fraction accepted when judged"),
                  (ax_rel, "draft probability of a node's path", "fraction of such nodes accepted"),
                  (ax_len, "accepted draft tokens L", "draft probability of the accepted path")]
        for ax, xlabel, ylabel in panels:
            ax.set_title(f"T = {t:g}", fontsize=11)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.set_ylim(0, 1.05)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    heads = {"trace_depth": "How deep the accepted path gets", "trace_rank": "Acceptance by sibling rank",
             "trace_calibration": "Drafter calibration"}
    for name, (fig, _) in figs.items():
        fig.suptitle(f"{heads[name]} - {title}", fontsize=12)
    return {name: fig for name, (fig, _) in figs.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default="results", help="benchmark results directory (default: %(default)s)")
    p.add_argument("--out", help="plot directory (default: RESULTS/plots)")
    p.add_argument("--all", action="store_true", help="plot every record, not only the last run's")
    args = p.parse_args(argv)
    results = Path(args.results)
    try:
        records, env = read_results(results, args.all)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not records:
        print(f"error: no benchmark records in {results} (run `bash run_benchmark.sh --out {results}` first)",
              file=sys.stderr)
        return 2
    try:
        out = output_dir(args.out or results / "plots", "the plot directory" if args.out is None else "--out")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    specs = method_order(records)
    rows = summarize(records, specs)
    cells = list(dict.fromkeys(cell_of(r) for r in rows))
    drafter = env.get("drafter", "?")
    modes = env.get("modes") or {"float": env.get("dtype", "")}  # mode -> its dtype (older runs: one mode)
    where = (f"{env.get('target', '')}, {env.get('gpu') or env.get('cpu', '')}, "
             + "; ".join(f"{mode}: {dtype}" for mode, dtype in modes.items())
             + f"; medians over {env.get('repeats', 1)} timed repeat(s), bars: their range")
    note = " (random weights: measures overhead, not the method)" if drafter == "untrained" else ""
    figures = {
        "speedup_vs_budget": budget_curve(rows, cells, "speedup", "speedup over AR (tokens/s ratio, same prompts;\n"
                                          "end to end, and decode only dashed)",
                                          f"Speedup vs DDTree budget - drafter: {drafter}{note}\n{where}", 1.0),
        "tau_vs_budget": budget_curve(rows, cells, "tau", "tau (tokens per target pass)",
                                      f"Acceptance length vs DDTree budget - drafter: {drafter}{note}\n{where}", 1.0),
        "acceptance_hist": acceptance_hist(records, specs, cells,
                                           f"Accepted length per step - drafter: {drafter}{note}\n{where}"),
        "stage_time": stage_bars(rows, cells, f"Where the time goes - drafter: {drafter}{note}\n{where}"),
    }
    traced = read_traces(results, {r["key"] for r in records})
    if traced:
        figures.update(trace_figures(traced, f"drafter: {drafter}{note}\n{where}"))
    for name, fig in figures.items():
        fig.tight_layout(rect=(0, getattr(fig, "legend_margin", 0.0), 1, 1))
        for ext in ("png", "pdf"):
            fig.savefig(out / f"{name}.{ext}", dpi=120)
        plt.close(fig)
        print(out / f"{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
