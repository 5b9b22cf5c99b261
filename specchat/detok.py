"""Incremental detokenizer: token bytes in, complete UTF-8 text out.

A character can span tokens (byte-fallback tokens of an emoji or a CJK character), so a token's piece
is not always valid text on its own. The stdlib's incremental decoder holds the incomplete tail back
until the bytes that finish it arrive.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable


class Detokenizer:
    def __init__(self, token_bytes: Callable[[int], bytes]):
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        """Text completed by this token ('' while a multi-byte character is still incomplete)."""
        return self._decoder.decode(self._token_bytes(token))

    def flush(self) -> str:
        """The end of the text: an unfinished character still held (a reply cut by -n between the bytes
        of an emoji) is dropped, not turned into U+FFFD; its token ids are still reported."""
        self._decoder.reset()
        return ""


class StopMatcher:
    """Holds back text that could be the start of a stop string, so a stop string never reaches the
    screen and the final text ends right before it."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to show now, whether a stop string was found)."""
        if not self.stops:
            return text, False
        buf = self.held + text
        found = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if found:
            self.held = ""
            return buf[: min(found)], True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:n]):
                    hold = n
                    break
        self.held = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held
