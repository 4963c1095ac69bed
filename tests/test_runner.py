"""The runner compare and the benchmark share, the one speedup definition, and the benchmark's presets."""
import json
from types import SimpleNamespace

import pytest

from ddtree.api import Pair
from ddtree.bench.benchmark import PRESETS, build_plan, estimate_seconds, step_costs, summarize
from ddtree.bench.compare import compare
from ddtree.base.config import ConfigError
from ddtree.bench.datasets import load_prompt_items, load_prompts
from ddtree.engine.method_spec import MethodSpec, parse_methods
from ddtree.bench.runner import RunSettings, run_prompt, summarize_methods
from ddtree.bench.testing import char_tokenizer, random_pair


def rec(method, prompt_index, seconds, new_tokens, steps=None, dataset="d", temperature=0.0):
    steps = steps or new_tokens
    return dict(method=method, prompt_index=prompt_index, seconds=seconds, new_tokens=new_tokens, steps=steps,
                acceptance_lengths=[new_tokens // steps] * steps, tree_sizes=[1] * steps, stage_seconds={},
                check="identical", dataset=dataset, temperature=temperature, time_to_first_token=0.0)


def test_speedup_is_tokens_per_second_over_ar_on_the_same_prompts():
    specs = parse_methods("ddtree:8")
    records = [rec("ar", 0, 10.0, 100), rec("ar", 1, 1.0, 10), rec("ar", 2, 50.0, 10),
               rec("ddtree:8", 0, 5.0, 100, steps=50), rec("ddtree:8", 1, 2.0, 40, steps=20)]  # no prompt 2
    rows = {r["method"]: r for r in summarize_methods(records, specs)}
    # ar over prompts 0 and 1 only: 110 tokens / 11 s = 10 tok/s; ddtree: 140 / 7 = 20 tok/s -> 2x
    assert rows["ddtree:8"]["speedup"] == pytest.approx(2.0)
    assert rows["ddtree:8"]["tokens_per_second"] == pytest.approx(20.0) and rows["ddtree:8"]["tau"] == 2.0
    assert rows["ar"]["speedup"] == pytest.approx(1.0)
    # the benchmark's summary is the same rows, per dataset and temperature
    bench = summarize(records + [rec("ar", 0, 1.0, 10, dataset="e")], specs)
    assert [(r["dataset"], r["method"]) for r in bench] == [("d", "ar"), ("d", "ddtree:8"), ("e", "ar")]
    assert bench[1]["speedup"] == rows["ddtree:8"]["speedup"]


def test_a_steps_cost_per_stage_and_against_ar():
    ar = dict(rec("ar", 0, 1.1, 11, steps=10), time_to_first_token=0.1, stage_seconds=dict(prefill=0.1, verify=0.9))
    tree = dict(rec("ddtree:4", 0, 0.7, 11, steps=5), time_to_first_token=0.1,
                stage_seconds=dict(prefill=0.1, draft=0.1, verify=0.45, tree_build=0.02))
    rows = {r["method"]: r for r in summarize_methods([ar, tree], parse_methods("ddtree:4"))}
    # ar: 1.0 s of decoding over 10 steps, 90 ms of it verifying; ddtree: 0.6 s over 5 steps
    assert rows["ar"]["ms_per_step"] == pytest.approx(100.0)
    assert rows["ar"]["stage_ms_per_step"]["verify"] == pytest.approx(90.0)
    assert rows["ddtree:4"]["ms_per_step"] == pytest.approx(120.0)
    assert rows["ddtree:4"]["stage_ms_per_step"] == pytest.approx(
        dict(draft=20.0, tree_build=4.0, tree_compile=0.0, verify=90.0, commit=0.0))
    table = step_costs(summarize([ar, tree], parse_methods("ddtree:4")))
    # the draft as a share of ar's whole step, the verify against ar's verify, the rest of the step
    assert "| d, 0 | ar | 1.0 | 1.00 | 100.00 | 0.00 | 90.00 | 10.00 |" in table
    assert "| d, 0 | ddtree:4 | 1.0 | 2.00 | 120.00 | 20.00 (20%) | 90.00 (1.00x) | 10.00 |" in table


def test_compare_runs_the_shared_runner_and_checks_against_ar():
    target, drafter = random_pair("llama", seed=9, block_size=4)
    pair = Pair(target, drafter, None)
    result = compare(pair, [[1, 2, 3], [4, 5]], methods=["dflash", "ddtree:4"], max_new_tokens=6, show=False)
    assert [r["method"] for r in result.rows] == ["ar", "dflash", "ddtree:4"]
    assert [(r["prompt_index"], r["method"]) for r in result.records] == [
        (i, m) for i in (0, 1) for m in ("ar", "dflash", "ddtree:4")]
    assert all(r["check"] == "identical" for r in result.records if r["method"] != "ar") and result.ok
    assert result.rows == summarize_methods(result.records, parse_methods(["dflash", "ddtree:4"]))


def test_run_prompt_skips_hf_when_sampling_and_lets_a_tamper_fail_the_check():
    target, drafter = random_pair("llama", seed=9, block_size=4)
    pair = Pair(target, drafter, None)
    specs = parse_methods("hf,ddtree:4")
    sampled = run_prompt(pair, [1, 2, 3], specs, RunSettings(5, temperature=1.0), seed=1, peers=None)
    assert [r["method"] for r in sampled] == ["ar", "ddtree:4"] and sampled[1]["check"] == "skipped (T > 0)"

    def corrupt(spec, tokens, record):
        return tokens[:-1] + [(tokens[-1] + 1) % 96] if spec.name == "ddtree" else tokens

    seen = []
    greedy = run_prompt(pair, [1, 2, 3], specs[:1] + specs[2:], RunSettings(5), tamper=corrupt,
                        on_record=seen.append)
    assert [r["check"] for r in greedy] == ["reference", "error"] and seen == greedy
    with pytest.raises(ValueError, match="first method must be ar"):
        run_prompt(pair, [1], specs[2:], RunSettings(5))


def test_estimate_from_measured_runs():
    measured = [dict(rec("ar", 0, 1.1, 11), time_to_first_token=0.1, mode="float"),  # 0.1 s a token after the first
                dict(rec("ddtree:8", 0, 0.4, 7), time_to_first_token=0.1, mode="float"),  # 0.05 s a token
                dict(rec("ar", 0, 0.6, 11), time_to_first_token=0.1, mode="gguf-int8")]  # 0.05 s a token
    groups = [dict(mode="float", slots=[dict(method="ar"), dict(method="ddtree:8"), dict(method="hf")])] * 2
    # per group: ar 0.1 + 0.1 x 20, ddtree 0.1 + 0.05 x 20, hf (unmeasured) as the slowest: 2.1 -> 5.3 s x 2
    assert estimate_seconds(measured, groups, SimpleNamespace(max_new_tokens=20)) == pytest.approx(10.6)
    assert estimate_seconds(measured, groups, SimpleNamespace(max_new_tokens=20, repeats=2)) == pytest.approx(21.2)
    # each target mode at its own rates: ar in gguf-int8 1.1 s, its ddtree:8 (unmeasured) as the slowest, 2.1 s
    int8 = [dict(mode="gguf-int8", slots=[dict(method="ar"), dict(method="ddtree:8")])]
    assert estimate_seconds(measured, int8, SimpleNamespace(max_new_tokens=20)) == pytest.approx(3.2)


def test_presets_show_the_project_quickly_and_sweep_in_full():
    quick, full = PRESETS["quick"], PRESETS["full"]
    for preset in (quick, full):
        specs = parse_methods(preset["methods"], preset["budgets"])
        assert {"ar", "hf", "dflash"} <= {s.name for s in specs} and MethodSpec("ddtree", "auto") in specs
        assert set(preset["datasets"].split(",")) == {"humaneval", "mt-bench", "gsm"}
        temps = [float(t) for t in preset["temperatures"].split(",")]
        assert 0.0 in temps and any(t > 0 for t in temps)
    fixed = lambda p: [s.budget for s in parse_methods("ddtree", p["budgets"]) if isinstance(s.budget, int)]  # noqa: E731
    assert len(fixed(quick)) >= 2 and max(fixed(quick)) < 64 <= 256 <= max(fixed(full))  # the sweep: --full
    assert quick["num_prompts"] * quick["max_new_tokens"] < full["num_prompts"] * full["max_new_tokens"]
    assert 3 in fixed(quick) and 3 in fixed(full)  # the best fixed budget on code in the integer mode
    assert all(p["repeats"] >= 2 for p in PRESETS.values())  # every cell timed more than once


def test_compare_with_stops_cuts_every_method_alike_and_skips_the_peers():
    target, drafter = random_pair("llama", seed=11, block_size=4, init_scale=0.25)
    tok = char_tokenizer()
    pair = Pair(target, drafter, tok, stop_ids=(1,))
    prompt = tok.encode("The cat")
    full = pair.generate(prompt, method="ar", max_new_tokens=30).text
    stop = full[12:14]
    result = compare(pair, [prompt], methods=["hf", "dflash", "ddtree:4"], max_new_tokens=30, stop=[stop, "~"],
                     show=False)
    assert [r["method"] for r in result.records] == ["ar", "dflash", "ddtree:4"]  # hf runs without stops: not run
    assert {r["text"] for r in result.records} == {full[:full.find(stop)]} and result.ok
    assert all(r["stop_reason"] == "stop_string" and r["stop_match"] == stop for r in result.records)
    with pytest.raises(ConfigError, match="empty string"):
        compare(pair, [prompt], methods=["ar"], stop=[""], show=False)


def test_benchmark_jsonl_prompts_carry_their_stops(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a", "stop": "\n\n"}) + "\n" + json.dumps({"prompt": "b"}) + "\n")
    assert load_prompt_items(str(path), 5) == [("a", ("\n\n",)), ("b", ())] and load_prompts(str(path), 5) == ["a", "b"]
    target, drafter = random_pair("llama", seed=9, block_size=4)
    args = SimpleNamespace(target=None, threads=1, repeats=1, max_new_tokens=8, top_p=1.0, top_k=0, block_size=None,
                           attention="auto", inject_mismatch=False, traces=False, datasets=str(path),
                           num_prompts=2, temperatures="0", seed=0)
    groups = build_plan(args, Pair(target, drafter, None), parse_methods("hf,ddtree:4"))
    assert [g["stop"] for g in groups] == [("\n\n",), ()]
    assert [[s["method"] for s in g["slots"]] for g in groups] == [["ar", "ddtree:4"], ["ar", "hf", "ddtree:4"]]
    path.write_text(json.dumps({"prompt": "a", "stop": ["ok", 3]}) + "\n")
    with pytest.raises(ConfigError, match=r"p.jsonl:1: stop must be a string or a list of strings"):
        load_prompt_items(str(path), 1)


def timed(method, prompt_index, runs, new_tokens=10, loads=None):
    """A record with repeats: runs = [(seconds, time_to_first_token), ...]."""
    r = rec(method, prompt_index, sorted(s for s, _ in runs)[len(runs) // 2], new_tokens)
    r["repeats"] = [dict(seconds=s, time_to_first_token=f, load=(loads or [None] * len(runs))[i])
                    for i, (s, f) in enumerate(runs)]
    return r


def test_repeats_give_medians_ranges_and_decode_only_speedups():
    """Repeat i of every prompt is one measurement of the cell; the row is the median over repeats with their
    range, end to end and decode only (tokens after the first over the time after the prefill)."""
    specs = parse_methods("ddtree:4")
    records = [timed("ar", 0, [(1.0, 0.1), (1.2, 0.1), (1.1, 0.1)]),
               timed("ddtree:4", 0, [(0.5, 0.1), (0.4, 0.1), (0.6, 0.1)])]
    row = {r["method"]: r for r in summarize_methods(records, specs)}["ddtree:4"]
    assert row["repeats"] == 3
    assert row["speedup"] == pytest.approx(2.0)  # 1.0/0.5, 1.2/0.4 = 3.0, 1.1/0.6: median 2.0
    assert row["speedup_range"] == pytest.approx([1.1 / 0.6, 3.0])
    # decode only: (1.0 - 0.1) / (0.5 - 0.1) = 2.25, 1.1 / 0.3 = 3.67, 1.0 / 0.5 = 2.0
    assert row["decode_speedup"] == pytest.approx(2.25) and row["decode_speedup_range"] == pytest.approx([2.0, 1.1 / 0.3])
    assert row["tokens_per_second"] == pytest.approx(20.0) and row["decode_tokens_per_second"] == pytest.approx(22.5)
    # one run per record (compare, old records): the plain ratio, and no decode figure without a timed prefill
    plain = summarize_methods([rec("ar", 0, 2.0, 10), rec("ddtree:4", 0, 1.0, 10)], specs)
    assert plain[1]["speedup"] == pytest.approx(2.0) and plain[1]["decode_speedup"] is None
    assert plain[1]["repeats"] == 1 and plain[1]["flagged"] is None


def test_cells_are_flagged_by_load_and_by_spread():
    specs = parse_methods("ddtree:4")
    steady = [(1.0, 0.1), (1.02, 0.1)]
    # quiet and steady: no flag
    rows = summarize_methods([timed("ar", 0, steady, loads=[0.0, 0.1]), timed("ddtree:4", 0, steady)], specs)
    assert [r["flagged"] for r in rows] == [None, None]
    # another process on one core during one of ar's runs: both cells (ar is every cell's reference)
    rows = summarize_methods([timed("ar", 0, steady, loads=[0.0, 1.0]), timed("ddtree:4", 0, steady)], specs)
    assert all("other processes used 1.00 cores" in r["flagged"] for r in rows)
    # ar's repeats 50% apart: every cell of the setting; the cell's speedup spread: its cell only
    rows = summarize_methods([timed("ar", 0, [(1.0, 0.1), (1.5, 0.1)]), timed("ddtree:4", 0, steady)], specs)
    assert all("ar's tokens/s varied 40% over 2 repeats" in r["flagged"] for r in rows)
    rows = summarize_methods([timed("ar", 0, steady), timed("ddtree:4", 0, [(1.0, 0.1), (2.0, 0.1)])], specs)
    assert rows[0]["flagged"] is None and rows[1]["flagged"] == "its speedup varied 65% over 2 repeats"
    # the machine slower in one repeat for both: ar's spread flags the setting, the speedup itself is steady
    rows = summarize_methods([timed("ar", 0, [(1.0, 0.1), (1.5, 0.1)]), timed("ddtree:4", 0, [(0.5, 0.1), (0.75, 0.1)])],
                             specs)
    assert rows[1]["speedup_range"] == pytest.approx([2.0, 2.0]) and "speedup varied" not in rows[1]["flagged"]


def test_merge_repeats_keeps_the_first_runs_tokens_and_the_worst_check():
    from ddtree.bench.benchmark import merge_repeats

    run = dict(rec("ddtree:4", 0, 1.0, 10), token_ids=[1, 2], time_to_first_token=0.2,
               stage_seconds={"verify": 0.5}, load=0.0)
    merged = merge_repeats([run, dict(run, seconds=3.0, load=0.5, stage_seconds={"verify": 1.5}),
                            dict(run, seconds=2.0, check="error", check_detail="bad", token_ids=[1, 3],
                                 stage_seconds={"verify": 1.0})])
    assert merged["seconds"] == 2.0 and merged["stage_seconds"] == {"verify": 1.0} and merged["load"] == 0.5
    assert [t["seconds"] for t in merged["repeats"]] == [1.0, 3.0, 2.0]
    assert merged["check"] == "error" and merged["check_detail"] == "bad" and merged["repeats_differ"]
    assert merged["token_ids"] == [1, 2] and merged["decode_seconds"] == pytest.approx(1.8)
    assert merged["decode_tokens_per_second"] == pytest.approx(9 / 1.8)  # from the median times, not run 1's


def test_headline_tables_best_fixed_budget_and_the_readme(tmp_path):
    from ddtree.bench.benchmark import best_fixed, headline, readme_table, update_readme

    def row(method, speedup, flagged=None, budget=None, mode="float"):
        return dict(mode=mode, dataset="gsm", temperature=0.0, method=method, budget=budget, speedup=speedup,
                    decode_speedup=speedup * 1.1, tau=2.0, tokens_per_second=50.0 * speedup, flagged=flagged)

    rows = [row("ar", 1.0), row("dflash", 0.9), row("ddtree:2", 1.2, budget=2), row("ddtree:3", 1.4, "busy", 3),
            row("ddtree:auto", 1.1, budget="auto"), row("ar", 1.0, mode="gguf-int8"),
            row("ddtree:2", 1.3, budget=2, mode="gguf-int8")]
    assert [(b["method"], b["flagged"]) for b in best_fixed(rows)] == [("ddtree:3", "busy"), ("ddtree:2", None)]
    env = dict(modes={"float": "float32", "gguf-int8": "float32 gguf int8"}, threads=2, world_size=1, repeats=2,
               cpu="a CPU (2 cores; AVX2, no VNNI, no AMX)", date="2026-11-27", git_commit="abc", drafter="shipped",
               gpu=None)
    text = headline(rows, env)
    assert "| gsm, 0 | 50.0 | 0.90x / 0.99x (2.00) | 1.20x / 1.32x (2.00) | 1.40x / 1.54x (2.00) † |" in text
    assert "| 3: 1.40x / 1.54x (2.00) † |" in text  # the best fixed budget, flagged as its cell
    table = readme_table(rows, env)
    assert "a CPU (2 cores; AVX2, no VNNI, no AMX), 2 thread(s)" in table and "2026-11-27" in table
    assert "| gsm, 0 | 50.0 / 50.0 | 0.90x / - (2.00) | 1.20x / 1.30x (2.00) | 1.40x † / - (2.00) |" in table
    assert table.rstrip().endswith("| 3: 1.40x † / 2: 1.30x |")
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- benchmark-results:begin -->\nold table\n<!-- benchmark-results:end -->\nrest\n")
    update_readme(readme, table)
    new = readme.read_text()
    assert new.startswith("intro\n<!-- benchmark-results:begin -->\nMeasured by") and new.endswith("end -->\nrest\n")
    assert "old table" not in new and "| 3: 1.40x" in new
    readme.write_text("no markers\n")
    with pytest.raises(ConfigError, match="benchmark-results:begin"):
        update_readme(readme, table)


def test_benchmark_exit_status_tells_a_crash_from_a_failed_check(monkeypatch, capsys, tmp_path):
    from ddtree.bench import benchmark

    def crash(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(benchmark, "_run", crash)
    monkeypatch.setattr(benchmark, "busy_cores", lambda seconds=0.5: 0.0)
    monkeypatch.setattr(benchmark.torch, "set_num_threads", lambda n: None)  # the tests' one thread stays
    assert benchmark.main(["--tiny", "--out", str(tmp_path)]) == benchmark.EXIT_CRASHED == 3
    assert "RuntimeError: a bug" in capsys.readouterr().err
    assert not (tmp_path / ".benchmark.lock").exists()  # the lock goes with the run
    assert benchmark.EXIT_LOSSLESS_FAILED == 1 and benchmark.EXIT_BAD_INPUT == 2


def test_a_prompt_over_the_context_is_refused_when_the_plan_is_made(tmp_path):
    """Issue 55: a prompt longer than the target's context is found by build_plan (before any decoding), named by
    its file and line, or its built-in dataset and index; before, only the run that reached it refused it, unnamed."""
    from ddtree.bench.testing import char_tokenizer

    target, drafter = random_pair("llama", seed=9, block_size=4, max_position_embeddings=48)
    pair = Pair(target, drafter, char_tokenizer())
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "short"}) + "\n\n" + json.dumps({"prompt": "x" * 60}) + "\n")
    args = SimpleNamespace(target=None, threads=1, repeats=1, max_new_tokens=8, top_p=1.0, top_k=0, block_size=None,
                           attention="auto", inject_mismatch=False, traces=False, datasets=str(path),
                           num_prompts=1, temperatures="0", seed=0)
    assert len(build_plan(args, pair, parse_methods("ddtree:4"))) == 1  # the long prompt is not asked for
    args.num_prompts = 2
    with pytest.raises(ConfigError, match=r"p\.jsonl:3: the prompt has \d+ tokens, more than the target's context "
                                          r"limit of 48"):
        build_plan(args, pair, parse_methods("ddtree:4"))
    args.datasets = "humaneval"
    with pytest.raises(ConfigError, match=r"^dataset humaneval, prompt index 0: the prompt has \d+ tokens"):
        build_plan(args, pair, parse_methods("ddtree:4"))
