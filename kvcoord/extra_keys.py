"""vLLM's extra keys: the request-level inputs (LoRA, multimodal items, cache salt, prompt embeddings)
that go into a block's hash next to its tokens, in the style of the engine's release (see
:mod:`kvcoord.hashing`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, Final, Literal, TypeAlias

ExtraKeyStyle: TypeAlias = Literal["untagged", "tagged", "dynamo"]

# Tags of the tagged style. One module-level object each, exactly like vLLM's literals: pickle
# writes the second "mm" of a block as a memo reference to the first, so identity matters.
_TAG_LORA: Final = "lora"
_TAG_MM: Final = "mm"
_TAG_SALT: Final = "cache_salt"
_TAG_EMBEDS: Final = "prompt_embeds"


@dataclass(frozen=True, slots=True)
class MultiModalItem:
    """A multimodal placeholder: its identifier (vLLM's mm hash) and token range in the prompt."""

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.identifier, str):
            raise ValueError(f"multimodal identifier must be a string, not {type(self.identifier).__name__}")
        for name, value, low in (("offset", self.offset, 0), ("length", self.length, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"multimodal {name} must be an integer >= {low}, not {value!r}")


@dataclass(frozen=True, slots=True)
class RequestKeys:
    """The request-level inputs of vLLM's extra keys.

    ``mm_items`` must be sorted by offset (vLLM assumes it). ``prompt_embeds_digests`` holds one
    digest per block (vLLM: SHA-256 of the block's embedding tensor), supplied by the caller.
    """

    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None
    mm_items: tuple[MultiModalItem, ...] = field(default=())
    prompt_embeds_digests: tuple[bytes, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("lora_name", "lora_path", "cache_salt"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, not {type(value).__name__}")
        items = tuple(self.mm_items)
        object.__setattr__(self, "mm_items", items)
        for item in items:
            if not isinstance(item, MultiModalItem):
                raise ValueError(f"mm_items must be MultiModalItem, not {type(item).__name__}")
        if any(a.offset > b.offset for a, b in pairwise(items)):
            raise ValueError("multimodal items must be sorted by offset, as vLLM requires")
        if self.prompt_embeds_digests is not None:
            digests = tuple(self.prompt_embeds_digests)
            if not all(type(d) is bytes for d in digests):
                raise ValueError("prompt-embeds digests must be bytes")
            object.__setattr__(self, "prompt_embeds_digests", digests)

    @property
    def empty(self) -> bool:
        """True when no block of the request gets extra keys."""
        return (
            self.lora_name is None
            and not self.cache_salt
            and not self.mm_items
            and self.prompt_embeds_digests is None
        )


def _mm_items_in_block(
    items: tuple[MultiModalItem, ...], start: int, end: int, idx: int
) -> tuple[list[MultiModalItem], int]:
    """The items overlapping tokens ``[start, end)``, walked as vLLM's ``_gen_mm_extra_hash_keys``.

    ``idx`` is the item to start from (-1: the last one, as vLLM does for blocks completed after
    the first hashing call); returns the overlapping items and the next start index.
    """
    found: list[MultiModalItem] = []
    if not items:
        return found, idx
    last = items[-1]
    if last.offset + last.length <= start:
        return found, idx
    if idx < 0:
        idx += len(items)
    while idx < len(items):
        item = items[idx]
        if end <= item.offset:
            break  # the block has not reached this item yet
        if start >= item.offset + item.length:
            idx += 1  # the block is past this item
            continue
        found.append(item)
        if end >= item.offset + item.length:
            idx += 1  # the item ends in this block; the next one may start here too
        else:
            break
    return found, idx


def extra_keys_range(
    keys: RequestKeys | None,
    style: ExtraKeyStyle,
    block_size: int,
    first_block: int,
    count: int,
    mm_idx: int,
) -> list[tuple[Any, ...] | None]:
    """Extra keys of blocks ``first_block .. first_block+count-1`` in ``style``, in vLLM's order.

    Order: LoRA, multimodal items, cache salt (first block only), prompt-embeds digest.
    Raises ``ValueError`` (before anything is hashed) when a block lacks its embeds digest.
    """
    if keys is None or keys.empty:
        return [None] * count
    tagged = style == "tagged"
    lora: list[Any] = []
    if keys.lora_name is not None:
        if tagged:
            if keys.lora_path is None:
                raise ValueError("tagged extra keys (vLLM >= 0.31) hash the LoRA path too: give lora_path")
            lora = [(_TAG_LORA, keys.lora_name, keys.lora_path)]
        else:
            lora = [keys.lora_name]
    digests = keys.prompt_embeds_digests
    if digests is not None and len(digests) < first_block + count:
        raise ValueError(
            f"{len(digests)} prompt-embeds digests for {first_block + count} full blocks: give one per block"
        )
    out: list[tuple[Any, ...] | None] = []
    for b in range(first_block, first_block + count):
        start = b * block_size
        items, mm_idx = _mm_items_in_block(keys.mm_items, start, start + block_size, mm_idx)
        if tagged:
            mm: list[Any] = [(_TAG_MM, it.identifier, it.offset - start) for it in items]
        else:
            mm = [(it.identifier, it.offset - start) for it in items]
        salt: list[Any] = []
        if start == 0 and keys.cache_salt:
            salt = [(_TAG_SALT, keys.cache_salt)] if tagged else [keys.cache_salt]
        embeds: list[Any] = []
        if digests is not None:
            embeds = [(_TAG_EMBEDS, digests[b])] if tagged else [digests[b]]
        extra = lora + mm + salt + embeds
        out.append(tuple(extra) if extra else None)
    return out


def block_extra_keys(
    keys: RequestKeys | None,
    block_size: int,
    num_tokens: int,
    *,
    style: ExtraKeyStyle = "untagged",
) -> list[tuple[Any, ...] | None]:
    """Per full block, the extra keys that enter the hash in ``style`` (None for a block without)."""
    return extra_keys_range(keys, style, block_size, 0, num_tokens // block_size, 0)


def published_extra_keys(
    keys: RequestKeys | None, block_size: int, num_tokens: int
) -> list[tuple[Any, ...] | None]:
    """Per full block, the extra keys as vLLM's ``BlockStored.extra_keys`` carry them.

    Every release publishes the untagged form (LoRA name, ``(mm_id, offset)`` pairs, cache salt
    on block 0, embeds digest), even those (>= 0.31) that hash the tagged form.
    """
    return block_extra_keys(keys, block_size, num_tokens, style="untagged")
