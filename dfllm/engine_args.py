"""vLLM's view of :class:`dfllm.LLM`'s engine arguments, and the command line's.

Each argument is one field of :class:`~dfllm.config.EngineArgs` (defined next to the
:class:`~dfllm.config.EngineConfig` it resolves to, so that the engine's layers can read it):
its type, its default (vLLM's, for vLLM's arguments), its help text and, for vLLM's
compatibility arguments, what dfllm does with it. Everything else is derived from the fields:
``LLM.__init__``'s keyword-only signature spells them out (tests/compat/vllm checks it), the
dataframe methods' keyword check reads :data:`ENGINE_ARG_NAMES`, the command line's engine
flags come from :func:`add_cli_args` and docs/from_vllm.md's table is :func:`markdown_table`.

vLLM's ``LLM(model, **kwargs)`` forwards its keyword arguments to ``EngineArgs``; offline
examples commonly pass some that concern machinery dfllm does not have (swap space,
Ray) or choices it does not offer (quantization, remote code). Each of those
(:data:`VLLM_ARGS`) has an ``effect``, and :func:`check_vllm_args` decides each one in one place:

- **maps**: the value changes what dfllm does (``tokenizer_mode="slow"``, ``max_logprobs``,
  ``scheduling_policy``, ``enforce_eager``, ``skip_tokenizer_init``, ``reasoning_parser``);
- **no-op**: any value of the right type is accepted and changes nothing (``swap_space``);
- **refuses**: a value dfllm cannot honour raises ``ValueError`` naming the argument and
  the value, instead of being ignored silently (``trust_remote_code=True``).

Names dfllm does not know still raise ``TypeError``, as in vLLM.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from dataclasses import Field, fields
from typing import Any

from dfllm.config import EngineArgs

ENGINE_ARGS: tuple[Field, ...] = fields(EngineArgs)
#: the keyword arguments of ``LLM(model, **engine_kwargs)``: every field but ``model``
ENGINE_ARG_NAMES: tuple[str, ...] = tuple(a.name for a in ENGINE_ARGS if a.name != "model")
#: vLLM's compatibility arguments: the fields with an effect, the table of docs/from_vllm.md
VLLM_ARGS: tuple[Field, ...] = tuple(a for a in ENGINE_ARGS if a.metadata["effect"])
BY_NAME: dict[str, Field] = {a.name: a for a in VLLM_ARGS}
DEFAULTS: dict[str, Any] = {a.name: a.default for a in ENGINE_ARGS}


def vllm_args(args: EngineArgs) -> dict[str, Any]:
    """The values of vLLM's compatibility arguments (:data:`VLLM_ARGS`) in ``args``, by name."""
    return {a.name: getattr(args, a.name) for a in VLLM_ARGS}


def check_vllm_args(**kwargs: Any) -> dict[str, Any]:
    """Check vLLM engine arguments by name; return what dfllm uses of them.

    An unknown name raises ``TypeError``; a value dfllm cannot honour raises ``ValueError``
    naming the argument and the value. The result is ``{"use_fast": bool}`` (for the
    tokenizer); ``max_logprobs``, ``scheduling_policy``, ``hf_overrides``, ``quantization``,
    ``kv_cache_dtype``, ``enforce_eager``, ``compilation_config`` and the LoRA arguments go to
    :meth:`dfllm.config.EngineConfig.create`;
    everything else accepted is a no-op.
    """
    unknown = sorted(set(kwargs) - set(BY_NAME))
    if unknown:
        raise TypeError(f"unexpected vLLM engine argument(s) {unknown}")
    for name, value in kwargs.items():
        BY_NAME[name].metadata["check"](name, value)
    return {"use_fast": kwargs.get("tokenizer_mode", "auto") != "slow"}


def _show(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def markdown_table() -> str:
    """The table of vLLM's arguments in docs/from_vllm.md: argument | vLLM default | in dfllm."""
    rows = ["| argument | vLLM default | in dfllm |", "|---|---|---|"]
    rows += [f"| `{a.name}` | `{_show(a.default)}` | {a.metadata['help']} |" for a in VLLM_ARGS]
    return "\n".join(rows)


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None


def add_cli_args(parser: Any, names: Iterable[str] = ENGINE_ARG_NAMES, prefix: str = "", **helps: str) -> None:
    """One flag per engine argument of ``names`` (in the fields' order), in vLLM's spelling (``max_model_len`` ->
    ``--max-model-len``), stored as ``prefix + name``, helped by the field's text (or ``helps[name]``):
    a bool takes ``--x``/``--no-x``, an int, float or str its value (one of the field's choices,
    if it has them), anything else JSON. Each defaults to None: unset, ``LLM``'s default."""
    wanted = set(names)
    for arg in (a for a in ENGINE_ARGS if a.name in wanted):
        kind = str(arg.type).replace(" ", "")
        options: dict[str, Any] = {
            "default": None,
            "dest": prefix + arg.name,
            "help": helps.get(arg.name, arg.metadata["help"]).replace("%", "%%"),
        }
        if kind.startswith("bool"):
            options["action"] = argparse.BooleanOptionalAction
        elif arg.metadata["choices"]:
            options.update(choices=arg.metadata["choices"], metavar="NAME")
        elif kind.startswith("int"):
            options.update(type=int, metavar="N")
        elif kind.startswith("float"):
            options.update(type=float, metavar="X")
        elif kind.startswith("str"):
            options["metavar"] = "TEXT"
        else:
            options.update(type=_json_value, metavar="JSON")
        parser.add_argument("--" + arg.name.replace("_", "-"), **options)


def cli_kwargs(args: argparse.Namespace, prefix: str) -> dict[str, Any]:
    """The engine flags of :func:`add_cli_args` given on the command line, as ``LLM(...)`` keyword arguments."""
    return {k.removeprefix(prefix): v for k, v in vars(args).items() if k.startswith(prefix) and v is not None}
