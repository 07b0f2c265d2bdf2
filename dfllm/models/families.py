"""What dfllm runs, read from the registry: each supported architecture and its tasks (``dfllm
models`` lists them), and the error for an architecture it does not run, which names the
closest supported ones."""

from __future__ import annotations

import difflib
import re

GENERATE_TASKS = ("generate", "chat", "embed", "token_embed", "score")  # decoders also pool (runner="pooling")
SUFFIXES = (
    "ForConditionalGeneration",
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForCausalLM",
    "ForMaskedLM",
    "LMHeadModel",
    "ChatModel",
    "Model",
)


def supported_architectures() -> dict[str, tuple[str, ...]]:
    """Architecture name -> the tasks dfllm serves with it, for every registered architecture."""
    from dfllm.models.registry import DECODER_CLASSIFIER_ARCHITECTURES, ENCODER_ARCHITECTURES, GENERATIVE_ARCHITECTURES

    tasks: dict[str, tuple[str, ...]] = {name: GENERATE_TASKS for name in GENERATIVE_ARCHITECTURES}
    for name in DECODER_CLASSIFIER_ARCHITECTURES:
        tasks[name] = ("classify", "score")
    for name, cls in ENCODER_ARCHITECTURES.items():
        if getattr(cls, "late_interaction", False):
            tasks[name] = ("token_embed", "score")
        elif hasattr(cls, "classify"):
            tasks[name] = ("classify", "score")
        else:
            tasks[name] = ("embed", "token_embed", "score")
    return dict(sorted(tasks.items()))


def family(architecture: str) -> str:
    """The model family of an architecture name, normalised: ``Qwen2_5_VLForConditionalGeneration``
    -> ``qwen25vl``, ``LlamaForCausalLM`` -> ``llama``."""
    for suffix in SUFFIXES:
        if architecture.endswith(suffix) and architecture != suffix:
            architecture = architecture[: -len(suffix)]
            break
    return re.sub(r"[^a-z0-9]", "", architecture.lower())


def closest_supported(architecture: str, n: int = 3) -> list[str]:
    """Supported architectures nearest ``architecture``: those of the same family (one family
    name a prefix of the other, longest first), else close spellings of a family name."""
    names = list(supported_architectures())
    wanted = family(architecture)
    same: list[tuple[int, str]] = []
    for name in names:
        fam = family(name)
        if wanted and fam and (wanted.startswith(fam) or fam.startswith(wanted)):
            same.append((-min(len(fam), len(wanted)), name))
    # the same kind of head first (a classifier for a classifier, a decoder for a decoder)
    kind = next((s for s in SUFFIXES if architecture.endswith(s)), "")
    ranked = [name for _, name in sorted(same, key=lambda t: (t[0], not t[1].endswith(kind) if kind else False))]
    if not ranked:  # no family in common: a close spelling of a family name ("Lama")
        families = {family(name): name for name in reversed(names)}
        ranked = [families[f] for f in difflib.get_close_matches(wanted, list(families), n=n, cutoff=0.75)]
    return ranked[:n]


def unsupported_architecture_message(architectures: list[str] | tuple[str, ...]) -> str:
    """The error for a config whose architectures dfllm runs none of."""
    archs = list(architectures)
    if not archs:
        return (
            "unsupported architecture (none in config.json); dfllm runs: "
            f"{', '.join(supported_architectures())} (see `dfllm models`)"
        )
    near = [c for a in archs for c in closest_supported(a)]
    near = list(dict.fromkeys(near))[:3]
    hint = f"; the closest supported: {', '.join(near)}" if near else ""
    return (
        f"unsupported architecture {archs}{hint}. dfllm runs: {', '.join(supported_architectures())} "
        "(see `dfllm models`)"
    )
