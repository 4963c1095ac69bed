"""The target's own n-grams: after each 3-gram its answers often continue the same way, the token that followed most.

Where the context lookup (lookup.py) finds no earlier occurrence to copy, the text so far may still end in a 3-gram
that the target's own answers to other prompts continued one way most of the time ("Here is", "Let me", "I hope
this"): those continuations, chained 3-gram by 3-gram, are a cheap guess that the drafter misses most where it is
weakest (open chat and writing). The table is built from the training data's answers (`python -m ddtree train
ngram-table`; never the evaluation sets) and ships beside the drafter as `ngrams.npz`. Its chains are grafted onto
the tree like the lookup's and verified like every node, so the output stays exactly the target's.

A 3-gram is kept when it occurred at least `min_count` times and one next token took at least `min_share` of them.
The keys are the three token ids packed 21 bits each into one uint64, sorted, so a lookup is one binary search.
"""
from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ..base.config import ConfigError

FILE = "ngrams.npz"  # its name in a drafter's folder
ORDER = 3  # tokens a key holds
BITS = 21  # bits a token id takes in a key: ids below 2^21 (2,097,152), every tokenizer's
MIN_COUNT = 3  # occurrences a kept 3-gram needs
MIN_SHARE = 0.6  # the share of them its most frequent next token needs


def pack(a, b, c):
    """The key of the 3-gram (a, b, c): token ids as Python ints (an int) or as uint64 arrays (an array of keys)."""
    return (a << 2 * BITS) | (b << BITS) | c


def pack_rows(grams: np.ndarray) -> np.ndarray:
    """Keys [n] uint64 of 3-grams [n, 3] (token ids)."""
    grams = grams.astype(np.uint64)
    return pack(grams[:, 0], grams[:, 1], grams[:, 2])


def unpack_rows(keys: np.ndarray) -> np.ndarray:
    """The 3-grams [n, 3] (int64 token ids) of keys [n]."""
    mask = np.uint64((1 << BITS) - 1)
    return np.stack([keys >> np.uint64(2 * BITS), (keys >> np.uint64(BITS)) & mask, keys & mask], 1).astype(np.int64)


class NgramTable:
    """3-gram -> the next token the target's answers took most often after it."""

    def __init__(self, grams: np.ndarray, next_ids: np.ndarray, vocab_size: int):
        grams, next_ids = np.asarray(grams), np.asarray(next_ids)
        if grams.ndim != 2 or grams.shape[1] != ORDER or next_ids.shape != grams.shape[:1]:
            raise ConfigError(f"an n-gram table needs 3-grams [n, 3] and one next token each, got {grams.shape} "
                              f"and {next_ids.shape}; rebuild it with `python -m ddtree train ngram-table`")
        if vocab_size > 1 << BITS or (grams.size and max(int(grams.max()), int(next_ids.max())) >= vocab_size):
            raise ConfigError(f"an n-gram table's token ids must lie below its vocabulary ({vocab_size}, at most "
                              f"{1 << BITS}); rebuild it with `python -m ddtree train ngram-table`")
        keys = pack_rows(grams)
        order = np.argsort(keys, kind="stable")
        self.keys, self.next_ids = keys[order], next_ids[order].astype(np.int64)
        if keys.size > 1 and not (np.diff(self.keys) > 0).all():
            raise ConfigError("an n-gram table holds a 3-gram twice; rebuild it with `python -m ddtree train "
                              "ngram-table`")
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return int(self.keys.size)

    def next_token(self, a: int, b: int, c: int) -> int | None:
        """The token the table predicts after (a, b, c), or None."""
        if max(a, b, c) >= self.vocab_size:
            return None
        key = np.uint64(pack(a, b, c))
        i = int(self.keys.searchsorted(key))
        return int(self.next_ids[i]) if i < self.keys.size and self.keys[i] == key else None

    def chain(self, history: list[int], length: int) -> list[int]:
        """Up to `length` tokens after `history` (its last 3 tokens and each predicted one in turn), as far as every
        3-gram on the way is in the table."""
        window, out = list(history[-ORDER:]), []
        while len(out) < length and len(window) == ORDER:
            token = self.next_token(*window)
            if token is None:
                break
            out.append(token)
            window = window[1:] + [token]
        return out

    @classmethod
    def from_sequences(cls, sequences: Iterable[list[int]], vocab_size: int, min_count: int = MIN_COUNT,
                       min_share: float = MIN_SHARE) -> "NgramTable":
        """The table of token sequences (the target's answers, each with the tokens before it that its first
        3-grams need): every 3-gram seen >= min_count times whose most frequent next token took >= min_share."""
        if min_count < 1 or not 0.0 < min_share <= 1.0:
            raise ConfigError(f"an n-gram table needs min_count >= 1 and 0 < min_share <= 1, got {min_count} and "
                              f"{min_share}")
        grams, nexts = [], []
        for seq in sequences:
            s = np.asarray(seq, dtype=np.int64)
            if s.size > ORDER:
                grams.append(np.lib.stride_tricks.sliding_window_view(s[:-1], ORDER))
                nexts.append(s[ORDER:])
        if not grams:
            return cls(np.zeros((0, ORDER), np.int64), np.zeros(0, np.int64), vocab_size)
        g, n = np.concatenate(grams), np.concatenate(nexts)
        if max(int(g.max()), int(n.max())) >= vocab_size:
            raise ConfigError(f"a sequence holds a token id >= the vocabulary's {vocab_size}: the data is another "
                              "tokenizer's")
        keys = pack_rows(g)
        order = np.lexsort((n, keys))  # by key, then next token
        keys, n, g = keys[order], n[order], g[order]
        # runs of one (key, next) pair, then the pairs of one key
        pair_start = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]) | (n[1:] != n[:-1])])
        pair_count = np.diff(np.r_[pair_start, keys.size])
        pair_key = keys[pair_start]
        key_start = np.flatnonzero(np.r_[True, pair_key[1:] != pair_key[:-1]])
        total = np.add.reduceat(pair_count, key_start)
        most = np.maximum.reduceat(pair_count, key_start)
        key_of_pair = np.repeat(np.arange(key_start.size), np.diff(np.r_[key_start, pair_key.size]))
        top = np.flatnonzero(pair_count == most[key_of_pair])  # the most frequent pairs; ties: the lowest token id
        top = top[np.r_[True, key_of_pair[top][1:] != key_of_pair[top][:-1]]]
        keep = (total >= min_count) & (most >= min_share * total)
        first = pair_start[top[keep]]
        return cls(g[first], n[first], vocab_size)

    def save(self, path) -> None:
        small = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        np.savez_compressed(path, grams=unpack_rows(self.keys).astype(small), next_ids=self.next_ids.astype(small),
                            vocab_size=np.int64(self.vocab_size))

    @classmethod
    def load(cls, path) -> "NgramTable":
        path = Path(path)
        try:
            with np.load(path) as z:
                return cls(z["grams"].astype(np.int64), z["next_ids"].astype(np.int64), int(z["vocab_size"]))
        except (OSError, ValueError, KeyError, EOFError) as e:
            raise ConfigError(f"{path} is not an n-gram table ({type(e).__name__}: {e}); rebuild it with "
                              "`python -m ddtree train ngram-table`") from None
