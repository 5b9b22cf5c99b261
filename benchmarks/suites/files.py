"""Drafters on generated files: specchat against llama.cpp's `llama-speculative-simple` on the same files.

    python -m benchmarks files                             # every case below, 128 tokens, 3 reps, 2 threads
    python -m benchmarks files --case hybrid --reps 5
    python -m benchmarks files --case blocks --flash-attn off   # the same attention kernel on both sides
    python -m benchmarks files --case heads --k 1

tests/tiny_models.py writes the files: random weights built so that drafts are mostly accepted, and blocks
whose context moves some of the target's argmaxes off its bigram map, so every drafter misses now and then.
The prompt is the models' own text. Greedy, --ignore-eos, the same threads on both sides, no reply history.
specchat is `specchat prompt --json` after one untimed run per drafter that calibrates the machine; each row
is one fresh process, tok/s the median of --reps runs, interleaved so that a busy moment hits every row alike;
acc = accepted / drafted of the median run. A specchat text that is not its target-only text says where it parts.

- hybrid: per architecture (llama, the dense control; lfm2 and qwen35, whose recurrent state keeps snapshots;
  mamba2, which has none) a 4-layer x 512 target and a smaller draft of the same architecture, ~600 prompt
  tokens. A draft model at forced k = 4 (p-min 0) against `--spec-type draft-simple` at k = 4; prompt lookup
  with the policy against `ngram-simple` at its defaults. `re-reads`: cache cuts that had to re-read the
  conversation (target + draft model); it stays 0.
- chains: a qwen35 target with an MTP layer and a qwen35 draft; each chain against each of its drafters alone
  and against llama.cpp with the same `--spec-type` list (its defaults: the first non-empty draft).
- blocks: a llama target with a DFlash and a DSpark draft (block 8); forced k and the policy, against
  `--spec-type draft-dflash|draft-dspark` (n-max k, p-min 0; the policy against the file's whole block), and
  a draft written for another target (its drafts are nearly never right: the policy must cost nothing).
- heads: MTP (a qwen35 target's own layer) and EAGLE-3 (a head for a 4-layer llama) at exactly k drafts a
  step, p-min 0, against `--spec-type draft-mtp|draft-eagle3` at the same k.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import median

TITLE = "drafters on generated files vs llama-speculative-simple"
DEFAULTS = {"n": 128, "threads": 2, "reps": 3, "llama_dir": None, "jobs": None}


def options(p) -> None:
    p.add_argument("--case", default="hybrid,chains,blocks,heads", help="comma-separated: hybrid,chains,blocks,heads")
    p.add_argument("--archs", default="llama,lfm2,qwen35,mamba2", help="hybrid: the architectures")
    p.add_argument("--k", type=int, default=3, help="heads: drafts a step")
    p.add_argument("--flash-attn", choices=("on", "off", "auto"), help="-fa for both tools (default: each its own: "
                   "specchat's auto is off on the CPU alone, llama.cpp's is on)")


@dataclass
class Row:
    label: str
    ours: list[str] | None = None  # specchat prompt's drafting flags (None: no specchat run)
    theirs: dict | None = None  # harness.run_llamacpp's spec_type / draft / k / extra (None: no llama.cpp run)


@dataclass
class Group:
    title: str
    target: Path
    prompt: str
    rows: list[Row]
    notes: list = field(default_factory=list)  # (chain, its drafters alone): "x of its best drafter" lines


def hybrid(work: Path, a) -> list[Group]:
    tm = harness.tiny_models()
    groups = []
    for arch in a.archs.split(","):
        target = tm.write_model(work / f"{arch}-target.gguf", arch, context=tm.TARGET_CONTEXT[arch], n_embd=512,
                                n_layer=4)
        draft = tm.write_model(work / f"{arch}-draft.gguf", arch, context=tm.DRAFT_CONTEXT[arch], n_embd=512,
                               n_layer=1 if arch in ("llama", "mamba2") else 2)
        md = ["-md", str(draft), "--draft-p-min", "0"]
        groups.append(Group(f"{arch}: 4 layers x 512 target, a smaller draft, prompt 600 tokens", target,
                            harness.own_text(target, 600), [
            Row("draft model k=4", [*md, "--draft-fixed", "4"], {"spec_type": "draft-simple", "draft": draft, "k": 4}),
            Row("draft model, policy", md),
            Row("prompt lookup k=4", ["-md", "prompt-lookup", "--draft-fixed", "4"]),
            Row("prompt lookup, policy", ["-md", "prompt-lookup"], {"spec_type": "ngram-simple"}),
            Row("target only", ["--no-spec"])]))
    return groups


def chains(work: Path, a) -> list[Group]:
    tm = harness.tiny_models()
    context = tm.TARGET_CONTEXT["qwen35"]
    target = tm.write_model(work / "qwen35-mtp.gguf", "qwen35", context=context, mtp=True)
    draft = tm.write_model(work / "qwen35.gguf", "qwen35", context=context)
    text = harness.own_text(target, 48)
    rows = [Row("target only", ["--no-spec"])]
    for spec in ("draft-mtp", "ngram-simple", "draft-simple", "draft-mtp,ngram-simple",
                 "draft-simple,draft-mtp,ngram-simple"):
        md = ["-md", str(draft)] if "draft-simple" in spec else []
        rows.append(Row(spec, ["--spec-type", spec, *md],
                        {"spec_type": spec, "draft": draft if md else None}))
    return [Group("chains: tiny qwen35 target with an MTP layer + a qwen35 draft, prompt 96 tokens of its own text",
                  target, f"{text} {text}", rows,
                  [("draft-mtp,ngram-simple", ("draft-mtp", "ngram-simple")),
                   ("draft-simple,draft-mtp,ngram-simple", ("draft-simple", "draft-mtp", "ngram-simple"))])]


def blocks(work: Path, a) -> list[Group]:
    tm = harness.tiny_models()
    target = tm.write_dflash_target(work / "llama.gguf")
    drafts = {"draft-dflash": tm.write_dflash(work / "dflash.gguf"),
              "draft-dspark": tm.write_dflash(work / "dspark.gguf", markov=3.0)}
    other = tm.write_dflash(work / "other.gguf", seed=1)
    block = tm.DFLASH_BLOCK
    rows = [Row("target only", ["--no-spec"])]
    for spec, whole in (("draft-dflash", block - 1), ("draft-dspark", block)):
        md = ["--spec-type", spec, "-md", str(drafts[spec])]
        for k in sorted({3, whole}):
            rows.append(Row(f"{spec} k={k}", [*md, "--draft-fixed", str(k)],
                            {"spec_type": spec, "draft": drafts[spec],
                             "extra": ("--spec-draft-n-max", str(k), "--spec-draft-p-min", "0")}))
        rows.append(Row(f"{spec} policy", md, {"spec_type": spec, "draft": drafts[spec],
                                               "extra": ("--spec-draft-n-max", str(whole))}))
    rows.append(Row("draft-dflash policy, a draft for another target", ["--spec-type", "draft-dflash", "-md", str(other)],
                    {"spec_type": "draft-dflash", "draft": other, "extra": ("--spec-draft-n-max", str(block - 1))}))
    text = harness.own_text(target, 24)
    return [Group(f"block drafters: tiny llama target (n_embd {tm.dflash_target_width()}) + DFlash / DSpark drafts "
                  f"(block {block}), prompt: its own text", target, f"{text} {text}", rows)]


def heads(work: Path, a) -> list[Group]:
    tm = harness.tiny_models()
    mtp = tm.write_model(work / "qwen35-mtp.gguf", "qwen35", context=tm.TARGET_CONTEXT["qwen35"], mtp=True)
    llama = tm.write_model(work / "llama4.gguf", "llama", context=tm.TARGET_CONTEXT["llama"],
                           n_layer=tm.EAGLE3_TARGET_LAYERS)
    eagle = tm.write_eagle3(work / "eagle3.gguf")
    k = ["--draft-fixed", str(a.k), "--draft-p-min", "0"]
    return [Group(f"MTP: {mtp.name}'s own layer, k = {a.k}", mtp, harness.own_text(mtp, 64), [
                Row(f"mtp k={a.k}", ["-md", "mtp", *k], {"spec_type": "draft-mtp", "k": a.k}),
                Row("target only", ["--no-spec"])]),
            Group(f"EAGLE-3: {llama.name} + {eagle.name}, k = {a.k}", llama, harness.own_text(llama, 64), [
                Row(f"eagle3 k={a.k}", ["-md", str(eagle), *k], {"spec_type": "draft-eagle3", "draft": eagle, "k": a.k}),
                Row("target only", ["--no-spec"])])]


def run_group(g: Group, a, binary: Path, home: Path, result: harness.Result) -> None:
    fa = ["-fa", a.flash_attn] if a.flash_attn else []
    common = ["--no-lookup-history", *fa]

    def ours(row: Row, n: int) -> dict:
        return harness.run_specchat(g.target, g.prompt, n=n, threads=a.threads, extra=[*row.ours, *common],
                                    env=harness.specchat_env(home))

    for row in g.rows:  # calibrate the target and each drafter once (untimed)
        if row.ours and "--no-spec" not in row.ours:
            ours(row, 16)
    runs: dict[str, dict[str, list]] = {row.label: {"ours": [], "theirs": []} for row in g.rows}
    refused: dict[str, str] = {}
    for _ in range(a.reps):
        for row in g.rows:
            if row.ours is not None:
                runs[row.label]["ours"].append(ours(row, a.n))
            if row.theirs is not None:
                theirs = {**row.theirs, "extra": (*row.theirs.get("extra", ()), *fa)}
                got = harness.run_llamacpp(binary, g.target, g.prompt, n=a.n, threads=a.threads, **theirs)
                if "error" in got:
                    refused[row.label] = got["error"]
                else:
                    runs[row.label]["theirs"].append(got)
    plain = median(r["tps"] for r in runs["target only"]["ours"])
    reference = runs["target only"]["ours"][0]["ids"]
    table, medians = [], {}
    for row in g.rows:
        mine, theirs = runs[row.label]["ours"], runs[row.label]["theirs"]
        m = harness.median_run(mine) if mine else None
        t = harness.median_run(theirs) if theirs else None
        medians[row.label] = m["tps"] if m else None
        same = sum(x == y for x, y in zip(m["ids"], reference)) if m else len(reference)
        notes = [", ".join(f"{k} {v}" for k, v in sorted(m["drafted_by"].items()))] if m and m["drafted_by"] else []
        if same < len(reference):
            notes.append(f"text parts at token {same}")
        if row.label in refused:
            notes.append(f"llama.cpp cannot: {refused[row.label]}")
        table.append([row.label, m and m["tps"], m and harness.rate(m["accepted"], m["drafted"]), m and m["rereads"],
                      t and t["tps"], t and harness.rate(t["accepted"], t["drafted"]),
                      m["tps"] / t["tps"] if m and t else None, m["tps"] / plain if m else None, "; ".join(notes)])
    result.table(f"{g.title} · greedy · {a.n} tokens · {a.threads} threads · median of {a.reps} · "
                 f"-fa {a.flash_attn or 'each tool its own default'}",
                 ["setting", "specchat:.1f", "acc", "re-reads", "llama.cpp:.1f", "acc", "ratio:.2fx",
                  "/target:.2fx", "drafted by / notes"], table)
    for chain, alone in g.notes:
        best = max(alone, key=lambda label: medians[label])
        result.note(f"{chain}: {medians[chain] / medians[best]:.2f}x of its best drafter alone ({best}), "
                    f"{medians[chain] / plain:.2f}x of target-only")


CASES = {"hybrid": hybrid, "chains": chains, "blocks": blocks, "heads": heads}


def run(a, result: harness.Result) -> None:
    cases = [c.strip() for c in a.case.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad or not cases:
        raise SystemExit(f"benchmarks files: --case {','.join(bad) or '(none)'}; choose from {','.join(CASES)}")
    binary = harness.tool(a, "llama-speculative-simple")
    result.note(f"llama.cpp: {binary}")
    with harness.scratch("specchat-files-") as work:
        for case in cases:
            folder = work / case
            folder.mkdir()
            for group in CASES[case](folder, a):
                run_group(group, a, binary, folder / "home", result)
