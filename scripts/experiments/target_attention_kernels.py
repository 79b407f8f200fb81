"""The target stage's document-causal attention forward by kernel, at the benchmark's Qwen3-8B
shapes (4 rows x 3072 tokens, 32 query / 8 KV heads of 128): flex_attention under the stage's
block mask with its tiles (dm.SM90_FLEX_TARGET on Hopper; the mask in the same tiles,
dm.flex_mask_tile, since the fifty-second session: the forty-fifth's figures used 128), against
the varlen kernels PyTorch ships (FlashAttention 2 and cuDNN through cumulative sequence offsets,
each document one sequence), eager and replayed as a CUDA graph. Two packings: one document a
row (the benchmark's) and several documents a row as the pipeline packs them (tp.pack_epoch); the
offsets are padded to a fixed count with empty sequences, as a fixed-shape graph needs.

    python scripts/experiments/target_attention_kernels.py

Prints, per packing and kernel, ms eager and graphed, TFLOP/s over the visible (query, key) pairs
and the largest difference from flex's output on the real tokens. On an H100 with torch 2.11
(docs/benchmarks.md, forty-fifth session): flex fastest of the document-causal kernels; cuDNN's
varlen path builds its graph every call (~48 ms) and cannot be captured; cuDNN's dense causal
kernel is 1.5x flex but serves only one document a row."""
import os, sys
import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import dflash_model as dm  # noqa: E402
import train_dflash_pipeline as tp  # noqa: E402
from scripts.benchmark import time_cuda  # noqa: E402

dev = "cuda"
B, H, KV, L, D = 4, 32, 8, 3072, 128
T = B * L
gen = torch.Generator(dev).manual_seed(0)
# [T, heads, D]: the varlen kernels' layout; flex gets the transposed [B, heads, L, D] view
q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16, generator=gen)
k = torch.randn(T, KV, D, device=dev, dtype=torch.bfloat16, generator=gen)
v = torch.randn(T, KV, D, device=dev, dtype=torch.bfloat16, generator=gen)


def rows(t):
    return t.view(B, L, -1, D).transpose(1, 2)


def packed_doc_ids(seed):
    """The pipeline's packing (tp.pack_epoch, tp.make_batch) of documents of 64 to 2048 tokens:
    several a row, each row's unused end padding."""
    lengths = np.random.default_rng(seed).integers(64, 2049, 64)

    class Documents:  # make_batch reads only each document's tokens and loss mask
        def doc(self, d):
            return np.zeros(lengths[d], np.int64), np.ones(lengths[d], np.float32)
    packed = tp.pack_epoch(lengths, L, seed, 0)[:B]
    return tp.make_batch(Documents(), packed, L)["doc_ids"].to(dev)


def cu_seqlens(doc_ids, count):
    """Each run of one document (padding a run of its own) as one sequence of the flattened
    batch: [count + 1] int32 offsets, the unused ones T (empty sequences)."""
    flat = doc_ids.flatten()
    pos = torch.arange(T, device=dev)
    start = (pos % L == 0) | (flat != torch.roll(flat, 1))
    starts = torch.nonzero_static(start, size=count, fill_value=T).flatten()
    return torch.cat([starts, torch.tensor([T], device=dev)]).to(torch.int32)


for name, doc_ids in [("one document a row", torch.zeros(B, L, dtype=torch.long, device=dev)),
                      ("packed, padded", packed_doc_ids(0))]:
    opts = dm.flex_kernel_options(torch.device(dev), D, target_stage=True)
    block_mask = tp.document_block_mask(doc_ids, tile=dm.flex_mask_tile(opts))  # the stage's tiles since the 52nd session
    lengths = cu_seqlens(doc_ids, T).diff().double()  # every run's length, then empty ones
    n_seqs = int(lengths.gt(0).sum())
    flops = 4 * H * D * float((lengths * (lengths + 1) / 2).sum())  # the visible (query, key) pairs
    flex = torch.compile(lambda: flex_attention(rows(q), rows(k), rows(v), block_mask=block_mask, enable_gqa=True,
                                                kernel_options=opts).transpose(1, 2).reshape(T, H, D), dynamic=False)
    ref = flex()
    print(f"== {name}: {n_seqs} sequences, {flops / 1e9:.0f} GFLOP of attention", flush=True)
    kernels = {"flex (the stage's)": flex}
    for count in (n_seqs, 4 * n_seqs):
        cu = cu_seqlens(doc_ids, count)
        kernels[f"flash varlen, {count} offsets"] = lambda cu=cu: torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, L, L, 0.0, True, False)[0]
        kernels[f"cudnn varlen, {count} offsets"] = lambda cu=cu: torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu, cu, L, L, False, 0.0, True, False)[0]
    if name == "one document a row":
        def cudnn_dense():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(rows(q), rows(k), rows(v), is_causal=True, enable_gqa=True)\
                    .transpose(1, 2).reshape(T, H, D)
        kernels["cudnn sdpa causal (dense)"] = cudnn_dense
    real = (doc_ids >= 0).flatten()
    for label, fn in kernels.items():
        try:
            out = fn()
            diff = (out.float() - ref.float())[real].abs().max().item()
            t = time_cuda(fn, 20, dev, warmup=3)
        except Exception as e:  # a kernel this build or card cannot run: say so and go on
            print(f"  {label}: failed, {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                graphed_out = fn()
            graph.replay()
            graph_diff = (graphed_out.float() - out.float())[real].abs().max().item()
            tg = time_cuda(graph.replay, 20, dev, warmup=3)
        except Exception as e:  # runs, but not under capture
            print(f"  {label}: {t * 1e3:.3f} ms, {flops / t / 1e12:.0f} TFLOP/s, max |diff| from flex {diff:.4f}; "
                  f"capture failed, {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        print(f"  {label}: {t * 1e3:.3f} ms, graphed {tg * 1e3:.3f} ms, {flops / tg / 1e12:.0f} TFLOP/s, "
              f"max |diff| from flex {diff:.4f}, graph vs eager {graph_diff:.4f}", flush=True)
