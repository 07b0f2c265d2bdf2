"""Constraints on what a request may generate: a JSON schema, a regex, a choice or a grammar.

``StructuredOutputsParams`` has vLLM's name and fields. Exactly one of ``json``, ``regex``,
``choice`` and ``grammar`` is set:

- ``json``: a JSON schema as a dict (or its JSON text), or a pydantic model class (its
  ``model_json_schema()``). Output is compact JSON (``", "`` and ``": "`` separators, no
  other whitespace), so no tokens go to indentation and a small model cannot wander in
  whitespace.
- ``regex``: the whole output matches this regular expression.
- ``choice``: the output is exactly one of these strings.
- ``grammar``: an EBNF grammar (xgrammar's dialect, GBNF-like) whose ``root`` rule the
  output matches.

The constraint is checked when the object is built (a bad schema, regex or grammar raises
``ValueError``); the engine compiles it once per distinct constraint and masks the logits of
every step with it (see :mod:`dfllm.engine.structured`).
"""

from __future__ import annotations

import json as _json
import re
from dataclasses import dataclass

KINDS = ("json", "regex", "choice", "grammar")


@dataclass(eq=False)
class StructuredOutputsParams:
    """One constraint on a request's output; exactly one field is set."""

    json: dict | str | type | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("structured_outputs: set exactly one of json, regex, choice and grammar"
                             f" (got {given or 'none'})")
        if self.json is not None:
            self.json = _schema_dict(self.json)
        elif self.regex is not None:
            if not isinstance(self.regex, str) or not self.regex:
                raise ValueError(f"structured_outputs.regex must be a non-empty str, got {self.regex!r}")
        elif self.choice is not None:
            if isinstance(self.choice, str) or not hasattr(self.choice, "__iter__"):
                raise ValueError(f"structured_outputs.choice must be a list of strings, got {self.choice!r}")
            self.choice = list(self.choice)
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")
            if len(set(self.choice)) != len(self.choice):
                raise ValueError(f"structured_outputs.choice has duplicates: {self.choice!r}")
        elif not isinstance(self.grammar, str) or not self.grammar.strip():
            raise ValueError(f"structured_outputs.grammar must be a non-empty str, got {self.grammar!r}")
        self._check_compiles()

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "regex", "choice" or "grammar"."""
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def key(self) -> tuple[str, str]:
        """A canonical, hashable form: equal constraints share one compiled grammar.

        Key order is kept (not sorted): a schema's ``properties`` order is the order of the
        fields in the output.
        """
        value = getattr(self, self.kind)
        if self.kind in ("json", "choice"):
            value = _json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        return self.kind, value

    def __eq__(self, other) -> bool:
        return isinstance(other, StructuredOutputsParams) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"StructuredOutputsParams({self.kind}={getattr(self, self.kind)!r})"

    @classmethod
    def from_dict(cls, values: dict) -> StructuredOutputsParams:
        """Build from a plain dict such as ``{"json": {...}}``; unknown keys raise."""
        unknown = sorted(set(values) - set(KINDS))
        if unknown:
            raise ValueError(f"structured_outputs: unknown field(s) {unknown}; expected one of {list(KINDS)}")
        return cls(**{k: v for k, v in values.items() if v is not None})

    def to_ebnf(self) -> str | None:
        """The grammar of a ``choice`` (each option a literal); None for the other kinds."""
        if self.choice is None:
            return None
        return "root ::= " + " | ".join(_json.dumps(c, ensure_ascii=False) for c in self.choice)

    def _check_compiles(self) -> None:
        """Build the tokenizer-independent grammar now, so a bad constraint raises here."""
        import xgrammar as xgr

        try:
            if self.json is not None:
                xgr.Grammar.from_json_schema(_json.dumps(self.json), any_whitespace=False)
            elif self.regex is not None:
                xgr.Grammar.from_regex(self.regex)
            else:
                xgr.Grammar.from_ebnf(self.grammar if self.grammar is not None else self.to_ebnf())
        except RuntimeError as exc:  # xgrammar's parse errors
            message = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(exc).strip()) or repr(exc)
            raise ValueError(f"structured_outputs.{self.kind}: invalid {self.kind}: {message}") from None


def _schema_dict(schema) -> dict:
    """A JSON schema as a dict, from a dict, JSON text, or a pydantic model class."""
    if isinstance(schema, type):
        dump = getattr(schema, "model_json_schema", None)
        if dump is None:
            raise ValueError(f"structured_outputs.json: {schema.__name__} is not a pydantic model class; "
                             "pass a JSON schema dict or a pydantic BaseModel subclass")
        return dump()
    if isinstance(schema, str):
        try:
            schema = _json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.json: not valid JSON text: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError("structured_outputs.json must be a JSON schema dict, its JSON text, or a pydantic "
                         f"model class, got {type(schema).__name__}")
    try:
        return _json.loads(_json.dumps(schema))  # a private, JSON-serialisable copy
    except (TypeError, ValueError) as exc:
        raise ValueError(f"structured_outputs.json: the schema is not JSON-serialisable: {exc}") from None
