"""Which rows of a batch share a prefix, and the packed layout that computes each shared prefix once.

Two rows share their first p columns when their token ids and masks agree at every column there
and, when the caller passes position ids, so do those at real (attention-mask 1) columns. Padding ids
count too: no real output reads a padding token, but the padding position's own output (the logit at
the last padding column predicts the first real token, which a padding collator's labels include) is
computed from its id.

Groups are found wherever their rows are (adjacent as TRL lays them out, interleaved as verl does,
DPO's chosen and rejected halves): rows are sorted by their keys, so that rows with a common prefix
are neighbours, and the sorted order's longest-common-prefix array defines a tree of candidate groups
(the lcp-interval tree of string algorithms: every interval of sorted rows whose common prefix is
longer than its neighbours'). Walking that tree bottom-up, each node keeps its children's groups or
gathers some of them into one group of its own, whichever saves more tokens (a group of n rows with a
common prefix of p columns saves (n - 1) * p): a greedy choice, optimal for the batches trainers make
(one group per prompt, however its rows are arranged, completions that start alike), not for every
conceivable batch. A group needs p >= min_shared; a row in no group is computed on its own. Each group
shares the longest prefix all its rows have, which may run past the prompt when completions start
alike.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch import Tensor

from .prefix_attention import Bucket, PackedLayout

__all__ = [
    "PrefixGroup",
    "Grouping",
    "grouping_keys",
    "find_prefix_groups",
    "real_columns",
    "common_prefix",
    "plan_grouping",
    "ungroup_one_token_prefixes",
    "pack_layout",
]

_PADDING_FLAG = 2**31  # token ids are below 2**31: padding and real columns never share a key


@dataclasses.dataclass(frozen=True)
class PrefixGroup:
    """Rows (batch indices, ascending) that share their first `prefix` columns. A single row is a
    group of one whose prefix is the whole row."""

    rows: tuple[int, ...]
    prefix: int


def grouping_keys(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor | None) -> np.ndarray:
    """[rows, length] (or [rows, length, 2] with position ids) uint32 keys, big-endian, on the host:
    id + 1 at real columns, id + 1 + 2**31 at padding ones (and the position at real columns, offset to
    be non-negative). Host sync: the grouping is decided on the host, once per forward."""
    real = attention_mask.bool()
    ids = input_ids.long() + 1 + torch.where(real, 0, _PADDING_FLAG)
    if position_ids is not None:
        positions = torch.where(real, position_ids.long() - position_ids.min() + 1, 0)
        ids = torch.stack([ids, positions.expand_as(ids)], dim=-1)
    return ids.to(device="cpu", dtype=torch.int64).numpy().astype(">u4")


def find_prefix_groups(keys: np.ndarray, min_shared: int) -> list[PrefixGroup]:
    """A partition of the rows into groups (see the module docstring), ordered by first row."""
    rows, length = keys.shape[:2]
    flat = keys.reshape(rows, -1)
    order = sorted(range(rows), key=lambda r: flat[r].tobytes())  # big-endian bytes sort as the numbers do
    ranked = keys[order].reshape(rows, length, -1)
    if rows > 1:
        differs = (ranked[1:] != ranked[:-1]).any(axis=2)  # [rows - 1, length]
        lcp = np.where(differs.any(axis=1), differs.argmax(axis=1), length)  # sorted row i vs i + 1
    else:
        lcp = np.zeros(0, dtype=np.int64)

    # Post-order over the lcp-interval tree, with an explicit stack. A node, an interval [lo, hi) of
    # sorted rows whose common prefix is `shared` columns, splits into children where lcp == shared. Its
    # best partition: each child either keeps its own best partition, or gives all its rows to one group
    # at this node (worth `shared` per row, less `shared` once for the group) when that is worth more.
    best: dict[tuple[int, int], tuple[int, list[tuple[list[int], int]]]] = {}
    stack = [(0, rows, False)]
    while stack:
        lo, hi, expanded = stack.pop()
        if hi - lo == 1:
            best[lo, hi] = (0, [([lo], length)])
            continue
        inner = lcp[lo : hi - 1]
        shared = int(inner.min())
        cuts = [lo] + [lo + 1 + int(i) for i in np.flatnonzero(inner == shared)] + [hi]
        children = list(zip(cuts[:-1], cuts[1:]))
        if not expanded:
            stack.append((lo, hi, True))
            stack.extend((a, b, False) for a, b in children)
            continue
        results = [best.pop(c) for c in children]
        value = sum(v for v, _ in results)
        segments = [seg for _, segs in results for seg in segs]
        if shared >= min_shared:
            joins = [(b - a) * shared > v for (a, b), (v, _) in zip(children, results)]
            joined = [r for (a, b), join in zip(children, joins) if join for r in range(a, b)]
            if len(joined) >= 2:
                value = (len(joined) - 1) * shared + sum(v for (v, _), join in zip(results, joins) if not join)
                segments = [(joined, shared)] + [
                    seg for (_, segs), join in zip(results, joins) if not join for seg in segs
                ]
        best[lo, hi] = (value, segments)
    groups = [PrefixGroup(tuple(sorted(order[i] for i in positions)), prefix) for positions, prefix in best[0, rows][1]]
    return sorted(groups, key=lambda g: g.rows[0])


@dataclasses.dataclass(frozen=True)
class Grouping:
    """How a forward's rows are computed: `groups` of rows that share a prefix and, when `common` > 0,
    `common` tokens before them that every row shares, from its column `starts[row]` on (its first real
    one). With a common prefix, the groups' columns are the rows' own with the common ones taken out
    (`length - common` of them: the left padding, then what follows the common tokens)."""

    groups: list[PrefixGroup]
    length: int
    common: int = 0
    starts: np.ndarray | None = None

    @property
    def tokens(self) -> int:
        """Tokens the packed sequence computes."""
        own = self.length - self.common
        return self.common + sum(g.prefix + len(g.rows) * (own - g.prefix) for g in self.groups)


def real_columns(keys: np.ndarray) -> np.ndarray:
    """[rows, length] bool: the columns whose attention-mask bit is 1, read from `grouping_keys`' keys."""
    return (keys[..., 0] if keys.ndim == 3 else keys) < _PADDING_FLAG


def common_prefix(keys: np.ndarray) -> tuple[int, np.ndarray]:
    """(c, starts): the longest run of real tokens that every row has from its first real column on
    (`starts`), the same ids there (and positions, when the keys hold them). 0 when some row has no
    real token."""
    real = real_columns(keys)
    rows, length = real.shape
    if not real.any(axis=1).all():
        return 0, np.zeros(rows, dtype=np.int64)
    starts = real.argmax(axis=1)
    width = length - int(starts.max())
    columns = starts[:, None] + np.arange(width)  # [rows, width]: each row's columns from its first real one
    aligned = keys[np.arange(rows)[:, None], columns].reshape(rows, width, -1)
    agree = (aligned == aligned[:1]).all(axis=(0, 2)) & real[np.arange(rows)[:, None], columns].all(axis=0)
    return (int(agree.argmin()) if not agree.all() else width), starts


def _own_columns(length: int, common: int, starts: np.ndarray) -> np.ndarray:
    """[rows, length - common]: each row's columns with its `common` ones from starts[row] taken out."""
    own = np.arange(length - common)[None, :]
    return own + common * (own >= starts[:, None])


def plan_grouping(keys: np.ndarray, nested_keys: np.ndarray | None, min_shared: int) -> Grouping:
    """The cheaper of: groups of rows that share a prefix (`find_prefix_groups` over `keys`); and, when
    `nested_keys` are given (keys under which a token's result depends only on the tokens before it
    from the row's first real one: positions numbered from there, or given), a prefix of at least
    `min_shared` real tokens common to every row, computed once, with the groups found over what is
    left of each row (so that, say, each prompt's rows share their prompt after a system prompt common
    to all, whatever left padding each prompt has)."""
    length = keys.shape[1]
    flat = Grouping(find_prefix_groups(keys, min_shared), length)
    if nested_keys is None or keys.shape[0] < 2:
        return flat
    common, starts = common_prefix(nested_keys)
    if common < min_shared or common == length:  # (== length: every row the same, unpadded: nothing after it)
        return flat
    rest = nested_keys[np.arange(keys.shape[0])[:, None], _own_columns(length, common, starts)]
    nested = Grouping(find_prefix_groups(rest, min_shared), length, common, starts)
    return nested if nested.tokens < flat.tokens else flat


def ungroup_one_token_prefixes(grouping: Grouping, keys: np.ndarray) -> Grouping:
    """`grouping` with each group of several rows whose prefix holds exactly one real token after the
    common tokens split into rows of their own (a row then computes that token itself: one token more
    per row). For recurrent layers (`recurrent_segments`), whose scan cannot end a one-token segment
    continued from the common tokens' states with the states after it. Without common tokens a prefix
    starts from no state, and `grouping` is returned as it is."""
    if not grouping.common:
        return grouping
    rows, length = keys.shape[:2]
    own = real_columns(keys)[np.arange(rows)[:, None], _own_columns(length, grouping.common, grouping.starts)]
    groups = []
    for group in grouping.groups:
        if len(group.rows) > 1 and int(own[group.rows[0], : group.prefix].sum()) == 1:
            groups += [PrefixGroup((row,), length - grouping.common) for row in group.rows]
        else:
            groups.append(group)
    groups.sort(key=lambda g: g.rows[0])
    return dataclasses.replace(grouping, groups=groups)


def pack_layout(grouping: Grouping, attention_mask: Tensor) -> PackedLayout:
    """The packed sequence for a [rows, length] batch: the common tokens (if any), then the groups;
    groups of the same (size, prefix) form one bucket, whose attention runs batched."""
    groups, length, common = grouping.groups, grouping.length, grouping.common
    rows = sum(len(g.rows) for g in groups)
    starts = np.zeros(rows, dtype=np.int64) if grouping.starts is None else grouping.starts
    columns = _own_columns(length, common, starts)  # [rows, own]: the columns the groups compute
    own = length - common
    by_shape: dict[tuple[int, int], list[PrefixGroup]] = {}
    for g in groups:
        by_shape.setdefault((len(g.rows), g.prefix), []).append(g)
    buckets, src_parts = [], []
    dest = np.empty((rows, length), dtype=np.int64)
    if common:  # the common tokens: the first row's, serving every row
        first = groups[0].rows[0]
        src_parts.append(first * length + starts[first] + np.arange(common))
        dest[np.arange(rows)[:, None], starts[:, None] + np.arange(common)] = np.arange(common)
    offset = common
    for (n, prefix), members in sorted(by_shape.items()):
        suffix = own - prefix
        bucket = Bucket(offset=offset, groups=len(members), rows=n, prefix=prefix, suffix=suffix)
        member_rows = np.array([g.rows for g in members], dtype=np.int64)  # [groups, n]
        # Prefix tokens: each group's first row, its first `prefix` own columns.
        leaders = member_rows[:, 0]
        src_parts.append((leaders[:, None] * length + columns[leaders, :prefix]).reshape(-1))
        dest[member_rows[:, :, None], columns[member_rows, :prefix]] = (
            offset + np.arange(len(members))[:, None, None] * prefix + np.arange(prefix)[None, None, :]
        )
        # Suffix tokens: every row, its own columns from `prefix` on.
        suffix_start = offset + len(members) * prefix
        src_parts.append((member_rows[:, :, None] * length + columns[member_rows, prefix:]).reshape(-1))
        slot = np.arange(len(members) * n).reshape(len(members), n)
        dest[member_rows[:, :, None], columns[member_rows, prefix:]] = (
            suffix_start + slot[:, :, None] * suffix + np.arange(suffix)
        )
        buckets.append(bucket)
        offset += bucket.tokens
    device = attention_mask.device
    flat = np.concatenate(src_parts)
    src = torch.from_numpy(flat).to(device)
    offsets = torch.from_numpy(flat % length - starts[flat // length]).to(device)
    mask = attention_mask.bool()
    # A query sees some key once its row has had a real token: the left padding's queries see none.
    sees_a_key = mask.cummax(dim=1).values.reshape(-1)[src]
    return PackedLayout(
        buckets=tuple(buckets),
        src=src,
        dest=torch.from_numpy(dest.reshape(-1)).to(device),
        token_mask=mask.reshape(-1)[src],
        rows=rows,
        length=length,
        blind_queries=None if bool(sees_a_key.all()) else ~sees_a_key,
        common=common,
        offsets=offsets,
    )
