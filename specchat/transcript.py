"""Chat transcripts: JSONL, one line per message, appended and flushed as each message is final, in
data_dir()/transcripts/. `specchat chat --resume FILE` reads one back and keeps appending to it."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from .paths import data_dir
from .runner import UserError


def transcripts_dir() -> Path:
    return data_dir() / "transcripts"


def new_transcript_path() -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    path = transcripts_dir() / f"{stamp}.jsonl"
    n = 1
    while path.exists():
        n += 1
        path = transcripts_dir() / f"{stamp}-{n}.jsonl"
    return path


class Transcript:
    """Appends one JSON line per message and flushes it at once: a killed process loses nothing."""

    def __init__(self, path: Path):
        self.path = Path(path).expanduser()
        self.records: list[dict] = []

    def write(self, record: dict) -> None:
        record = {**record, "time": datetime.now().astimezone().isoformat(timespec="seconds")}
        self.records.append(record)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            f.flush()

    def save_as(self, path: Path) -> None:
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as f:
            for record in self.records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")


def load_transcript(path: Path) -> tuple[str | None, list[dict], list[dict]]:
    """(system message, user/assistant turns in pairs, all records) from a transcript file.
    A user message without its reply (the process died mid-turn) is left out."""
    path = Path(path).expanduser()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UserError(f"--resume: no such transcript: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--resume: cannot read {path}: {e}") from None
    system, turns, records, pending = None, [], [], None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            role, content = record["role"], record["content"]
        except (ValueError, KeyError, TypeError):
            raise UserError(f"--resume: {path}:{n}: not a transcript line (want a JSON object with role and content)") from None
        if not isinstance(content, str):
            raise UserError(f"--resume: {path}:{n}: content must be a string")
        records.append(record)
        if role == "system":
            system = content or None
        elif role == "user":
            pending = {"role": "user", "content": content}
        elif role == "assistant" and pending is not None:
            turns += [pending, {"role": "assistant", "content": content}]
            pending = None
    return system, turns, records
