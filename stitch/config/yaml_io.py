"""Reading a recipe's YAML file: UTF-8 text only, safe tags only, and a key given twice in one mapping refused with
both line numbers (PyYAML's safe loader keeps the last silently, so ``name: a`` then ``name: b`` would run as b)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class RecipeFileError(ValueError):
    """A recipe file cannot be read as a YAML mapping; the message names the file, the line and the key."""


class DuplicateKey(yaml.YAMLError):
    """A mapping repeats a key; the message holds both line numbers."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key repeated within one mapping, naming both of its lines."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.setdefault(key, line)
            except TypeError:  # an unhashable key: the safe constructor refuses it with its own message
                continue
            if first != line:
                raise DuplicateKey(f"key {key!r} appears twice in one mapping, on line {first} and on line {line}; "
                                   f"keep one")
        return super().construct_mapping(node, deep=deep)


def load_yaml_text(text: str, where: str) -> Any:
    """``text`` parsed with the safe loader, duplicate keys refused; ``where`` names the source in errors."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except DuplicateKey as exc:
        raise RecipeFileError(f"{where}: {exc}") from None
    except yaml.YAMLError as exc:  # its marks name the line and column; the text was read from ``where``
        detail = " ".join(str(exc).replace('in "<unicode string>", ', "").split())
        raise RecipeFileError(f"{where} is not valid YAML: {detail}") from None


def read_yaml_file(path: Path) -> Any:
    """The YAML document in ``path``: its bytes must be UTF-8 text (a binary file is refused naming it and the
    offset of the first bad byte), and its mappings must not repeat a key."""
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeFileError(
            f"recipe {str(path)!r} is not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start} "
            f"({exc.reason}); a recipe is a YAML text file") from None
    return load_yaml_text(text, f"recipe {str(path)!r}")
