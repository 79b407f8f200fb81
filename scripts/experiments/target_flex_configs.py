"""The target stage's flex attention forward alone, per kernel_options config, at the benchmark's
Qwen3-8B shapes: 4 rows x 3072 tokens, 32 query / 8 KV heads of 128, one document a row, under
the stage's own block mask (train_dflash_pipeline.document_block_mask, in tiles of each config's own:
dm.flex_mask_tile, as the stage builds it since the fifty-second session), the queries token-major
as the stage stores them (dm.token_major; head-major in the forty-fourth session's run). First
inductor's default for the card (None; on an H100/H200 in bf16 at head dim 128: BLOCK_M 128,
BLOCK_N 64, 3 stages, 8 warps), then the stage's own on Hopper (dm.SM90_FLEX_TARGET), then others.

    python scripts/experiments/target_flex_configs.py

Prints ms, TFLOP/s over the causal (query, key) pairs and the largest difference from the first
config's output (the default's), one line per config; the last line is the fastest config as
JSON (null: the default). Measured on an H200 (forty-fourth session) and an H100 (forty-fifth), both
with the mask in tiles of 128:
docs/benchmarks.md."""
import json, os, sys
import torch
from torch.nn.attention.flex_attention import flex_attention
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import dflash_model as dm  # noqa: E402
import train_dflash_pipeline as tp  # noqa: E402
from scripts.benchmark import time_cuda  # noqa: E402

torch._dynamo.config.recompile_limit = 64  # one compile per config
dev = "cuda"
B, H, KV, L, D = 4, 32, 8, 3072, 128
gen = torch.Generator(dev).manual_seed(0)
q = torch.randn(B, L, H, D, device=dev, dtype=torch.bfloat16, generator=gen).transpose(1, 2)  # token-major, as the stage's
k = torch.randn(B, KV, L, D, device=dev, dtype=torch.bfloat16, generator=gen)
v = torch.randn(B, KV, L, D, device=dev, dtype=torch.bfloat16, generator=gen)
doc_ids = torch.zeros(B, L, dtype=torch.long, device=dev)
flops = 4 * B * H * D * L * (L + 1) / 2
configs = [None, dm.SM90_FLEX_TARGET,
           dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
           dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4),
           dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
           dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=3),
           dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
           dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
           dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=3),
           dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=3),
           dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=3),
           dict(USE_TMA=True),
           dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2, USE_TMA=True)]

first_out, fastest = None, (float("inf"), None)
for cfg in configs:
    block_mask = tp.document_block_mask(doc_ids, tile=dm.flex_mask_tile(cfg))
    attn = torch.compile(lambda cfg=cfg, block_mask=block_mask: flex_attention(
        q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=cfg), dynamic=False)
    try:
        compile_s = time_cuda(attn, 1, dev)  # the first call compiles
        t = time_cuda(attn, 20, dev, warmup=3)
    except Exception as e:  # a config the card cannot run (shared memory, registers): say so and go on
        print(f"{cfg}: failed, {type(e).__name__}: {str(e)[:200]}")
        continue
    out = attn()
    first_out = out if first_out is None else first_out
    print(f"{cfg}: {t * 1e3:.3f} ms, {flops / t / 1e12:.0f} TFLOP/s, max |diff| {(out - first_out).abs().max().item():.4f}, "
          f"compiled in {compile_s:.0f}s", flush=True)
    if t < fastest[0]:
        fastest = (t, cfg)
print(json.dumps(fastest[1]))
