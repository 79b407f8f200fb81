"""The frozen target as transformers builds it: loading it and its tokenizer, its decoder layers,
the outputs of chosen layers (the hidden states the drafter reads), its stop ids, and the
attention implementations this project registers with transformers (flex_attention under a
BlockMask, for the target stage and the batched decoder).
"""

import functools

import numpy as np
import torch

from dflash_train.demo_assets import builtin_model_dir
from dflash_train.helpers import compiled, hopper

def resolve_model_path(name):
    """A model's directory or hub id; built-in names (builtin:...) are made on first use."""
    if name.startswith("builtin:"):
        return builtin_model_dir(name)
    return name


def load_tokenizer(name):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(resolve_model_path(name))


def load_full_target(name, device):
    """The whole target (all layers, LM head) for generation: bf16 on GPU, fp32 on CPU."""
    from transformers import AutoModelForCausalLM
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(name), dtype=dtype, device_map={"": str(device)})
    return model.eval().requires_grad_(False)  # loaded shard by shard onto the device


def stop_token_ids(tokenizer, generation_config=None):
    """Every id that ends generation: the tokenizer's eos and the generation config's."""
    ids = {tokenizer.eos_token_id} | set(np.atleast_1d(getattr(generation_config, "eos_token_id", None)).tolist())
    return sorted(int(i) for i in ids if i is not None)


def generation_config_of(model_path):
    """The generation config saved with a model, or None."""
    from transformers import GenerationConfig
    try:
        return GenerationConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return None


def target_windows(tc):
    """(which layers attend through a sliding window: None, "some" (per layer_types) or "every"
    (a plain sliding_window, no layer types), the window) of a target's text config."""
    layer_types = getattr(tc, "layer_types", None) or []
    window = getattr(tc, "sliding_window", None)
    if "sliding_attention" in layer_types:
        return "some", window
    if not layer_types and window is not None:
        return "every", window
    return None, None


def decoder_layers(model):
    """The model's decoder layers (transformers' `<base model>.layers`)."""
    base = getattr(model, model.base_model_prefix, model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers at .{model.base_model_prefix}.layers")
    return layers


class collect_layer_outputs:
    """Collects the outputs of the given decoder layers ("layer i" = output of decoder layer i)
    during a forward, in the order of layer_ids."""

    def __init__(self, model, layer_ids):
        self.layers = decoder_layers(model)
        self.layer_ids = list(layer_ids)

    def __enter__(self):
        self.outputs = [None] * len(self.layer_ids)
        self.hooks = []
        for slot, i in enumerate(self.layer_ids):
            def hook(module, args, output, slot=slot):
                self.outputs[slot] = output[0] if isinstance(output, tuple) else output
            self.hooks.append(self.layers[i].register_forward_hook(hook))
        return self.outputs

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()


def token_major(query):
    """[B, heads, L, D] queries, the same values stored [B, L, heads, D] (no copy where they already
    are). flex writes its output in its queries' order, so the [B, L, heads * D] an output
    projection reads is then a view, not a copy; the as_strided view makes inductor store the
    queries so rather than in an order of its own choosing."""
    query = query.transpose(1, 2).contiguous().transpose(1, 2)
    return query.as_strided(query.shape, query.stride())


def flex_attention_for_transformers(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                    kernel_options=None, **kwargs):
    """A transformers model's attention as flex_attention under the BlockMask given as its
    attention_mask (registered as "dflash_flex"; the target stage's as "dflash_flex_target"): the
    target stage's document mask, the decoder's per-row mask. kernel_options: flex_attention's
    (tile sizes, stages, warps)."""
    from torch.nn.attention.flex_attention import flex_attention
    if kwargs.get("softcap") is not None:
        raise ValueError("flex attention does not apply attention logit soft-capping: use the dense (target stage) "
                         "or grouped (decoder) attention for this model")
    attn = flex_attention if torch.compiler.is_compiling() else compiled(flex_attention)
    out = attn(token_major(query), key, value, block_mask=attention_mask, scale=scaling,
               enable_gqa=query.shape[1] != key.shape[1], kernel_options=kernel_options)
    return out.transpose(1, 2).contiguous(), None


# flex_attention's forward on Hopper at head_dim 128 under the target stage's document mask:
# 64 x 64 tiles with 4 warps instead of inductor's 128 x 64 with 8: faster with the same output
# (docs/benchmarks.md, kernel choices).
SM90_FLEX_TARGET = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}


def target_flex_kernel_options(device, head_dim):
    """The measured flex_attention settings for the target stage's forward; None (inductor's
    defaults) where none was measured."""
    return SM90_FLEX_TARGET if head_dim == 128 and hopper(device) else None


def target_flex_attention(module, query, key, value, attention_mask, **kwargs):
    """flex_attention_for_transformers with the target stage's forward tiles for the card
    (registered as "dflash_flex_target"; the decoder's steps keep inductor's)."""
    return flex_attention_for_transformers(module, query, key, value, attention_mask,
                                           kernel_options=target_flex_kernel_options(query.device, query.shape[-1]),
                                           **kwargs)


@functools.cache
def register_flex_attention(target_stage=False):
    """Registers flex_attention with transformers (once); returns the name to select it by."""
    from transformers import AttentionInterface
    name, attention = (("dflash_flex_target", target_flex_attention) if target_stage
                       else ("dflash_flex", flex_attention_for_transformers))
    AttentionInterface.register(name, attention)
    return name


class attention_implementation:
    """Within the block, the model's layers (a model's, or a list of models') use the named
    attention (restored after)."""

    def __init__(self, models, name):
        models = models if isinstance(models, list) else [models]
        self.configs = [c for c in {id(m.config): m.config for model in models for m in model.modules()
                                    if hasattr(getattr(m, "config", None), "_attn_implementation")}.values()]
        self.name = name

    def __enter__(self):
        self.saved = [c._attn_implementation for c in self.configs]
        for c in self.configs:
            c._attn_implementation = self.name

    def __exit__(self, *exc):
        for c, name in zip(self.configs, self.saved):
            c._attn_implementation = name
