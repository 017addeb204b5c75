"""The key-value interface every coordination store offers (embedded :mod:`.store`, :mod:`.etcd`),
and the error a store raises when it cannot be reached within its bound."""
from __future__ import annotations

from typing import Optional, Protocol


class StoreUnavailable(RuntimeError):
    """The store did not answer within its timeout (the message names the store and the limit)."""


class KV(Protocol):
    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> Optional[str]: ...
    def compare_set(self, key: str, expected: str, desired: str) -> str: ...
    def delete(self, key: str) -> None: ...
