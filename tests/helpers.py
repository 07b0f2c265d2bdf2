"""Test helpers: tiny random decoders saved as real Hugging Face directories, transformers'
own greedy decoding, random prompts, and real Dask clusters (``LocalCluster`` and the
``dask scheduler``/``dask worker`` command lines)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

from dfllm.engine.detokenizer import Detokenizer
from dfllm.engine.sequence import Request, Sequence
from dfllm.outputs import RequestMetrics
from dfllm.sampling_params import SamplingParams

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def build_tiny_model(
    root: Path,
    tokenizer_dir: Path,
    arch: str = "llama",
    heads: int = 4,
    kv_heads: int = 2,
    layers: int = 2,
    hidden: int = 64,
    seed: int = 0,
    **overrides,
) -> Path:
    """Save a random decoder with the SmolLM2 tokenizer into ``root`` and return its path."""
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[arch]
    vocab = AutoTokenizer.from_pretrained(tokenizer_dir).vocab_size
    kwargs = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        initializer_range=0.2,
        tie_word_embeddings=arch == "llama",
        bos_token_id=1,
        eos_token_id=2,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cls(**kwargs), dtype=torch.float32)
    path = root / f"{arch}-h{heads}-kv{kv_heads}-s{seed}"
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)
    return path


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: list[int] | int) -> list[list[int]]:
    """Hugging Face transformers' own greedy ``generate``, one prompt at a time (no padding)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    if isinstance(max_new_tokens, int):
        max_new_tokens = [max_new_tokens] * len(prompts)
    outs = []
    with torch.inference_mode():
        for ids, n in zip(prompts, max_new_tokens):
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0)
            outs.append(y[0, len(ids) :].tolist())
    return outs


def random_prompts(n: int, low: int, high: int, vocab: int = 1000, seed: int = 0) -> list[list[int]]:
    """``n`` token-id prompts of odd lengths in ``[low, high]``, ids in ``[20, vocab)``."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=g).tolist()
    lengths = [L | 1 for L in lengths]
    return [torch.randint(20, vocab, (L,), generator=g).tolist() for L in lengths]


# ---- real clusters of worker processes -----------------------------------------------------------------
@contextlib.contextmanager
def local_client(workers: int = 2, threads: int = 1):
    """A ``LocalCluster`` of worker processes (each serving its own /metrics) and its client."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=workers,
            threads_per_worker=threads,
            processes=True,
            dashboard_address=None,
            worker_dashboard_address="127.0.0.1:0",
        ) as cluster,
        Client(cluster) as client,
    ):
        yield client


def kill_a_worker_mid_task(client, future, key_part: str, timeout: float = 120.0) -> None:
    """SIGKILL a worker while it runs a task whose key holds ``key_part``, before ``future`` ends.

    The worker is frozen (SIGSTOP) the moment the scheduler sees it processing such a task, so
    it cannot finish its share between the check and the kill however fast the machine is; only
    then is the future checked to be still pending, and the worker killed (its connection drops
    and the scheduler recomputes what it held or ran)."""
    import signal
    import time

    pids = client.run(os.getpid)

    def running() -> list[str]:
        return client.run_on_scheduler(
            lambda dask_scheduler, key_part=key_part: sorted(
                ts.processing_on.address
                for ts in dask_scheduler.tasks.values()
                if ts.state == "processing" and ts.processing_on is not None and key_part in str(ts.key)
            )
        )

    deadline = time.time() + timeout
    busy = running()
    while not busy and time.time() < deadline and not future.done():
        time.sleep(0.01)
        busy = running()
    assert busy, f"no task {key_part!r} ran on a worker before the computation ended"
    victim = pids[busy[0]]
    os.kill(victim, signal.SIGSTOP)
    try:
        assert not future.done(), "the computation ended before a worker could be killed"
    finally:
        os.kill(victim, signal.SIGKILL)


# ---- a real multi-process cluster, started from Dask's command lines ---------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CLICluster:
    """``dask scheduler`` and ``dask worker`` processes on loopback, as an operator starts them."""

    def __init__(self, workers: int = 2, threads: int = 1, resources: str | list | None = None):
        import subprocess
        import sys
        import tempfile

        self.port = free_port()
        # the processes' logs, for :meth:`diagnose` when a test using the cluster times out
        self.log_dir = Path(tempfile.mkdtemp(prefix="dfllm-cli-cluster-"))
        self.address = f"tcp://127.0.0.1:{self.port}"
        env = {**os.environ, "DFLLM_NUM_THREADS": "1"}
        dask = [sys.executable, "-m", "dask"]
        self.procs = [
            subprocess.Popen(
                dask + ["scheduler", "--host", "127.0.0.1", "--port", str(self.port), "--no-dashboard"],
                env=env,
                start_new_session=True,
                stdout=subprocess.DEVNULL,
                stderr=open(self.log_dir / "scheduler.log", "w"),
            )
        ]
        per_worker = resources if isinstance(resources, list) else [resources] * workers
        for i, res in enumerate(per_worker):
            cmd = dask + [
                "worker",
                self.address,
                "--nthreads",
                str(threads),
                "--no-dashboard",
                "--memory-limit",
                "0",
                "--host",
                "127.0.0.1",
            ]
            if res:
                cmd += ["--resources", res]
            self.procs.append(
                subprocess.Popen(
                    cmd,
                    env=env,
                    start_new_session=True,
                    stdout=subprocess.DEVNULL,
                    stderr=open(self.log_dir / f"worker-{i}.log", "w"),
                )
            )
        self.client().wait_for_workers(workers, timeout=120)

    def client(self):
        from distributed import Client

        if not hasattr(self, "_client"):
            # not the process's default client: a test that runs on this cluster says so with
            # ``client.as_current()``, and later tests (in the same pytest process) run without it
            self._client = Client(self.address, timeout=60, set_as_default=False)
        return self._client

    def worker_pids(self) -> dict[str, int]:
        """Worker address -> pid of the worker process (the nanny's child)."""
        return self.client().run(os.getpid)

    def wait_for_worker_pids(
        self, n: int, gone: list[int] | tuple[int, ...] = (), timeout: float = 120
    ) -> dict[str, int]:
        """Worker address -> pid, once exactly ``n`` workers answer and none is one of the
        ``gone`` (killed) pids. Right after a kill the scheduler may still list the dead
        worker (``client.run`` then fails, or ``wait_for_workers(n)`` returns at once) and
        the nanny's new worker may not be registered yet: this waits out both."""
        import time

        end, last = time.monotonic() + timeout, None
        while time.monotonic() < end:
            try:
                pids = self.worker_pids()
            except Exception as exc:  # a dead worker still registered: its connection is closed
                last = exc
            else:
                if len(pids) == n and not set(pids.values()) & set(gone):
                    return pids
                last = pids
            time.sleep(0.1)
        raise TimeoutError(f"no {n} workers without pids {list(gone)} after {timeout} s (last: {last!r})")

    def diagnose(self, tail: int = 6000) -> str:
        """What the cluster is doing, for a test that timed out: the scheduler's tasks not in
        memory (key, state, worker), every thread's stack on every worker, and the tails of
        the processes' logs."""
        import traceback

        def stacks() -> str:
            import sys
            import threading

            names = {t.ident: t.name for t in threading.enumerate()}
            threads = [
                f"--- {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame)[-14:])
                for ident, frame in sys._current_frames().items()
            ]
            return "\n".join(sorted(threads, key=lambda t: "dfllm" not in t))  # the tasks' threads first

        def tasks(dask_scheduler) -> list:
            return [
                (str(k), ts.state, getattr(ts.processing_on, "address", None), [w.address for w in ts.who_has or ()])
                for k, ts in dask_scheduler.tasks.items()
                if ts.state not in ("memory", "released", "forgotten")
            ]

        out = []
        try:
            client = self.client()
            out.append(f"scheduler tasks: {client.run_on_scheduler(tasks)!r}")
            for addr, text in client.run(stacks).items():
                out.append(f"==== worker {addr} stacks\n{text[:tail]}")
        except Exception:
            out.append(f"(cluster state unavailable: {traceback.format_exc()})")
        for log in sorted(self.log_dir.glob("*.log")):
            out.append(f"==== {log.name}\n{log.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)

    def close(self) -> None:
        import signal

        if hasattr(self, "_client"):
            self._client.close()
        for p in reversed(self.procs):
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except Exception:
                os.killpg(p.pid, signal.SIGKILL)
        shutil.rmtree(self.log_dir, ignore_errors=True)


def faulty_detokenizer(tokenizer, fault: Callable[[Sequence], BaseException | None]) -> Detokenizer:
    """The engine's detokenizer for ``tokenizer``, raising ``fault(seq)`` (where not None) for a
    sequence it is about to decode, on whichever path the engine decodes it: a step's texts
    together (``prepare``, windows) or one sequence at a time (``step``, a byte-level
    vocabulary's bytes)."""

    class Faulty(Detokenizer):
        def prepare(self, seqs):
            for seq in seqs:
                _raise(fault(seq))
            return super().prepare(seqs)

        def step(self, seq):
            _raise(fault(seq))
            return super().step(seq)

    return Faulty(tokenizer)


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error


SENTENCEPIECE_CORPUS = [
    "Hello world, naïve café. 東京 is big 🙂",
    "The capital of France is Paris.",
    "Ωmega ≈ çava — ok!",
    "日本語のテキスト、そして emoji 🎉🎉",
    "  double  spaces\tand tabs\nnewlines",
]


def sentencepiece_tokenizer(strip: bool = True):
    """A small tokenizer built as Llama 2's and Mistral's are (``strip``; Gemma's without):
    SentencePiece-style BPE over ``▁``-joined words with the 256 byte tokens ``<0xHH>`` as
    ordinary vocabulary (ids 3-258) for characters it lacks, ``<unk>``, ``<s>`` and ``</s>``
    special, and the decoder ``Replace("▁", " ")``, ``ByteFallback``, ``Fuse`` (then
    ``Strip(" ", 1, 0)``). Trained on a few sentences: 440 ids."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    norm = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = norm
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=60)
    trained.train_from_iterator(SENTENCEPIECE_CORPUS * 20, trainer)
    model = json.loads(trained.to_str())["model"]
    order = sorted(model["vocab"], key=model["vocab"].get)
    vocab = order[:3] + [f"<0x{b:02X}>" for b in range(256)] + order[3:]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(vocab)},
            merges=merges,
            unk_token="<unk>",
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    tok.normalizer = norm
    parts = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(parts + [decoders.Strip(" ", 1, 0)] if strip else parts)
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def make_seq(tokens: list[int]) -> Sequence:
    """A one-sequence request over ``tokens``, for scheduler and block-manager tests."""
    req = Request("r", None, tokens, SamplingParams(), RequestMetrics(0.0))
    return Sequence(req, 0, list(tokens), len(tokens))


def build_tiny_classifier(root: Path) -> Path:
    """Save a tiny random BERT sequence classifier (3 labels, ``label_0``..``label_2``) with
    the bundled MiniLM's tokenizer into ``root`` and return its path."""
    from dfllm.models.bundled import resolve_model

    return tiny_bert(root, resolve_model("all-minilm-l6-v2"), 3, seed=0)[0]


# ---- LoRA adapters and small classifiers ------------------------------------------------------------
def make_adapter(
    base: Path, out: Path, seed: int, r: int, targets: list[str], alpha: int = 16, rslora: bool = False
) -> Path:
    """A random (non-zero) PEFT LoRA adapter of ``base``, saved as PEFT saves it."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.1, init_lora_weights=False
    )
    peft = get_peft_model(model, cfg)
    with torch.no_grad():  # PEFT's random init leaves B small: make every adapter change the greedy output
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    peft.save_pretrained(out)
    return out


def tiny_bert(tmp_path: Path, minilm_dir: Path, num_labels: int, seed: int | None = None):
    """A small random BERT sequence classifier with ``num_labels`` labels and the MiniLM
    tokenizer, saved in ``tmp_path``; returns its path and the transformers model (weights
    drawn with ``seed``, by default ``num_labels``)."""
    from transformers import AutoModelForSequenceClassification, BertConfig

    cfg = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
        num_labels=num_labels,
        id2label={i: f"label_{i}" for i in range(num_labels)},
        label2id={f"label_{i}": i for i in range(num_labels)},
        architectures=["BertForSequenceClassification"],
    )
    torch.manual_seed(num_labels if seed is None else seed)
    model = AutoModelForSequenceClassification.from_config(cfg).eval()
    path = tmp_path / f"bert-{num_labels}"
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_dir / name, path / name)
    return path, model
