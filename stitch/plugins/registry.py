"""What a layer below the host sees of the registries: a lookup by kind and name (``stitch.host`` fills it)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


class Registry(Protocol):
    """The loaded registrations: ``get(kind, name)`` returns the spec registered as ``name`` in registry ``kind``
    (``"models"``, ``"encoders"``, ``"projectors"``, ``"rollout_engines"``...) and raises naming what is available
    and what to install on a miss; ``names(kind)`` lists a registry."""

    def get(self, kind: str, name: str) -> Any: ...

    def names(self, kind: str) -> list[str]: ...


@dataclass(frozen=True)
class SpecTable:
    """A ``Registry`` over specs already looked up: what a process without the plugin host (a Ray rollout worker)
    is shipped. Pickled with its specs (their factories are module-level functions or classes)."""

    specs: Mapping[tuple[str, str], Any] = field(default_factory=dict)

    @classmethod
    def pick(cls, registry: Registry, wanted: Iterable[tuple[str, str]]) -> SpecTable:
        """The specs ``(kind, name)`` of ``registry``; a miss raises as ``registry.get`` does."""
        return cls({(kind, name): registry.get(kind, name) for kind, name in wanted})

    def get(self, kind: str, name: str) -> Any:
        if (kind, name) not in self.specs:
            raise KeyError(f"no {kind} entry {name!r} was shipped; shipped: {sorted(self.specs)}")
        return self.specs[(kind, name)]

    def names(self, kind: str) -> list[str]:
        return sorted(name for k, name in self.specs if k == kind)
