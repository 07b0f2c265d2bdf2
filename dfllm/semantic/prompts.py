"""Prompts of the semantic operators: the instruction first, the row's fields last.

Every operator's prompt is a fixed part (the operator's preamble and the user's instruction,
identical for every row) followed by the row's fields, so that the engine's prefix cache
computes the fixed part once per engine and each row only adds its own tokens. The user's
instruction names fields as ``{column}`` (``"{review} is about shipping delays"``); in the
fixed part each becomes ``[column]``, and the record after it lists ``[column]: value`` for
every field, in the order the instruction first names them.

:func:`semantic_prompt` gives the ``(system, template)`` pair that ``.llm.chat`` (``system=``
and its one-user-turn template) or ``.llm.generate`` (``system`` None, the whole prompt in
the template) take. Shared by every semantic operator.
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dfllm.tasks.templates import template_fields


def instruction_fields(instruction: str) -> list[str]:
    """The columns an instruction names, in order of first use; ``ValueError`` for a
    malformed one, or one that names no column."""
    if not isinstance(instruction, str) or not instruction.strip():
        raise ValueError(f"the instruction must be a non-empty string, got {instruction!r}")
    fields = template_fields(instruction)
    if not fields:
        raise ValueError(
            f"the instruction {instruction!r} names no column: write the fields it is about as "
            '{column}, e.g. "{review} is about shipping delays"'
        )
    return fields


def escape(text: str) -> str:
    """``text`` as literal text inside a ``{column}`` template (braces doubled)."""
    return text.replace("{", "{{").replace("}", "}}")


def render_instruction(instruction: str, names: Mapping[str, str] | None = None) -> str:
    """The instruction as plain text, each ``{column}`` written ``[column]`` (or
    ``[names[column]]``): what the fixed part of a prompt says."""
    parts = []
    for literal, name, _spec, _conv in string.Formatter().parse(instruction):
        parts.append(literal)
        if name is not None:
            parts.append(f"[{(names or {}).get(name, name)}]")
    return "".join(parts)


def record_template(fields: Sequence[str] | Mapping[str, str]) -> str:
    """The row's part of a prompt, as a template: one ``[label]: {column}`` line per field.
    ``fields`` is a list of columns (each its own label) or a mapping label -> column."""
    pairs = fields.items() if isinstance(fields, Mapping) else ((f, f) for f in fields)
    return "\n".join(f"[{escape(label)}]: {{{column}}}" for label, column in pairs)


@dataclass(frozen=True)
class SemanticPrompt:
    """A semantic operator's prompt: ``system`` (chat; None for generate) and the
    ``{column}`` template of the rest, whose fixed part comes before every field."""

    system: str | None
    template: str

    def text(self, row: Mapping[str, object]) -> str:
        """The prompt for one row (``system`` and the user turn joined; for display and tests)."""
        body = self.template.format(**{k: row[k] for k in template_fields(self.template)})
        return body if self.system is None else f"{self.system}\n\n{body}"


def semantic_prompt(
    preamble: str,
    instruction: str,
    fields: Sequence[str] | Mapping[str, str] | None = None,
    *,
    answer: str = "",
    chat: bool = True,
    names: Mapping[str, str] | None = None,
) -> SemanticPrompt:
    """The prompt of one operator call: ``preamble`` (what the operator asks: fixed text),
    the user's ``instruction`` (its ``{column}`` as ``[column]``), then the record of
    ``fields`` (default: the instruction's), then ``answer`` (fixed text asking for the
    answer, after the record).

    With ``chat`` (``.llm.chat``) the preamble is the system message and the rest one user
    turn; otherwise (``.llm.generate``) it is one completion prompt ending with ``Answer:``.
    ``names`` relabels columns (``{"review_right": "right.review"}``) in the instruction and,
    when ``fields`` is a list, in the record."""
    if fields is None:
        fields = instruction_fields(instruction)
    if not isinstance(fields, Mapping):
        fields = {(names or {}).get(f, f): f for f in fields}
    body = f"{escape(render_instruction(instruction, names))}\n\n{record_template(fields)}"
    if answer:
        body += f"\n\n{escape(answer)}"
    if chat:
        return SemanticPrompt(preamble, body)
    return SemanticPrompt(None, f"{escape(preamble)}\n\n{body}\nAnswer:")
