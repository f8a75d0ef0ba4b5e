"""YAML loading that remembers where every value came from, so config errors can name file and line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

FieldPath = tuple[str | int, ...]


class ConfigError(ValueError):
    """A config or tenant file that cannot be used: says which file, which line, which field and why."""

    def __init__(self, file: str, line: int | None, field: str, reason: str) -> None:
        self.file = file
        self.line = line
        self.field = field
        self.reason = reason
        where = f"{file}:{line}" if line else file
        super().__init__(f"{where}: {field}: {reason}" if field else f"{where}: {reason}")


@dataclass(frozen=True, slots=True)
class YamlDoc:
    """A parsed YAML document plus the line of every mapping key and sequence item in it."""

    file: str
    data: Any
    path_to_line: dict[FieldPath, int]

    def line_of(self, path: FieldPath) -> int | None:
        """The line of ``path`` or of its nearest ancestor that has one."""
        for end in range(len(path), -1, -1):
            line = self.path_to_line.get(path[:end])
            if line is not None:
                return line
        return None

    def error(self, path: FieldPath, reason: str) -> ConfigError:
        return ConfigError(self.file, self.line_of(path), format_path(path), reason)


def format_path(path: FieldPath) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def load_yaml(path: Path) -> YamlDoc:
    """Parse ``path``; syntax errors become a ConfigError with the parser's line."""
    name = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(name, None, "", f"cannot read file: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(name, None, "", "file is not valid UTF-8") from None
    return parse_yaml(text, name)


def parse_yaml(text: str, name: str) -> YamlDoc:
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(name, line, "", f"invalid YAML: {problem}") from None
    path_to_line: dict[FieldPath, int] = {}
    if node is None:
        return YamlDoc(name, None, path_to_line)
    path_to_line[()] = node.start_mark.line + 1
    _index(node, (), path_to_line)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:  # composed but not constructible (e.g. an unknown tag)
        raise ConfigError(name, path_to_line[()], "", f"invalid YAML: {exc}") from None
    return YamlDoc(name, data, path_to_line)


def _index(node: yaml.Node, path: FieldPath, out: dict[FieldPath, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node.value)
            child = (*path, key)
            out[child] = key_node.start_mark.line + 1
            _index(value_node, child, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            child = (*path, i)
            out[child] = item.start_mark.line + 1
            _index(item, child, out)
