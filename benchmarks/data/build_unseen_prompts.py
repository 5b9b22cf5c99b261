"""Build benchmarks/data/unseen_prompts.jsonl and unseen_learning.jsonl from two public benchmarks.

    python benchmarks/data/build_unseen_prompts.py SPEC_BENCH_QUESTION_JSONL HUMANEVALPACK_PYTHON_JSONL

Sources (see README.md in this folder for licences):
- Spec-Bench (github.com/hemingkx/Spec-Bench, data/spec_bench/question.jsonl, Apache-2.0): MT-bench's
  writing / roleplay / extraction / coding turns, WMT14 de-en translation, CNN/DailyMail summarisation,
  Natural Questions (qa), GSM8K (math_reasoning) and NQ with retrieved passages (rag).
- HumanEvalPack (github.com/bigcode-project/octopack, evaluation/create/humaneval-x/data/python/data/
  humanevalpack.jsonl, MIT): HumanEvalFix, a bug put into each HumanEval solution by hand.

Selection rule (deterministic, nothing picked by looking at the results): for each kind, items in the
source's own order (question_id, task_id); the FIRST 5 are the evaluation set, the NEXT 2 are the
learning set (for the 8 kinds the issue names; qa and coding have none). Only the wrapping is ours: a
base model gets raw text, so each item is put in a plain "User:/Assistant:", "Question:/Answer:" or
"...\\nSummary:" frame (KINDS below). Articles are cut at a sentence end if over MAX_PROMPT_TOKENS.

Multi-turn chat (MT-bench roleplay, both turns): the first assistant reply is gemma-3-270m's own greedy
target-only reply to turn 1 (<= 96 tokens, cut at a "User:" it writes itself), made once here and stored,
so the benchmark's second turn sees a conversation the model itself produced.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))

N_EVAL, N_LEARN = 5, 2
MAX_PROMPT_TOKENS = 1400  # context 4096; the reply and llama.cpp's overshoot fit after it
FIRST_REPLY_TOKENS = 96

# kind -> (source, category in the source, frame, in the learning set)
KINDS = {
    "code-editing": ("HumanEvalPack", "humanevalfix", "fix", True),
    "summarisation": ("Spec-Bench", "summarization", "summary", True),
    "qa-context": ("Spec-Bench", "rag", "rag", True),
    "maths": ("Spec-Bench", "math_reasoning", "qa", True),
    "writing": ("Spec-Bench", "writing", "chat", True),
    "translation": ("Spec-Bench", "translation", "translate", True),
    "chat": ("Spec-Bench", "roleplay", "multi-turn", True),
    "extraction": ("Spec-Bench", "extraction", "chat", True),
    "qa": ("Spec-Bench", "qa", "qa", False),
    "coding": ("Spec-Bench", "coding", "chat", False),
}


def frame(kind: str, how: str, turns: list[str]) -> str:
    t = turns[0].strip()
    if how == "summary":  # Spec-Bench's text starts "Summarize: <article>"
        return f"{t}\nSummary:"
    if how == "rag":  # passages, then the question on the last line
        return f"{t}\nAnswer:"
    if how == "qa":
        return f"Question: {t}\nAnswer:"
    if how == "translate":  # "Translate German to English: <sentence>"
        return f"{t}\nEnglish:"
    if how == "chat":
        return f"User: {t}\nAssistant:"
    raise ValueError(how)


def fix_prompt(row: dict) -> str:
    """HumanEvalFix in the shape of its paper's prompt ("Fix bugs in <function>."), code in a fence."""
    code = row["declaration"] + row["buggy_solution"]
    return f"Fix bugs in {row['entry_point']}.\n```python\n{code.rstrip()}\n```\nFixed code:\n```python\n"


def first_reply(text: str) -> str:
    """gemma-3-270m's greedy target-only reply to the first turn (the CLI, as a user would run it)."""
    prompt = f"User: {text}\nAssistant:"
    out = subprocess.run(
        [sys.executable, "-m", "specchat.cli", "prompt", prompt, "--raw", "-m", "gemma-3-270m", "--no-spec",
         "-n", str(FIRST_REPLY_TOKENS), "-t", "2", "-c", "4096", "--temp", "0", "-ngl", "0", "--json"],
        capture_output=True, text=True, check=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    reply = json.loads(out.stdout)["text"]
    reply = reply.split("\nUser:")[0]
    return reply.strip()


def trim(text: str, tokenize, limit: int, keep: int) -> tuple[str, bool]:
    """Cut the article (all but the last `keep` lines: the question, the frame) at a sentence end until
    the prompt fits."""
    if len(tokenize(text)) <= limit:
        return text, False
    lines = text.split("\n")
    head, tail = "\n".join(lines[:-keep]), "\n".join(lines[-keep:])
    while len(tokenize(head + "\n" + tail)) > limit:
        cut = head.rfind(". ", 0, len(head) - 200)
        head = head[: cut + 1]
    return head + "\n" + tail, True


def main() -> None:
    spec_path, hep_path = sys.argv[1], sys.argv[2]
    from llama_cpp import Llama

    from specchat.config import load_config
    from specchat.sources import resolve

    vocab = Llama(str(resolve(load_config().model("gemma-3-270m"))), vocab_only=True, verbose=False)
    tokenize = lambda s: vocab.tokenize(s.encode(), add_bos=True, special=False)  # noqa: E731

    spec = [json.loads(line) for line in open(spec_path, encoding="utf-8")]
    hep = [json.loads(line) for line in open(hep_path, encoding="utf-8")]
    evaluation, learning = [], []
    for kind, (source, category, how, learn) in KINDS.items():
        if source == "HumanEvalPack":
            items = [(r["task_id"], r) for r in hep]
        else:
            items = [(f"spec-bench/{r['question_id']}", r) for r in spec if r["category"] == category]
        picked = items[: N_EVAL + (N_LEARN if learn else 0)]
        for i, (sid, row) in enumerate(picked):
            trimmed = False
            if how == "fix":
                prompt = fix_prompt(row)
            elif how == "multi-turn":
                t1, t2 = row["turns"][0].strip(), row["turns"][1].strip()
                reply = first_reply(t1)
                prompt = f"User: {t1}\nAssistant: {reply}\nUser: {t2}\nAssistant:"
            else:
                prompt, trimmed = trim(frame(kind, how, row["turns"]), tokenize, MAX_PROMPT_TOKENS, 2 if how == "rag" else 1)
            record = {"id": f"{kind}-{i + 1 if i < N_EVAL else i + 1 - N_EVAL}", "kind": kind, "source": source,
                      "source_id": sid, "category": category, "prompt_tokens": len(tokenize(prompt)),
                      "trimmed": trimmed, "prompt": prompt}
            if i < N_EVAL:
                evaluation.append(record)
            else:
                record["id"] = f"learn-{kind}-{i + 1 - N_EVAL}"
                learning.append(record)
            print(f"{record['id']:<22} {sid:<18} {record['prompt_tokens']:>5} tokens{' (trimmed)' if trimmed else ''}")
    for name, rows in (("unseen_prompts.jsonl", evaluation), ("unseen_learning.jsonl", learning)):
        with open(HERE / name, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"{len(evaluation)} evaluation prompts, {len(learning)} learning prompts")


if __name__ == "__main__":
    main()
