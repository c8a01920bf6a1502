"""The router's approximate picture of what each worker has in its prefix cache. Pure: no I/O, no clock.

The router does not tokenize. A chat body becomes its routing units (``chat_units``; a completions
body: its text prompt's pieces, ``prompt_units``): each message in
order, as its role and its text cut into pieces of at most ``CHUNK_CHARS`` characters, each image (and
each video) one unit named by its content key (epd: the ``image_ref`` / ``video_ref`` key; other modes: a
hash of its URL, a ``data:`` URL by the time a policy reads it; of a long one, its length and its first
and last ``URL_SAMPLE`` characters, so that the event loop never hashes megabytes: a routing key need
not be exact). A message is cut on its own, so a later turn of a conversation, which repeats every
earlier message, starts with exactly the earlier request's units. A text unit weighs its characters,
an image ``IMAGE_CHARS``, a video its planned tokens as characters (``chat_units``' ``weights``, from
``router.plan.videos.RefVideo.weight``; ``IMAGE_CHARS`` when the router planned none).

A ``Prefix`` holds the units as a hash chain: node i is the hash of node i-1 and unit i, so one node
names the whole prefix up to it (as the engine names its full KV blocks). A ``PrefixTree`` is the set of
nodes one worker was sent, at most ``max_nodes``, least recently used evicted first. ``insert`` refreshes
a prefix from its last node to its first, so a node is always more recent than its descendants:
eviction takes leaves first, and a node kept means its whole prefix is kept.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from dataclasses import dataclass

CHUNK_CHARS = 64  # text per unit: about 16 tokens, one KV block of the engine's default --block-size
IMAGE_CHARS = 1024  # an image's weight: about the text of the 256 tokens a small image takes
URL_SAMPLE = 32 << 10  # characters hashed at each end of a long image URL
_MESSAGE = "\x1e"  # starts each message's first unit (no client text is read as a message boundary)
_IMAGE = "\x1d"  # starts an image's unit
_NONE: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True)
class Prefix:
    nodes: tuple[int, ...]  # the hash chain, one node per unit
    weights: tuple[int, ...]  # the weight of the units up to each node, itself included

    @classmethod
    def of(cls, units: Iterable[tuple[str, int]]) -> Prefix:
        """The chain of ``units`` (text, weight), in order."""
        nodes, weights, node, weight = [], [], 0, 0
        for text, unit_weight in units:
            node = hash((node, text))
            weight += unit_weight
            nodes.append(node)
            weights.append(weight)
        return cls(tuple(nodes), tuple(weights))

    @property
    def total(self) -> int:
        return self.weights[-1] if self.weights else 0

    def weight(self, matched: int) -> int:
        """The weight of the first ``matched`` units."""
        return self.weights[matched - 1] if matched else 0


class PrefixTree:
    """The prefixes one worker was sent, at most ``max_nodes`` nodes."""

    def __init__(self, max_nodes: int) -> None:
        if max_nodes <= 0:
            raise ValueError(f"a prefix tree needs max_nodes > 0, got {max_nodes}")
        self.max_nodes = max_nodes
        self._nodes: OrderedDict[int, None] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._nodes)

    def match(self, prefix: Prefix) -> int:
        """How many of ``prefix``'s leading units this tree holds. Changes nothing."""
        count = 0
        for node in prefix.nodes:
            if node not in self._nodes:
                break
            count += 1
        return count

    def insert(self, prefix: Prefix) -> None:
        """Hold ``prefix`` (refreshed last node first, so that its first is the most recent), then
        evict least recently used nodes down to ``max_nodes``."""
        nodes = self._nodes
        for node in reversed(prefix.nodes):
            if node in nodes:
                nodes.move_to_end(node)
            else:
                nodes[node] = None
        while len(nodes) > self.max_nodes:
            nodes.popitem(last=False)


def chat_units(body: dict, weights: Mapping[str, int] = _NONE) -> list[tuple[str, int]]:
    """The routing units (text, weight) of a chat body, in order (see the module doc). Malformed
    messages and parts are skipped: the stage's schema check answers them. ``weights``: a unit's
    weight by its content key, where it is not ``IMAGE_CHARS`` (a video's)."""
    units: list[tuple[str, int]] = []
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        if not isinstance(message, dict):
            continue
        text = f"{_MESSAGE}{message.get('role')}\n"
        content = message.get("content")
        for part in [content] if isinstance(content, str) else content if isinstance(content, list) else ():
            if isinstance(part, str):
                text += part
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                text += part["text"]
            elif (key := image_key(part)) is not None:
                units += _chunks(text)
                units.append((_IMAGE + key, weights.get(key, IMAGE_CHARS)))
                text = ""
        units += _chunks(text)
    return units


def prompt_units(body: dict) -> list[tuple[str, int]]:
    """The routing units of a ``/v1/completions`` body: its (first) text prompt cut into pieces; none
    for token ids (the router does not tokenize, nor detokenize)."""
    prompt = body.get("prompt")
    first = prompt[0] if isinstance(prompt, list) and prompt else prompt
    return _chunks(first) if isinstance(first, str) else []


def image_key(part: object) -> str | None:
    """An image (or video) part's content key: an ``image_ref``'s (``video_ref``'s) own, a hash of an
    ``image_url``'s (``video_url``'s) URL; None for any other part."""
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    if kind in ("image_ref", "video_ref"):
        ref = part.get(kind)
        key = ref.get("key") if isinstance(ref, dict) else None
        return key if isinstance(key, str) else None
    if kind in ("image_url", "video_url"):
        field = part.get(kind)
        url = field.get("url") if isinstance(field, dict) else field
        return url_key(url) if isinstance(url, str) else None
    return None


def url_key(url: str) -> str:
    """A URL's content key (long ones sampled: see the module doc)."""
    sample = url if len(url) <= 2 * URL_SAMPLE else f"{len(url)}:{url[:URL_SAMPLE]}:{url[-URL_SAMPLE:]}"
    return hashlib.blake2b(sample.encode(), digest_size=16).hexdigest()


def _chunks(text: str) -> list[tuple[str, int]]:
    return [(text[i:i + CHUNK_CHARS], len(text[i:i + CHUNK_CHARS])) for i in range(0, len(text), CHUNK_CHARS)]
