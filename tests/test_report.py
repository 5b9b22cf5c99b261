"""`specchat report`: settings and prompt parsing, aggregation checked number by number against hand
computation (README "Metrics"), the run loop over fake backends, the written files, bad input through
the real CLI, and one small report on the real default pair."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fakes import FakeBackend, markov_logits

from specchat import report as rp
from specchat.lookup import PromptLookup
from specchat.engine import Finished, StepEvent, TokenEvent
from specchat.policy import FixedPolicy
from specchat.runner import UserError
from specchat.sampling import SamplingParams
from specchat.stats import RunStats, StepStats

ROOT = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# -- --sweep -------------------------------------------------------------------------------------------


def test_draft_max_list_sorted_with_baseline_first_and_policy_last():
    settings = rp.parse_sweep("policy, 4,2,0,4")
    assert [s.name for s in settings] == ["target-only", "k=2", "k=4", "policy"]
    assert [s.k for s in settings] == [0, 2, 4, None]
    assert settings[0].is_baseline and not settings[-1].is_baseline


def test_draft_max_adds_the_baseline_when_not_listed():
    assert [s.name for s in rp.parse_sweep("3")] == ["target-only", "k=3"]
    assert [s.name for s in rp.parse_sweep("POLICY")] == ["target-only", "policy"]


@pytest.mark.parametrize("text", ["2,x", "-1", "2,,4", "1.5", ""])
def test_draft_max_bad_item_is_one_line(text):
    with pytest.raises(UserError) as info:
        rp.parse_sweep(text)
    assert "--sweep" in str(info.value) and "\n" not in str(info.value)


def test_draft_max_with_only_zero_has_nothing_to_compare():
    with pytest.raises(UserError, match="nothing to compare"):
        rp.parse_sweep("0")


# -- prompt sets -------------------------------------------------------------------------------------


def test_builtin_set_has_six_kinds_and_enough_prompts():
    items, source = rp.load_prompts(None)
    assert source == "builtin"
    assert len(items) >= 30
    counts = {}
    for item in items:
        counts[item.category] = counts.get(item.category, 0) + 1
        assert all(t.strip() for t in item.turns)
    assert set(counts) >= {"conversation", "translation", "summarisation", "qa", "maths", "code"}
    assert min(counts.values()) >= 5
    assert sum(len(i.turns) > 1 for i in items) >= 3  # some conversations
    assert len({i.id for i in items}) == len(items)
    # interleaved, so --limit 6 samples every kind
    assert len({i.category for i in items[:6]}) == 6


def test_jsonl_prompts_parse_with_defaults():
    text = "\n".join([
        json.dumps({"id": "a", "category": "maths", "turns": ["1+1?", "and 2+2?"]}),
        "",
        json.dumps({"prompt": "hello"}),
        json.dumps({"id": 7, "turns": ["x"]}),
    ])
    items = rp.parse_prompts(text, "p.jsonl")
    assert items == [
        rp.PromptItem("a", "maths", ("1+1?", "and 2+2?")),
        rp.PromptItem("line-3", "custom", ("hello",)),
        rp.PromptItem("7", "custom", ("x",)),
    ]


def test_plain_prompts_one_per_line():
    items = rp.parse_prompts("first prompt\n\n  second prompt  \n", "p.txt")
    assert items == [rp.PromptItem("line-1", "custom", ("first prompt",)),
                     rp.PromptItem("line-3", "custom", ("second prompt",))]


@pytest.mark.parametrize("bad_line, message", [
    ('{"id": "b", "turns": ["ok"', "not valid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"id": "b"}', 'missing "turns"'),
    ('{"id": "b", "turns": []}', "non-empty list"),
    ('{"id": "b", "turns": ["ok", 3]}', "turn 2 must be a non-empty string"),
    ('{"id": "a", "turns": ["dup"]}', "duplicate id 'a' (first on line 1)"),
    ('{"id": "b", "turns": ["x"], "colour": 1}', "unknown key 'colour'"),
    ('{"id": "b", "category": "all", "turns": ["x"]}', "reserved"),
])
def test_jsonl_errors_name_file_and_line(bad_line, message):
    text = json.dumps({"id": "a", "turns": ["fine"]}) + "\n\n" + bad_line + "\n"
    with pytest.raises(UserError) as info:
        rp.parse_prompts(text, "p.jsonl")
    assert str(info.value).startswith("p.jsonl:3: ")
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_prompt_file_missing_empty_or_a_directory(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        rp.load_prompts(tmp_path / "nope.jsonl")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(UserError, match="no prompts"):
        rp.load_prompts(empty)
    with pytest.raises(UserError, match="directory"):
        rp.load_prompts(tmp_path)


def test_select_by_category_and_limit():
    items = [rp.PromptItem(str(i), c, ("t",)) for i, c in enumerate("abab")]
    assert [i.id for i in rp.select_prompts(items, ["b"], None)] == ["1", "3"]
    assert [i.id for i in rp.select_prompts(items, None, 3)] == ["0", "1", "2"]
    assert [i.id for i in rp.select_prompts(items, ["a", "b"], 1)] == ["0"]
    with pytest.raises(UserError, match="no such category.*have: a, b"):
        rp.select_prompts(items, ["c"], None)


# -- aggregation on hand-computed event streams ------------------------------------------------------
#
# Category "a", prompt p1:
#   target-only: 4 steps of (drafted 0, accepted 0, emitted 1); prefill 0.2 s, generation 0.5 s
#   k=2: steps (2, 2, 3), (2, 0, 1), (2, 1, 2); draft 0.01 s and verify 0.05 s each; prefill 0.2, gen 0.25
# Category "b", prompt p2:
#   target-only: (0,0,1), (0,0,1), (0,0,0) [EOG step]; prefill 0.1, generation 0.2
#   k=2: (2, 0, 1), (1, 1, 1) [stopped inside the step]; draft 0.02 s, verify 0.1 s each; prefill 0.1, gen 0.4


def stream(steps, *, prefill, generate, draft_s=0.0, verify_s=0.1, tokens_from=100):
    """The events engine.generate would yield for these (drafted, accepted, emitted) steps."""
    stats = RunStats(prompt_tokens=10, prompt_tokens_evaluated=10, prefill_seconds=prefill)
    events, token = [], tokens_from
    ids = []
    for i, (drafted, accepted, emitted) in enumerate(steps):
        sources = ["target"] if drafted == 0 else ["accepted"] * accepted + (
            ["resampled"] if accepted < drafted else ["bonus"])
        for source in sources[:emitted]:
            events.append(TokenEvent(token, "x", source, i))
            ids.append(token)
            token += 1
        step = StepStats(i, drafted, accepted, emitted, draft_s if drafted else 0.0, verify_s, planned=drafted)
        stats.add(step)
        events.append(StepEvent(step, stats))
    stats.generate_seconds = generate
    events.append(Finished("x" * len(ids), ids, "length", stats, list(range(10))))
    return events


def hand_records():
    def rec(events, pid, cat, setting, order):
        return rp.record_from_events(events, prompt_id=pid, category=cat, turn=0, setting=setting, order=order)

    return [
        rec(stream([(0, 0, 1)] * 4, prefill=0.2, generate=0.5), "p1", "a", "target-only", 0),
        rec(stream([(2, 2, 3), (2, 0, 1), (2, 1, 2)], prefill=0.2, generate=0.25, draft_s=0.01, verify_s=0.05),
            "p1", "a", "k=2", 1),
        rec(stream([(2, 0, 1), (1, 1, 1)], prefill=0.1, generate=0.4, draft_s=0.02, verify_s=0.1), "p2", "b", "k=2", 0),
        rec(stream([(0, 0, 1), (0, 0, 1), (0, 0, 0)], prefill=0.1, generate=0.2), "p2", "b", "target-only", 1),
    ]


def test_record_from_events_keeps_stats_text_and_sources():
    r = hand_records()[1]
    assert (r.stats.steps, r.stats.drafted, r.stats.accepted, r.stats.emitted) == (3, 6, 3, 6)
    assert r.sources == {"accepted": 3, "bonus": 1, "resampled": 2}
    assert r.text == "xxxxxx" and r.finish_reason == "length" and len(r.token_ids) == 6


def test_aggregate_category_a_by_hand():
    agg = rp.aggregate(hand_records(), drafter_kind="draft-model")
    assert agg["categories"] == ["a", "b"]
    assert agg["settings"] == ["target-only", "k=2"]
    base, spec = agg["summary"]["a"]["target-only"], agg["summary"]["a"]["k=2"]

    assert (base["steps"], base["generated_tokens"], base["drafted"]) == (4, 4, 0)
    assert base["acceptance_rate"] is None
    assert base["mean_accepted_length"] == pytest.approx(1.0)
    assert base["tokens_per_second"] == pytest.approx(4 / 0.5)
    assert base["end_to_end_tokens_per_second"] == pytest.approx(4 / 0.7)
    assert base["speedup_generation"] == pytest.approx(1.0)
    assert base["projected_speedup"] == 1.0

    assert (spec["prompts"], spec["runs"]) == (1, 1)
    assert (spec["steps"], spec["drafted"], spec["accepted"], spec["generated_tokens"]) == (3, 6, 3, 6)
    assert spec["acceptance_rate"] == pytest.approx(3 / 6)
    assert spec["mean_accepted_length"] == pytest.approx(6 / 3)
    assert spec["per_position_acceptance"] == pytest.approx([2 / 3, 1 / 3])
    assert spec["position_tries"] == [3, 3] and spec["position_hits"] == [2, 1]
    assert spec["accepted_length_histogram"] == {"0": 1, "1": 1, "2": 1}
    assert spec["draft_lengths"] == {"2": 3}
    assert spec["tokens_per_second"] == pytest.approx(6 / 0.25)
    assert spec["baseline_tokens_per_second"] == pytest.approx(4 / 0.5)
    assert spec["speedup_generation"] == pytest.approx((6 / 0.25) / (4 / 0.5))  # 3.0
    assert spec["speedup_end_to_end"] == pytest.approx((6 / 0.45) / (4 / 0.7))  # 2.333
    assert spec["draft_share"] == pytest.approx(0.03 / (0.03 + 0.15))
    assert spec["drafted_per_step"] == pytest.approx(2.0)
    # c = (0.03 s / 6 drafted) / (0.5 s / 4 tokens) = 0.04; projected = 2 / (1 + 0.04 * 2)
    assert spec["draft_cost_ratio"] == pytest.approx(0.04)
    assert spec["projected_speedup"] == pytest.approx(2 / 1.08)
    assert agg["recommended"]["a"] == {"setting": "k=2", "speedup_end_to_end": pytest.approx(7 / 3),
                                       "speedup_generation": pytest.approx(3.0), "worth_it": True}


def test_aggregate_category_b_recommends_target_only_when_drafting_loses():
    agg = rp.aggregate(hand_records(), drafter_kind="draft-model")
    base, spec = agg["summary"]["b"]["target-only"], agg["summary"]["b"]["k=2"]
    assert base["mean_accepted_length"] == pytest.approx(2 / 3)  # the EOG step emits nothing
    assert base["projected_speedup"] == 1.0  # plain decoding is the unit
    assert (spec["steps"], spec["drafted"], spec["accepted"], spec["generated_tokens"]) == (2, 3, 1, 2)
    assert spec["acceptance_rate"] == pytest.approx(1 / 3)
    assert spec["mean_accepted_length"] == pytest.approx(1.0)
    assert spec["per_position_acceptance"] == pytest.approx([1 / 2, 0 / 1])
    assert spec["accepted_length_histogram"] == {"0": 1, "1": 1}
    assert spec["draft_lengths"] == {"1": 1, "2": 1}
    assert spec["speedup_generation"] == pytest.approx((2 / 0.4) / (2 / 0.2))  # 0.5
    assert spec["speedup_end_to_end"] == pytest.approx((2 / 0.5) / (2 / 0.3))  # 0.6
    assert spec["draft_share"] == pytest.approx(0.04 / 0.24)
    # c = (0.04 / 3) / (0.2 / 2) = 0.1333; projected = 1 / (1 + 0.1333 * 1.5) = 1 / 1.2
    assert spec["draft_cost_ratio"] == pytest.approx(0.04 / 3 / 0.1)
    assert spec["projected_speedup"] == pytest.approx(1 / 1.2)
    assert agg["recommended"]["b"] == {"setting": "target-only", "speedup_end_to_end": 1.0,
                                       "speedup_generation": 1.0, "worth_it": False}


def test_aggregate_overall_by_hand_and_categories_add_up():
    agg = rp.aggregate(hand_records(), drafter_kind="draft-model")
    base, spec = agg["summary"]["all"]["target-only"], agg["summary"]["all"]["k=2"]
    assert (base["steps"], base["generated_tokens"], base["prompts"], base["runs"]) == (7, 6, 2, 2)
    assert base["tokens_per_second"] == pytest.approx(6 / 0.7)
    assert (spec["steps"], spec["drafted"], spec["accepted"], spec["generated_tokens"]) == (5, 9, 4, 8)
    assert spec["acceptance_rate"] == pytest.approx(4 / 9)
    assert spec["mean_accepted_length"] == pytest.approx(8 / 5)
    assert spec["per_position_acceptance"] == pytest.approx([3 / 5, 1 / 4])
    assert spec["accepted_length_histogram"] == {"0": 2, "1": 2, "2": 1}
    assert spec["speedup_generation"] == pytest.approx((8 / 0.65) / (6 / 0.7))
    assert spec["speedup_end_to_end"] == pytest.approx((8 / 0.95) / (6 / 1.0))
    assert spec["draft_share"] == pytest.approx((0.03 + 0.04) / (0.03 + 0.04 + 0.15 + 0.2))
    c = (0.07 / 9) / (0.7 / 6)
    assert spec["draft_cost_ratio"] == pytest.approx(c)
    assert spec["projected_speedup"] == pytest.approx(1.6 / (1 + c * 9 / 5))
    assert agg["recommended"]["all"]["setting"] == "k=2"
    for setting in agg["settings"]:
        for key in ("steps", "drafted", "accepted", "generated_tokens", "runs", "prefill_seconds", "generate_seconds"):
            parts = sum(agg["summary"][c][setting][key] for c in agg["categories"])
            assert parts == pytest.approx(agg["summary"]["all"][setting][key]), (setting, key)


def test_prompt_lookup_drafts_for_free_in_the_projection():
    agg = rp.aggregate(hand_records(), drafter_kind="prompt-lookup")
    spec = agg["summary"]["a"]["k=2"]
    assert spec["draft_cost_ratio"] == 0.0
    assert spec["projected_speedup"] == pytest.approx(2.0)  # = tau


def test_projection_formula_and_recommend_tie_breaks():
    assert rp.projected_speedup(3.0, 4.0, 0.25) == pytest.approx(3.0 / 2.0)
    assert rp.projected_speedup(None, 4.0, 0.0) is None
    rows = {"target-only": {"speedup_end_to_end": 1.0, "speedup_generation": 1.0},
            "k=2": {"speedup_end_to_end": 1.3, "speedup_generation": 1.5},
            "k=4": {"speedup_end_to_end": 1.3, "speedup_generation": 1.6},
            "policy": {"speedup_end_to_end": None, "speedup_generation": None}}
    assert rp.recommend(rows)["setting"] == "k=2"
    assert [rp.usage_hint(s) for s in ("k=4", "policy", "target-only")] == [
        "--draft-fixed 4", "the default (adaptive policy)", "--no-spec"]


def test_saved_runs_reaggregate_to_the_same_summary():
    records = hand_records()
    again = [rp.record_from_dict(json.loads(json.dumps(r.as_dict()))) for r in records]
    assert rp.aggregate(again, drafter_kind="draft-model") == rp.aggregate(records, drafter_kind="draft-model")


def test_run_stats_read_back_are_the_stats_saved():
    from specchat.stats import RunStats, StepStats

    stats = RunStats(prompt_tokens=7, prompt_tokens_evaluated=3, prefill_seconds=0.5, generate_seconds=1.5,
                     rollback_recoveries=1)
    for drafted, accepted, source in ((4, 4, "draft-model"), (3, 1, "lookup"), (0, 0, "")):
        stats.add(StepStats(step=stats.steps, drafted=drafted, accepted=accepted, emitted=accepted + 1,
                            draft_seconds=0.01, verify_seconds=0.02, rollback_seconds=0.003, source=source))
    saved = json.loads(json.dumps(stats.as_dict(counts=True)))
    assert RunStats.from_dict(saved) == stats
    assert "position_tries" not in stats.as_dict()  # what transcripts keep: the metrics only


def test_tables_show_the_numbers():
    agg = rp.aggregate(hand_records(), drafter_kind="draft-model", min_samples=1)
    specs = rp.table_specs(agg)
    assert [s.title.split(" (")[0] for s in specs] == [
        "Recommended setting per category", "Speed and acceptance",
        "Projected where verifying k tokens costs one decode", "Per-position acceptance", "Accepted-length histogram"]
    rec_rows = {row[0]: row for row in specs[0].rows}
    assert rec_rows["a"][2:5] == ["k=2", "2.33×", "3.00×"]
    assert rec_rows["b"][2] == "target-only"
    projected = {row[0]: row[1:] for row in specs[2].rows}
    assert projected["a"] == ["0.04", "2", "2.00", "1.85×", "0.67"] and "PROJECTED" in specs[2].note
    speed = {(row[0], row[1]): row for row in specs[1].rows}
    assert speed[("a", "k=2")][2:] == ["6", "50%", "2.00", "24.0", "3.00×", "2.33×", "17%", "1.85×"]
    positions = {(row[0], row[1]): row[2:] for row in specs[3].rows}
    assert positions[("all", "k=2")] == ["60% (5)", "25% (4)"]
    hist = {(row[0], row[1]): row[2:] for row in specs[4].rows}
    assert hist[("all", "k=2")] == ["0", "2", "2", "1"]
    compact = rp.table_specs(agg, categories=["all"], max_positions=1, compact=True)
    assert compact[3].rows == [["all", "k=2", "60%"]]
    assert "beyond 1" in compact[3].note


# -- the run loop, over fake backends ----------------------------------------------------------------


def test_run_report_alternates_order_resets_caches_and_continues_with_the_baseline_reply():
    n_vocab = 26
    table = np.full((n_vocab, n_vocab), -5.0)
    for t in range(n_vocab):
        table[t, (t + 1) % 5] = 5.0  # a short cycle: prompt lookup finds it after a few tokens
    target = FakeBackend(markov_logits(table), n_vocab)
    drafter = PromptLookup(1, 3)
    seen_messages = []

    def render(messages):
        seen_messages.append([dict(m) for m in messages])
        text = " ".join(m["content"] for m in messages)
        return [ord(ch) % n_vocab for ch in text if ch.isalpha()], []

    items = [rp.PromptItem("one", "a", ("abcdefghij",)), rp.PromptItem("two", "b", ("klmno", "pqrst"))]
    settings = rp.parse_sweep("3,policy")
    started = []
    records = rp.run_report(
        target, drafter, items, settings, SamplingParams(temperature=0.0, seed=1), max_tokens=10, render=render,
        policy_for=lambda s: FixedPolicy(5 if s.k is None else s.k),
        on_start=lambda item, turn, s: started.append((item.id, turn, s.name, len(target.tokens))),
    )
    assert [(r.prompt_id, r.turn, r.setting, r.order) for r in records] == [
        ("one", 0, "target-only", 0), ("one", 0, "k=3", 1), ("one", 0, "policy", 2),
        ("two", 0, "policy", 0), ("two", 0, "k=3", 1), ("two", 0, "target-only", 2),
        ("two", 1, "policy", 0), ("two", 1, "k=3", 1), ("two", 1, "target-only", 2),
    ]
    assert len(started) == len(records)
    assert target.truncations.count(0) >= len(records)  # every run prefilled from an empty cache
    base = {(r.prompt_id, r.turn): r for r in records if r.setting == "target-only"}
    for r in records:
        assert r.stats.emitted == 10
        if r.setting == "target-only":
            assert r.stats.drafted == 0 and r.matches_baseline is None
        else:
            assert r.stats.drafted > 0
            assert r.matches_baseline is True  # greedy over exact fake logits: the same tokens
    # the second turn saw the first turn's target-only reply
    second = [m for m in seen_messages if len(m) == 3]
    assert second and second[0][1] == {"role": "assistant", "content": base[("two", 0)].text}
    agg = rp.aggregate(records, drafter_kind="prompt-lookup")
    assert agg["summary"]["b"]["k=3"]["runs"] == 2 and agg["summary"]["b"]["k=3"]["prompts"] == 1
    assert agg["same_output_as_target_only"]["k=3"] == {"same": 3, "runs": 3}


# -- output files ------------------------------------------------------------------------------------


def test_outputs_written_json_markdown_png(tmp_path):
    settings = rp.parse_sweep("2")
    items = [rp.PromptItem("p1", "a", ("x",)), rp.PromptItem("p2", "b", ("y",))]
    doc = rp.build_doc(hand_records(), target="T", drafter="D", drafter_kind="draft-model", settings=settings,
                       items=items, source="test", params=SamplingParams(temperature=0.0, seed=0), max_tokens=8)
    (tmp_path / "out").mkdir()
    paths = rp.write_outputs(doc, tmp_path / "out")
    saved = json.loads(paths["json"].read_text())
    assert saved["schema"] == rp.SCHEMA and len(saved["runs"]) == 4
    assert saved["summary"]["all"]["k=2"]["generated_tokens"] == 8
    md = paths["markdown"].read_text()
    assert "| a | **k=2** |" in md and "PROJECTED" in md
    png = paths["chart"].read_bytes()
    assert png.startswith(PNG_SIGNATURE)
    pil = pytest.importorskip("PIL.Image")
    with pil.open(paths["chart"]) as image:
        assert image.format == "PNG" and image.size[0] > 400


def test_unwritable_out_dir_is_caught_before_running(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="exists and is not a directory"):
        rp.check_out_dir(blocker)
    with pytest.raises(UserError, match="cannot write there"):
        rp.check_out_dir(blocker / "sub")
    rp.check_out_dir(tmp_path / "new" / "dir")
    assert (tmp_path / "new" / "dir").is_dir() and not list((tmp_path / "new" / "dir").iterdir())


# -- the CLI ----------------------------------------------------------------------------------------


def run_cli(args, tmp_path, home, timeout=600):
    env = {**os.environ, "SPECCHAT_HOME": str(home), "PYTHONPATH": str(ROOT), "NO_COLOR": "1",
           "COLUMNS": "120"}
    env.pop("SPECCHAT_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "specchat.cli", "report", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


def assert_user_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_cli_bad_inputs_are_one_line_exit_2(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --out is relative

    def report(*args):
        return cli("report", *args, env={"NO_COLOR": "1", "COLUMNS": "120"})

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "turns": ["ok"]}\n{"id": "b", "turns": "not a list"}\n')
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    assert_user_error(report("--prompts", str(tmp_path / "missing.jsonl")), "missing.jsonl", "no such file")
    assert_user_error(report("--prompts", str(bad)), f"{bad}:2:", "turns")
    assert_user_error(report("--prompts", str(empty)), "no prompts")
    assert_user_error(report("--out", str(blocker / "sub")), "--out", "cannot write")
    assert_user_error(report("--sweep", "2,four"), "--sweep", "'four'")
    assert_user_error(report("--category", "poetry"), "poetry", "conversation")
    assert not (tmp_path / "specchat-report").exists()


@pytest.mark.real
def test_real_report_on_the_default_pair(tmp_path, measured_home):
    out = tmp_path / "rep"
    proc = run_cli(["--limit", "3", "-n", "12", "--sweep", "0,4,policy", "--out", str(out)], tmp_path, measured_home)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Recommended overall" in proc.stdout and str(out / "report.json") in proc.stdout

    doc = json.loads((out / "report.json").read_text())
    assert doc["schema"] == rp.SCHEMA
    for key in ("created", "machine", "target", "drafter", "drafter_kind", "params", "prompts", "settings",
                "categories", "summary", "recommended", "runs"):
        assert key in doc, key
    assert doc["target"] == "smollm2-135m" and doc["drafter"] == "prompt-lookup"
    assert doc["settings"] == ["target-only", "k=4", "policy"]
    assert doc["params"]["temperature"] == 0.0 and doc["params"]["max_tokens"] == 12
    assert len(doc["categories"]) == 3 and doc["prompts"]["count"] == 3
    turns = sum(i["turns"] for i in doc["prompts"]["items"])
    assert len(doc["runs"]) == turns * 3
    for run in doc["runs"]:
        assert set(run) >= {"prompt_id", "category", "turn", "setting", "order", "stats", "text", "finish_reason"}
        assert 0 < run["stats"]["generated_tokens"] <= 12
        assert run["stats"]["prefill_seconds"] > 0 and run["stats"]["generate_seconds"] > 0
        if run["setting"] == "target-only":
            assert run["stats"]["drafted"] == 0
    for setting in doc["settings"]:
        total = doc["summary"]["all"][setting]
        for key in ("generated_tokens", "steps", "drafted", "accepted", "runs"):
            assert sum(doc["summary"][c][setting][key] for c in doc["categories"]) == total[key], (setting, key)
        for field in ("acceptance_rate", "mean_accepted_length", "per_position_acceptance",
                      "accepted_length_histogram", "tokens_per_second", "speedup_generation", "speedup_end_to_end",
                      "draft_share", "projected_speedup"):
            assert field in total
        assert sum(total["accepted_length_histogram"].values()) == total["steps"]
    assert set(doc["recommended"]) == {*doc["categories"], "all"}
    assert doc["recommended"]["all"]["setting"] in doc["settings"]

    md = (out / "report.md").read_text()
    assert "Speed and acceptance" in md and "PROJECTED" in md
    png = (out / "report.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE)
    pil = pytest.importorskip("PIL.Image")
    with pil.open(out / "report.png") as image:
        image.verify()


def test_a_block_drafter_is_priced_per_draft_in_the_projection():
    """A DFlash draft costs one forward whatever its length: c is per draft, and the projection charges it
    once per drafting step (a per-token c would call its long drafts 2-7x dearer than they are)."""
    agg = rp.aggregate(hand_records(), drafter_kind="dflash", min_samples=1)
    spec = agg["summary"]["a"]["k=2"]
    # c = (0.03 s / 3 drafts) / (0.5 s / 4 tokens) = 0.08; every step drafted: projected = 2 / (1 + 0.08)
    assert spec["draft_cost_ratio"] == pytest.approx(0.08)
    assert spec["projected_speedup"] == pytest.approx(2 / 1.08)
    a = agg["projected"]["a"]
    assert a["cost_per"] == "forward" and a["draft_cost_ratio"] == pytest.approx(0.08)
    assert a["k"] == 2 and a["speedup"] == pytest.approx((1 + 2 / 3 + 1 / 3) / 1.08)
    # E(k) = 1, 1.9, 2.71, 3.21 for one forward of c = 0.5 each: the whole block pays, and up to c < 2.21
    pr = rp.project_best_k([0.9, 0.81, 0.5], 0.5, forward=True)
    assert pr["k"] == 3 and pr["speedup"] == pytest.approx(3.21 / 1.5)
    assert pr["break_even_cost_ratio"] == pytest.approx(2.21)
    assert rp.project_best_k([0.9, 0.81, 0.5], 0.5)["k"] == 2  # per token: 2.71 / 2 beats 3.21 / 2.5


def test_project_best_k_by_hand():
    # E(k) = 1, 1.9, 2.71, 3.21; with c = 0.1: 1, 1.727, 2.258, 2.469 -> k = 3
    pr = rp.project_best_k([0.9, 0.81, 0.5], 0.1)
    assert pr["k"] == 3 and pr["speedup"] == pytest.approx(3.21 / 1.3) and pr["tokens_per_step"] == pytest.approx(3.21)
    assert pr["break_even_cost_ratio"] == pytest.approx(0.9)  # max(0.9/1, 1.71/2, 2.21/3)
    # a draft as costly as the target never pays, even when always right
    assert rp.project_best_k([1.0, 1.0], 1.0)["k"] == 0
    # free drafts (prompt lookup): every measured position that adds anything is worth drafting
    assert rp.project_best_k([0.6, 0.3, 0.0], 0.0)["k"] == 2
    assert rp.project_best_k([], 0.1) is None and rp.project_best_k([0.5], None) is None


def test_projection_pools_the_drafting_settings_of_a_category():
    agg = rp.aggregate(hand_records(), drafter_kind="draft-model", min_samples=1)
    # category a: k=2 only, positions [2/3, 1/3], c = (0.03 s / 6 drafted) / (0.5 s / 4 tokens) = 0.04
    a = agg["projected"]["a"]
    assert a["per_position_acceptance"] == pytest.approx([2 / 3, 1 / 3]) and a["draft_cost_ratio"] == pytest.approx(0.04)
    assert a["k"] == 2 and a["speedup"] == pytest.approx(2.0 / 1.08)
    # all: both categories' k=2 runs pooled (5 steps: position 1 tried 5 times, accepted 2 + 1)
    assert agg["projected"]["all"]["per_position_acceptance"][0] == pytest.approx(3 / 5)
    assert "PROJECTED" in agg["projection_assumption"]


def test_projection_uses_only_positions_with_enough_samples():
    """`report --limit 3` once projected k = 11 from positions drafted once or twice: a position counts
    only when enough steps drafted that far, and the projection says which positions it used."""
    # positions 1-3 drafted 12, 10, 9 times; 4-11 once each (a single long lookup draft), all accepted
    acc = [0.5, 0.4, 0.9] + [1.0] * 8
    tries = [12, 10, 9] + [1] * 8
    pr = rp.project_best_k(acc, 0.0, tries, min_samples=10)
    assert pr["measured_positions"] == 2 and pr["positions_left_out"] == 9
    assert pr["per_position_acceptance"] == [0.5, 0.4] and pr["position_tries"] == [12, 10]
    assert pr["k"] == 2 and pr["tokens_per_step"] == pytest.approx(1.9)
    everything = rp.project_best_k(acc, 0.0)  # without the threshold: the one-step positions decide
    assert everything["k"] == 11
    assert rp.project_best_k(acc, 0.0, [3] * 11, min_samples=10) is None  # nothing measured enough
    from specchat.report.command import projection_basis

    assert projection_basis(pr) == ("from positions 1-2 (each drafted at least 10 times; 9 further positions "
                                    "drafted fewer times left out)")


def test_aggregate_applies_the_sample_threshold():
    records = hand_records()
    assert rp.aggregate(records, drafter_kind="draft-model")["projected"]["a"] is None  # 3 steps: too few
    assert rp.aggregate(records, drafter_kind="draft-model", min_samples=3)["projected"]["a"]["k"] == 2
