"""Stop strings, matched in the text stream even when they span token boundaries.

Text that could still become the start of a stop string is held back; text
that cannot is released at once. On a match, everything before it (and the
stop string itself with ``include``) is released and the sequence ends.
When several could match, the one that ends first in the text wins.
Pure: text in, text out.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str], *, include: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = tuple(stops)
        self.include = include
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """The part of ``held + text`` that can be released now. Sets ``matched`` on a match."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        buffer = self._held + text
        # The stop string that *ends* first wins (then the one starting first):
        # that is the one a token-by-token stream completes first, so the
        # result does not depend on how the text was cut into deltas.
        hits = [(at + len(s), at, s) for s in self.stops if (at := buffer.find(s)) != -1]
        if hits:
            _, at, self.matched = min(hits)
            self._held = ""
            return buffer[:at] + (self.matched if self.include else "")
        keep = self._partial(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep]

    def _partial(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop string."""
        longest = min(len(buffer), max(len(s) for s in self.stops) - 1)
        for k in range(longest, 0, -1):
            tail = buffer[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def flush(self) -> str:
        """At the end of the sequence, the held-back text was not a stop string after all."""
        held, self._held = self._held, ""
        return "" if self.matched is not None else held
