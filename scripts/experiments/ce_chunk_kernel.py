"""The LM-head cross-entropy chunk's non-matmul part as one hand-written Triton kernel, against
inductor's (dflash_model._head_ce_chunk compiled, as in the training step), at the benchmark's
Qwen3-8B shapes: 4096 positions a chunk, hidden 4096, vocabulary 151936.

Inductor's kernel for the chunk reads each row of logits several times (15.7 ms a step for 8
chunks in the twentieth session's profile, about 6 passes over 9.3 GB). This kernel reads a
row twice and writes its gradient once: pass 1 keeps a running max, sum of exponentials and
argmax (first index of the max, as torch.argmax) per lane; pass 2 writes softmax -
onehot(label) in bf16.

    python scripts/experiments/ce_chunk_kernel.py                      # GPU: check and time
    TRITON_INTERPRET=1 python scripts/experiments/ce_chunk_kernel.py --cpu   # small check, no GPU

Prints the largest difference of ce, correct, d ce / d hidden against the compiled chunk, and
ms per chunk for both."""
import argparse, os, sys
import torch
import triton
import triton.language as tl
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import dflash_model as dm
from scripts.benchmark import time_cuda


@triton.jit
def ce_rows_kernel(logits, labels, dlogits, ce, correct, V, BLOCK: tl.constexpr, WITH_GRAD: tl.constexpr):
    # One program a row. Pass 1 keeps, per lane, a running max, the sum of exponentials under it
    # (one exp an element) and the first index of that max; the lanes are combined once, at the
    # end. Pass 2 writes the gradient.
    row = tl.program_id(0).to(tl.int64)
    x_row = logits + row * V
    label = tl.load(labels + row)
    lane_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    lane_sum = tl.zeros((BLOCK,), tl.float32)
    lane_first = tl.zeros((BLOCK,), tl.int64)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        above = x > lane_max  # strict: a lane keeps its first maximum
        e = tl.where(x == float("-inf"), 0.0, tl.exp(-tl.abs(x - lane_max)))  # masked lanes add nothing (no nan)
        lane_sum = tl.where(above, lane_sum * e + 1.0, lane_sum + e)
        lane_first = tl.where(above, cols.to(tl.int64), lane_first)
        lane_max = tl.maximum(lane_max, x)
    row_max = tl.max(lane_max, 0)
    lse = row_max + tl.log(tl.sum(lane_sum * tl.exp(lane_max - row_max), 0))  # an empty lane: 0 * exp(-inf)
    best = tl.min(tl.where(lane_max == row_max, lane_first, V), 0)  # the first index of the row's maximum
    tl.store(ce + row, lse - tl.load(x_row + label).to(tl.float32))
    tl.store(correct + row, best == label)
    if WITH_GRAD:
        g_row = dlogits + row * V
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < V, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) - (cols == label).to(tl.float32)
            tl.store(g_row + cols, g.to(dlogits.dtype.element_ty), mask=cols < V)


def ce_rows(logits, labels, with_grad, block=2048, num_warps=8):
    """(ce fp32, correct, softmax - onehot in logits' dtype or None) of [N, V] logits."""
    N, V = logits.shape
    ce = torch.empty(N, dtype=torch.float32, device=logits.device)
    correct = torch.empty(N, dtype=torch.bool, device=logits.device)
    dlogits = torch.empty_like(logits) if with_grad else ce  # ce: a placeholder pointer, never written
    ce_rows_kernel[(N,)](logits, labels, dlogits, ce, correct, V, BLOCK=block, WITH_GRAD=with_grad,
                         num_warps=num_warps)
    return ce, correct, dlogits if with_grad else None


def head_ce_chunk(hidden, weight, labels, with_grad, **config):
    """dm._head_ce_chunk's contract, its reductions in ce_rows."""
    ce, correct, dlogits = ce_rows(hidden.to(weight.dtype) @ weight.t(), labels, with_grad, **config)
    return ce, correct, None if dlogits is None else (dlogits @ weight).to(hidden.dtype)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cpu", action="store_true", help="small shapes on the CPU (with TRITON_INTERPRET=1)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--configs", default="2048x8,4096x8,4096x16,8192x16", help="BLOCKxWARPS settings of the kernel to time")
    a = p.parse_args()
    dev, (N, H, V) = ("cpu", (8, 64, 1000)) if a.cpu else ("cuda", (4096, 4096, 151936))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g).to(dev, torch.bfloat16)
    weight = (torch.randn(V, H, generator=g) * 0.05).to(dev, torch.bfloat16)
    labels = torch.randint(0, V, (N,), generator=g).to(dev)
    labels[: N // 2] = (hidden.float() @ weight.float().t())[: N // 2].argmax(-1)  # some argmax hits
    if a.cpu:
        logits = torch.tensor([[1.0, 3.0, 3.0, -2.0] * 300], dtype=torch.bfloat16).repeat(2, 1)  # tied maxima
        _, tied, _ = ce_rows(logits, torch.tensor([1, 2]), False, block=256)
        assert tied.tolist() == (logits.float().argmax(-1) == torch.tensor([1, 2])).tolist() == [True, False]
    inductor = dm._head_ce_chunk if a.cpu else torch.compile(dm._head_ce_chunk, dynamic=False)
    want = inductor(hidden, weight, labels, True)
    got = head_ce_chunk(hidden, weight, labels, True)
    print(f"ce max |diff| {(got[0] - want[0]).abs().max().item():.3g} (ce up to {want[0].abs().max().item():.3g}); "
          f"correct equal on {(got[1] == want[1]).float().mean().item():.2%} of rows ({want[1].sum().item()} right); "
          f"d ce / d hidden max |diff| {(got[2].float() - want[2].float()).abs().max().item():.3g} "
          f"(values up to {want[2].float().abs().max().item():.3g})", flush=True)
    if a.cpu:
        return
    logits = hidden @ weight.t()
    ms = lambda fn: time_cuda(fn, a.iters, "cuda", warmup=3) * 1e3  # noqa: E731
    print(f"{'inductor chunk (today)':32s}: {ms(lambda: inductor(hidden, weight, labels, True)):7.2f} ms "
          f"per {N}-position chunk", flush=True)
    print(f"{'the two matmuls alone':32s}: {ms(lambda: (hidden @ weight.t()) @ weight):7.2f} ms", flush=True)
    for config in a.configs.split(","):
        block, warps = map(int, config.split("x"))
        whole = ms(lambda: head_ce_chunk(hidden, weight, labels, True, block=block, num_warps=warps))
        alone = ms(lambda: ce_rows(logits, labels, True, block=block, num_warps=warps))
        print(f"{f'triton chunk, {block} x {warps} warps':32s}: {whole:7.2f} ms (its reductions alone {alone:.2f})",
              flush=True)


if __name__ == "__main__":
    main()
