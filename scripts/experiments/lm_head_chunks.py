"""The drafter's whole LM head + cross-entropy (dflash_model.lm_head_ce: every predicting position
of one step, in chunks) by chunk size, at the benchmark's Qwen3-8B shapes: 4 rows x 512 anchors x
15 predicting slots = 30720 positions, hidden 4096, vocabulary 151936. Its two matmuls a chunk
(logits = h W^T, then d ce / d h = dlogits W, whose inner dimension is the vocabulary) are about
28% of the step's FLOPs, so how fast cuBLAS runs them at each chunk's shape matters.

    python scripts/experiments/lm_head_chunks.py [--chunks 2048,3840,4096,...]

For each chunk size: ms for the whole lm_head_ce forward (with its gradient), ms for its matmuls
alone, and the matmuls' TFLOP/s; and the largest difference of ce and d ce / d h against the
4096-position chunks (the default)."""
import argparse, os, sys
import torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import dflash_model as dm
from scripts.benchmark import time_cuda


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--positions", type=int, default=4 * 512 * 15)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--chunks", default="2048,3072,3840,4096,5120,6144,7680,8192,10240,15360,30720")
    a = p.parse_args()
    N, H, V = a.positions, 4096, 151936
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    weight = (torch.randn(V, H, generator=g) * 0.05).to("cuda", torch.bfloat16)
    labels = torch.randint(0, V, (N,), generator=g).to("cuda")
    ms = lambda fn: time_cuda(fn, a.iters, "cuda", warmup=2) * 1e3  # noqa: E731

    def ce_and_grad(chunk):
        hidden.grad = None
        ce, _ = dm.lm_head_ce(hidden, weight, labels, chunk)
        ce.sum().backward()
        return ce, hidden.grad

    def logits_matmuls(chunk):
        return [hidden[s:s + chunk] @ weight.t() for s in range(0, N, chunk)]

    def grad_matmuls(logits):
        for chunk_logits in logits:
            chunk_logits @ weight

    ref_ce, ref_grad = [t.detach().clone() for t in ce_and_grad(4096)]
    flops = 2 * 2 * N * H * V
    print(f"{N} positions, hidden {H}, vocabulary {V}: {flops / 1e12:.1f} TFLOP in the matmuls", flush=True)
    for chunk in map(int, a.chunks.split(",")):
        ce, grad = ce_and_grad(chunk)
        diff_ce = (ce - ref_ce).abs().max().item()
        diff_grad = (grad.float() - ref_grad.float()).abs().max().item()
        whole = ms(lambda: ce_and_grad(chunk))
        peak = torch.cuda.max_memory_allocated() / 2**30
        with torch.no_grad():
            forward = ms(lambda: logits_matmuls(chunk))
            logits = logits_matmuls(chunk)
            backward = ms(lambda: grad_matmuls(logits))
            logits = None
        torch.cuda.reset_peak_memory_stats()
        print(f"chunk {chunk:6d} ({-(-N // chunk)} chunks): lm_head_ce {whole:7.2f} ms (peak {peak:5.1f} GB); "
              f"matmuls: logits {forward:6.2f} ms ({flops / 2 / forward / 1e9:3.0f} TFLOP/s), "
              f"d ce / d h {backward:6.2f} ms ({flops / 2 / backward / 1e9:3.0f} TFLOP/s); "
              f"max |diff| vs 4096: ce {diff_ce:.3g}, grad {diff_grad:.3g}", flush=True)


if __name__ == "__main__":
    main()
