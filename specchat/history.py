"""Earlier replies as an n-gram source for prompt lookup (llama.cpp's lookup caches, kept as text).

A user's replies repeat themselves across sessions: the same code edited again, the same kind of summary,
the same boilerplate. Prompt lookup searches the conversation first; these earlier replies are searched
too and win when they match a longer suffix. They come from the chat transcripts specchat already writes
and from the replies of `specchat report` runs (saved under data_dir()/replies). Text is kept, not token
ids, so any target can use any reply: it is tokenised with the target's tokenizer when a run starts.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

from .lookup import NgramHistory, PromptLookup
from .paths import data_dir

MAX_CHARS = 400_000  # the newest replies up to this much text (~100k tokens; under 100 ms to tokenise)


def replies_dir() -> Path:
    return data_dir() / "replies"


def _files() -> list[Path]:
    """Transcripts and saved report replies, newest first."""
    files: list[Path] = []
    for folder in (data_dir() / "transcripts", replies_dir()):
        try:
            files += [p for p in folder.glob("*.jsonl") if p.is_file()]
        except OSError:
            continue
    def mtime(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:
            return 0.0
    return sorted(files, key=mtime, reverse=True)


def earlier_replies(max_chars: int = MAX_CHARS) -> list[str]:
    """Assistant messages from the newest files back, oldest first, up to max_chars of text. Lines that
    are not JSON records with a string content are skipped: these files are read, never trusted."""
    picked: list[list[str]] = []
    total = 0
    for path in _files():
        if total >= max_chars:
            break
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            continue
        texts = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("role") == "assistant" and isinstance(record.get("content"), str):
                texts.append(record["content"])
        picked.append(texts)
        total += sum(len(t) for t in texts)
    replies = [t for texts in reversed(picked) for t in texts if t]
    while replies and total > max_chars and len(replies) > 1:
        total -= len(replies.pop(0))
    return replies


def reply_history(target, max_chars: int = MAX_CHARS) -> NgramHistory | None:
    """The earlier replies in the target's tokens, or None when there are none."""
    replies = earlier_replies(max_chars)
    if not replies:
        return None
    return NgramHistory([target.tokenize(text, add_special=False) for text in replies])


def save_replies(texts: Iterable[str], *, target: str, kind: str = "report") -> Path | None:
    """Keep a run's replies for later lookups (one JSONL file per run); None when there is nothing
    to keep or the data dir cannot be written (this only costs the lookup source)."""
    records = [{"role": "assistant", "content": t, "target": target} for t in texts if t]
    if not records:
        return None
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    path = replies_dir() / f"{kind}-{stamp}.jsonl"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
    except OSError:
        return None
    return path


def build_lookup(build) -> PromptLookup:
    """The kinds table's factory for prompt lookup (loader.Build): lookup over the conversation and, unless
    turned off, this user's earlier replies."""
    opts = build.opts
    history = reply_history(build.target) if opts.lookup_history else None
    return PromptLookup(opts.lookup_min, opts.lookup_max, draft_min=opts.draft_min, history=history)
