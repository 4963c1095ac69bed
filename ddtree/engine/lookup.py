"""Context lookup: a draft chain copied from the text so far (prompt lookup decoding), grafted onto the drafter's tree.

Code and worked answers repeat their context: a signature and docstring written out again, a variable name, a number
from the question. When the last `match` committed tokens (the step's root included) occurred earlier in the prompt
or the output, the tokens that followed that earlier occurrence are a cheap guess at what follows now. The guess is
grafted onto the step's tree as a chain (tree.graft_chain): nodes the tree already holds are shared, the rest are
appended. The target verifies every node as it verifies the drafter's, so the output stays exactly the target's.

The index maps each `match`-gram to where it last ended, so a step's lookup and each committed token cost one dict
access; the chain is the continuation of the most recent earlier occurrence. The longer that occurrence agrees with
the text before the root, the further its continuation tends to hold (a function body copied line by line, a number
and its unit), so the chain runs on for longer: up to `length` tokens, or a longer tier's (`longer`).
"""
from __future__ import annotations

MATCH = 3  # tokens that must agree (the root and the two before it): 2 proposed more but wrong chains on chat
LENGTH = 4  # tokens a chain proposes at most (each new node is one more verified row)
# (tokens that agree at least, tokens the chain proposes at most) beyond MATCH / LENGTH: the further an earlier
# occurrence agrees, the further its continuation holds (measured on prompts outside the evaluation sets:
# docs/cpu-speed.md)
LONGER = ((6, 8), (10, 12))
TABLE_LENGTH = 3  # tokens a table chain proposes at most: its later tokens matched too rarely to pay for their rows


class ContextLookup:
    """The committed tokens of one generation and an index of their `match`-grams."""

    def __init__(self, match: int = MATCH, length: int = LENGTH, longer: tuple = LONGER, table=None):
        tiers = ((match, length), *longer)
        if match < 1 or length < 1 or any(b[0] <= a[0] or b[1] <= a[1] for a, b in zip(tiers, tiers[1:])):
            raise ValueError(f"context lookup needs match >= 1, length >= 1 and longer tiers that need more agreeing "
                             f"tokens and propose more, got {tiers}")
        self.match, self.tiers = match, tiers
        self.table = table  # an NgramTable or None
        self.length = max(tiers[-1][1], TABLE_LENGTH if table is not None else 0)  # the longest chain it proposes
        self.top = len(tiers) - 1  # the highest tier chain() may use (greedy: all; sampled: the first, DDTree.prepare)
        self.tier = 0  # the kind of the last chain(): an index into tiers, or len(tiers) for the table's
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], int] = {}  # match-gram -> index of its last token, latest occurrence
        self._previous: int | None = None  # where the current last match-gram ended before (None: first time)

    def start(self, tokens: list[int]) -> None:
        """A new generation: the prompt and the prefill's token."""
        self.tokens, self._ends, self._previous = [], {}, None
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Tokens just committed."""
        history, n = self.tokens, self.match
        for token in tokens:
            history.append(int(token))
            if len(history) >= n:
                key = tuple(history[-n:])
                self._previous = self._ends.get(key)
                self._ends[key] = len(history) - 1

    @property
    def kinds(self) -> int:
        """How many kinds of chain chain() tells apart in self.tier: each tier of the context's, then the table's."""
        return len(self.tiers) + 1

    def chain(self) -> list[int]:
        """The tokens that followed the last match-gram's previous occurrence: as many as the longest tier (up to
        `top`) whose agreement that occurrence reaches allows (self.tier). Without one, the table's chain (self.tier
        = len(tiers)), or []."""
        if self._previous is None:
            self.tier = len(self.tiers)
            return self.table.chain(self.tokens, TABLE_LENGTH) if self.table is not None else []
        history, end, last = self.tokens, self._previous, len(self.tokens) - 1
        agree, most = self.match, self.tiers[self.top][0]
        while agree < most and end - agree >= 0 and history[end - agree] == history[last - agree]:
            agree += 1
        self.tier = max(i for i, (needs, _) in enumerate(self.tiers[:self.top + 1]) if agree >= needs)
        return history[end + 1:end + 1 + self.tiers[self.tier][1]]
