"""Stop strings (`stop` in the OpenAI API) cut the generated text where they first appear.

Text streams out piece by piece, so a piece that ends with the start of a stop string is held
back until the next piece shows whether the stop string completes; the client never sees text
that a stop string would have removed.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...] | list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""

    def push(self, piece: str) -> tuple[str, bool]:
        """Text safe to send now, and whether a stop string was hit (generation ends)."""
        buf = self._held + piece
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return buf[:min(hits)], True
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        """The held-back tail once generation ended without completing a stop string."""
        out, self._held = self._held, ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest end of `buf` that begins some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
