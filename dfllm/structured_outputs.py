"""Constraints on what a request may generate: a JSON schema, a regex, a choice, a grammar,
any JSON object, or structural tags.

``StructuredOutputsParams`` has vLLM's name and fields. Exactly one of ``json``, ``regex``,
``choice``, ``grammar``, ``json_object`` and ``structural_tag`` is set:

- ``json``: a JSON schema as a dict (or its JSON text), or a pydantic model class (its
  ``model_json_schema()``). Output is compact JSON (``", "`` and ``": "`` separators, no
  other whitespace), so no tokens go to indentation and a small model cannot wander in
  whitespace; ``disable_any_whitespace=False`` allows any whitespace between tokens, as
  vLLM does by default. ``disable_additional_properties=True`` closes every object of the
  schema that does not say otherwise (``"additionalProperties": false``).
- ``json_object=True``: any JSON object (vLLM compiles the schema ``{"type": "object"}``).
- ``regex``: the whole output matches this regular expression.
- ``choice``: the output is exactly one of these strings.
- ``grammar``: an EBNF grammar (xgrammar's dialect, GBNF-like) whose ``root`` rule the
  output matches.
- ``structural_tag``: xgrammar's structural tag as JSON text, in vLLM's older form
  (``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}``) or xgrammar's
  current one: free text until a trigger, then the tagged structure.

``whitespace_pattern`` (an option of vLLM's outlines backend) is refused: xgrammar, the
backend dfllm uses, has no whitespace pattern. ``backend`` is None, "auto" or "xgrammar";
vLLM's other backends ("guidance", "outlines", "lm-format-enforcer") are refused by name, per
request as in ``LLM(structured_outputs_config={"backend": ...})``. The engine's
``structured_outputs_config`` gives ``disable_any_whitespace`` and
``disable_additional_properties`` their defaults (:func:`with_engine_defaults`).

A JSON schema, regex, choice or structural tag is checked when the object is built (a bad
one raises ``ValueError``); a ``grammar`` is checked when a request using it is made
(``generate``, ``chat``, ``enqueue``, a dataframe row), as vLLM does, so that params built
once with a bad grammar fail per call: vLLM's validation error, "Failed to convert the
grammar ...". Messages carry vLLM's words first ("Failed to transform regex into a grammar",
"Invalid JSON grammar specification.", ...) and dfllm's detail (the field) after them. The
engine compiles each distinct constraint once and masks the logits of every step with it
(see :mod:`dfllm.engine.structured`).

Identity (``key``, ``==``, ``hash`` and ``repr``, which the engine's deduplication and a
resumed write's key use) holds every field that decides the output: the kind, its value
(a schema with ``disable_additional_properties`` applied) and whether JSON may hold any
whitespace (``disable_any_whitespace=False``).
"""

from __future__ import annotations

import json as _json
import re
from dataclasses import dataclass, replace

from dfllm.errors import MAX_NESTING_DEPTH, array_as_list, nesting_depth

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
ANY_JSON_OBJECT = {"type": "object"}
BACKENDS = ("auto", "xgrammar")  # vLLM's structured-output backends dfllm ships
UNSHIPPED_BACKENDS = ("guidance", "outlines", "lm-format-enforcer")


def check_backend(backend: object) -> None:
    """``ValueError`` unless ``backend`` (vLLM's ``structured_outputs_config["backend"]`` or a
    request's ``backend``) is one dfllm ships (:data:`BACKENDS`); vLLM's others are named."""
    if not any(backend == b for b in BACKENDS):
        which = "vLLM's" if backend in UNSHIPPED_BACKENDS else "an unknown"
        raise ValueError(
            f"structured outputs backend {backend!r} ({which} backend) is not supported by dfllm: dfllm ships "
            f"xgrammar only (supported: {', '.join(repr(b) for b in BACKENDS)})"
        )


@dataclass(eq=False)
class StructuredOutputsParams:
    """One constraint on a request's output; exactly one field is set."""

    json: dict | str | type | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool | None = None  # None: compact JSON (dfllm's default)
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    backend: str | None = None  # None or "auto": the engine's; "xgrammar" (dfllm's only backend)

    def __post_init__(self) -> None:
        # messages show the values: each one nested past Python's limit (a schema: _schema_dict)
        for name in (*KINDS, *OPTIONS):
            setattr(self, name, array_as_list(getattr(self, name, None)))
            if name != "json" and nesting_depth(getattr(self, name, None)) > MAX_NESTING_DEPTH:
                raise ValueError(f"structured_outputs.{name} must be nested at most {MAX_NESTING_DEPTH} levels deep")
        if self.backend is not None:
            check_backend(self.backend)
        if self.json_object is False:
            self.json_object = None
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            specified = {  # a schema can nest past Python's limit: shown as "..."
                k: "..." if nesting_depth(getattr(self, k)) > MAX_NESTING_DEPTH else getattr(self, k) for k in given
            }
            vllm = (
                f"You can only use one kind of structured outputs constraint but multiple are specified: {specified}"
                if given
                else "You must use one kind of structured outputs constraint but none are specified"
            )
            raise ValueError(
                f"{vllm} (structured_outputs: set exactly one of {', '.join(KINDS)}, got {given or 'none'})"
            )
        if self.whitespace_pattern is not None:
            raise ValueError(
                "structured_outputs.whitespace_pattern is not supported: dfllm's grammar backend is "
                "xgrammar, which has none; use disable_any_whitespace"
            )
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be True or False, got {self.json_object!r}")
        if self.json is not None:
            self.json = _schema_dict(self.json)
            if self.disable_additional_properties:
                self.json = _closed(self.json)
        elif self.structural_tag is not None:
            if not isinstance(self.structural_tag, str) or not self.structural_tag.strip():
                raise ValueError(
                    f"Invalid structural tag specification. (structured_outputs.structural_tag must "
                    f"be JSON text, got {self.structural_tag!r})"
                )
        elif self.regex is not None:
            if not isinstance(self.regex, str) or not self.regex:
                raise ValueError(f"structured_outputs.regex must be a non-empty str, got {self.regex!r}")
        elif self.choice is not None:
            if isinstance(self.choice, str) or not hasattr(self.choice, "__iter__"):
                raise ValueError(f"structured_outputs.choice must be a list of strings, got {self.choice!r}")
            self.choice = list(self.choice)
            if not self.choice:
                raise ValueError(
                    f"Choice '{self.choice}' cannot be an empty list (structured_outputs.choice must "
                    "be a non-empty list of non-empty strings)"
                )
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(
                    f"structured_outputs.choice must be a non-empty list of non-empty strings, got {self.choice!r}"
                )
            if len(set(self.choice)) != len(self.choice):
                raise ValueError(f"structured_outputs.choice has duplicates: {self.choice!r}")
        elif self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(
                f"structured_outputs.grammar cannot be an empty string (structured_outputs.grammar "
                f"must be a non-empty str, got {self.grammar!r})"
            )
        if self.grammar is None:  # a grammar is checked per request (check()), as vLLM does
            self.check()

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "regex", "choice" or "grammar"."""
        return next(k for k in KINDS if getattr(self, k) is not None)

    @property
    def any_whitespace(self) -> bool:
        """Whether JSON output may hold any whitespace between tokens (else compact)."""
        return self.disable_any_whitespace is False

    @property
    def key(self) -> tuple[str, str, bool]:
        """A canonical, hashable form of everything that decides the output, ``(kind, value,
        any_whitespace)``: equal constraints share one compiled grammar, and only they.

        Key order is kept (not sorted): a schema's ``properties`` order is the order of the
        fields in the output.
        """
        value = ANY_JSON_OBJECT if self.kind == "json_object" else getattr(self, self.kind)
        text = (
            _json.dumps(value, ensure_ascii=False, separators=(",", ":"))
            if self.kind in ("json", "choice", "json_object")
            else str(value)
        )
        return self.kind, text, self.any_whitespace

    def __eq__(self, other) -> bool:
        return isinstance(other, StructuredOutputsParams) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        """The constraint and every option that changes the output (``repr`` is part of the
        identity of a request: the engine's deduplication and a resumed write's key use it)."""
        options = ", disable_any_whitespace=False" if self.any_whitespace else ""
        return f"StructuredOutputsParams({self.kind}={getattr(self, self.kind)!r}{options})"

    @classmethod
    def from_dict(cls, values: dict) -> StructuredOutputsParams:
        """Build from a plain dict such as ``{"json": {...}}``; unknown keys raise."""
        unknown = sorted(set(values) - set(KINDS) - set(OPTIONS), key=repr)  # keys of any type
        if unknown:
            raise ValueError(
                f"structured_outputs: unknown field(s) {unknown}; expected one of "
                f"{list(KINDS)} and the options {list(OPTIONS)}"
            )
        return cls(**{k: v for k, v in values.items() if v is not None})

    def to_ebnf(self) -> str | None:
        """The grammar of a ``choice`` (each option a literal); None for the other kinds."""
        if self.choice is None:
            return None
        return "root ::= " + " | ".join(_json.dumps(c, ensure_ascii=False) for c in self.choice)

    def check(self) -> None:
        """Build the tokenizer-independent grammar of the constraint; ``ValueError`` with
        vLLM's message (then dfllm's, naming the field) if it does not compile. Run when the
        object is built, except for a ``grammar``: that is checked when a request uses it
        (the engine calls this before compiling), as vLLM does."""
        import xgrammar as xgr

        try:
            if self.json is not None or self.json_object:
                xgr.Grammar.from_json_schema(self.key[1], any_whitespace=self.any_whitespace)
            elif self.structural_tag is not None:
                structural_tag_grammar(self.structural_tag)
            elif self.regex is not None:
                xgr.Grammar.from_regex(self.regex)
            else:
                xgr.Grammar.from_ebnf(self.grammar if self.grammar is not None else self.to_ebnf() or "")
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:  # xgrammar's parse errors, a bad tag
            message = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(exc).strip()) or repr(exc)
            raise ValueError(
                f"{self._vllm_error(message)} (structured_outputs.{self.kind}: invalid {self.kind}: {message})"
            ) from None

    def _vllm_error(self, message: str) -> str:
        """vLLM's words (its xgrammar backend's validation) for a constraint that does not compile."""
        if self.kind in ("json", "json_object"):
            return f"Failed to transform json schema into a grammar: {message}"
        if self.kind == "regex":
            return f"Failed to transform regex into a grammar: {message}"
        if self.kind == "choice":
            return f"Failed to transform choices into a grammar: {message}"
        if self.kind == "structural_tag":
            return "Invalid structural tag specification."
        if _looks_like_lark(self.grammar or ""):  # no "::=" rule: vLLM would try it as Lark; dfllm reads EBNF only
            return (
                "Failed to convert the grammar from Lark to EBNF. dfllm reads EBNF grammars only "
                "(xgrammar's dialect, 'root ::= ...'), and this is not one."
            )
        return "Failed to convert the grammar: Invalid grammar specification."


OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern", "backend")


def _looks_like_lark(grammar: str) -> bool:
    """vLLM's test for a Lark grammar: no line (comments removed) defines a rule with ``::=``."""
    lines = (re.sub(r"(#|//).*$", "", line).strip() for line in grammar.split("\n"))
    return not any("::=" in line for line in lines if line)


def structural_tag_grammar(structural_tag: str, compiler=None):
    """The grammar of a structural tag (JSON text), compiled with ``compiler`` (an xgrammar
    ``GrammarCompiler``) or, without one, only parsed: vLLM's older form
    (``structures``/``triggers``) or xgrammar's current one."""
    import xgrammar as xgr

    tag = _json.loads(structural_tag)
    build = xgr.Grammar.from_structural_tag if compiler is None else compiler.compile_structural_tag
    if isinstance(tag, dict) and "structures" in tag:
        items = [
            xgr.StructuralTagItem(begin=s["begin"], schema=_json.dumps(s["schema"]), end=s["end"])
            for s in tag["structures"]
        ]
        return build(items, tag["triggers"])
    return build(structural_tag)


def _closed(schema):
    """``schema`` with ``"additionalProperties": false`` on every object schema that does not set it."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _schema_dict(schema) -> dict:
    """A JSON schema as a dict, from a dict, JSON text, or a pydantic model class."""
    if isinstance(schema, type):
        dump = getattr(schema, "model_json_schema", None)
        if dump is None:
            raise ValueError(
                f"structured_outputs.json: {schema.__name__} is not a pydantic model class; "
                "pass a JSON schema dict or a pydantic BaseModel subclass"
            )
        schema = dump()
    elif isinstance(schema, str):
        if not schema.strip():
            raise ValueError("structured_outputs.json cannot be an empty string (give a JSON schema)")
        try:
            schema = _json.loads(schema)
        except RecursionError:  # deeper than Python reads: past the limit too
            raise ValueError(_TOO_DEEP) from None
        except ValueError as exc:
            raise ValueError(
                f"Invalid JSON grammar specification. (structured_outputs.json: not valid JSON text: {exc})"
            ) from None
    if not isinstance(schema, dict):
        raise ValueError(
            "structured_outputs.json must be a JSON schema dict, its JSON text, or a pydantic "
            f"model class, got {type(schema).__name__}"
        )
    # before anything walks it recursively (the copy below, the grammar, a request's keys, its repr)
    if nesting_depth(schema) > MAX_NESTING_DEPTH:
        raise ValueError(_TOO_DEEP)
    try:
        return _json.loads(_json.dumps(schema))  # a private, JSON-serialisable copy
    except (TypeError, ValueError) as exc:
        raise ValueError(f"structured_outputs.json: the schema is not JSON-serialisable: {exc}") from None


_TOO_DEEP = f"structured_outputs.json must be nested at most {MAX_NESTING_DEPTH} levels deep"


def with_engine_defaults(
    params: StructuredOutputsParams, disable_any_whitespace: bool | None, disable_additional_properties: bool
) -> StructuredOutputsParams:
    """``params`` with the engine's ``structured_outputs_config`` defaults for the options the
    request leaves unset (``disable_any_whitespace=None``; ``disable_additional_properties`` is
    closed by either); ``params`` itself when they change nothing."""
    whitespace = params.disable_any_whitespace if params.disable_any_whitespace is not None else disable_any_whitespace
    closed = params.disable_additional_properties or disable_additional_properties
    if whitespace == params.disable_any_whitespace and closed == params.disable_additional_properties:
        return params
    return replace(params, disable_any_whitespace=whitespace, disable_additional_properties=closed)
