"""Stop strings (`stop` in the OpenAI API) cut the generated text where the first one begins.

Text streams out piece by piece, so text that may begin a stop string is held back until later
pieces settle it; the client never sees text that a stop string would have removed. A stop
string found in the buffer wins only once no other stop string could still begin before it.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""

    def push(self, piece: str) -> tuple[str, bool]:
        """Text safe to send now, and whether a stop string was hit (generation ends)."""
        self._held += piece
        return self._drain(final=False)

    def flush(self) -> tuple[str, bool]:
        """Once generation ended: the held-back text, cut at a stop string it holds."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, bool]:
        buf = self._held
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        first = min(hits, default=len(buf))
        pending = len(buf) if final else self._partial_start(buf)
        if hits and first <= pending:
            self._held = ""
            return buf[:first], True
        safe = min(first, pending)
        self._held = buf[safe:]
        return buf[:safe], False

    def _partial_start(self, buf: str) -> int:
        """Where the earliest end of `buf` that is a proper prefix of a stop string begins."""
        start = len(buf)
        for s in self.stops:
            for j in range(max(0, len(buf) - len(s) + 1), start):
                if s.startswith(buf[j:]):
                    start = j
                    break
        return start
