"""The pooling engine: embeddings, class probabilities and per-token states, batched by length.

Its ``input_processor`` checks and tokenizes prompts into the requests it runs
(:meth:`~dfllm.engine.input_processor.InputProcessor.process_pooling`). Requests of one call
are sorted by length and packed into batches under a token budget
(``max_num_batched_tokens`` padded tokens, ``max_num_seqs`` sequences), so a batch pads
only to its own longest member; results come back in input order.

BERT and (XLM-)RoBERTa encoders take padded batches and run them unpadded
(:mod:`dfllm.models.bert`). Decoder embedders (Llama/Qwen2 with
last-token or mean pooling) run through the decoder's paged-attention forward, one prefill
step per batch, with a KV cache just large enough for a batch.

``token_embed`` gives one vector per token: the hidden states, or for a model with a ColBERT
head (``token_head``: ``HF_ColBERT``, bge-m3 with its head in safetensors) the head's
projections, normalised unless ``PoolingParams(normalize=False)``.

With ``enable_lora`` a decoder runs each prompt with its LoRA adapter (``loras``, one per
prompt, None: the base model): a batch holds at most ``max_loras`` distinct adapters, put into
the model's slots before it runs by a :class:`~dfllm.lora.manager.LoRAManager`, as the
generation engine's steps. An adapter that cannot be read into a slot when its batch comes
(its files broke after the request was checked, and the CPU cache no longer held it) fails
only its own prompts (:class:`PoolingFailedError`); the other prompts are batched again from
there, as a call without the failed ones would have batched them.

``PoolingParams(dimensions=N)`` (vLLM's Matryoshka embeddings) keeps the first N values of an
embedding before normalising it; :meth:`PoolingEngine.check_params` refuses it, with vLLM's
messages, where vLLM does.

Image-text models (CLIP, SigLIP: ``image_text``) also embed images (:class:`ImagePrompt`):
each distinct image (by content hash) is preprocessed by the model's image processor and
encoded once, in batches of ``max_num_seqs``; its features are kept (LRU, :data:`IMAGE_CACHE_SIZE`
images) so that the same image in a later call is not encoded again (``reset_mm_cache``).
Their embeddings are normalised unless ``PoolingParams(normalize=False)``, as vLLM's.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace
from typing import Any, cast

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from dfllm.config import EngineConfig
from dfllm.engine.input_processor import ImagePrompt, InputProcessor, PoolingRequest
from dfllm.engine.model_runner import ModelRunner
from dfllm.engine.runner import lora_manager
from dfllm.engine.scheduler import SchedulerOutput
from dfllm.engine.sequence import Request, Sequence
from dfllm.engine.step_inputs import prepare_inputs
from dfllm.errors import InvalidRequestError
from dfllm.kernels.backend import encoder_attention_op
from dfllm.lora.adapter import LoRAAdapterError
from dfllm.lora.manager import LoRASlotError
from dfllm.lora.request import LoRARequest
from dfllm.models.bert import BertForSequenceClassification, use_encoder_attention
from dfllm.models.cpu_linear import packing_available, prepack_linears
from dfllm.models.loader import load_weights
from dfllm.models.pooler import PoolerConfig, normalize, pool
from dfllm.models.quantization import quantize_encoder
from dfllm.models.registry import pooling_model_class
from dfllm.outputs import RequestMetrics
from dfllm.pooling_params import POOLING_TASKS, PoolingParams
from dfllm.sampling_params import SamplingParams

TASKS = POOLING_TASKS  # "embed", "classify", "token_embed"
IMAGE_CACHE_SIZE = 4096  # image embeddings kept per engine (a few MB)


class PoolingFailedError(RuntimeError):
    """Some prompts of :meth:`PoolingEngine.encode` failed while every other one completed:
    ``results`` holds every prompt's tensor in input order (None for a failed one) and
    ``errors`` each failed prompt's error by index (a LoRA adapter that could not be read
    into a slot: its :class:`~dfllm.lora.adapter.LoRAAdapterError`, naming it)."""

    def __init__(self, results: list[torch.Tensor | None], errors: dict[int, BaseException]):
        first = errors[min(errors)]
        super().__init__(f"{len(errors)} of {len(results)} prompts failed: {first}")
        self.results, self.errors = results, errors


class PoolingEngine:
    """A pooling model on one device."""

    def __init__(self, cfg: EngineConfig, pooler: PoolerConfig, tokenizer: PreTrainedTokenizerBase | None):
        """``tokenizer`` is None under ``skip_tokenizer_init=True``: prompts are then token ids."""
        self.cfg, self.pooler = cfg, pooler
        cls, self.is_decoder = pooling_model_class(cfg.model)
        self.num_labels = cfg.model.num_labels if hasattr(cls, "classify") else 0
        self.model: nn.Module
        if self.is_decoder:
            self.runner = ModelRunner(cfg)
            num_blocks = self._blocks_for_one_batch()
            self.runner.allocate_kv_cache(num_blocks)
            assert self.runner.model is not None  # just built
            self.model = self.runner.model
        else:
            self.model = _build(cls, cfg)
        self.image_text = bool(getattr(self.model, "image_text", False))  # CLIP, SigLIP: images too
        if self.image_text:
            from dfllm.models.clip import load_image_processor

            self.image_processor = load_image_processor(cfg.model_path)
            if not (cfg.model_path / "modules.json").is_file():
                self.pooler = replace(pooler, normalize=True)
        self._image_cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.image_stats = {"encoded": 0, "reused": 0}  # images encoded; images served without encoding
        # ColBERT models score by MaxSim over token vectors and have no single-vector embedding
        self.late_interaction = bool(getattr(self.model, "late_interaction", False))
        # RoBERTa reads fewer tokens than max_position_embeddings (its positions start after the pad id)
        self.max_input_tokens: int | None = getattr(self.model, "max_input_tokens", None)
        # LoRA adapters (decoders with enable_lora), as LLMEngine's
        self.lora = lora_manager(cfg, self.runner) if self.is_decoder else None
        limit = min(n for n in (cfg.max_model_len, pooler.max_length, self.max_input_tokens) if n)
        self.input_processor = InputProcessor(
            tokenizer, cfg.model.vocab_size, limit, set(), embeds_images=self.image_text, model_name=cfg.model_path.name
        )

    def check_lora(self, lora_request: LoRARequest, where: str = "lora_request") -> None:
        """Raise :class:`~dfllm.errors.InvalidRequestError` naming ``lora_request`` unless it can
        run: a decoder started with ``enable_lora=True``, and an adapter that reads and fits."""
        if not self.is_decoder:
            raise InvalidRequestError(
                f"{where}: {lora_request!r}: this is an encoder pooling model "
                f"({', '.join(self.cfg.model.architectures)}), which takes no LoRA adapters; "
                "adapters are served for decoders run with runner='pooling'",
                parameter="lora_request",
            )
        if self.lora is None:
            raise InvalidRequestError(
                f"Got lora_request {lora_request!r} but LoRA is not enabled! ({where}: "
                "start the engine with enable_lora=True)",
                parameter="lora_request",
            )
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError(
                f"{where}: expected a LoRARequest or None, got {type(lora_request).__name__}", parameter="lora_request"
            )
        try:
            self.lora.check(lora_request)
        except LoRAAdapterError as exc:
            raise InvalidRequestError(f"{where}: {exc}", parameter="lora_request") from None

    @property
    def embedding_size(self) -> int:
        """The size of this model's embeddings (vLLM's ``ModelConfig.embedding_size``)."""
        hf = self.cfg.hf_config
        size = getattr(self.model, "embedding_size", None) or getattr(hf, "embedding_size", None)
        if size is None and self.image_text:
            size = getattr(hf, "projection_dim", None)
        return int(size or self.cfg.model.hidden_size)

    def check_params(self, params: PoolingParams, task: str) -> None:
        """Raise :class:`~dfllm.errors.InvalidRequestError` (vLLM's message, naming
        ``dimensions``) unless ``params`` can run ``task`` on this model: ``dimensions`` is
        for embeddings of a Matryoshka model only (vLLM's ``PoolingParams.verify``)."""
        d = params.dimensions
        if d is None:
            return
        if task not in ("embed", "token_embed"):
            raise InvalidRequestError(
                f"Task {task!r} only supports ['use_activation'] parameters, "
                "does not support ['dimensions'] parameters",
                parameter="dimensions",
                value=d,
            )
        hf, name, size = self.cfg.hf_config, str(self.cfg.model_path), self.embedding_size
        allowed = getattr(hf, "matryoshka_dimensions", None)
        if not (allowed or getattr(hf, "is_matryoshka", False)):
            raise InvalidRequestError(
                f"Model {name!r} does not support Matryoshka embeddings; dimensions must be unset "
                f"(received dimensions={d}).",
                parameter="dimensions",
                value=d,
            )
        if not 1 <= d <= size:
            raise InvalidRequestError(
                f"Model {name!r} only supports dimensions in range [1, {size}], got {d}.",
                parameter="dimensions",
                value=d,
            )
        if allowed and d not in allowed:
            raise InvalidRequestError(
                f"Model {name!r} only supports Matryoshka dimensions {allowed}, got {d}.",
                parameter="dimensions",
                value=d,
            )

    @property
    def supported_tasks(self) -> tuple[str, ...]:
        if self.num_labels:
            return ("classify", "score") if self.num_labels == 1 else ("classify",)
        if self.late_interaction:
            return ("token_embed", "score")
        return ("embed", "token_embed", "score")

    def _blocks_for_one_batch(self) -> int:
        bs, cfg = self.cfg.block_size, self.cfg
        # A batch holds max_num_batched_tokens tokens, or one prompt of up to max_model_len.
        return -(-max(cfg.max_num_batched_tokens, cfg.max_model_len) // bs) + cfg.max_num_seqs

    # ---- batching ---------------------------------------------------------------------
    def encode(
        self, requests: list[PoolingRequest], task: str, on_batch=None, loras: list[LoRARequest | None] | None = None
    ) -> list[torch.Tensor]:
        """Run ``task`` over checked requests (token ids, and images of an image-text model);
        one CPU tensor per request, in input order. ``loras``: each text prompt's LoRA adapter
        (None: the base model), checked already (:meth:`check_lora`).

        An adapter that cannot be read into a slot when its batch comes fails its prompts
        alone: the rest of the call is batched again without them and runs, then
        :class:`PoolingFailedError` holds every result and each failed prompt's error."""
        if loras is not None and all(lora is None for lora in loras):
            loras = None
        prompts, params = [r.prompt_token_ids for r in requests], [r.params for r in requests]
        results: list[torch.Tensor | None] = [None] * len(prompts)
        images = [i for i, r in enumerate(requests) if r.image is not None]
        if images:
            embedded = self.encode_images(
                [cast(ImagePrompt, requests[i].image) for i in images], [params[i] for i in images], task
            )
            for i, out in zip(images, embedded):
                results[i] = out
            if on_batch is not None:
                on_batch(len(images))
        texts = [i for i, r in enumerate(requests) if r.image is None]
        order = sorted(texts, key=lambda i: len(prompts[i]), reverse=True)
        errors: dict[int, BaseException] = {}
        while order:
            done = 0
            for batch in self._batches(order, prompts, loras):
                types = [requests[i].token_type_ids for i in batch]
                batch_loras = [loras[i] for i in batch] if loras is not None else None
                try:
                    outs = self._run([prompts[i] for i in batch], types, task, [params[i] for i in batch], batch_loras)
                except LoRASlotError as exc:  # raised before any slot changed: nothing of the batch ran
                    assert loras is not None
                    broken: dict[int | None, BaseException] = {k: e for k, e in exc.errors.items()}
                    failed = [i for i in order[done:] if _lora_id(loras[i]) in broken]
                    for i in failed:
                        errors[i] = broken[_lora_id(loras[i])]
                    if on_batch is not None:
                        on_batch(len(failed))
                    # the rest, batched again without the failed prompts: the batches a call
                    # without them makes from here (the ones before did not hold them)
                    order = [i for i in order[done:] if i not in errors]
                    break
                for i, out in zip(batch, outs):
                    results[i] = out
                done += len(batch)
                if on_batch is not None:
                    on_batch(len(batch))
            else:
                order = []
        if errors:
            raise PoolingFailedError(results, errors)
        return results  # type: ignore[return-value]

    @torch.inference_mode()
    def encode_images(self, images: list[ImagePrompt], params: list[PoolingParams], task: str) -> list[torch.Tensor]:
        """Embeddings of ``images`` (``task`` "embed"): each distinct image encoded once, and
        not at all when its features are cached from an earlier call."""
        if not self.image_text or task != "embed":
            raise ValueError(
                f"{task} takes no images"
                if self.image_text
                else "this model takes no images (multi_modal_data): it embeds text only"
            )
        cache, first = self._image_cache, {im.hash: im.image for im in images}
        missing = [h for h in first if h not in cache]
        self.image_stats["reused"] += len(images) - len(missing)
        self.image_stats["encoded"] += len(missing)
        embed = cast(Any, self.model).image_features
        for start in range(0, len(missing), self.cfg.max_num_seqs):
            chunk = missing[start : start + self.cfg.max_num_seqs]
            pixels = self.image_processor(images=[_rgb(first[h]) for h in chunk], return_tensors="pt")["pixel_values"]
            feats = embed(pixels.to(self.cfg.device, self.cfg.dtype)).float().cpu()
            for h, f in zip(chunk, feats):
                cache[h] = f
        out = []
        for im, p in zip(images, params):
            cache.move_to_end(im.hash)
            f = cache[im.hash] if p.dimensions is None else cache[im.hash][: p.dimensions]
            out.append(normalize(f) if _wants_norm(p, self.pooler.normalize) else f.clone())
        while len(cache) > IMAGE_CACHE_SIZE:
            cache.popitem(last=False)
        return out

    def reset_mm_cache(self) -> None:
        """Forget the cached image features (the next call encodes every image again)."""
        self._image_cache.clear()

    def _batches(self, order: list[int], prompts, loras: list[LoRARequest | None] | None = None):
        """``order`` cut into batches under the token and sequence budgets, each with at most
        ``max_loras`` distinct LoRA adapters."""
        batch: list[int] = []
        adapters: set[int] = set()
        for i in order:
            longest = len(prompts[batch[0]]) if batch else len(prompts[i])
            lora = loras[i] if loras is not None else None
            new_adapter = lora is not None and lora.lora_int_id not in adapters
            if batch and (
                (len(batch) + 1) * longest > self.cfg.max_num_batched_tokens
                or len(batch) >= self.cfg.max_num_seqs
                or (new_adapter and len(adapters) >= self.cfg.max_loras)
            ):
                yield batch
                batch, adapters = [], set()
            batch.append(i)
            if lora is not None:
                adapters.add(lora.lora_int_id)
        if batch:
            yield batch

    # ---- one batch --------------------------------------------------------------------
    @torch.inference_mode()
    def _run(
        self, prompts, types, task: str, params: list[PoolingParams], loras: list[LoRARequest | None] | None = None
    ) -> list[torch.Tensor]:
        hidden, valid = self._hidden(prompts, types, loras)
        if task == "token_embed":
            return self._token_embed(hidden, prompts, params)
        if task == "classify":
            # a classifier (the only models with ``classify``); torch's stubs see Module attributes as Tensor | Module
            classify = cast(BertForSequenceClassification, self.model).classify
            # a decoder classifier reads each row's last valid token (seq_cls)
            logits = (classify(hidden, valid) if self.is_decoder else classify(hidden)).float()  # type: ignore[call-arg]
            return [_activate(row, p.use_activation is not False) for row, p in zip(logits.cpu(), params)]
        pool_text = getattr(self.model, "pool_text", None)  # CLIP/SigLIP: their own token, then a projection
        pooled = (
            pool(hidden, valid, self.pooler.pooling_type) if pool_text is None else pool_text(hidden, prompts)
        ).float()
        out = []
        for row, p in zip(pooled, params):
            row = row if p.dimensions is None else row[: p.dimensions]  # Matryoshka, before normalising
            out.append((normalize(row) if _wants_norm(p, self.pooler.normalize) else row.clone()).cpu())
        return out

    def _token_embed(
        self, hidden: torch.Tensor, prompts: list[list[int]], params: list[PoolingParams]
    ) -> list[torch.Tensor]:
        """One vector per token: the hidden states, or a ColBERT head's projections of them
        (less the first ``token_skip`` tokens), normalised by default when there is a head."""
        head = getattr(self.model, "token_head", None)
        skip = getattr(self.model, "token_skip", 0) if head is not None else 0
        vectors = (head(hidden) if head is not None else hidden).float()
        out = []
        for i, (p, param) in enumerate(zip(prompts, params)):
            v = vectors[i, skip : len(p)]
            if param.dimensions is not None:
                v = v[:, : param.dimensions]
            wanted = _wants_norm(param, head is not None)  # a token head's vectors are normalised
            out.append((normalize(v) if wanted else v).cpu())
        return out

    def _hidden(
        self, prompts: list[list[int]], types, loras: list[LoRARequest | None] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token hidden states ``[batch, longest, h]`` (right-padded) and the valid mask."""
        dev = self.cfg.device
        longest = len(prompts[0])
        ids = torch.zeros(len(prompts), longest, dtype=torch.long)
        tt = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p)
            if types[i] is not None:
                tt[i, : len(p)] = torch.tensor(types[i])
        valid = (torch.arange(longest).unsqueeze(0) < torch.tensor([len(p) for p in prompts]).unsqueeze(1)).to(dev)
        if not self.is_decoder:
            return self.model(ids.to(dev), tt.to(dev), valid), valid
        return self._decoder_hidden(prompts, longest, loras), valid

    def _lora_requests(self, loras: list[LoRARequest | None]) -> list[Request]:
        """One request per prompt carrying its adapter and the slot it runs in (adapters put
        into slots now)."""
        assert self.lora is not None, "lora_request needs enable_lora=True"
        wanted = {lora.lora_int_id: lora for lora in loras if lora is not None}
        slots = self.lora.activate(wanted)
        by_id: dict[int | None, Request] = {None: _POOL_REQUEST}
        for lid, lora in wanted.items():
            by_id[lid] = replace(_POOL_REQUEST, seqs=[], lora_request=lora, lora_slot=slots[lid])
        return [by_id[None if lora is None else lora.lora_int_id] for lora in loras]

    def _decoder_hidden(
        self, prompts: list[list[int]], longest: int, loras: list[LoRARequest | None] | None = None
    ) -> torch.Tensor:
        requests = self._lora_requests(loras) if loras is not None else [_POOL_REQUEST] * len(prompts)
        # prepare_inputs puts each adapter's rows together (by slot): give them in that order
        order = sorted(range(len(prompts)), key=lambda i: requests[i].lora_slot)
        seqs, bs, next_block = [], self.cfg.block_size, 0
        for i in order:
            p = prompts[i]
            seq = Sequence(requests[i], 0, p, len(p))
            n = -(-len(p) // bs)
            seq.block_table = list(range(next_block, next_block + n))
            next_block += n
            seqs.append(seq)
        inputs = prepare_inputs(SchedulerOutput(seqs, [len(prompts[i]) for i in order]), bs, self.cfg.device)
        flat = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        hidden = flat.new_zeros(len(prompts), longest, flat.shape[-1])
        start = 0
        for i in order:
            n = len(prompts[i])
            hidden[i, :n] = flat[start : start + n]
            start += n
        return hidden


_POOL_REQUEST = Request("pool", None, [], SamplingParams(), RequestMetrics(0.0))


def _build(cls: type[nn.Module], cfg: EngineConfig) -> nn.Module:
    build = getattr(cls, "from_hf_config", None)  # models of nested configs (CLIP, SigLIP) read them whole
    with torch.device(cfg.device):
        model = build(cfg.hf_config) if build is not None else cls(cfg.model)
    model.to(cfg.dtype)
    load_weights(model, cfg.model_path)
    attach = getattr(model, "attach_token_head", None)
    if attach is not None:
        attach(cfg.model_path)  # bge-m3's ColBERT head, when converted to safetensors
    if cfg.quantization is not None:
        # before prepacking, which only takes the float layers left (pooler, heads): the int8
        # MLP layer fuses no GELU, so BertIntermediate applies it after the int8 GEMM
        quantize_encoder(model, cfg.quantization)
    if packing_available(cfg.device, cfg.dtype):
        prepack_linears(model)
    use_encoder_attention(model, encoder_attention_op(cfg.attention_backend, cfg.device))
    return model.eval()


def _rgb(image):
    """A PIL image in RGB, as vLLM converts images before their processor."""
    return image if image.mode == "RGB" else image.convert("RGB")


def _activate(logits: torch.Tensor, use_activation: bool) -> torch.Tensor:
    if not use_activation:
        return logits
    return torch.sigmoid(logits) if logits.numel() == 1 else torch.softmax(logits, dim=-1)


def _wants_norm(params: PoolingParams, model_default: bool) -> bool:
    """dfllm's ``normalize``, else vLLM's ``use_activation`` (an embedder's normalisation
    switch), else the model's own."""
    return next((w for w in (params.normalize, params.use_activation) if w is not None), model_default)


def _lora_id(lora: LoRARequest | None) -> int | None:
    return None if lora is None else lora.lora_int_id
