"""Settings of one ``EmbeddingCache``, validated at construction (messages name the CLI flag).

Every process that shares a Redis should use the same ``budget_bytes`` and ``ttl_s``: each write
enforces the budget and TTL of the process that makes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

MIB = 1 << 20
DEFAULT_BUDGET_MIB = 1024.0  # --cache-budget-mib default, of every process that writes
DEFAULT_TTL_S = 3600.0  # --cache-ttl-s default, of every process that writes or touches entries


@dataclass(frozen=True)
class CacheConfig:
    """``url``: redis:// or unix:// URL (``--redis-url``).
    ``budget_bytes``: the most bytes of entries (metadata + payload) kept; LRU entries are evicted
    past it (``--cache-budget-mib``). ``ttl_s``: an entry unused this long is dropped (``--cache-ttl-s``).
    ``op_timeout_s``: the deadline of each Redis call (``--cache-op-timeout-s``).
    ``max_connections``: the connection pool's size. ``claim_check_s``: how often a waiter re-checks
    that its key is still claimed (the longest it sits on after an encoder dies without a word).
    """

    url: str
    budget_bytes: int
    ttl_s: float
    op_timeout_s: float = 2.0
    max_connections: int = 32
    claim_check_s: float = 0.5

    def __post_init__(self) -> None:
        if urlsplit(self.url).scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"--redis-url must start with redis://, rediss:// or unix://, got {self.safe_url!r}")
        if self.budget_bytes < 1:
            raise ValueError(f"--cache-budget-mib must be positive, got {self.budget_bytes / MIB:g} MiB")
        if not self.ttl_s > 0:
            raise ValueError(f"--cache-ttl-s must be positive, got {self.ttl_s}")
        if not self.op_timeout_s > 0:
            raise ValueError(f"--cache-op-timeout-s must be positive, got {self.op_timeout_s}")
        if self.max_connections < 2:
            raise ValueError(f"max_connections must be at least 2 (one is held by pub/sub), got {self.max_connections}")
        if not self.claim_check_s > 0:
            raise ValueError(f"--claim-check-s must be positive, got {self.claim_check_s}")

    @property
    def ttl_ms(self) -> int:
        return max(1, round(self.ttl_s * 1000))

    @property
    def safe_url(self) -> str:
        """``url`` with any password replaced by ``***`` (for messages and logs)."""
        parts = urlsplit(self.url)
        if parts.password is None:
            return self.url
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
        return urlunsplit(parts._replace(netloc=netloc))
