"""What a report runs: the settings swept (--sweep) and the prompt sets (pure; errors carry file:line)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..errors import UserError

BASELINE = "target-only"
POLICY = "policy"
ALL = "all"
DEFAULT_CATEGORY = "custom"  # prompts from a plain-text file, or JSONL lines without a category


# -- settings ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One column of the sweep: a fixed draft length k (0 = target-only) or the adaptive policy (k None)."""

    name: str
    k: int | None

    @property
    def is_baseline(self) -> bool:
        return self.k == 0

    def as_dict(self) -> dict:
        return {"name": self.name, "kind": "policy" if self.k is None else "fixed", "k": self.k}


def fixed(k: int) -> Setting:
    return Setting(BASELINE if k == 0 else f"k={k}", k)


def parse_sweep(text: str, extra: Sequence[int] = ()) -> list[Setting]:
    """--sweep '0,2,4,policy' -> [target-only, k=2, k=4, policy]. Target-only is always run (it is what
    speedups are measured against); fixed lengths come sorted (with `extra`, --draft-fixed's), the policy last."""
    ks: set[int] = {0, *extra}
    policy = False
    for raw in text.split(","):
        item = raw.strip()
        if item.lower() == POLICY:
            policy = True
            continue
        try:
            k = int(item)
        except ValueError:
            k = -1
        if k < 0:
            raise UserError(
                f"--sweep: {item!r} is not a draft length (a whole number >= 0) or `policy`; "
                "example: --sweep 0,2,4,policy"
            )
        ks.add(k)
    settings = [fixed(k) for k in sorted(ks)] + ([Setting(POLICY, None)] if policy else [])
    if len(settings) < 2:
        raise UserError("--sweep: nothing to compare with target-only; give a length > 0 or `policy`")
    return settings


# -- prompt sets -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptItem:
    id: str
    category: str
    turns: tuple[str, ...]  # user messages; more than one = a conversation


def parse_prompts(text: str, source: str) -> list[PromptItem]:
    """A prompt file's text -> items. JSONL (first non-blank line starts with '{'):
    {"id": ..., "category": ..., "turns": ["...", ...]} per line ("prompt": "..." is accepted for one
    turn; id and category are optional). Otherwise one prompt per line, blank lines skipped.
    Errors are one line: `<source>:<line>: <what is wrong>`."""
    lines = text.splitlines()
    first = next((line.strip() for line in lines if line.strip()), "")
    items: list[PromptItem] = []
    if not first.startswith("{"):
        for n, line in enumerate(lines, 1):
            if line.strip():
                items.append(PromptItem(f"line-{n}", DEFAULT_CATEGORY, (line.strip(),)))
        return items
    seen: dict[str, int] = {}
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue

        def bad(message: str) -> UserError:
            return UserError(f"{source}:{n}: {message}")

        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise bad(f"not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise bad(f"expected a JSON object like {{\"id\", \"category\", \"turns\"}}, got {type(obj).__name__}")
        unknown = sorted(set(obj) - {"id", "category", "turns", "prompt"})
        if unknown:
            raise bad(f"unknown key {unknown[0]!r} (known: id, category, turns, prompt)")
        if "turns" in obj and "prompt" in obj:
            raise bad("give either \"turns\" or \"prompt\", not both")
        turns = obj.get("turns", [obj["prompt"]] if "prompt" in obj else None)
        if turns is None:
            raise bad("missing \"turns\": a list of user messages")
        if not isinstance(turns, list) or not turns:
            raise bad("\"turns\" must be a non-empty list of strings")
        for i, turn in enumerate(turns):
            if not isinstance(turn, str) or not turn.strip():
                raise bad(f"turn {i + 1} must be a non-empty string")
        pid = obj.get("id", f"line-{n}")
        if not isinstance(pid, (str, int)) or isinstance(pid, bool) or not str(pid).strip():
            raise bad("\"id\" must be a non-empty string or a number")
        pid = str(pid)
        if pid in seen:
            raise bad(f"duplicate id {pid!r} (first on line {seen[pid]})")
        seen[pid] = n
        category = obj.get("category", DEFAULT_CATEGORY)
        if not isinstance(category, str) or not category.strip():
            raise bad("\"category\" must be a non-empty string")
        if category.strip() == ALL:
            raise bad(f"category {ALL!r} is reserved for the overall rows")
        items.append(PromptItem(pid, category.strip(), tuple(turns)))
    return items


def builtin_text() -> str:
    return resources.files("specchat").joinpath("prompts/builtin.jsonl").read_text(encoding="utf-8")


def load_prompts(path: Path | None) -> tuple[list[PromptItem], str]:
    """(items, source label): the built-in set, or the user's file."""
    if path is None:
        return parse_prompts(builtin_text(), "builtin.jsonl"), "builtin"
    if not path.exists():
        raise UserError(f"--prompts {path}: no such file")
    if path.is_dir():
        raise UserError(f"--prompts {path}: is a directory, not a prompt file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"--prompts {path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise UserError(f"--prompts {path}: cannot read it ({e.strerror or e})") from None
    items = parse_prompts(text, str(path))
    if not items:
        raise UserError(f"--prompts {path}: no prompts in the file")
    return items, str(path)


def select_prompts(items: Sequence[PromptItem], categories: Sequence[str] | None, limit: int | None) -> list[PromptItem]:
    chosen = list(items)
    if categories:
        known = list(dict.fromkeys(i.category for i in items))
        missing = [c for c in categories if c not in known]
        if missing:
            raise UserError(f"--category {missing[0]!r}: no such category in this prompt set (have: {', '.join(known)})")
        chosen = [i for i in chosen if i.category in categories]
    if limit is not None:
        chosen = chosen[:limit]
    if not chosen:
        raise UserError("no prompts to run (check --category / --limit)")
    return chosen
