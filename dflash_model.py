"""The DFlash drafter: config, layers, the attention rule and its kernels, the training objective,
the model and its checkpoint format.

A drafter proposes `block_size` tokens in one forward pass. Its input is a block whose slot 0 holds
the real token at an anchor position and whose other slots hold a mask token; its context is the
target model's hidden states (several layers, concatenated) for every token before the anchor.
Every draft layer attends from the block to `concat(context, block)`: keys and values of the
context are injected into every layer. The target's embedding and LM head are used frozen and
never stored in the drafter's checkpoint.

Read top to bottom: config -> layers -> attention rule and kernels -> LM head and loss -> model ->
checkpoint. Decoding with a drafter is dflash_train/decoding.py's; the target stage is train_dflash_pipeline.py's.
"""

import copy
import json
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from dflash_train.kernels import BLOCK_ATTENTION_CONFIG, block_attention, ce_rows, key_tile_blocks, triton
from dflash_train.helpers import block_mask_of_tiles, compiled, compute_dtype, hopper, ordered_blocks, \
    process_umask, sdpa_attend, text_config

# -----------------------------------------------------------------------------
# Config

# Loss decay per block slot: exp(-(k - 1) / gamma); the published values per block size.
LOSS_DECAY_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_loss_gamma(block_size):
    # Other block sizes: keep the published ratio gamma / block_size (7/16).
    return LOSS_DECAY_GAMMA.get(block_size, max(1.0, block_size * 7.0 / 16.0))


def default_target_layer_ids(num_target_layers, num_draft_layers):
    """Target layers whose outputs feed the drafter, spread evenly (the published recipe's rule:
    one layer -> L // 2, else round(1 + i * (L - 4) / (n - 1)); Qwen3-8B, 5 layers: [1, 9, 17, 25, 33])."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def check_target_layer_ids(layer_ids, num_target_layers):
    """Layers in [0, L - 1): for the target's last layer the reference decoder and SGLang hand the
    drafter the final-normed hidden_states[L], not the layer's own output that training reads."""
    bad = [i for i in layer_ids if not 0 <= i < num_target_layers - 1]
    if bad:
        raise ValueError(f"target layer ids {bad} are outside [0, {num_target_layers - 1}) for a target of "
                         f"{num_target_layers} layers: the last layer ({num_target_layers - 1}) is read final-normed "
                         "by the servers, which training cannot match")


def rope_fields(config):
    """(rope_theta, rope_scaling or None) of a config from transformers 4.x or 5.x."""
    params = getattr(config, "rope_parameters", None)
    if params:
        params = dict(params)
        theta = params.pop("rope_theta", getattr(config, "rope_theta", 10000.0))
        scaling = params if params.get("rope_type", "default") != "default" else None
        return float(theta), scaling
    return float(getattr(config, "rope_theta", 10000.0)), getattr(config, "rope_scaling", None)


def attention_shape(config):
    """(query heads, KV heads, head_dim) of a target's text config: the drafter's own."""
    heads = config.num_attention_heads
    return (heads, getattr(config, "num_key_value_heads", None) or heads,
            getattr(config, "head_dim", None) or config.hidden_size // heads)


def make_drafter_config(target_config, mask_token_id, num_draft_layers=5, block_size=16,
                        target_layer_ids=None):
    """A Qwen3-style drafter config with the target's shapes plus the DFlash fields."""
    tc = text_config(target_config)
    num_target_layers = tc.num_hidden_layers
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(num_target_layers, num_draft_layers)
    target_layer_ids = [int(i) for i in target_layer_ids]
    check_target_layer_ids(target_layer_ids, num_target_layers)
    if block_size < 2:
        raise ValueError(f"block_size must be at least 2, got {block_size}")
    if not 0 <= mask_token_id < tc.vocab_size:
        raise ValueError(f"mask_token_id {mask_token_id} is outside the vocabulary ({tc.vocab_size})")
    heads, kv_heads, head_dim = attention_shape(tc)
    rope_theta, rope_scaling = rope_fields(tc)
    rope = {"rope_theta": rope_theta}
    if rope_scaling:
        rope["rope_scaling"] = dict(rope_scaling)
    config = Qwen3Config(
        vocab_size=tc.vocab_size,
        hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size,
        num_hidden_layers=num_draft_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=getattr(tc, "max_position_embeddings", 32768),
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        attention_bias=False,
        tie_word_embeddings=False,
        layer_types=["full_attention"] * num_draft_layers,
        **rope,
    )
    config.architectures = ["DFlashDraftModel"]
    config.block_size = block_size
    config.num_target_layers = num_target_layers
    config.dflash_config = {"mask_token_id": int(mask_token_id), "target_layer_ids": target_layer_ids}
    return config


def serving_config_dict(config):
    """The drafter config as config.json holds it for the servers: a Qwen3 config plus the DFlash
    fields, the RoPE fields at the top level."""
    d = config.to_dict()
    theta, scaling = rope_fields(config)
    # Readers on transformers 4.x ignore rope_parameters and would fall back to theta 10000.
    d["rope_theta"] = theta
    if scaling:
        d["rope_scaling"] = scaling
    d.update(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        block_size=config.block_size,
        num_target_layers=config.num_target_layers,
        dflash_config=dict(config.dflash_config),
        # vLLM builds before its DFlash layer-offset fix read only this field (layer i -> i + 1)
        eagle_aux_hidden_state_layer_ids=[i + 1 for i in config.dflash_config["target_layer_ids"]],
        layer_types=["full_attention"] * config.num_hidden_layers,
        num_hidden_layers=config.num_hidden_layers,
        torch_dtype="bfloat16",
    )
    for key in ("id2label", "label2id", "dtype"):
        d.pop(key, None)
    return d


# -----------------------------------------------------------------------------
# Layers (Qwen3-style: RMSNorm, q/k-norm, RoPE, SwiGLU)

class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    # x: [B, heads, S, head_dim]; cos/sin: [B, S, head_dim]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


@torch.library.custom_op("dflash::computed_once", mutates_args=())
def computed_once(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos/sin as an opaque copy. Compiled, inductor fuses their computation into every
    consumer, so once per head, and again in the backward; an op it cannot see into makes it
    compute them once per position, into a buffer."""
    return cos.clone(), sin.clone()


@computed_once.register_fake
def _(cos, sin):
    return torch.empty_like(cos), torch.empty_like(sin)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def same_rows(t):
    return t


class DraftAttention(nn.Module):
    """Queries from the block; keys/values = concat(context, block) through the same k/v_proj."""

    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        h, qd, kvd = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(h, qd, bias=False)
        self.k_proj = nn.Linear(h, kvd, bias=False)
        self.v_proj = nn.Linear(h, kvd, bias=False)
        self.o_proj = nn.Linear(qd, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def _kv(self, x, cos, sin, spread=same_rows):
        B, S = cos.shape[:2]
        k = self.k_norm(spread(self.k_proj(x)).view(B, S, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = spread(self.v_proj(x)).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def context_kv(self, context, cos, sin):
        """Keys/values of the context (the drafter's KV cache holds exactly these)."""
        return self._kv(context, cos, sin)

    def forward(self, x, cos, sin, ctx_k, ctx_v, attend, spread=same_rows, keep=same_rows):
        """x: the block's rows, or with `spread` only its distinct rows (spread maps their
        projections onto the block's rows); `keep`: the rows whose output is wanted."""
        B, Q = cos.shape[:2]
        q = self.q_norm(spread(self.q_proj(x)).view(B, Q, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        blk_k, blk_v = self._kv(x, cos, sin, spread)
        k = torch.cat([ctx_k, blk_k], dim=2)
        v = torch.cat([ctx_v, blk_v], dim=2)
        out = attend(q, k, v)  # [B, heads, Q, head_dim]
        return self.o_proj(keep(out.transpose(1, 2).reshape(B, Q, -1)))


class DraftLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = DraftAttention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, attend, spread=same_rows, keep=same_rows):
        """spread: x holds only the block's distinct rows, each normed and projected once (spread
        maps them onto the block's rows); keep: the rows carried past the attention."""
        x, h = keep(spread(x)), self.input_layernorm(x)
        x = x + self.self_attn(h, cos, sin, ctx_k, ctx_v, attend, spread, keep)
        return x + self.mlp(self.post_attention_layernorm(x))


# -----------------------------------------------------------------------------
# Attention rule: block at anchor a sees context positions kv < a of its own document, and
# every slot of its own block. A document is a run of equal doc_ids (the packer lays a row's
# documents, then its padding, as runs), so the context a block sees is one range of keys,
# [start of the anchor's document, a): two numbers per block, read per query, none per key.
# One predicate; a dense form (CPU, tests) and a flex_attention block mask (GPU) are both built
# from it.

def context_starts(anchors, doc_ids):
    """[B, A]: the first position of each anchor's document: the last run start at or before it.
    A [B, A, L] reduction, not a cumulative max over the row: inductor's CPU flex_attention found
    no kernel for a mask reading a cummax's output."""
    pos = torch.arange(doc_ids.shape[1], device=doc_ids.device)
    run_start = torch.ones_like(doc_ids, dtype=torch.bool)
    run_start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return torch.where(run_start[:, None, :] & (pos <= anchors[:, :, None]), pos, 0).amax(-1)


def block_visible(q_idx, kv_idx, starts, anchors, seq_len, block_size):
    """Whether block query q_idx may attend to key kv_idx (keys: seq_len context, then blocks).

    starts and anchors [A] are one row's (context_starts, anchors); q_idx/kv_idx are
    broadcastable index tensors.
    """
    blk = q_idx // block_size
    at = blk.clamp(max=anchors.shape[-1] - 1)  # a padded q_idx past the last block stays in range
    in_context = (kv_idx >= starts[at]) & (kv_idx < anchors[at])  # anchors < seq_len: context keys only
    return in_context | ((kv_idx - seq_len) // block_size == blk)


def block_mask_mod(starts, anchors, seq_len, block_size):
    """flex_attention's mask_mod of the rule, for rows of starts and anchors [B, A]."""
    def mask_mod(b, h, q_idx, kv_idx):
        return block_visible(q_idx, kv_idx, starts[b], anchors[b], seq_len, block_size)
    return mask_mod


def visible_keys(starts, anchors, seq_len, block_size, num_keys):
    """[B, A, num_keys]: the keys each block may attend to. Every slot of a block sees the same
    keys (its anchor's context, then its own block), so one query per block decides; keys past
    the last block (padding to whole tiles) are seen by none."""
    first_slot = torch.arange(anchors.shape[1], device=anchors.device)[:, None] * block_size
    kv = torch.arange(num_keys, device=anchors.device)[None, :]
    # vmap over rows, not a Python loop: a loop traced into the compiled step grows with the
    # rows (at 4096 rows tracing alone had not finished after 140 s on the H200 machine)
    one_row = lambda row_starts, row_anchors: block_visible(first_slot, kv, row_starts, row_anchors, seq_len,
                                                            block_size)
    return torch.vmap(one_row)(starts, anchors)


def dense_block_mask(anchors, doc_ids, block_size):
    """[B, 1, A*bs, L + A*bs] boolean mask (True = may attend)."""
    A, L = anchors.shape[1], doc_ids.shape[1]
    seen = visible_keys(context_starts(anchors, doc_ids), anchors, L, block_size, L + A * block_size)
    return seen.repeat_interleave(block_size, 1)[:, None]


def flex_block_mask(starts, anchors, seq_len, block_size, mask_mod, tile=128):
    """The BlockMask create_block_mask(mask_mod) would give for the rule over rows of starts and
    anchors [B, A] (seq_len context keys), without evaluating it at every (query, key) pair: all
    slots of a block see the same keys, so the rule is evaluated once per block (first slot) and
    per-tile counts follow from how blocks overlap query tiles. At the benchmark's shapes:
    [4, 512, 11264] evaluations instead of [4, 8192, 11264], and no argsort. tile: one size, or
    (query tile, key tile)."""
    B, A = anchors.shape
    Q, KV = A * block_size, seq_len + A * block_size
    q_tile, kv_tile = (tile, tile) if isinstance(tile, int) else tile
    n_q, n_kv = -(-Q // q_tile), -(-KV // kv_tile)
    seen = visible_keys(starts, anchors, seq_len, block_size, n_kv * kv_tile)  # [B, A, n_kv * kv_tile]
    keys_per_tile = seen.view(B, A, n_kv, kv_tile).sum(-1, dtype=torch.int32)  # [B, A, n_kv]
    tile_start = torch.arange(n_q, device=anchors.device)[:, None] * q_tile
    block_start = torch.arange(A, device=anchors.device) * block_size
    queries = (torch.minimum(tile_start + q_tile, block_start + block_size)
               - torch.maximum(tile_start, block_start)).clamp(min=0)       # [n_q, A]: block's queries in tile
    # (query, key) pairs visible per tile, in integers: a matmul would run in bf16 under autocast
    pairs = (queries.int()[None, :, :, None] * keys_per_tile[:, None]).sum(2)[:, None]  # [B, 1, n_q, n_kv]
    full = pairs == q_tile * kv_tile
    partial = (pairs > 0) & ~full
    mask = block_mask_of_tiles(partial, full, mask_mod, (Q, KV), tile)
    # flex's backward kernel reads q indices with unit stride along the last dim: contiguous
    q_num, q_idx = ordered_blocks(partial.transpose(-2, -1).contiguous())
    full_q_num, full_q_idx = ordered_blocks(full.transpose(-2, -1).contiguous())
    mask.q_num_blocks, mask.q_indices = q_num, q_idx
    mask.full_q_num_blocks, mask.full_q_indices = full_q_num, full_q_idx
    return mask


# flex_attention's backward on Hopper (sm90) at head_dim 64 and 128: 2 stages instead of
# inductor's default 3, faster with bitwise the same outputs and gradients (scripts/tune_kernels.py
# re-measures it).
SM90_FLEX_BACKWARD = {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                      "bwd_num_stages": 2, "bwd_num_warps": 8}
def flex_kernel_options(device, head_dim):
    """The measured flex_attention settings for the drafter's training attention; None
    (inductor's defaults) where none was measured."""
    return SM90_FLEX_BACKWARD if head_dim in (64, 128) and hopper(device) else None


def flex_attend(anchors, doc_ids, block_size):
    """flex_attention over a block-sparse mask built from the same predicate (GPU path). Inside a
    torch.compile'd step both are traced into the step; eagerly, flex_attention runs compiled."""
    from torch.nn.attention.flex_attention import flex_attention
    L, starts = doc_ids.shape[1], context_starts(anchors, doc_ids)
    # Not create_block_mask: compiling it cost 153 s at start-up at the benchmark's shapes on an
    # H200, in eager mode (its _compile) and traced into the compiled step.
    block_mask = flex_block_mask(starts, anchors, L, block_size, block_mask_mod(starts, anchors, L, block_size))
    attn = flex_attention if torch.compiler.is_compiling() else compiled(flex_attention)

    def attend(q, k, v):
        return attn(q, k, v, block_mask=block_mask, enable_gqa=True,
                    kernel_options=flex_kernel_options(q.device, q.shape[-1]))
    return attend


def block_attend(anchors, doc_ids, block_size):
    """The rule by the Triton kernels above (CUDA with triton). q/k/v as DraftAttention hands
    them over: doc_ids.shape[1] context keys, then the blocks'. The backward needs anchors sorted
    per row, as select_anchors gives them. Per batch, once for every layer: each block's key
    range, and the run of blocks each tile of context keys may be seen by."""
    starts = context_starts(anchors, doc_ids).to(torch.int32).contiguous()
    anchors = anchors.to(torch.int32).contiguous()
    key_tile = BLOCK_ATTENTION_CONFIG["dkdv_keys"]
    tile_blocks = key_tile_blocks(starts, anchors, doc_ids.shape[1], key_tile)

    def attend(q, k, v):
        # One dtype for the kernels' dots: under autocast the one SDPA would take (q and k come
        # out of the fp32-weighted q/k-norm in fp32, v from its projection in bf16)
        dtype = compute_dtype(q.device, q.dtype)
        return block_attention(q.to(dtype), k.to(dtype), v.to(dtype), starts, anchors, tile_blocks, block_size,
                                key_tile)[0]
    return attend


def full_attend(q, k, v):
    # Inference: the block sees its whole context (all of it lies before the anchor) and itself.
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


# -----------------------------------------------------------------------------
# LM head + cross-entropy in chunks: peak memory holds one chunk of logits, never
# num_positions x vocab. The LM head is frozen, so the only gradient is d ce / d hidden, and it is
# computed in the forward pass while the chunk's logits are at hand: two matmuls per chunk in all
# (a recompute in backward would be a third). Backward only scales it by the incoming grad.

def _upcast(x):
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _head_logits(hidden, weight, labels):
    """(logits in fp32 or wider, their logsumexp, ce, whether the argmax is the label) of one
    chunk of positions."""
    logits = _upcast(hidden @ weight.t())
    lse = torch.logsumexp(logits, -1, keepdim=True)
    ce = (lse - logits.gather(1, labels[:, None])).squeeze(1)
    return logits, lse, ce, logits.argmax(-1) == labels


def _head_ce_chunk(hidden, weight, labels, with_grad):
    """ce, correct and (if with_grad) d ce / d hidden for one chunk of positions (hidden in the
    weight's dtype, as lm_head_ce hands it over)."""
    logits, lse, ce, correct = _head_logits(hidden, weight, labels)
    if not with_grad:
        return ce, correct, None
    probs = torch.exp(logits - lse)  # d ce / d logits = softmax - onehot(label)
    if torch.compiler.is_compiling():  # fused into the reductions' pass, which then writes bf16
        label_hit = torch.arange(probs.shape[1], device=probs.device) == labels[:, None]
        dlogits = torch.where(label_hit, probs - 1.0, probs)
    else:  # eager: in place, no second vocabulary-wide buffer
        dlogits = probs.scatter_add_(1, labels[:, None], torch.full_like(probs[:, :1], -1.0))
    return ce, correct, dlogits.to(weight.dtype) @ weight


# On CUDA the chunk's reductions are one Triton kernel: inductor's reads each row of logits about
# six times, this one twice, writing the gradient once in bf16 over the logits themselves.
HEAD_CE_KERNEL = "triton"  # or "torch" (inductor's); scripts/benchmark.py --ce-kernel compares them
def _head_ce_chunk_triton(hidden, weight, labels, with_grad, **config):
    """_head_ce_chunk's contract, its reductions in ce_rows."""
    logits = hidden @ weight.t()
    ce, correct = ce_rows(logits, labels.contiguous(), with_grad, **config)
    return ce, correct, logits @ weight if with_grad else None


def head_ce_chunk_fn(device, compile_chunk):
    """The chunk function lm_head_ce runs: HEAD_CE_KERNEL "triton" on CUDA where triton is
    installed, else torch's (compiled when compile_chunk)."""
    if HEAD_CE_KERNEL == "triton" and device.type == "cuda" and triton is not None:
        return _head_ce_chunk_triton
    return compiled(_head_ce_chunk) if compile_chunk else _head_ce_chunk


# Distillation: the target's next-token distribution p arrives as its top-k (ids, probabilities)
# with the rest of its mass r = 1 - sum(p) as one bucket, the drafter's q is its softmax, and the
# loss is KL(p || q) over the k tokens and the bucket:
#     sum_i p_i log(p_i / q_i) + r log(r / q_rest),   q_rest = the drafter's mass outside the k.
# With k = the vocabulary it is the exact KL; with p one-hot on the label it is the cross-entropy.
# d KL / d logit_j = q_j - p_j (j among the k), q_j - r q_j / q_rest (else): bounded, since
# q_j / q_rest sums to 1 outside the k. kl_weight w mixes it with the cross-entropy on the
# data's token: (1 - w) ce + w kl.

def _head_distill_chunk(hidden, weight, labels, top_ids, top_probs, kl_weight, with_grad):
    """_head_ce_chunk's contract for the loss (1 - kl_weight) ce + kl_weight KL(p || q), p given
    as top_ids, top_probs [N, k] and the rest of its mass."""
    logits, lse, ce, correct = _head_logits(hidden, weight, labels)
    p = top_probs.to(logits.dtype)
    rest = (1.0 - p.sum(-1, keepdim=True)).clamp(min=0.0)
    outside = logits.scatter(1, top_ids, float("-inf"))  # the drafter's logits outside the k
    lse_rest = torch.logsumexp(outside, -1, keepdim=True)
    has_rest = (rest > 0) & (lse_rest > float("-inf"))  # k = the vocabulary: no bucket, whatever rounding left
    soft_ce = -(p * (logits.gather(1, top_ids) - lse)).sum(-1, keepdim=True) \
        - torch.where(has_rest, rest * (lse_rest - lse), 0.0)
    entropy = -torch.xlogy(p, p).sum(-1, keepdim=True) - torch.xlogy(rest, rest)
    kl = (soft_ce - entropy).squeeze(1)
    loss = (1.0 - kl_weight) * ce + kl_weight * kl
    if not with_grad:
        return loss, correct, None
    dlogits = torch.exp(logits - lse) - kl_weight * torch.where(has_rest, rest * torch.exp(outside - lse_rest), 0.0)
    dlogits = dlogits.scatter_add(1, top_ids, -kl_weight * p)
    dlogits = dlogits.scatter_add(1, labels[:, None], torch.full_like(p[:, :1], kl_weight - 1.0))
    return loss, correct, dlogits.to(weight.dtype) @ weight


# A custom op, so that torch.compile sees one opaque call: traced, the loop over chunks unrolled
# into the step, and compile time grew with the chunk count (53 chunks: still compiling after
# 200 s on an H200). Inside a compiled step each chunk runs one compiled kernel
# set instead (compile_chunk), built once per chunk shape.
@torch.library.custom_op("dflash::lm_head_ce", mutates_args=())
def _lm_head_ce(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                with_grad: bool, compile_chunk: bool, top_ids: Optional[torch.Tensor] = None,
                top_probs: Optional[torch.Tensor] = None,
                kl_weight: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if top_ids is None:
        chunk = head_ce_chunk_fn(hidden.device, compile_chunk)
        parts = [chunk(hidden[s:s + chunk_size], weight, labels[s:s + chunk_size], with_grad)
                 for s in range(0, hidden.shape[0], chunk_size)]
    else:
        chunk = compiled(_head_distill_chunk) if compile_chunk else _head_distill_chunk
        parts = [chunk(hidden[s:s + chunk_size], weight, labels[s:s + chunk_size], top_ids[s:s + chunk_size],
                       top_probs[s:s + chunk_size], kl_weight, with_grad)
                 for s in range(0, hidden.shape[0], chunk_size)]
    loss, correct = torch.cat([o[0] for o in parts]), torch.cat([o[1] for o in parts])
    dloss_dhidden = torch.cat([o[2] for o in parts]) if with_grad else hidden.new_empty(0)
    return loss, correct, dloss_dhidden


@_lm_head_ce.register_fake
def _(hidden, weight, labels, chunk_size, with_grad, compile_chunk, top_ids=None, top_probs=None, kl_weight=0.0):
    n = hidden.shape[0]
    return (hidden.new_empty(n, dtype=torch.promote_types(weight.dtype, torch.float32)),
            hidden.new_empty(n, dtype=torch.bool),
            hidden.new_empty((n, hidden.shape[1]) if with_grad else 0))


def _lm_head_ce_setup(ctx, inputs, output):
    ctx.with_grad = inputs[4]
    ctx.save_for_backward(output[2])


def _lm_head_ce_backward(ctx, grad_loss, grad_correct, grad_dloss_dhidden):
    if not ctx.with_grad:
        raise RuntimeError("lm_head_ce was called with with_grad=False")
    (dloss_dhidden,) = ctx.saved_tensors
    grad = _upcast(dloss_dhidden) * _upcast(grad_loss)[:, None]
    return (grad.to(dloss_dhidden.dtype),) + (None,) * 8


_lm_head_ce.register_autograd(_lm_head_ce_backward, setup_context=_lm_head_ce_setup)


def lm_head_ce(hidden, weight, labels, chunk_size, with_grad=True, distribution=None, kl_weight=0.0):
    """Per-position cross-entropy of the frozen LM head and whether its argmax is the label;
    differentiable in hidden when with_grad. With distribution = (top ids, top probabilities)
    [N, k] of the target's next-token distribution, the loss is (1 - kl_weight) ce + kl_weight
    KL(target || drafter) instead (_head_distill_chunk). hidden enters the op in the weight's
    dtype, as the chunks' matmuls read it: in a compiled step the final norm then writes bf16, not
    fp32 that the opaque op would cast chunk by chunk and whose gradient it would upcast and
    concatenate."""
    top_ids, top_probs = distribution if distribution is not None else (None, None)
    loss, correct, _ = _lm_head_ce(hidden.to(weight.dtype), weight, labels, chunk_size, with_grad,
                                   torch.compiler.is_compiling(), top_ids, top_probs, float(kl_weight))
    return loss, correct


# -----------------------------------------------------------------------------
# The drafter

def embedding_on(module, device, dtype=None):
    """The target's embedding module on device in dtype: itself where it already is, else a copy."""
    w = module.weight
    if w.device == torch.device(device) and (dtype is None or w.dtype == dtype):
        return module
    return copy.deepcopy(module).to(device, dtype or w.dtype)


class DFlashDraftModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.block_size = config.block_size
        self.mask_token_id = config.dflash_config["mask_token_id"]
        self.target_layer_ids = list(config.dflash_config["target_layer_ids"])
        h = config.hidden_size
        self.layers = nn.ModuleList(DraftLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)  # non-persistent buffers only
        # The target's frozen embedding module and LM head, set by set_target_parts(): never in
        # state_dict or the checkpoint.
        object.__setattr__(self, "embed_tokens", None)
        self.register_buffer("lm_head_weight", None, persistent=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)

    def set_target_parts(self, embedding, lm_head_weight):
        """The target's frozen input embedding module and LM head weight, on this drafter's
        device. Block tokens go through the embedding module's own forward, as the serving stacks
        embed them: targets that scale their embedding (Gemma: x sqrt(hidden)) stay right."""
        embedding.requires_grad_(False)
        object.__setattr__(self, "embed_tokens", embedding)  # not a submodule: kept out of the checkpoint
        self.lm_head_weight = lm_head_weight
        return self

    def attach_target(self, target, dtype=None):
        """Use the target's embedding and LM head, frozen (copied to this drafter's device)."""
        dev = next(self.parameters()).device
        head = target.get_output_embeddings().weight.detach()
        return self.set_target_parts(embedding_on(target.get_input_embeddings(), dev, dtype),
                                     head.to(dev, dtype or head.dtype))

    def num_parameters(self):
        return sum(p.numel() for p in self.parameters())

    # --- shared by training and inference --------------------------------------------------

    def context_kv(self, target_hidden, positions):
        """Per-layer keys/values of the context: hidden_norm(fc(features)) through each k/v_proj."""
        ctx = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rope(ctx, positions)
        return [layer.self_attn.context_kv(ctx, cos, sin) for layer in self.layers]

    def rope(self, x, positions):
        """RoPE's (cos, sin) at positions, in x's dtype, computed once per position when compiled."""
        return computed_once(*self.rotary_emb(x, positions))

    def draft_hidden(self, anchor_ids, block_positions, ctx_kv, attend):
        """Final-norm hidden states [B, A, bs - 1, H] of the predicting slots (1..) of the blocks
        whose slot 0 holds anchor_ids [B, A] and every other slot the mask token; block_positions
        [B, A * bs]. Logits are these @ lm_head_weight.T.

        The first layer projects each distinct input row once: each block's anchor row, and one
        mask row for all blocks (its bs - 1 mask rows are the same vector until the attention). The
        last layer carries only the predicting slots past its attention: slot 0's output is
        never read."""
        B, A = anchor_ids.shape
        bs, last = self.block_size, len(self.layers) - 1
        mask = torch.full((1,), self.mask_token_id, dtype=anchor_ids.dtype, device=anchor_ids.device)
        # the residual stream in the dtype the matmuls compute in: autocast's where it is on (bf16, as a
        # server runs the drafter), else the master weights' (a norm's: never the
        # bf16 copies a training step may pass for the matmul weights)
        dtype = compute_dtype(anchor_ids.device, self.norm.weight.dtype)
        x = self.embed_tokens(torch.cat([anchor_ids.reshape(-1), mask])).to(dtype)  # distinct rows
        slot0 = (torch.arange(bs, device=anchor_ids.device) == 0).view(1, 1, bs, 1)

        def spread(t):  # [B * A + 1, n] (anchor rows, then the mask row) -> [B, A * bs, n]
            # a broadcast, whose backward sums the mask rows (a cat of an expanded view: torch
            # 2.11's inductor wrote a Triton kernel that does not compile)
            return torch.where(slot0, t[:-1].view(B, A, 1, -1), t[-1].view(1, 1, 1, -1)).view(B, A * bs, -1)

        def predicting(t):  # [B, A * bs, n] -> [B, A * (bs - 1), n]
            return t.view(B, A, bs, -1)[:, :, 1:].reshape(B, A * (bs - 1), -1)

        cos, sin = self.rope(x, block_positions)
        for i, (layer, (k, v)) in enumerate(zip(self.layers, ctx_kv)):
            x = layer(x, cos, sin, k, v, attend, spread=spread if i == 0 else same_rows,
                      keep=predicting if i == last else same_rows)
        return self.norm(x).view(B, A, bs - 1, -1)

    # --- training ---------------------------------------------------------------------------

    @staticmethod
    def anchor_can_draft(loss_mask, doc_ids):
        """[B, L]: whether a block anchored at each position has a trained token to draft (a + 1
        in the loss mask and the same document, and a too)."""
        ok = loss_mask.bool()
        valid = torch.zeros_like(ok)
        valid[:, :-1] = ok[:, :-1] & ok[:, 1:] & (doc_ids[:, :-1] == doc_ids[:, 1:])
        return valid

    @staticmethod
    def select_anchors(anchor_noise, loss_mask, doc_ids, num_anchors):
        """A fixed number of anchors per row among positions a with loss_mask[a] and
        loss_mask[a+1] in one document; extra draws when too few are valid get valid=False.
        Fixed shapes and no host sync: top-k of masked random scores, then sorted."""
        valid = DFlashDraftModel.anchor_can_draft(loss_mask, doc_ids)
        scores = torch.where(valid, anchor_noise, torch.full_like(anchor_noise, -1.0))
        anchors = torch.sort(scores.topk(num_anchors, dim=1).indices, dim=1).values
        return anchors, valid.gather(1, anchors)

    def block_hidden(self, target_hidden, input_ids, doc_ids, position_ids, anchors, attention="sdpa"):
        """Hidden states [B, A, bs - 1, H] of the predicting slots of the blocks at `anchors` [B, A]
        (training forward)."""
        bs = self.block_size
        B, A = anchors.shape
        slot = torch.arange(bs, device=anchors.device)
        block_pos = position_ids.gather(1, anchors)[:, :, None] + slot
        if attention == "triton":
            attend = block_attend(anchors, doc_ids, bs)
        elif attention == "flex":
            attend = flex_attend(anchors, doc_ids, bs)
        else:
            attend = sdpa_attend(dense_block_mask(anchors, doc_ids, bs))
        ctx_kv = self.context_kv(target_hidden, position_ids)
        return self.draft_hidden(input_ids.gather(1, anchors), block_pos.view(B, A * bs), ctx_kv, attend)

    def forward(self, target_hidden, input_ids, loss_mask, doc_ids, position_ids, anchor_noise,
                target_top_ids=None, target_top_probs=None, *, num_anchors, gamma=None, kl_weight=0.0,
                ce_chunk_size=4096, attention="sdpa"):
        """Training loss for one fixed-shape batch, plus a stats vector (see stats_to_metrics).

        target_hidden [B, L, n*H]; input_ids, loss_mask, doc_ids, position_ids, anchor_noise [B, L];
        target_top_ids, target_top_probs [B, L, k]: the target's next-token distribution after each
        position as its top k, for the loss (1 - kl_weight) ce + kl_weight KL (lm_head_ce).
        """
        bs = self.block_size
        gamma = gamma or default_loss_gamma(bs)
        anchors, anchor_valid = self.select_anchors(anchor_noise, loss_mask, doc_ids, num_anchors)
        distribution = None if target_top_ids is None else (target_top_ids, target_top_probs)
        ce, correct, label_ok = self.block_predictions(target_hidden, input_ids, loss_mask, doc_ids, position_ids,
                                                       anchors, anchor_valid, ce_chunk_size, attention,
                                                       distribution, kl_weight)
        slot = torch.arange(1, bs, device=anchors.device)
        weight = torch.exp(-(slot - 1).to(ce.dtype) / gamma) * label_ok
        loss = (weight * ce).sum() / weight.sum().clamp(min=1e-6)
        return loss, self.block_stats(loss, correct, label_ok, anchor_valid)

    def block_predictions(self, target_hidden, input_ids, loss_mask, doc_ids, position_ids, anchors, anchor_valid,
                          ce_chunk_size=4096, attention="sdpa", distribution=None, kl_weight=0.0):
        """(loss, greedy draft correct, label counts) [B, A, bs - 1] for slots 1.. of the blocks at
        anchors [B, A]; the loss is the cross-entropy, or with distribution (the target's top ids
        and probabilities [B, L, k]) mixed with the KL at kl_weight."""
        bs = self.block_size
        B, num_anchors = anchors.shape
        hidden = self.block_hidden(target_hidden, input_ids, doc_ids, position_ids, anchors, attention)
        labels, label_ok = self.block_labels(input_ids, loss_mask, doc_ids, anchors, anchor_valid)
        if distribution is not None:
            distribution = tuple(t.flatten(0, 2) for t in self.block_distribution(distribution, anchors))
        predicting = hidden.flatten(0, 2)
        loss, correct = lm_head_ce(predicting, self.lm_head_weight, labels.reshape(-1), ce_chunk_size,
                                   torch.is_grad_enabled() and predicting.requires_grad, distribution, kl_weight)
        return loss.view(B, num_anchors, bs - 1), correct.view(B, num_anchors, bs - 1), label_ok

    def block_distribution(self, distribution, anchors):
        """The target's top ids and probabilities after each position [B, L, k], for slots 1.. of the
        blocks at anchors [B, A]: [B, A, bs - 1, k]. Slot k predicts token a + k, so it reads the
        distribution after a + k - 1."""
        B, A = anchors.shape
        L, k = distribution[0].shape[1:]
        after = (anchors[:, :, None] + torch.arange(self.block_size - 1, device=anchors.device)).clamp(max=L - 1)
        return tuple(t.gather(1, after.view(B, -1, 1).expand(-1, -1, k)).view(B, A, self.block_size - 1, k)
                     for t in (distribution[0].long(), distribution[1]))

    def block_labels(self, input_ids, loss_mask, doc_ids, anchors, anchor_valid):
        """(labels, whether each counts) [B, A, bs - 1]: slot k of the block at a predicts token
        a + k (k >= 1), which counts inside the row, the anchor's document and the loss mask."""
        B, L = input_ids.shape
        idx = anchors[:, :, None] + torch.arange(1, self.block_size, device=anchors.device)
        in_row = idx < L
        idx = idx.clamp(max=L - 1)
        flat = lambda t: t.gather(1, idx.view(B, -1)).view(B, -1, self.block_size - 1)  # noqa: E731
        anchor_doc = doc_ids.gather(1, anchors)[:, :, None]
        counts = in_row & (flat(doc_ids) == anchor_doc) & flat(loss_mask).bool() & anchor_valid[:, :, None]
        return flat(input_ids), counts

    @torch.no_grad()
    def accepted_lengths(self, target_hidden, input_ids, anchors, loss_mask=None, doc_ids=None, position_ids=None,
                         ce_chunk_size=4096, attention="sdpa"):
        """Teacher-forced: the tokens greedy verification would gain at each anchor [B, A] (1 + the
        leading slots whose greedy draft equals the tokens that follow, inside the anchor's
        document and loss mask). Without the packing tensors: one document per row, all counted.
        Slot by slot, the LM head only for blocks still right so far: it is most of the cost."""
        B, L = input_ids.shape
        if loss_mask is None:
            loss_mask, doc_ids = torch.ones(B, L, device=input_ids.device), torch.zeros_like(input_ids)
            position_ids = torch.arange(L, device=input_ids.device).expand(B, L)
        hidden = self.block_hidden(target_hidden, input_ids, doc_ids, position_ids, anchors, attention)
        every = torch.ones_like(anchors, dtype=torch.bool)
        labels, label_ok = self.block_labels(input_ids, loss_mask, doc_ids, anchors, every)
        tau = torch.ones_like(anchors)
        right_so_far = torch.ones_like(anchors, dtype=torch.bool)
        for k in range(1, self.block_size):
            b, a = right_so_far.nonzero(as_tuple=True)
            if not len(b):
                break
            draft = torch.cat([(h.to(self.lm_head_weight.dtype) @ self.lm_head_weight.t()).argmax(-1)
                               for h in hidden[b, a, k - 1].split(ce_chunk_size)])
            hit = (draft == labels[b, a, k - 1]) & label_ok[b, a, k - 1]
            tau[b, a] += hit.long()
            right_so_far[b, a] = hit
        return tau

    @torch.no_grad()
    def expected_accepted_lengths(self, target_hidden, input_ids, anchors, distribution, loss_mask, doc_ids,
                                  position_ids, ce_chunk_size=4096, attention="sdpa"):
        """Teacher-forced, sampled: the tokens speculative sampling is expected to gain at each
        anchor [B, A], the target sampling from `distribution` (its top ids and probabilities after
        each position [B, L, k], at the serving temperature): 1 + sum_k prod_{j <= k} p(draft_j),
        p the target's probability of the drafter's proposal (its argmax) after the data's tokens.
        Exact while the proposals are the data's tokens; a proposal outside the top k counts as
        rejected."""
        B, A = anchors.shape
        hidden = self.block_hidden(target_hidden, input_ids, doc_ids, position_ids, anchors, attention)
        _, label_ok = self.block_labels(input_ids, loss_mask, doc_ids, anchors, torch.ones_like(anchors).bool())
        draft = torch.cat([(h.to(self.lm_head_weight.dtype) @ self.lm_head_weight.t()).argmax(-1)
                           for h in hidden.flatten(0, 2).split(ce_chunk_size)]).view(B, A, -1, 1)
        top_ids, top_probs = self.block_distribution(distribution, anchors)
        accepted = torch.where(top_ids == draft, top_probs.float(), 0.0).sum(-1) * label_ok
        return 1 + accepted.cumprod(-1).sum(-1)

    @staticmethod
    def block_stats(loss, correct, label_ok, anchor_valid):
        """Sums that add up across steps: [loss, sum tau, blocks, correct per slot, labels per slot].
        correct and label_ok are [B, A, bs - 1], for slots 1..bs-1."""
        hit = correct & label_ok
        tau = 1 + hit.long().cumprod(-1).sum(-1)  # 1 + leading correct slots
        valid = anchor_valid.float()
        return torch.cat([
            loss.detach().float()[None],
            (tau.float() * valid).sum()[None],
            valid.sum()[None],
            hit.float().sum((0, 1)),
            label_ok.float().sum((0, 1)),
        ])

    # --- inference --------------------------------------------------------------------------

    @torch.no_grad()
    def draft_logits(self, ctx_kv, anchor_token, anchor_position, attend=full_attend):
        """Logits [B, bs-1, V] for slots 1.. of B blocks: anchor tokens [B] (or one scalar) at
        anchor positions [B] (or one number), given the context cache; attend: which context
        keys each block sees (default: all of them)."""
        bs, dev = self.block_size, self.lm_head_weight.device
        anchor = torch.as_tensor(anchor_token, device=dev).reshape(-1, 1)
        positions = torch.as_tensor(anchor_position, device=dev).reshape(-1, 1) + torch.arange(bs, device=dev)
        hidden = self.draft_hidden(anchor, positions.expand(len(anchor), bs), ctx_kv, attend)[:, 0]
        return hidden.to(self.lm_head_weight.dtype) @ self.lm_head_weight.t()

    # --- checkpoint -------------------------------------------------------------------------

    def save_pretrained(self, path, dtype=None):
        """config.json + model.safetensors, the format SGLang / vLLM / the reference code load."""
        from safetensors.torch import save_file
        os.makedirs(path, exist_ok=True)
        state = {k: v.detach().to(dtype or v.dtype).contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        os.chmod(os.path.join(path, "model.safetensors"), 0o666 & ~process_umask())  # as open() would make it
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(serving_config_dict(self.config), f, indent=2, sort_keys=True)

    @staticmethod
    def read_config(path):
        """The config of a drafter directory (its config.json)."""
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        return Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("model_type", "transformers_version")})

    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype=None):
        from safetensors.torch import load_file
        model = cls(cls.read_config(path))
        model.load_state_dict(load_file(os.path.join(path, "model.safetensors")), strict=True)
        return model.to(device=device, dtype=dtype)


TRAINING_RECORD = "dflash_training.json"


def write_training_record(path, settings):
    """Beside config.json: how the drafter was trained (target, data, chat-template options,
    shapes, target layers, mask token), so a server can be set up the same way and an evaluation
    knows the drafter's own target."""
    with open(os.path.join(path, TRAINING_RECORD), "w") as f:
        json.dump(settings, f, indent=1, sort_keys=True)


def read_training_record(path):
    p = os.path.join(path, TRAINING_RECORD)
    if not os.path.exists(p):
        return {}
    with open(p) as f:
        return json.load(f)


def stats_to_metrics(stats, steps):
    """Turn summed block_stats into loss, tau_hat and accuracy per slot 1..bs-1."""
    stats = stats.double().cpu()
    n = (stats.numel() - 3) // 2
    hits, labels = stats[3:3 + n], stats[3 + n:]
    return {
        "loss": float(stats[0]) / max(steps, 1),
        "tau_hat": float(stats[1] / stats[2].clamp(min=1)),
        "acc": [round(float(a), 4) for a in hits / labels.clamp(min=1)],
        "acc_mean": float(hits.sum() / labels.sum().clamp(min=1)),
    }
