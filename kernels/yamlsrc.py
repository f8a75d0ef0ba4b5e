"""YAML loading that remembers where every value came from, so config errors can name file and line, and
the typed field reader every config section is parsed with.

Every YAML file Polymorph reads goes through ``parse_yaml``: the gateway config and tenant files, the
catalogs, scenarios, SLO and rules files, so none of them drops a key given twice. It sits in ``kernels``,
the bottom package, so that every other package may import it."""

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
    """Parse ``text`` (read from ``name``); what YAML cannot say without ambiguity is refused with its
    line: a key given twice in one mapping (PyYAML keeps the last silently, so a second ``pools:``
    block would drop the first) and nesting too deep for the parser."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(name, line, "", f"invalid YAML: {problem}") from None
    except RecursionError:
        raise ConfigError(name, None, "", "invalid YAML: nested too deeply") from None
    path_to_line: dict[FieldPath, int] = {}
    if node is None:
        return YamlDoc(name, None, path_to_line)
    path_to_line[()] = node.start_mark.line + 1
    _index(name, node, path_to_line)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:  # composed but not constructible (e.g. an unknown tag)
        raise ConfigError(name, path_to_line[()], "", f"invalid YAML: {exc}") from None
    except RecursionError:
        raise ConfigError(name, path_to_line[()], "", "invalid YAML: nested too deeply") from None
    return YamlDoc(name, data, path_to_line)


def _index(name: str, root: yaml.Node, out: dict[FieldPath, int]) -> None:
    """The line of every mapping key and sequence item under ``root``. A node is indexed once: one an
    alias reaches again (a shared or a recursive anchor) keeps the lines of where it was written, and
    paths through the alias fall back to the alias's own line (``YamlDoc.line_of``)."""
    seen: set[int] = set()
    todo: list[tuple[yaml.Node, FieldPath]] = [(root, ())]
    while todo:
        node, path = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            key_to_line: dict[str, int] = {}
            for key_node, value_node in node.value:
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node.value)
                line = key_node.start_mark.line + 1
                if key in key_to_line and key != "<<":  # a merge key may be given more than once
                    raise ConfigError(name, line, format_path((*path, key)), f"duplicate key (first given on line {key_to_line[key]})")
                key_to_line[key] = line
                out[(*path, key)] = line
                todo.append((value_node, (*path, key)))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                out[(*path, i)] = item.start_mark.line + 1
                todo.append((item, (*path, i)))


class FieldReader:
    """Reads typed fields out of one mapping of a YAML document, reporting errors with lines."""

    def __init__(self, doc: YamlDoc, path: FieldPath, data: object, known: set[str]) -> None:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise doc.error(path, f"must be a mapping, not {type(data).__name__}")
        for key in data:
            if key not in known:
                raise doc.error((*path, key), f"unknown field (expected one of: {', '.join(sorted(known))})")
        self.doc, self.path, self.data = doc, path, data

    def error(self, key: str | int, reason: str) -> ConfigError:
        return self.doc.error((*self.path, key), reason)

    def number(self, key: str, default: float, *, lo: float = 0.0, hi: float = float("inf"), integer: bool = False) -> Any:
        value = self.data.get(key, default)
        kinds = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise self.error(key, f"must be {'an integer' if integer else 'a number'}, not {value!r}")
        if not lo <= value <= hi:
            raise self.error(key, f"must be between {lo:g} and {hi:g}, not {value!r}")
        return value

    def text(self, key: str, default: str | None) -> str | None:
        value = self.data.get(key, default)
        if value is not None and not isinstance(value, str):
            raise self.error(key, f"must be a string, not {value!r}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, not {value!r}")
        return value

    def names(self, key: str, default: list[str] | None, allowed: tuple[str, ...] | None = None) -> list[str] | None:
        value = self.data.get(key, default)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.error(key, "must be a list of strings")
        if allowed is not None:
            for i, v in enumerate(value):
                if v not in allowed:
                    raise self.doc.error((*self.path, key, i), f"{v!r} is not one of: {', '.join(allowed)}")
        return value
