"""Whether llama.cpp's SentencePiece tokenizer, given one score per token, merges as a BPE's ranked merges do.

transformers' BPE merges, again and again, the adjacent pair of lowest *rank* in its merge list; llama.cpp's SPM
tokenizer (``llm_tokenizer_spm_session``) merges any adjacent pair whose joined text is a token, the token of
highest *score* first (leftmost on ties). With each token scored minus the rank of its first merge
(``first_merge_ranks``), the two agree when:

- every split of a token into two tokens is a merge (llama.cpp would merge pairs the BPE never merges), and
- one token's merges are adjacent in rank; where they are not (transformers 5 interleaves the merges of tokens
  SentencePiece scores alike, such as Mistral's runs of spaces), the two are run on every text of up to three
  pieces of the tokens concerned, and must split each alike.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

Merges = list[tuple[str, str]]
MAX_PROBE_PIECES = 400  # beyond this, the merges are far from SentencePiece's order: not probed, refused


def first_merge_ranks(merges: Merges) -> dict[str, int]:
    """Each merged token's rank: the rank of the first merge that makes it."""
    ranks: dict[str, int] = {}
    for rank, (left, right) in enumerate(merges):
        ranks.setdefault(left + right, rank)
    return ranks


def merge_pieces(text: str, priority: Callable[[str, str], int | None]) -> list[str]:
    """``text`` (one character a piece to start) after merging, again and again, the adjacent pair of lowest
    ``priority`` (leftmost on ties; None: never merged), as both tokenizers do with their own priority."""
    pieces = list(text)
    following = [*range(1, len(pieces)), -1]
    preceding = list(range(-1, len(pieces) - 1))
    queue: list[tuple[int, int, int, int]] = []

    def push(left: int, right: int) -> None:
        if left != -1 and right != -1:
            order = priority(pieces[left], pieces[right])
            if order is not None:
                heapq.heappush(queue, (order, left, right, len(pieces[left]) + len(pieces[right])))

    for index in range(1, len(pieces)):
        push(index - 1, index)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        if not pieces[left] or not pieces[right] or len(pieces[left]) + len(pieces[right]) != size:
            continue  # one of the two was merged since
        pieces[left], pieces[right] = pieces[left] + pieces[right], ""
        following[left] = following[right]
        if following[right] != -1:
            preceding[following[right]] = left
        push(preceding[left], left)
        push(left, following[left])
    return [piece for piece in pieces if piece]


def missing_merge(vocab: dict[str, int], merges: Merges) -> str | None:
    """A split of a token into two tokens that is not a merge (llama.cpp would merge it), or None."""
    pairs = set(merges)
    for token in vocab:
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab and (left, right) not in pairs:
                return (
                    f"{left!r} + {right!r} -> {token!r} is not one of its merges, though all three are tokens"
                    " (llama.cpp merges any two pieces that form a token)"
                )
    return None


def interleaved_pieces(merges: Merges) -> set[str]:
    """The tokens whose merges are not adjacent in rank, those merged in between, and their merges' pieces."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for rank, (left, right) in enumerate(merges):
        first.setdefault(left + right, rank)
        last[left + right] = rank
    pieces: set[str] = set()
    for token, start in first.items():
        span = merges[start : last[token] + 1]
        if any(left + right != token for left, right in span):
            pieces.update(piece for pair in span for piece in (*pair, "".join(pair)))
    return pieces


def merge_problem(vocab: dict[str, int], merges: Merges) -> str | None:
    """Why llama.cpp, with each token scored minus its first merge's rank, would not merge as ``merges`` (in rank
    order) do, or None. ``vocab`` is the BPE's own vocabulary (added-only tokens are matched whole first)."""
    missing = missing_merge(vocab, merges)
    if missing is not None:
        return missing
    pieces = sorted(interleaved_pieces(merges))
    if not pieces:
        return None
    if len(pieces) > MAX_PROBE_PIECES:
        return f"the merges of {len(pieces)} tokens are apart in rank, far from SentencePiece's order by score"
    rank = {pair: index for index, pair in enumerate(merges)}
    first = first_merge_ranks(merges)

    def by_rank(left: str, right: str) -> int | None:  # transformers: the pair's own rank
        return rank.get((left, right))

    def by_score(left: str, right: str) -> int | None:  # llama.cpp: the joined token's score (its first rank)
        return first.get(left + right)

    longest = 3 if len(pieces) <= 40 else 2
    for count in range(1, longest + 1):
        for combination in itertools.product(pieces, repeat=count):
            text = "".join(combination)
            expected, got = merge_pieces(text, by_rank), merge_pieces(text, by_score)
            if got != expected:
                return (
                    f"some tokens' merges are apart in rank, and one score per token cannot order them: llama.cpp"
                    f" would split {text!r} into {got} where the merges give {expected}"
                )
    return None
