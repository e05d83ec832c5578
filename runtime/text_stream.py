"""The text of a growing list of new tokens, handed out in pieces, with stop strings: the one
matcher that runtime.generate --stop, the Triton generate model (stop_words) and through it
`runtime.triton client --stop` share, so that every surface ends the text at the same place.

    text = TextStream(tokenizer, stop_tokens=(eos,), stop_strings=("\\n\\n", "The end"))
    for token in tokens:
        piece = text.push(token)       # what this token adds that is safe to show now
        if text.stopped: break         # a stop string is complete: stop generating
    piece = text.flush()               # the rest (after the last token)

Stop strings are matched on the decoded text (stop tokens left out) across token boundaries;
the text ends just before the first stop string, which is not part of it. Text that could
still be the start of a stop string is held back until it is known not to be one (or the
sequence ends), and so is a trailing U+FFFD: byte-level tokens can split a UTF-8 character,
which the decoder shows as U+FFFD until a later token completes it. The pieces concatenated
are the final text (`text()`).
"""
from __future__ import annotations

from typing import Iterable


class TextStream:
    """See the module docstring. tokenizer: anything with decode(ids) -> str."""

    def __init__(self, tokenizer, stop_tokens: Iterable[int] = (), stop_strings: Iterable[str] = ()):
        self.tokenizer = tokenizer
        self.stop = frozenset(stop_tokens)
        self.stop_strings = tuple(s for s in stop_strings if s)        # "" would stop before anything
        self._longest = max((len(s) for s in self.stop_strings), default=0)
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False              # a stop string completed: the text ends before it
        self._cut: str | None = None      # the text up to the stop string, once stopped

    def text(self) -> str:
        """The text so far (the final text once stopped or flushed)."""
        return self._cut if self._cut is not None else self.tokenizer.decode(self.ids)

    def _find_stop(self, text: str) -> int:
        """Start of the first stop string in text, or -1. Only the end can hold a new one: the text
        before len(sent) - longest was searched already (held-back text keeps a match findable)."""
        start = max(0, len(self.sent) - self._longest)
        found = [i for i in (text.find(s, start) for s in self.stop_strings) if i >= 0]
        return min(found) if found else -1

    def _held(self, text: str) -> int:
        """How many characters at the end of text could still start a stop string."""
        for k in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop_strings):
                return k
        return 0

    def push(self, token: int, last: bool = False) -> str:
        """The text `token` adds that can be shown now (with last=True: everything left)."""
        if self.stopped:
            return ""
        if token not in self.stop:
            self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if self.stop_strings:
            i = self._find_stop(text)
            if i >= 0:
                self.stopped, self._cut = True, text[:i]
                return self._take(self._cut)
        if last:
            return self._take(text)
        ready = text.rstrip("\ufffd")
        if self.stop_strings:
            ready = ready[:len(ready) - self._held(ready)]
        return self._take(ready)

    def flush(self) -> str:
        """Everything not sent yet (the sequence has ended)."""
        return self._take(self.text())

    def _take(self, ready: str) -> str:
        if not ready.startswith(self.sent):      # the decoder revised text already sent: hold until the end
            return ""
        piece, self.sent = ready[len(self.sent):], ready
        return piece
