"""Pairing rules: which prefills may feed which decodes (``GET/PUT /admin/pairing``). Pure.

Rules are on top of fingerprint compatibility (``workers.compatible``), never instead of it:

    {"by": "any"}                          every compatible pair (the default)
    {"by": "group"}                        a prefill feeds decodes of its own group
    {"by": "group", "links": {"a": ["a", "b"]}}
                                           a prefill of group a feeds decodes of groups a and b;
                                           a label not in links feeds its own label only
    {"by": "transfer", "links": {...}}     the same with the transfer backend as the label

A worker's group is the label given when it was added (``POST /admin/workers {"group"}``) or its
stage's ``--group`` (its ``/server_info`` ``group``); a worker with neither is in group ``default``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from router.fleet.workers import Worker, compatible, fingerprint_diff

BY = ("any", "group", "transfer")
DEFAULT_GROUP = "default"


@dataclass(frozen=True)
class PairingRules:
    by: str = "any"
    links: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        if self.by not in BY:
            raise ValueError(f"pairing 'by' must be one of {list(BY)}, got {self.by!r}")
        if self.links and self.by == "any":
            raise ValueError("pairing 'links' need 'by': 'group' or 'transfer'")
        for source, targets in self.links.items():
            if not _label(source) or not isinstance(targets, tuple) or not all(_label(t) for t in targets):
                raise ValueError(f"pairing 'links' maps a label to a list of labels, got {source!r}: {targets!r}")
        object.__setattr__(self, "links", MappingProxyType(dict(self.links)))

    @classmethod
    def from_json(cls, body: object) -> PairingRules:
        """Rules from a ``PUT /admin/pairing`` body; ValueError says what is wrong with it."""
        if not isinstance(body, dict) or set(body) - {"by", "links"}:
            raise ValueError('pairing rules are {"by": "any" | "group" | "transfer", "links"?: {label: [labels]}}')
        links = body.get("links") or {}
        if not isinstance(links, dict) or not all(isinstance(v, list) for v in links.values()):
            raise ValueError(f"pairing 'links' maps a label to a list of labels, got {links!r}")
        return cls(body.get("by", "any"), {k: tuple(v) for k, v in links.items()})

    def to_json(self) -> dict:
        return {"by": self.by, "links": {k: list(v) for k, v in self.links.items()}}

    def label(self, worker: Worker) -> str | None:
        """What the rules compare for ``worker`` (None under ``by: any``)."""
        if self.by == "group":
            return worker.group or DEFAULT_GROUP
        if self.by == "transfer":
            return (worker.fingerprint or {}).get("backend")
        return None

    def allows(self, prefill: Worker, decode: Worker) -> bool:
        if self.by == "any":
            return True
        source = self.label(prefill)
        return source is not None and self.label(decode) in self.links.get(source, (source,))

    def describe(self) -> str:
        if self.by == "any":
            return "any compatible pair"
        links = "; ".join(f"{k} -> {', '.join(v) or 'nothing'}" for k, v in self.links.items())
        return f"by {self.by}" + (f" (links: {links})" if links else " (each label feeds its own)")


def _label(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


class Pairing:
    """The router's pairing state: the rules (replaced whole by ``PUT /admin/pairing``) and the
    (prefill URL, decode URL) pairs a decode refused to let dial (``router.fleet.membership``), forgotten
    with a worker that leaves (``router.fleet.registry``)."""

    def __init__(self, rules: PairingRules | None = None) -> None:
        self.rules = rules or PairingRules()
        self.refused: set[tuple[str, str]] = set()

    def forget(self, worker: Worker) -> None:
        """``worker`` left the router: drop the refusals it was part of."""
        self.refused = {pair for pair in self.refused if worker.url not in pair}

    def pairable(self, prefill: Worker, decode: Worker) -> bool:
        """Compatible fingerprints, allowed by the rules, and dialable."""
        return (compatible(prefill, decode) and self.rules.allows(prefill, decode)
                and (prefill.url, decode.url) not in self.refused)

    def why_not(self, prefill: Worker, decode: Worker) -> str | None:
        """Why the pair is never built, or None if it may be."""
        if not compatible(prefill, decode):
            return "fingerprints differ: " + "; ".join(fingerprint_diff(prefill.fingerprint, decode.fingerprint))
        if not self.rules.allows(prefill, decode):
            return f"pairing rules ({self.rules.describe()})"
        if (prefill.url, decode.url) in self.refused:
            return "the decode did not register the prefill's bootstrap address (see the add answer)"
        return None
