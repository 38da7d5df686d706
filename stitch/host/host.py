"""Plugin discovery and the registries: the core owns every ``register`` callback and stamps each entry."""

from __future__ import annotations

import importlib.metadata
import os
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pluggy

from stitch import __version__
from stitch.plugins import hookspecs
from stitch.plugins.hookspecs import HOOKS

ENTRY_POINT_GROUP = "stitch"
BUILTIN_NAME = "stitch"

# What a plugin distribution declares it registers, per registry kind, so that a miss can name the distribution
# to install without importing anything: ``[project.entry-points."stitch.models"] "qwen3.5-4b" = "stitch_qwen"``.
PROVIDES_GROUP = ENTRY_POINT_GROUP + ".{kind}"
# A source checkout keeps the first-party plugins' packaging here (read when a plugin is not installed at all).
CHECKOUT_PLUGINS = Path(__file__).resolve().parents[2] / "plugins"


class PluginError(RuntimeError):
    """A plugin could not be loaded or registered something invalid."""


class RegistryLookupError(KeyError):
    """A name is in no registry; the message says what is available and what to install."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


@dataclass(frozen=True)
class Registration:
    kind: str
    name: str
    spec: Any
    plugin: str


@dataclass
class PluginInfo:
    name: str
    distribution: str | None
    version: str | None
    hooks: list[str] = field(default_factory=list)
    builtin: bool = False

    def as_dict(self, registrations: Iterable[Registration]) -> dict[str, Any]:
        registered: dict[str, list[str]] = {}
        for reg in registrations:
            if reg.plugin == self.name:
                registered.setdefault(reg.kind, []).append(reg.name)
        return {
            "name": self.distribution or self.name,
            "entry_point": self.name,
            "version": self.version,
            "hooks": sorted(self.hooks),
            "registered": {k: sorted(v) for k, v in sorted(registered.items())},
            "builtin": self.builtin,
        }


@dataclass(frozen=True)
class PluginFailure:
    name: str
    distribution: str | None
    error: str


@dataclass(frozen=True)
class Provider:
    """A distribution that declares (in its packaging metadata) that it registers a name."""

    distribution: str
    installed: bool


def declared_providers(kind: str, name: str) -> list[Provider]:
    """The distributions whose metadata declares ``name`` in registry ``kind``: installed ones (entry-point group
    ``stitch.KIND``), then first-party plugins of a source checkout (``plugins/*/pyproject.toml``)."""
    group = PROVIDES_GROUP.format(kind=kind)
    found: dict[str, Provider] = {}
    for ep in importlib.metadata.entry_points(group=group):
        if ep.name == name and ep.dist is not None:
            found.setdefault(ep.dist.name, Provider(ep.dist.name, installed=True))
    # only in a source checkout (the plugins' packaging beside the core's pyproject), never in site-packages
    checkout = (CHECKOUT_PLUGINS.parent / "pyproject.toml").is_file()
    for pyproject in sorted(CHECKOUT_PLUGINS.glob("*/pyproject.toml")) if checkout else []:
        project = tomllib.loads(pyproject.read_text()).get("project", {})
        dist = project.get("name")
        if dist and name in project.get("entry-points", {}).get(group, {}) and dist not in found:
            found[dist] = Provider(dist, installed=_installed(dist))
    return list(found.values())


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _names_from_env(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


class PluginHost:
    """Loaded plugins and what they registered."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager("stitch")
        self.pm.add_hookspecs(hookspecs)
        self.plugins: dict[str, PluginInfo] = {}
        self.failures: list[PluginFailure] = []
        self.filtered: list[str] = []  # distributions (or entry points) left out by the env allow/block lists
        self._registries: dict[str, dict[str, Registration]] = {kind: {} for kind in HOOKS}

    # -- loading -----------------------------------------------------------------------------------
    def _add(self, obj: object, info: PluginInfo) -> None:
        self.pm.register(obj, name=info.name)
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            self.pm.unregister(name=info.name)
            raise PluginError(
                f"plugin {info.distribution or info.name!r} implements a hook stitch does not define: {exc}. "
                f"Known hooks: {', '.join(sorted(h.name for h in HOOKS.values()))}"
            ) from exc
        info.hooks = [impl_name for impl_name in self._hook_names() if self._implements(info.name, impl_name)]
        self.plugins[info.name] = info

    def _hook_names(self) -> list[str]:
        return [hook.name for hook in HOOKS.values()]

    def _implements(self, plugin_name: str, hook: str) -> bool:
        caller = getattr(self.pm.hook, hook)
        return any(impl.plugin_name == plugin_name for impl in caller.get_hookimpls())

    def _collect(self) -> None:
        for kind, declared in HOOKS.items():
            hook = declared.name
            for impl in getattr(self.pm.hook, hook).get_hookimpls():
                plugin = impl.plugin_name

                def register(spec: Any, *, _plugin: str = plugin, _kind: str = kind) -> None:
                    self._register(_kind, spec, _plugin)

                try:
                    impl.function(register=register)
                except PluginError:
                    raise
                except Exception as exc:  # a plugin's own bug: name it, keep the others
                    info = self.plugins.pop(plugin, None)
                    self.pm.unregister(name=plugin)
                    self._drop(plugin)
                    self.failures.append(
                        PluginFailure(plugin, info.distribution if info else None,
                                      f"{hook} raised {type(exc).__name__}: {exc}")
                    )

    def _drop(self, plugin: str) -> None:
        for registry in self._registries.values():
            for name in [n for n, r in registry.items() if r.plugin == plugin]:
                del registry[name]

    def _register(self, kind: str, spec: Any, plugin: str) -> None:
        spec_type, noun = HOOKS[kind].spec_type, HOOKS[kind].noun
        if not isinstance(spec, spec_type):
            raise PluginError(
                f"plugin {self.label(plugin)!r} passed a {type(spec).__name__} to the {noun} registry; "
                f"expected a {spec_type.__name__}"
            )
        registry = self._registries[kind]
        if spec.name in registry:
            first = registry[spec.name].plugin
            raise PluginError(
                f"duplicate {noun} {spec.name!r}: registered by plugin {self.label(first)!r} "
                f"and again by plugin {self.label(plugin)!r}; disable one with STITCH_DISABLED_PLUGINS"
            )
        registry[spec.name] = Registration(kind, spec.name, spec, plugin)

    def label(self, plugin: str) -> str:
        """A plugin's distribution name where it has one, else its entry-point name."""
        info = self.plugins.get(plugin)
        return (info.distribution or info.name) if info else plugin

    # -- queries -----------------------------------------------------------------------------------
    def registrations(self, kind: str | None = None) -> list[Registration]:
        kinds = [kind] if kind else list(HOOKS)
        return [reg for k in kinds for reg in self._registries[k].values()]

    def names(self, kind: str) -> list[str]:
        return sorted(self._registries[kind])

    def get(self, kind: str, name: str) -> Any:
        """The spec registered as ``name``; a miss names the plugin to install or the one that failed."""
        registry = self._registries[kind]
        if name in registry:
            return registry[name].spec
        message = f"no {HOOKS[kind].noun} named {name!r}."
        for provider in declared_providers(kind, name):
            message += " " + self._why_missing(provider)
            break
        available = ", ".join(self.names(kind)) or "none"
        raise RegistryLookupError(f"{message} Available {kind.replace('_', ' ')}: {available}.")

    def _why_missing(self, provider: Provider) -> str:
        dist = provider.distribution
        failed = [f for f in self.failures if dist in (f.distribution, f.name)]
        if failed:
            return f"It comes from the plugin {dist!r}, which failed to load: {failed[0].error}"
        if any(info.distribution == dist for info in self.plugins.values()):
            return (f"The plugin {dist!r} declares it in its metadata but did not register it: a bug in that "
                    f"plugin (its entry points and its register_* hooks disagree).")
        if dist in self.filtered:
            filters = {var: os.environ[var] for var in ("STITCH_LOAD_PLUGINS", "STITCH_DISABLED_PLUGINS")
                       if var in os.environ}
            shown = ", ".join(f"{var}={value!r}" for var, value in filters.items())
            return f"It comes from the plugin {dist!r}, which is installed but left out by {shown}."
        if provider.installed:
            return (f"It comes from the plugin {dist!r}, which is installed but exposes no entry point in the "
                    f"{ENTRY_POINT_GROUP!r} group: reinstall it.")
        return (f"It comes from the plugin {dist!r}, which is not installed: pip install ./plugins/{dist} "
                f"(from a stitch checkout) or pip install {dist}.")

    def describe(self, include_builtins: bool = False) -> list[dict[str, Any]]:
        regs = self.registrations()
        return [
            info.as_dict(regs)
            for info in self.plugins.values()
            if include_builtins or not info.builtin
        ]


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def load_plugins(
    extra: Mapping[str, object] | None = None,
    entry_points: Iterable[importlib.metadata.EntryPoint] | None = None,
) -> PluginHost:
    """Build a PluginHost: built-ins, then installed entry points (filtered by env), then ``extra`` objects.

    ``STITCH_LOAD_PLUGINS=a,b`` loads only those plugins; ``STITCH_DISABLED_PLUGINS=a`` skips them. Names
    match either the entry-point name or the distribution name. A plugin that fails to import is recorded
    in ``host.failures`` with its error; the others still load.
    """
    from stitch.host import builtins  # deferred: stitch --help skips torch (the built-ins import it)

    host = PluginHost()
    host._add(builtins, PluginInfo(BUILTIN_NAME, "stitch-lm", __version__, builtin=True))
    allow = _names_from_env("STITCH_LOAD_PLUGINS")
    deny = _names_from_env("STITCH_DISABLED_PLUGINS") or set()
    for ep in _entry_points() if entry_points is None else entry_points:
        dist = ep.dist.name if ep.dist is not None else None
        version = ep.dist.version if ep.dist is not None else None
        names = {ep.name, dist} - {None}
        if (allow is not None and not names & allow) or names & deny:
            host.filtered.append(dist or ep.name)
            continue
        if ep.name in host.plugins:
            raise PluginError(f"two plugins use the entry-point name {ep.name!r} (one is {dist!r})")
        try:
            module = ep.load()
        except Exception as exc:
            host.failures.append(PluginFailure(ep.name, dist, f"{type(exc).__name__}: {exc}"))
            continue
        host._add(module, PluginInfo(ep.name, dist, version))
    for name, obj in (extra or {}).items():
        host._add(obj, PluginInfo(name, None, None))
    host._collect()
    return host


_HOST: PluginHost | None = None


def get_host() -> PluginHost:
    """The process-wide PluginHost, loaded on first use."""
    global _HOST
    if _HOST is None:
        _HOST = load_plugins()
    return _HOST


def reset_host() -> None:
    global _HOST
    _HOST = None
