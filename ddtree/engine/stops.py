"""Where a generation ends, and the text it leaves. One Stops object per generation: the decoding loop hands
it each step's committed tokens (cut), a stream asks it for the text that is safe to show (ready), and the
result's text comes from it (finish). Every decision is made token by token, in order, from the token
sequence alone, never from how the tokens were grouped into steps, so every method stops at the same token
as plain decoding and leaves the same text.

    token_ids  end with the token that ended the generation: an EOS or stop token id, or the token whose text
               completed a stop string (its text may run past the stop string)
    text       never contains the stop: it ends where the first stop string starts; a stop token's (or
               EOS's) own text is left out
    reason     "eos" (the model's EOS ids), "stop_token" (match: the id) or "stop_string" (match: the string)
"""
from __future__ import annotations

import numbers

from ..base.config import ConfigError

REPLACEMENT = "\ufffd"  # what decode() makes of an incomplete UTF-8 character


def check_stop(stop) -> tuple[str, ...]:
    """`stop` (None, a string or a list of strings) as a tuple of non-empty strings, else a ConfigError."""
    if stop is None:
        return ()
    strings = [stop] if isinstance(stop, str) else stop
    if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) for s in strings):
        raise ConfigError(f"stop must be a string or a list of strings, got {type(stop).__name__} {stop!r:.60}; "
                          "for stop token ids use stop_token_ids=[...]")
    if any(not s for s in strings):
        raise ConfigError("stop contains an empty string, which would end every generation before it starts; "
                          "remove it")
    return tuple(dict.fromkeys(strings))


def check_stop_token_ids(ids, vocab_size: int) -> tuple[int, ...]:
    """`ids` (None, an int or a list of ints in 0..vocab_size-1) as a tuple, else a ConfigError."""
    if ids is None:
        return ()
    ids = [ids] if isinstance(ids, numbers.Integral) and not isinstance(ids, bool) else ids
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                      for t in ids):
        raise ConfigError(f"stop_token_ids must be a token id or a list of token ids (integers), got "
                          f"{type(ids).__name__} {ids!r:.60}; for stop strings use stop=[...]")
    bad = [int(t) for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ConfigError(f"stop_token_ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})")
    return tuple(int(t) for t in ids)


class TextTail:
    """The text of a token sequence, built one token at a time and only ever appended to. Each new token is
    decoded together with the tokens of the previous piece (a SentencePiece word's leading space depends on
    what precedes it) and held back while it ends in an incomplete UTF-8 character (U+FFFD), until a later
    token completes it. Each token costs two decodes of a few tokens."""

    def __init__(self, decode):
        self.decode, self.ids, self.text = decode, [], ""
        self._prefix = self._read = 0  # ids[_prefix:_read]: the last piece's tokens (context); ids[_read:]: pending

    def push(self, token: int) -> None:
        self.ids.append(token)
        before, after = self._decode()
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)

    def flush(self) -> None:
        """At the end: the pending tokens' text as decode() gives it (an incomplete character as U+FFFD)."""
        before, after = self._decode()
        self.text += after[len(before):]
        self._prefix = self._read = len(self.ids)

    def _decode(self) -> tuple[str, str]:
        return self.decode(self.ids[self._prefix:self._read]), self.decode(self.ids[self._prefix:])


class Stops:
    """The stops of one generation: the model's EOS ids (`eos`), the caller's `token_ids` and `strings`.
    decode(ids) -> str is the tokenizer's (None: no text; stop strings then need one). live=True follows the
    text during decoding even without stop strings (a stream); otherwise it is built once at the end."""

    def __init__(self, eos=(), token_ids=(), strings=(), decode=None, live: bool = False):
        if strings and decode is None:
            raise ConfigError("stop strings need a tokenizer to read the text; this target has none: use "
                              "stop_token_ids instead")
        self.eos, self.token_ids, self.strings = frozenset(eos), frozenset(token_ids), tuple(strings)
        self.tail = TextTail(decode) if decode is not None else None
        self.live = self.tail is not None and (live or bool(self.strings))
        self.reason, self.match = "", None
        self._end = None  # with a stop string: where the text ends (the stop string's start)
        self._shown = 0  # characters of the text handed out by ready()
        self._longest = max(map(len, self.strings), default=0)

    def cut(self, new: list[int]) -> int:
        """How many of the tokens `new` (just committed) to keep: all, or up to and including the first that
        ends the generation (then `reason` and `match` say why)."""
        for j, token in enumerate(new):
            if token in self.eos or token in self.token_ids:
                self.reason, self.match = ("eos", None) if token in self.eos else ("stop_token", token)
                return j + 1
            if self.live and self._push(token):
                return j + 1
        return len(new)

    def _push(self, token: int) -> bool:
        """Add one token's text; True when a stop string now appears (it can only end in the new text)."""
        tail, start = self.tail, len(self.tail.text)
        tail.push(token)
        if not self.strings or len(tail.text) == start:
            return False
        offset = max(0, start - self._longest + 1)
        window = tail.text[offset:]
        found = [(p, i) for i, s in enumerate(self.strings) if (p := window.find(s)) >= 0]
        if not found:
            return False
        p, i = min(found)  # the earliest start; a tie goes to the stop listed first
        self._end, self.reason, self.match = offset + p, "stop_string", self.strings[i]
        return True

    def ready(self) -> str:
        """The text not yet handed out that no later token can change: held back are an incomplete character
        and a tail that could be the start of a stop string (it would be cut if the stop completed)."""
        text = self.tail.text if self.live else ""
        end = self._end if self._end is not None else len(text) - self._held(text)
        piece = text[self._shown:end]
        self._shown = max(self._shown, end)
        return piece

    def _held(self, text: str) -> int:
        for k in range(min(self._longest - 1, len(text)), 0, -1):
            if any(s.startswith(text[-k:]) for s in self.strings):
                return k
        return 0

    def finish(self, tokens: list[int]) -> str:
        """The generation's text, once it has ended with `tokens`."""
        if self.tail is None:
            return ""
        if not self.live:  # built now, outside the timed loop, by the same steps a live one takes
            for token in tokens:
                if token in self.eos or token in self.token_ids:
                    break
                self.tail.push(token)
            self.live = True
        if self._end is None:
            self.tail.flush()
            self._end = len(self.tail.text)
        return self.tail.text[:self._end]

    def rest(self, tokens: list[int]) -> str:
        """A stream's last piece: the text not handed out by ready()."""
        return self.finish(tokens)[self._shown:]
