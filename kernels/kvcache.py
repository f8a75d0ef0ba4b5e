"""Paged KV memory with a radix-like prefix cache of whole prompt blocks.

Memory is counted in pages (``page_size`` tokens). A request holds private pages for the tokens it
computed itself, plus references to shared prefix blocks. A block is keyed by its chained id (the
block's own hash id folded with its parent's key), so a key names the whole prefix up to that block,
as a path in a radix tree does. Blocks nobody references stay cached until memory runs short; then
the least recently released go first, deepest block first, so a parent outlives its children.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def chain_block_keys(prefix_hash_ids: Sequence[int]) -> tuple[int, ...]:
    """Keys that name each leading block together with everything before it (deterministic)."""
    keys: list[int] = []
    parent = 0
    for hash_id in prefix_hash_ids:
        # Tuples of ints hash the same in every process (only str/bytes hashing is salted).
        parent = hash((parent, hash_id))
        keys.append(parent)
    return tuple(keys)


class KVCache:
    """Page accounting plus the shared-block cache; returns False/None when something does not fit."""

    __slots__ = (
        "num_pages",
        "page_size",
        "block_tokens",
        "block_pages",
        "enable_prefix_cache",
        "_num_used_pages",
        "_key_to_refs",
        "_unreferenced",
    )

    def __init__(self, num_pages: int, page_size: int, block_tokens: int, enable_prefix_cache: bool) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.block_tokens = block_tokens
        self.block_pages = -(-block_tokens // page_size)
        self.enable_prefix_cache = enable_prefix_cache
        self._num_used_pages = 0  # private pages plus every cached block, referenced or not
        self._key_to_refs: dict[int, int] = {}
        self._unreferenced: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first

    # --- pages -------------------------------------------------------------------------------------
    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size) if num_tokens > 0 else 0

    @property
    def num_free_pages(self) -> int:
        return self.num_pages - self._num_used_pages

    @property
    def num_evictable_pages(self) -> int:
        return len(self._unreferenced) * self.block_pages

    @property
    def num_available_pages(self) -> int:
        """Pages an allocation may obtain: free ones plus cached blocks nobody references."""
        return self.num_free_pages + self.num_evictable_pages

    @property
    def num_used_pages(self) -> int:
        return self._num_used_pages

    @property
    def num_cached_blocks(self) -> int:
        return len(self._key_to_refs)

    def allocate(self, num_pages: int) -> bool:
        """Take ``num_pages``, evicting unreferenced blocks as needed; False (and no change) if impossible."""
        if num_pages <= 0:
            return True
        if num_pages > self.num_available_pages:
            return False
        while self.num_free_pages < num_pages:
            key, _ = self._unreferenced.popitem(last=False)
            del self._key_to_refs[key]
            self._num_used_pages -= self.block_pages
        self._num_used_pages += num_pages
        return True

    def free(self, num_pages: int) -> None:
        self._num_used_pages -= num_pages
        assert self._num_used_pages >= 0, "freed more KV pages than were allocated"

    # --- prefix blocks -----------------------------------------------------------------------------
    def match(self, block_keys: Sequence[int], max_num_blocks: int) -> int:
        """How many leading blocks of ``block_keys`` are cached (at most ``max_num_blocks``)."""
        if not self.enable_prefix_cache:
            return 0
        num_matched = 0
        refs = self._key_to_refs
        for key in block_keys[:max_num_blocks]:
            if key not in refs:
                break
            num_matched += 1
        return num_matched

    def num_unreferenced_among(self, block_keys: Sequence[int]) -> int:
        """Of these cached blocks, how many nobody references (locking them takes them off the evictable list)."""
        return sum(1 for key in block_keys if self._key_to_refs.get(key) == 0)

    def lock(self, block_keys: Sequence[int]) -> None:
        """Reference cached blocks (all must be cached)."""
        for key in block_keys:
            refs = self._key_to_refs[key]
            if refs == 0:
                del self._unreferenced[key]
            self._key_to_refs[key] = refs + 1

    def release(self, block_keys: Sequence[int]) -> None:
        """Drop references; blocks that reach zero become evictable, deepest first in LRU order."""
        for key in reversed(block_keys):
            refs = self._key_to_refs[key] - 1
            self._key_to_refs[key] = refs
            if refs == 0:
                self._unreferenced[key] = None

    def share(self, block_keys: Sequence[int]) -> int:
        """Reference these blocks, caching the ones not cached yet; returns how many were shared.

        Stops at the first block that cannot get pages (the caller keeps the rest private).
        """
        if not self.enable_prefix_cache:
            return 0
        num_shared = 0
        for key in block_keys:
            if key in self._key_to_refs:
                self.lock((key,))
            elif self.allocate(self.block_pages):
                self._key_to_refs[key] = 1
            else:
                break
            num_shared += 1
        return num_shared
