"""The classifier's part of a gateway config (``shapes``, ``default_shape``, ``classifier``) for the CLI.

The gateway validates the whole file with line numbers (gateway/config.py); this reader exists
because ``classifiers`` may not import ``gateway``, and ``polymorph classify --config`` needs only
these three keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from classifiers.shape import DOMAINS, ShapeRule, ShapeRules, default_shape_rules
from kernels.yamlsrc import ConfigError, format_path, load_yaml

_BOUND_KEYS = ("min_prompt_tokens", "max_prompt_tokens", "min_predicted_output", "max_predicted_output")
_SET_KEYS = ("tiers", "domains", "tenants")


class ClassifierConfigError(ValueError):
    """The config's shapes or classifier settings are invalid: ``path`` names the key, ``reason`` says why."""

    def __init__(self, path: tuple[str | int, ...], reason: str) -> None:
        self.path = path
        self.reason = reason
        where = format_path(path)
        super().__init__(f"{where}: {reason}" if where else reason)


@dataclass(frozen=True, slots=True)
class ClassifierConfig:
    model: str
    tokenizer: str | None
    rules: ShapeRules


def _name_set(where: tuple[str | int, ...], value: object, allowed: tuple[str, ...] | None) -> frozenset[str]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ClassifierConfigError(where, "must be a list of names")
    for i, item in enumerate(value):
        if allowed is not None and item not in allowed:
            raise ClassifierConfigError((*where, i), f"{item!r} is not one of: {', '.join(allowed)}")
    return frozenset(value)


def _rule(index: int, body: object) -> ShapeRule:
    where: tuple[str | int, ...] = ("shapes", index)
    if not isinstance(body, dict):
        raise ClassifierConfigError(where, "must be a mapping")
    for key in body:
        if key not in {"name", *_SET_KEYS, *_BOUND_KEYS}:
            raise ClassifierConfigError((*where, key), f"unknown field (expected one of: name, {', '.join(_SET_KEYS + _BOUND_KEYS)})")
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise ClassifierConfigError((*where, "name"), "every shape needs a name")
    bounds: dict[str, int | None] = {}
    for key in _BOUND_KEYS:
        value = body.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ClassifierConfigError((*where, key), f"must be a non-negative integer, not {value!r}")
        bounds[key] = value
    sets = {
        key: _name_set((*where, key), body[key], DOMAINS if key == "domains" else None) if key in body else None
        for key in _SET_KEYS
    }
    return ShapeRule(
        name=name, tiers=sets["tiers"], domains=sets["domains"], tenants=sets["tenants"],
        min_prompt_tokens=bounds["min_prompt_tokens"], max_prompt_tokens=bounds["max_prompt_tokens"],
        min_predicted_output=bounds["min_predicted_output"], max_predicted_output=bounds["max_predicted_output"],
    )


def rules_from_mapping(data: dict[str, Any]) -> ShapeRules:
    """ShapeRules from a config mapping's ``shapes`` and ``default_shape`` (defaults when absent)."""
    raw = data.get("shapes")
    if raw is None:
        return default_shape_rules()
    if not isinstance(raw, list) or not raw:
        raise ClassifierConfigError(("shapes",), "must be a non-empty list of shape rules")
    rules = tuple(_rule(i, body) for i, body in enumerate(raw))
    default = data.get("default_shape", rules[-1].name)
    if not isinstance(default, str) or not default:
        raise ClassifierConfigError(("default_shape",), "must be a shape name")
    return ShapeRules(rules=rules, default=default)


def load_classifier_config(path: Path | None) -> ClassifierConfig:
    """The classifier settings of a gateway config file, or the defaults when ``path`` is None."""
    if path is None:
        return ClassifierConfig("builtin", None, default_shape_rules())
    try:
        data = load_yaml(path).data or {}
    except ConfigError as exc:  # unreadable, invalid YAML, or a key given twice: file and line
        raise ClassifierConfigError((), str(exc)) from None
    if not isinstance(data, dict):
        raise ClassifierConfigError((), f"{path}: the config must be a YAML mapping")
    settings = data.get("classifier") or {}
    if not isinstance(settings, dict):
        raise ClassifierConfigError(("classifier",), "must be a mapping with model and tokenizer")
    model, tokenizer = settings.get("model", "builtin") or "builtin", settings.get("tokenizer")
    if not isinstance(model, str) or (tokenizer is not None and not isinstance(tokenizer, str)):
        raise ClassifierConfigError(("classifier",), "model and tokenizer must be strings")
    # relative paths are relative to the config file, as the gateway reads them
    if model != "builtin":
        model = str((path.parent / model).resolve())
    if tokenizer is not None:
        tokenizer = str((path.parent / tokenizer).resolve())
    return ClassifierConfig(model, tokenizer, rules_from_mapping(data))
