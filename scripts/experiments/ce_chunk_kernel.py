"""The LM-head cross-entropy chunk with its reductions in dflash_model's Triton kernel (ce_rows,
the CUDA default) against inductor's (dflash_model._head_ce_chunk compiled), at the benchmark's
Qwen3-8B shapes: 4096 positions a chunk, hidden 4096, vocabulary 151936; and a sweep of the
kernel's block size and warps (dflash_model.CE_ROWS_BLOCK, CE_ROWS_WARPS).

    python scripts/experiments/ce_chunk_kernel.py [--configs 2048x8,4096x8,...]

Prints the largest difference of ce, correct, d ce / d hidden against the compiled chunk, and
ms per chunk for each."""
import argparse, os, sys
import torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import dflash_model as dm
from scripts.benchmark import time_cuda


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--configs", default="1024x4,2048x8,4096x8,4096x16,8192x16", help="BLOCKxWARPS settings to time")
    a = p.parse_args()
    N, H, V = 4096, 4096, 151936
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g).to("cuda", torch.bfloat16)
    weight = (torch.randn(V, H, generator=g) * 0.05).to("cuda", torch.bfloat16)
    labels = torch.randint(0, V, (N,), generator=g).to("cuda")
    labels[: N // 2] = (hidden.float() @ weight.float().t())[: N // 2].argmax(-1)  # some argmax hits
    inductor = dm.compiled(dm._head_ce_chunk)
    want = inductor(hidden, weight, labels, True)
    got = dm._head_ce_chunk_triton(hidden, weight, labels, True)
    print(f"ce max |diff| {(got[0] - want[0]).abs().max().item():.3g} (ce up to {want[0].abs().max().item():.3g}); "
          f"correct equal on {(got[1] == want[1]).float().mean().item():.2%} of rows ({want[1].sum().item()} right); "
          f"d ce / d hidden max |diff| {(got[2].float() - want[2].float()).abs().max().item():.3g} "
          f"(values up to {want[2].float().abs().max().item():.3g})", flush=True)
    logits = hidden @ weight.t()  # the reductions alone overwrite it with the gradient: same work each call
    ms = lambda fn: time_cuda(fn, a.iters, "cuda", warmup=3) * 1e3  # noqa: E731
    print(f"{'inductor chunk (torch)':32s}: {ms(lambda: inductor(hidden, weight, labels, True)):7.2f} ms "
          f"per {N}-position chunk", flush=True)
    print(f"{'the two matmuls alone':32s}: {ms(lambda: (hidden @ weight.t()) @ weight):7.2f} ms", flush=True)
    for config in a.configs.split(","):
        block, warps = map(int, config.split("x"))
        whole = ms(lambda: dm._head_ce_chunk_triton(hidden, weight, labels, True, block=block, num_warps=warps))
        alone = ms(lambda: dm.ce_rows(logits, labels, True, block=block, num_warps=warps))
        print(f"{f'triton chunk, {block} x {warps} warps':32s}: {whole:7.2f} ms (its reductions alone {alone:.2f})",
              flush=True)


if __name__ == "__main__":
    main()
