"""Chat transcripts: JSONL, one line per message, appended and flushed as each message is final, in
data_dir()/transcripts/. `specchat chat --resume FILE` reads one back and keeps appending to it.

Each session gets a file of its own, created exclusively (two chats started in the same second never
share one). A transcript that cannot be written (a read-only disk, a full one) never ends the chat: the
first failure is reported once as a warning and the chat goes on without saving.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from .paths import data_dir
from .errors import UserError


def transcripts_dir() -> Path:
    return data_dir() / "transcripts"


def create_transcript(folder: Path | None = None) -> Path:
    """Claim a new transcript file: created exclusively (O_EXCL), so a session started in the same second
    as another gets its own `-2`, `-3`, ... Raises OSError when the folder cannot be written."""
    folder = transcripts_dir() if folder is None else folder
    folder.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    for n in range(1, 10_000):
        path = folder / (f"{stamp}.jsonl" if n == 1 else f"{stamp}-{n}.jsonl")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            continue
        os.close(fd)
        return path
    raise OSError(f"no free transcript name in {folder}")


class Transcript:
    """Appends one JSON line per message and flushes it at once: a killed process loses nothing.

    `path` None: nothing is saved (the transcript could not be created). A write that fails sets
    `error` (the reason, for the one warning the chat prints) and later writes are not tried again;
    `records` keeps every message either way, so /save can still write them elsewhere."""

    def __init__(self, path: Path | None, *, error: str | None = None):
        self.path = Path(path).expanduser() if path is not None else None
        self.records: list[dict] = []
        self.error = error
        self._at_line_start = False  # checked before the first append: the file may end in a torn line

    @classmethod
    def new(cls) -> Transcript:
        """A session's own new transcript, or a Transcript that saves nothing (with `error` set)."""
        try:
            return cls(create_transcript())
        except OSError as e:
            return cls(None, error=_reason(e, transcripts_dir()))

    @property
    def saving(self) -> bool:
        return self.path is not None and self.error is None

    def write(self, record: dict) -> str | None:
        """Append one message. Returns the reason when this write failed (None when it was saved, or
        when saving had already stopped)."""
        record = {**record, "time": datetime.now().astimezone().isoformat(timespec="seconds")}
        self.records.append(record)
        if not self.saving:
            return None
        line = json.dumps(record, ensure_ascii=False) + "\n"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as f:
                if not self._at_line_start:
                    # a file whose last write was cut (kill -9, a full disk) may end mid-line: start ours on
                    # a line of its own, so that it is never glued onto the cut one
                    if f.tell() > 0 and _last_byte(self.path) != b"\n":
                        line = "\n" + line
                    self._at_line_start = True
                f.write(line)
                f.flush()
        except OSError as e:
            self.error = _reason(e, self.path)
            return self.error
        return None

    def drop_torn_tail(self, torn: Torn) -> None:
        """Cut a torn last line (read_transcript found it) off the file, as a journal drops a torn last record,
        unless the file changed since it was read. A file that cannot be cut keeps it: the next record still
        starts on a line of its own (write), and --resume drops the torn line again."""
        if self.path is None:
            return
        try:
            if self.path.stat().st_size == torn.size:
                os.truncate(self.path, torn.offset)
        except OSError:
            pass

    def discard(self) -> None:
        """Remove the file if nothing was ever written to it (a chat that ended before its first message)."""
        if self.path is None:
            return
        try:
            if self.path.stat().st_size == 0:
                self.path.unlink()
        except OSError:
            pass

    def save_as(self, path: Path) -> None:
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as f:
            for record in self.records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")


def _last_byte(path: Path) -> bytes:
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


def _reason(e: OSError, where: Path) -> str:
    text = e.strerror or str(e)
    name = e.filename if isinstance(e.filename, str) else str(where)
    return f"{text}: {name}"


@dataclass
class Torn:
    """A last line cut mid-write: no newline after it and no record in it."""

    line: int  # its line number
    offset: int  # the byte it starts at: the file holds whole lines up to here
    size: int  # the file's size when it was read

    def describe(self, path: Path) -> str:
        return (f"dropped the torn last line of {path} (line {self.line}, {self.size - self.offset} bytes cut "
                f"mid-write); every message before it is restored")


@dataclass
class Resumed:
    """What --resume reads back from a transcript."""

    system: str | None
    turns: list[dict]  # user/assistant messages in pairs
    records: list[dict]  # every record, as read
    skipped: list[str] = field(default_factory=list)  # messages that could not be paired, described
    pending: str | None = None  # a last user message that has no reply (the process died mid-turn)
    torn: Torn | None = None  # a last line cut mid-write, left out

    def __iter__(self):  # (system, turns, records), as load_transcript has always returned
        return iter((self.system, self.turns, self.records))

    @property
    def exchanges(self) -> int:
        return len(self.turns) // 2


def read_transcript(path: Path) -> Resumed:
    """A transcript file, paired: each assistant message answers the user message right before it. A user
    message followed by another user message, or an assistant message with no user message before it
    (two sessions once wrote one file), cannot be paired: it is left out and listed in `skipped`. A user
    message whose turn failed (a `dropped` record follows it) is left out silently; a last user message
    with no reply is kept as `pending`.

    A last line with no newline after it that holds no record was cut mid-write (the process was killed, the
    disk was full): it is left out and described in `torn`. Damage anywhere else is a UserError."""
    path = Path(path).expanduser()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise UserError(f"--resume: no such transcript: {path}") from None
    except OSError as e:
        raise UserError(f"--resume: cannot read {path}: {e}") from None
    system, turns, records, skipped = None, [], [], []
    pending: tuple[int, str] | None = None  # (line, content)
    torn: Torn | None = None
    lines = data.split(b"\n")  # the last item is what follows the last newline: b"" in a whole file
    offset = 0
    for n, raw in enumerate(lines, 1):
        start, offset = offset, offset + len(raw) + 1
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
            role, content = record["role"], record["content"]
        except (ValueError, KeyError, TypeError) as e:  # UnicodeDecodeError is a ValueError
            if n == len(lines):  # no newline after it: the write was cut
                torn = Torn(n, start, len(data))
                break
            if isinstance(e, UnicodeDecodeError):
                raise UserError(f"--resume: cannot read {path}:{n}: {e}") from None
            raise UserError(f"--resume: {path}:{n}: not a transcript line (want a JSON object with role and content)") from None
        if not isinstance(content, str):
            raise UserError(f"--resume: {path}:{n}: content must be a string")
        records.append(record)
        if role == "system":
            system = content or None
        elif role == "user":
            if pending is not None:
                skipped.append(f"line {pending[0]} (a message with no reply)")
            pending = (n, content)
        elif role == "assistant":
            if pending is None:
                skipped.append(f"line {n} (a reply with no message before it)")
            else:
                reply = {"role": "assistant", "content": content}
                if isinstance(record.get("reasoning_content"), str) and record["reasoning_content"]:
                    reply["reasoning_content"] = record["reasoning_content"]  # a reasoning model's thought
                turns += [{"role": "user", "content": pending[1]}, reply]
                pending = None
        elif role == "dropped":
            pending = None  # that turn failed and was dropped; the chat said so at the time
    return Resumed(system, turns, records, skipped, pending[1] if pending is not None else None, torn)


def load_transcript(path: Path) -> Resumed:
    """(system message, user/assistant turns in pairs, all records) from a transcript file; the result
    also carries what could not be paired and an unanswered last message (see read_transcript)."""
    return read_transcript(path)
