"""What the planner knows about a model: its gather/release units and their parameters' shapes.

A :class:`ModelSpec` comes from one of:

- an ``nn.Module`` (on any device, ``meta`` included): the engine's own unit rule (``sharding.plan_sharding``), so a
  model is planned exactly as the strategy will shard it;
- a Hugging Face config (a ``config.json`` path, its dict, or a ``transformers`` config object: read, never
  downloaded) of the ``gpt2``, ``gpt_neox`` or ``llama``/``mistral`` families, laid out as those models' modules are;
- a name from :data:`REFERENCE_MODELS` (the seed documents' reference models, GPT-2, and the example app's GPT);
- the example app's ``GPTConfig`` (any object with ``n_embd``, ``n_layer``, ``n_head``, ``vocab_size``,
  ``block_size``), laid out exactly as ``lightning_mics.app.models.gpt.GPT`` (checked in tests/plan/test_plan.py);
- a parameter count (``20e9``, ``"1.3B"``): ``n_layer`` equal units of one flat parameter each, no embeddings, no
  activation estimate (the shape is unknown).

Transformer dimensions, where known, feed the activation estimate. ``tp`` marks the tensors a tensor-parallel
plan splits, and ``tp_dim`` the dimension: for the transformer layouts a Megatron-style plan (attention and MLP
matrices column- then row-parallel, the column biases, embeddings and head split on the vocabulary); for a
module, what its parameters already are (DTensors on a 1-D mesh with a Shard placement, as ``configure_model``
leaves them under ``tensor_parallel_degree``). The planner cuts that dimension into ceil(d / t) (tensor-parallel
rank 0's part, as DTensor cuts it).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch.nn as nn

from lightning_mics.layout.sharding import plan_sharding, resolve_classes


@dataclass(frozen=True)
class ParamShape:
    shape: Tuple[int, ...]
    trainable: bool = True
    tp: bool = False  # split by tensor parallelism
    tp_dim: int = 0  # along this dimension


@dataclass
class UnitShapes:
    name: str  # "" = the root
    params: List[ParamShape]


@dataclass
class TransformerDims:
    hidden: int
    n_layer: int
    n_head: int
    vocab: int
    ffn: int
    gated: bool = False  # SwiGLU MLP (three matrices)


@dataclass
class ModelSpec:
    name: str
    units: List[UnitShapes]  # root first
    dims: Optional[TransformerDims] = None
    source: str = ""
    notes: List[str] = field(default_factory=list)

    @property
    def n_params(self) -> int:
        return sum(_numel(p.shape) for u in self.units for p in u.params)


def _numel(shape: Tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _fail(option: str, value: Any, allowed: str) -> None:
    raise ValueError(f"plan option {option}={value!r} is invalid: allowed is {allowed}.")


# -- from a module ------------------------------------------------------------------------------------------

def from_module(module: nn.Module, shard_units: Optional[List[Any]] = None) -> ModelSpec:
    """The engine's units of ``module`` (threshold 0 here: the planner applies the threshold per s)."""
    plan = plan_sharding(module, resolve_classes(shard_units, "shard_units"), 0, 2)
    units = [UnitShapes(u.path, [_param_shape(pp.param) for pp in (*u.params, *u.replicated)]) for u in plan.units]
    return ModelSpec(type(module).__name__, units, source="nn.Module (the engine's own unit rule)")


def _param_shape(p: nn.Parameter) -> ParamShape:
    """Global shape; for a tensor-parallel DTensor (1-D mesh, Shard(d)) also the dimension it is split along."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor) and p.device_mesh.ndim == 1 and p.placements[0].is_shard():
        return ParamShape(tuple(p.shape), p.requires_grad, tp=True, tp_dim=p.placements[0].dim)
    return ParamShape(tuple(p.shape), p.requires_grad)


# -- transformer layouts ------------------------------------------------------------------------------------

def _block(h: int, f: int, bias: bool, kv: int, gated: bool, norm_bias: bool, conv1d: bool = False) -> List[ParamShape]:
    """One decoder block's parameters, in module order (norms, attention, norm, MLP)."""
    def lin(out: int, inp: int, col: bool) -> List[ParamShape]:
        split = (0 if col else 1) if not conv1d else (1 if col else 0)  # the output dim if column-parallel
        w = ParamShape((inp, out) if conv1d else (out, inp), tp=True, tp_dim=split)
        return [w] + ([ParamShape((out,), tp=col)] if bias else [])

    norm = [ParamShape((h,))] + ([ParamShape((h,))] if norm_bias else [])
    if kv == h:
        attn = lin(3 * h, h, True)
    else:
        attn = lin(h, h, True) + lin(kv, h, True) + lin(kv, h, True)
    attn += lin(h, h, False)
    mlp = (lin(f, h, True) + lin(f, h, True) if gated else lin(f, h, True)) + lin(h, f, False)
    return norm + attn + norm + mlp


def transformer(name: str, *, hidden: int, n_layer: int, n_head: int, vocab: int, ffn: Optional[int] = None,
                positions: int = 0, tied: bool = False, bias: bool = True, kv_heads: Optional[int] = None,
                gated: bool = False, norm_bias: bool = True, conv1d: bool = False, source: str = "") -> ModelSpec:
    """A decoder-only transformer whose blocks sit in an ``nn.ModuleList`` (so each block is a unit), the
    embeddings, final norm and head in the root."""
    for option, value in (("hidden", hidden), ("n_layer", n_layer), ("n_head", n_head), ("vocab", vocab)):
        if not isinstance(value, int) or value < 1:
            _fail(option, value, "a positive integer")
    f = ffn or 4 * hidden
    kv = hidden if kv_heads in (None, n_head) else hidden // n_head * kv_heads
    root = [ParamShape((vocab, hidden), tp=True)]
    if positions:
        root.append(ParamShape((positions, hidden)))
    root += [ParamShape((hidden,))] + ([ParamShape((hidden,))] if norm_bias else [])
    if not tied:
        root.append(ParamShape((vocab, hidden), tp=True))
    units = [UnitShapes("", root)] + [UnitShapes(f"h.{i}", _block(hidden, f, bias, kv, gated, norm_bias, conv1d))
                                      for i in range(n_layer)]
    return ModelSpec(name, units, TransformerDims(hidden, n_layer, n_head, vocab, f, gated), source)


def from_gpt_config(cfg: Any, name: str = "gpt") -> ModelSpec:
    """The example app's GPT (``lightning_mics/app/models/gpt.py``) for a ``GPTConfig``-like object or dict."""
    get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
    return transformer(name, hidden=get("n_embd"), n_layer=get("n_layer"), n_head=get("n_head"),
                       vocab=get("vocab_size"), positions=get("block_size"), tied=get("tie_weights", True),
                       bias=get("bias", True), norm_bias=get("bias", True),
                       source="the example app's GPT (lightning_mics.app.models.gpt)")


_HF_FAMILIES = ("gpt2", "gpt_neox", "llama", "mistral")


def from_hf_config(cfg: Any, name: Optional[str] = None) -> ModelSpec:
    """A Hugging Face config: a path to ``config.json``, its dict, or a ``transformers`` config object."""
    source = "Hugging Face config"
    if isinstance(cfg, (str, os.PathLike)):
        source = f"Hugging Face config {os.fspath(cfg)}"
        with open(cfg) as fh:
            cfg = json.load(fh)
    elif hasattr(cfg, "to_dict"):
        cfg = cfg.to_dict()
    if not isinstance(cfg, dict):
        _fail("model", type(cfg).__name__, "a config.json path, a dict or a transformers config object")
    kind = cfg.get("model_type")
    name = name or cfg.get("_name_or_path") or kind or "model"
    if kind == "gpt2":
        return transformer(name, hidden=cfg["n_embd"], n_layer=cfg["n_layer"], n_head=cfg["n_head"],
                           vocab=cfg["vocab_size"], ffn=cfg.get("n_inner"), positions=cfg["n_positions"],
                           tied=cfg.get("tie_word_embeddings", True), conv1d=True, source=source)
    if kind == "gpt_neox":
        return transformer(name, hidden=cfg["hidden_size"], n_layer=cfg["num_hidden_layers"],
                           n_head=cfg["num_attention_heads"], vocab=cfg["vocab_size"],
                           ffn=cfg.get("intermediate_size"), tied=cfg.get("tie_word_embeddings", False),
                           source=source)
    if kind in ("llama", "mistral"):
        return transformer(name, hidden=cfg["hidden_size"], n_layer=cfg["num_hidden_layers"],
                           n_head=cfg["num_attention_heads"], vocab=cfg["vocab_size"],
                           ffn=cfg["intermediate_size"], kv_heads=cfg.get("num_key_value_heads"),
                           tied=cfg.get("tie_word_embeddings", False), bias=False, gated=True, norm_bias=False,
                           source=source)
    _fail("model", f"model_type={kind!r}", f"a Hugging Face config of the families {list(_HF_FAMILIES)} "
          "(or plan the nn.Module itself, or a parameter count)")
    raise AssertionError  # unreachable


# -- the built-in table -------------------------------------------------------------------------------------

# Shapes of the seed documents' reference models (SageMaker's sharded data parallelism page) and two small ones.
# GPT-NeoX-20B is EleutherAI's published config; the seed names a 65B GPT-NeoX without its shape: 80 layers of
# width 8192 (64 heads) with NeoX's vocabulary is the NeoX layout at 65B parameters.
REFERENCE_MODELS: Dict[str, Dict[str, Any]] = {
    "gpt2": dict(model_type="gpt2", n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024),
    "gpt-neox-20b": dict(model_type="gpt_neox", hidden_size=6144, num_hidden_layers=44, num_attention_heads=64,
                         intermediate_size=24576, vocab_size=50432, tie_word_embeddings=False),
    "gpt-neox-65b": dict(model_type="gpt_neox", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                         intermediate_size=32768, vocab_size=50432, tie_word_embeddings=False),
    "llama-2-7b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, intermediate_size=11008, vocab_size=32000),
}
# The example app's GPT with its defaults (conf/model/gpt.yaml; tests check them against GPTConfig()).
APP_GPT_DEFAULTS = dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128, bias=True, tie_weights=True)

_COUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def from_count(n: float, n_layer: int = 32) -> ModelSpec:
    """Only a parameter count: ``n_layer`` equal units of one flat parameter each (no padding, nothing small)."""
    if isinstance(n, bool) or not isinstance(n, (int, float)) or n < 1:
        _fail("model", n, "a parameter count >= 1")
    per = int(round(n / n_layer))
    units = [UnitShapes("", [])] + [UnitShapes(f"u.{i}", [ParamShape((per,))]) for i in range(n_layer)]
    return ModelSpec(f"{n / 1e9:.3g}B params", units, source="a parameter count",
                     notes=[f"only a parameter count: {n_layer} equal units, no padding or small parameters, "
                            "no activation estimate (give a config for one)"])


def resolve(model: Any, shard_units: Optional[List[Any]] = None) -> ModelSpec:
    """Any accepted form of ``model`` -> :class:`ModelSpec` (see the module docstring)."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, nn.Module):
        return from_module(model, shard_units)
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        return from_count(model)
    if isinstance(model, str):
        key = model.strip().lower()
        if key in REFERENCE_MODELS:
            return from_hf_config(REFERENCE_MODELS[key], name=key)
        if key == "gpt" or key.startswith("gpt:"):  # gpt:n_layer=8,n_embd=256
            cfg = dict(APP_GPT_DEFAULTS)
            for item in filter(None, key[4:].split(",")):
                k, _, v = item.partition("=")
                if k not in cfg:
                    _fail("model", model, f"'gpt' or 'gpt:key=value,...' with keys {sorted(cfg)}")
                cfg[k] = v.lower() in ("1", "true") if isinstance(cfg[k], bool) else int(v)
            return from_gpt_config(cfg, name=model)
        m = _COUNT.match(key)
        if m:
            return from_count(float(m.group(1)) * _SCALE[m.group(2).lower()])
        if os.path.exists(model):
            return from_hf_config(model)
        _fail("model", model, f"a name from {sorted(REFERENCE_MODELS) + ['gpt', 'gpt:key=value,...']}, a parameter "
              "count such as 20e9 or 1.3B, or a path to a Hugging Face config.json")
    if isinstance(model, os.PathLike):
        return from_hf_config(model)
    if isinstance(model, dict):
        return from_hf_config(model) if "model_type" in model else from_gpt_config(model)
    if hasattr(model, "to_dict") and hasattr(model, "model_type"):
        return from_hf_config(model)
    if all(hasattr(model, k) for k in ("n_embd", "n_layer", "block_size")):
        return from_gpt_config(model)
    _fail("model", type(model).__name__, "an nn.Module, a parameter count, a reference model name, a Hugging Face "
          "config (path, dict or transformers object) or the app's GPTConfig")
    raise AssertionError  # unreachable
