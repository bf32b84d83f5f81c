"""Tiny random models of every MoE model type in the installed transformers' experts interface.

Every model type whose modeling file holds a class decorated with ``@use_experts_implementation``
(:func:`ds_hecate.hf.interface.interface_classes`) gets a tiny config: the type's default config with its sizes
shrunk (:data:`TINY`, applied to the config and each of its sub-configs), layer schedules cut to the tiny depth,
8 experts, top-2, then the few per-type settings the generic shrink cannot guess (:data:`OVERRIDES`). Types that
cannot be built tiny on a CPU are listed in :data:`UNBUILDABLE` with the reason; every other type must build.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Set

import torch

VOCAB, SEQ, EXPERTS, TOP_K, LAYERS = 96, 8, 8, 2, 2
MAX_PARAMETERS = 8_000_000

#: Sizes set wherever a config (or a sub-config) has the key.
TINY: Dict[str, Any] = {
    # widths
    "hidden_size": 32, "d_model": 32, "intermediate_size": 48, "ffn_hidden_size": 48, "moe_intermediate_size": 16,
    "expert_ffn_hidden_size": 16, "shared_expert_intermediate_size": 24, "moe_shared_expert_intermediate_size": 24,
    "first_dense_intermediate_size": 48, "dense_intermediate_size": 48, "shared_intermediate_size": 24,
    "mlp_dim": 32, "output_channels": 16, "out_hidden_size": 32, "output_dim": 32, "projector_hidden_size": 32,
    "thinker_hidden_size": 32,
    # attention
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "num_heads": 2, "encoder_attention_heads": 2,
    "q_lora_rank": 16, "kv_lora_rank": 8, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "qk_head_dim": 16, "o_lora_rank": 16, "o_groups": 2, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4,
    "sliding_window": 4, "global_head_dim": 16, "attention_chunk_size": 4, "rotary_dim": 8,
    "index_block_size": 4, "index_topk_blocks": 2,
    # linear attention / state space
    "linear_head_dim": 8, "linear_num_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "linear_num_key_heads": 2, "linear_num_value_heads": 2,
    "ssm_state_size": 8, "mamba_num_heads": 4, "mamba_head_dim": 8, "n_groups": 1, "chunk_size": 4,
    "mamba_d_state": 4, "mamba_dt_rank": 4, "mamba_expand": 2, "block_size": 4, "conv_L_cache": 3,
    # depth
    "num_hidden_layers": LAYERS, "num_layers": LAYERS, "depth": 1, "encoder_layers": 1,
    # experts
    "num_experts": EXPERTS, "num_local_experts": EXPERTS, "n_routed_experts": EXPERTS, "moe_num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K, "num_experts_per_token": TOP_K, "moe_topk": TOP_K, "moe_k": TOP_K,
    "top_k_experts": TOP_K, "n_shared_experts": 1, "n_group": 1, "num_expert_group": 1, "moe_hidden_size": 32,
    "topk_group": 1, "first_k_dense_replace": 1,
    # vocabulary and positions
    "vocab_size": VOCAB, "max_position_embeddings": 64, "model_max_length": 64, "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 8,
    # vision / audio towers (multimodal types: the text tower holds the MoE)
    "image_size": 28, "patch_size": 14, "num_mel_bins": 16, "encoder_ffn_dim": 32, "downsample_hidden_size": 16,
    "num_position_embeddings": 16, "vision_output_dim": 32, "pos_emb_height": 4, "pos_emb_width": 4,
    # numbers
    "initializer_range": 0.3, "output_router_logits": True, "router_aux_loss_coef": 0.02, "tie_word_embeddings": False,
    "use_cache": False,
}

#: Token ids set to small values when the config has them and they would fall outside the tiny vocabulary.
TOKEN_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id")

DROP = object()   # an override value: remove the key (the config derives it)

#: Per-type settings after the generic shrink: ``{dotted key: value}`` in the config's dict (``__layers__``: the
#: depth, when the MoE layers or the layer kinds need more than two).
OVERRIDES: Dict[str, Dict[str, Any]] = {
    # the first layers are dense MLPs: one dense, one MoE layer (the dense-first variant)
    "deepseek_ocr2": {"text_config.mlp_layer_types": ["dense", "sparse"]},
    "lfm2_moe": {"num_dense_layers": 1, "layer_types": ["full_attention", "conv"]},
    # a hash-routed MoE layer and a learned-router one
    "deepseek_v4": {"mlp_layer_types": ["hash_moe", "moe"]},
    # multimodal rope: the sections of the tiny heads' rotary half (head_dim 16 times the partial-rotary factor)
    "ernie4_5_vl_moe": {"text_config.rope_parameters.mrope_section": [3, 3, 2]},
    "glm4v_moe": {"text_config.rope_parameters.mrope_section": [2, 1, 1]},
    "qwen3_5_moe": {"text_config.rope_parameters.mrope_section": [1, 1, 0]},
    "gemma4": {"text_config.enable_moe_block": True, "text_config.num_experts": EXPERTS,
               "text_config.top_k_experts": TOP_K, "text_config.moe_intermediate_size": 16},
    # state-space layers in PyTorch (the fused kernels are CUDA-only)
    "jamba": {"use_mamba_kernels": False, "expert_layer_period": 2, "expert_layer_offset": 1, "attn_layer_period": 2,
              "attn_layer_offset": 0},
    # the thinker (text, vision and audio towers; the text tower holds the MoE) is what trains on text; the talker
    # (a speech-codec decoder fed the thinker's hidden states) has the same experts layout. Its text config lacks a
    # key its model reads (checkpoints carry it).
    "qwen3_omni_moe": {"__model__": ("Qwen3OmniMoeThinkerForConditionalGeneration", "thinker_config"),
                       "talker_config.text_config.shared_expert_intermediate_size": 24},
    "flint": {"mlp_only_layers": [0]},
    "kolibri1_1": {"layer_types": ["sliding_attention", "indexed_attention"], "index_layers": [1],
                   "kv_source_layers": [0, 1], "mlp_only_layers": [0], "index_topk": 4, "index_pool_size": 16,
                   "index_compression": 2, "index_num_heads": 2, "index_num_local_tokens": 2,
                   "index_num_sink_tokens": 1, "mlp_only_intermediate_size": 48},
    "glm5_next": {"text_config.index_topk": 16},
    "dots3_note": {"vision_config.adapter_in_dim": 32, "vision_config.adapter_out_dim": 32,
                   "audio_config.adapter_out_dim": 32, "audio_config.adapter_input_size": 32},
    "hy_v4_vl": {"text_config.rope_parameters.mrope_section": [2, 1, 1]},
    "inkling2": {"vision_config.text_hidden_size": 32, "text_config.unpadded_vocab_size": VOCAB},
    "inkling2_loop": {"vision_config.text_hidden_size": 32, "text_config.unpadded_vocab_size": VOCAB},
    "inkling": {"__config__": "inkling_mm_model", "vision_config.n_layers": 2, "vision_config.patch_size": 4},
    "qwen4_exp": {"text_config.indexer_n_heads": 2, "text_config.indexer_kv_heads": 1,
                  "text_config.indexer_head_dim": 16, "text_config.indexer_budget": 4,
                  "text_config.indexer_compress_ratio": 2},
    "zaya": {"num_experts_per_tok": 1},   # the model supports top-1 routing only
    "granitemoehybrid": {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_chunk_size": 4},
    "muse_spark": {"audio_config.hidden_sizes": [8, 16], "audio_config.depths": [1, 1],
                   "audio_config.patch_sizes": [4, 2]},
    "nemotron_h": {"use_mamba_kernels": False, "layers_block_type": ["mamba", "moe", "attention", "moe"],
                   "__layers__": 4},
}

#: Model types that cannot be built tiny on a CPU, with the reason.
UNBUILDABLE: Dict[str, str] = {}


def _is_per_layer_dict(value: Any, old_layers: int) -> bool:
    return (isinstance(value, dict) and bool(value)
            and all(str(k).isdigit() and int(k) < old_layers for k in value))


def _layer_indices(d: Dict[str, Any], old_layers: int, layers: int) -> List[int]:
    """Which of the default depth's layers the tiny model keeps: the first layer of every kind each per-layer
    schedule of kinds names (so a dense-first model keeps a dense and an MoE layer, a hybrid one each layer kind),
    filled up with the first layers to ``layers``."""
    picked: Set[int] = set()
    for value in d.values():
        if isinstance(value, list) and len(value) == old_layers and all(isinstance(v, str) for v in value):
            first: Dict[str, int] = {}
            for i, kind in enumerate(value):
                first.setdefault(repr(kind), i)
            picked.update(first.values())
        elif _is_per_layer_dict(value, old_layers):
            picked.add(min(int(k) for k in value))
    for i in range(old_layers):
        if len(picked) >= layers:
            break
        picked.add(i)
    return sorted(picked)


def _shrink_dict(d: Dict[str, Any], layers: int) -> Dict[str, Any]:
    """The generic shrink of one config's dict (and, recursively, of its sub-configs' dicts)."""
    out = dict(d)
    mla = d.get("num_key_value_heads") is not None and d.get("num_key_value_heads") == d.get("num_attention_heads")
    old_layers = d.get("num_hidden_layers") or d.get("num_layers")
    for key, value in TINY.items():
        default = out.get(key)
        if key in out and not isinstance(default, (dict, list)) and (isinstance(default, bool) or default != 0):
            out[key] = layers if key in ("num_hidden_layers", "num_layers") else value   # (a 0 says "off")
    if mla and "num_key_value_heads" in out:
        out["num_key_value_heads"] = out["num_attention_heads"]   # one key/value head per query head stays so
    if "qk_rope_head_dim" in d and out.get("head_dim") is not None and d.get("head_dim") == d["qk_rope_head_dim"]:
        out["head_dim"] = out["qk_rope_head_dim"]   # multi-head latent attention: head_dim is the rope part
    if "qk_head_dim" in out and "qk_nope_head_dim" in out and "qk_rope_head_dim" in out:
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    if isinstance(old_layers, int) and old_layers > layers:
        picked = _layer_indices(d, old_layers, layers)
        for key in ("num_hidden_layers", "num_layers"):
            if key in out:
                out[key] = len(picked)
        for key, value in d.items():
            if isinstance(value, list) and len(value) == old_layers:
                out[key] = [value[i] for i in picked]   # a per-layer schedule
            elif _is_per_layer_dict(value, old_layers):   # per-layer settings: shrunk as well
                out[key] = {str(picked.index(int(i))): _shrink_dict(v, layers) if isinstance(v, dict) else v
                            for i, v in value.items() if int(i) in picked}
    for key, value in d.items():
        if isinstance(value, dict) and "model_type" in value:
            out[key] = _shrink_dict(value, layers)
    vocab = out.get("vocab_size")
    if isinstance(vocab, int):
        for i, key in enumerate(TOKEN_KEYS):
            token = out.get(key)
            if isinstance(token, int) and token >= vocab:
                out[key] = i
    return out


def tiny_config(model_type: str):
    """The tiny config of ``model_type``: its default config's dict shrunk, then built again (so what the config
    derives from its sizes, head dims and layer schedules, is derived from the tiny ones)."""
    from transformers import CONFIG_MAPPING
    override = OVERRIDES.get(model_type, {})
    cls = CONFIG_MAPPING[override.get("__config__", model_type)]
    d = cls().to_dict()
    for key in ("transformers_version", "architectures", "_name_or_path", "model_type"):
        d.pop(key, None)
    d = _shrink_dict(d, override.get("__layers__", LAYERS))
    for key, value in override.items():
        if not key.startswith("__"):
            _set_path(d, key, value)
    return cls(**d)


def _set_path(d: Dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for p in parents:
        d = d[p]
    if value is DROP:
        d.pop(last, None)
    else:
        d[last] = value


def model_class(config):
    """The class a user trains for a causal-LM loss: AutoModelForCausalLM where the type has one, else the type's
    image/audio-text-to-text class (multimodal types), trained on text."""
    import transformers as tf
    for auto in ("AutoModelForImageTextToText", "AutoModelForCausalLM", "AutoModelForMultimodalLM",
                 "AutoModelForTokenClassification"):
        mapping = getattr(tf, auto, None)
        if mapping is None:
            continue
        try:
            return mapping._model_mapping[type(config)]
        except KeyError:
            continue
    raise KeyError(f"no causal-LM class for {config.model_type}")


def build(model_type: str, seed: int = 0, check_size: bool = True):
    """A tiny random model of ``model_type`` (fp32, seeded); ``check_size`` builds it on the meta device first to
    refuse a size the shrink missed (not under ZeRO-3's ``zero.Init``, which the meta device does not go with)."""
    import transformers as tf
    if model_type == REGISTERED:
        return build_registered(seed)
    config = tiny_config(model_type)
    cls = model_class(config)
    chosen = OVERRIDES.get(model_type, {}).get("__model__")
    if chosen is not None:
        cls = getattr(tf, chosen[0])
        config = getattr(config, chosen[1]) if chosen[1] else config
    numel = 0
    if check_size:
        with torch.device("meta"):   # a size the shrink missed fails here, not by filling the memory
            numel = sum(p.numel() for p in cls._from_config(config, dtype=torch.float32).parameters())
    if numel > MAX_PARAMETERS:
        raise ValueError(f"{model_type}: the tiny config still has {numel:,} parameters (a size the shrink missed)")
    torch.manual_seed(seed)
    return cls._from_config(config, dtype=torch.float32)


def forward_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """The training loss of ``model`` (or of the DeepSpeed engine wrapping it) on token ids ``[B, S]``, as a user
    trains the type: the model's own loss (causal LM with its aux loss; token classification on labels derived
    from the ids), or, for a model without one (a block-diffusion decoder), cross-entropy of its logits against
    the ids it was given."""
    inner = getattr(model, "module", model)
    if inner.config.model_type == "diffusion_gemma":
        out = model(input_ids=ids, decoder_input_ids=ids)
        return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), ids.flatten())
    labels = ids % inner.config.num_labels if type(inner).__name__.endswith("ForTokenClassification") else ids
    return model(input_ids=ids, labels=labels).loss


#: A model type of the zoo's own: Mixtral with its experts modules replaced by :class:`PlainExperts`, a class
#: outside transformers' experts interface, which Hecate takes over after :func:`register_plain_experts`.
REGISTERED = "registered_plain_experts"


class PlainExperts(torch.nn.Module):
    """Mixtral's experts without the interface's decorator: fused parameters and an eager forward of its own."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act_fn) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(gate_up.detach().clone())
        self.down_proj = torch.nn.Parameter(down.detach().clone())
        self.act_fn = act_fn

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for k in range(top_k_index.shape[1]):
            for e in range(self.gate_up_proj.shape[0]):
                rows = (top_k_index[:, k] == e).nonzero().flatten()
                gate, up = torch.nn.functional.linear(hidden_states[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
                y = torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])
                out = out.index_add(0, rows, y * top_k_weights[rows, k, None])
        return out


def register_plain_experts() -> None:
    from ds_hecate.hf import MoEArchitecture, register_architecture
    register_architecture(MoEArchitecture("plain_experts", ("PlainExperts",)))


def build_registered(seed: int = 0):
    model = build("mixtral", seed)
    for layer in model.model.layers:
        experts = layer.mlp.experts
        layer.mlp.experts = PlainExperts(experts.gate_up_proj, experts.down_proj, experts.act_fn)
    return model
