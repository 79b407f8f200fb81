"""The Triton kernels of the drafter's training step on CUDA, each behind a torch custom op: block
attention over exactly the keys each block sees (forward and backward), and the LM head's
cross-entropy rows."""

import torch

try:  # comes with torch's CUDA builds; the kernels need it, CPUs run torch's paths
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None


# The same rule as Triton kernels (CUDA; attention="triton", the pipeline's --drafter-attention
# triton): as fast as flex_attention in the whole step, with no block mask to build
# (docs/architecture.md). A program takes a run of consecutive blocks and
# one KV head, with the blocks' slots for every query head sharing that KV head as its rows
# (blocks x heads x slots, e.g. 2 x 4 x 16 at Qwen3-8B's shapes), and runs over the keys those rows
# see: the union of their context ranges [start, anchor), each row masked to its own, then the
# blocks' own keys. Anchors are dense and sorted, so neighbouring blocks see nearly the same
# keys, and each key tile read serves all of them. The backward takes a block's own keys'
# gradients in that block's program (no other block sees them), and the context keys' in a
# program per tile of keys, over the run of blocks that may see it: anchors are sorted, and so
# are their documents' starts.

# (rows a program, keys a tile, warps, pipeline stages) of each kernel: the forward, the
# per-block backward and the per-key-tile backward; chosen by
# scripts/tune_kernels.py --only block-attention at Qwen3-8B's and Qwen3-1.7B's heads. A
# program takes as many whole blocks as fit its rows (at least one): 1, 2, 1 blocks of 4 heads x
# 16 slots, 2, 4, 2 blocks of 2 x 16.
BLOCK_ATTENTION_CONFIG = {"fwd_rows": 64, "fwd_keys": 64, "fwd_warps": 4, "fwd_stages": 3,
                          "dq_rows": 128, "dq_keys": 64, "dq_warps": 8, "dq_stages": 3,
                          "dkdv_rows": 64, "dkdv_keys": 64, "dkdv_warps": 4, "dkdv_stages": 2}
MAX_ROWS = 128  # a program's rows (blocks x query heads per KV head x slots), as measured and tested
# Every launch of this tool's Triton kernels passes these: fused multiply-adds, as the kernels were
# tuned and tested with. Triton 3.10 turns them off unless a launch asks (3.9 warns of it).
TRITON_OPTIONS = {"enable_fp_fusion": True}


def block_attention_fits(heads, kv_heads, head_dim, block_size):
    """Whether the Triton kernels run these shapes as measured and tested: triton installed,
    head_dim a power of two from 16 to 128, at most MAX_ROWS rows a program (query heads per KV
    head x block slots)."""
    return (triton is not None and 16 <= head_dim <= 128 and not head_dim & (head_dim - 1)
            and heads % kv_heads == 0 and heads // kv_heads * block_size <= MAX_ROWS)


if triton is not None:
    @triton.jit
    def _block_rows(blk0, end_blk, b, kvh, NKV, A, P: tl.constexpr, G: tl.constexpr, BS: tl.constexpr,
                    BLOCK_M: tl.constexpr):
        """A program's rows, the G heads x BS slots of blocks blk0 .. blk0 + P - 1 before end_blk:
        (row ok, its block, query head, query position, index into the [B, H, Q] row statistics)."""
        rows = tl.arange(0, BLOCK_M)
        blk, within = blk0 + rows // (G * BS), rows % (G * BS)
        head, pos = (kvh * G + within // BS).to(tl.int64), blk * BS + within % BS
        if P == 1:  # blk0 < end_blk by the grid and the loops: a mask the compiler can drop
            row_ok = rows < G * BS
        else:
            row_ok = (rows < P * G * BS) & (blk < end_blk)
        return row_ok, blk, head, pos, (b * NKV * G + head) * (A * BS) + pos

    @triton.jit
    def _row_ranges(starts, anchors, b, A, blk0, blk, row_ok, P: tl.constexpr):
        """Each row's context keys [start, end): its block's document start and anchor. One block
        a program: two numbers for all its rows; else a pair a row (empty for rows out of bounds)."""
        if P == 1:
            start = tl.load(starts + b * A + blk0)
            end = tl.load(anchors + b * A + blk0)
        else:
            start = tl.load(starts + b * A + blk, mask=row_ok, other=0)
            end = tl.load(anchors + b * A + blk, mask=row_ok, other=0)
        return start, end

    @triton.jit
    def _sees(keys, start, end, P: tl.constexpr, KEYS_FIRST: tl.constexpr):
        """Whether each row sees each of keys, [rows, keys] or [keys, rows] (start, end from
        _row_ranges; one block a program: a mask over keys, broadcast over rows)."""
        if P == 1:
            in_range = (keys >= start) & (keys < end)
            if KEYS_FIRST:
                seen = in_range[:, None]
            else:
                seen = in_range[None, :]
        else:
            if KEYS_FIRST:
                seen = (keys[:, None] >= start[None, :]) & (keys[:, None] < end[None, :])
            else:
                seen = (keys[None, :] >= start[:, None]) & (keys[None, :] < end[:, None])
        return seen

    @triton.jit
    def _whole_steps(begin, end, all_lo, all_hi, STEP: tl.constexpr):
        """Two points (whole, part) of a loop from begin to end by STEP: its steps from whole to part
        lie wholly in [all_lo, all_hi), keys every row sees, and need no mask; those before whole
        and from part on may not."""
        n = tl.cdiv(end - begin, STEP)
        first = tl.minimum(tl.cdiv(all_lo - begin, STEP), n)
        second = tl.maximum(first, tl.minimum((all_hi - begin) // STEP, n))
        return begin + first * STEP, begin + second * STEP

    @triton.jit
    def _key_span(starts, anchors, b, A, blk0, P: tl.constexpr, BLOCK_N: tl.constexpr):
        """The context keys the program's blocks see, as a loop by BLOCK_N tiles: (start, whole,
        part, end). Any of the blocks sees keys from the first one's document start to the last
        one's anchor; all of them from the last one's start to the first one's anchor, and the
        tiles from whole to part lie in that (_whole_steps). Starts and anchors are sorted."""
        last = b * A + tl.minimum(blk0 + P, A) - 1
        start, first_anchor = tl.load(starts + b * A + blk0), tl.load(anchors + b * A + blk0)
        if P == 1:
            end, all_lo = first_anchor, start
        else:
            end, all_lo = tl.load(anchors + last), tl.load(starts + last)
        whole, part = _whole_steps(start, end, all_lo, first_anchor, BLOCK_N)
        return start, whole, part, end

    @triton.jit
    def _own_key_tile(blk0, blk, row_ok, A, P: tl.constexpr, BS: tl.constexpr, BLOCK_B: tl.constexpr):
        """The program's blocks' own keys as one tile: (key ok, their positions among the blocks'
        keys, whether each row sees each: its own block's keys only)."""
        keys = tl.arange(0, BLOCK_B)
        key_blk = blk0 + keys // BS
        key_ok = (keys < P * BS) & (key_blk < A)
        return key_ok, blk0 * BS + keys, (key_blk[None, :] == blk[:, None]) & key_ok[None, :] & row_ok[:, None]

    @triton.jit
    def _rows(base, pos, stride, d):
        """Pointers [len(pos), D] to positions pos of a head (base: one pointer, or one a row)."""
        return (base + pos * stride)[:, None] + d[None, :]

    @triton.jit
    def _base2(sm_scale):
        """The scores' scale in base 2: the kernels take exp2 and log2 of scores times it."""
        return sm_scale * 1.4426950408889634  # log2(e)

    @triton.jit
    def _key_tile(k_head, v_head, keys, key_ok, sks, svs, d):  # key_ok None: every key is in bounds
        if key_ok is None:
            kt, vt = tl.load(_rows(k_head, keys, sks, d)), tl.load(_rows(v_head, keys, svs, d))
        else:
            kt = tl.load(_rows(k_head, keys, sks, d), mask=key_ok[:, None], other=0.0)
            vt = tl.load(_rows(v_head, keys, svs, d), mask=key_ok[:, None], other=0.0)
        return kt, vt

    @triton.jit
    def _softmax_update(qt, kt, vt, seen, m, l_sum, acc, qk_scale):
        """One tile of keys into the running max m, sum l_sum and output acc (base 2); seen:
        [rows, keys], or None where every row sees every key. A row that has seen no key yet keeps
        m = -inf, and adds nothing (no nan)."""
        s = tl.dot(qt, tl.trans(kt))
        if seen is None:
            m_new = tl.maximum(m, tl.max(s, 1) * qk_scale)
            p = tl.exp2(s * qk_scale - m_new[:, None])
            alpha = tl.exp2(m - m_new)
        else:
            s = tl.where(seen, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m - m_safe)
        return m_new, l_sum * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)

    @triton.jit
    def _attend_tiles(qt, k_head, v_head, lo, hi, end, row_start, row_end, m, l_sum, acc, sks, svs, d, qk_scale,
                      P: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
        """The context keys lo .. hi (those before end) into m, l_sum, acc, tile by tile; MASKED:
        whether some row may not see some key of theirs."""
        for n0 in range(lo, hi, BLOCK_N):
            keys = n0 + tl.arange(0, BLOCK_N)  # masked: those before end, and per row its own range
            kt, vt = _key_tile(k_head, v_head, keys, (keys < end) if MASKED else None, sks, svs, d)
            seen = _sees(keys, row_start, row_end, P, False) if MASKED else None
            m, l_sum, acc = _softmax_update(qt, kt, vt, seen, m, l_sum, acc, qk_scale)
        return m, l_sum, acc

    @triton.jit
    def _score_grads(qt, do_t, kt, vt, seen, row_lse, row_delta, qk_scale):
        """(probabilities, d loss / d scaled scores) of rows x one tile of keys; seen: [rows, keys],
        or None where every row sees every key."""
        p = tl.exp2(tl.dot(qt, tl.trans(kt)) * qk_scale - row_lse[:, None])
        if seen is not None:
            p = tl.where(seen, p, 0.0)
        return p, p * (tl.dot(do_t, tl.trans(vt)) - row_delta[:, None])

    @triton.jit
    def _dq_tiles(qt, do_t, k_head, v_head, lo, hi, end, row_start, row_end, row_lse, row_delta, acc, sks, svs, d,
                  qk_scale, P: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
        """The context keys lo .. hi (those before end) into acc, d loss / d q unscaled, as _attend_tiles."""
        for n0 in range(lo, hi, BLOCK_N):
            keys = n0 + tl.arange(0, BLOCK_N)  # masked: those before end, and per row its own range
            kt, vt = _key_tile(k_head, v_head, keys, (keys < end) if MASKED else None, sks, svs, d)
            seen = _sees(keys, row_start, row_end, P, False) if MASKED else None
            p, ds = _score_grads(qt, do_t, kt, vt, seen, row_lse, row_delta, qk_scale)
            acc += tl.dot(ds.to(kt.dtype), kt)
        return acc

    @triton.jit
    def _block_attention_fwd(q, k, v, out, lse, starts, anchors,
                             sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos,
                             A, L, NKV, sm_scale,
                             P: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
        blk0, bh = tl.program_id(0) * P, tl.program_id(1)
        b, kvh = (bh // NKV).to(tl.int64), bh % NKV
        row_ok, blk, head, pos, row_stat = _block_rows(blk0, A, b, kvh, NKV, A, P, G, BS, BLOCK_M)
        row_start, row_end = _row_ranges(starts, anchors, b, A, blk0, blk, row_ok, P)
        d = tl.arange(0, D)
        qk_scale = _base2(sm_scale)
        qt = tl.load(_rows(q + b * sqb + head * sqh, pos, sqs, d), mask=row_ok[:, None], other=0.0)
        k_head, v_head = k + b * skb + kvh * skh, v + b * svb + kvh * svh
        start, whole, part, end = _key_span(starts, anchors, b, A, blk0, P, BLOCK_N)
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_sum = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        # The context keys they see: tiles some rows do not see (masked) before and after those all
        # rows see (one block a program: none before, at most one after)
        if P > 1:
            m, l_sum, acc = _attend_tiles(qt, k_head, v_head, start, whole, end, row_start, row_end, m, l_sum, acc,
                                          sks, svs, d, qk_scale, P, BLOCK_N, True)
        m, l_sum, acc = _attend_tiles(qt, k_head, v_head, whole, part, end, row_start, row_end, m, l_sum, acc,
                                      sks, svs, d, qk_scale, P, BLOCK_N, False)
        m, l_sum, acc = _attend_tiles(qt, k_head, v_head, part, end, end, row_start, row_end, m, l_sum, acc,
                                      sks, svs, d, qk_scale, P, BLOCK_N, True)
        # then their own keys, after the L context keys
        key_ok, own, seen = _own_key_tile(blk0, blk, row_ok, A, P, BS, BLOCK_B)
        kt, vt = _key_tile(k_head, v_head, L + own, key_ok, sks, svs, d)
        m, l_sum, acc = _softmax_update(qt, kt, vt, seen, m, l_sum, acc, qk_scale)
        tl.store(_rows(out + b * sob + head * soh, pos, sos, d), (acc / l_sum[:, None]).to(out.dtype.element_ty),
                 mask=row_ok[:, None])
        tl.store(lse + row_stat, m + tl.log2(l_sum), mask=row_ok)  # base 2, of the scaled scores

    @triton.jit
    def _block_attention_bwd_block(q, k, v, out, dout, lse, delta, dq, dk, dv, starts, anchors,
                                   sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos,
                                   sgb, sgh, sgs, sdqb, sdqh, sdqs, sdkb, sdkh, sdks, sdvb, sdvh, sdvs,
                                   A, L, NKV, sm_scale,
                                   P: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
        # Per run of blocks: its rows' delta = rowsum(dout * out) (stored for the context-key
        # kernel, which runs after), dq over every key they see, and dk, dv of their own keys.
        blk0, bh = tl.program_id(0) * P, tl.program_id(1)
        b, kvh = (bh // NKV).to(tl.int64), bh % NKV
        row_ok, blk, head, pos, row_stat = _block_rows(blk0, A, b, kvh, NKV, A, P, G, BS, BLOCK_M)
        row_start, row_end = _row_ranges(starts, anchors, b, A, blk0, blk, row_ok, P)
        d = tl.arange(0, D)
        qk_scale = _base2(sm_scale)
        qt = tl.load(_rows(q + b * sqb + head * sqh, pos, sqs, d), mask=row_ok[:, None], other=0.0)
        do_t = tl.load(_rows(dout + b * sgb + head * sgh, pos, sgs, d), mask=row_ok[:, None], other=0.0)
        ot = tl.load(_rows(out + b * sob + head * soh, pos, sos, d), mask=row_ok[:, None], other=0.0)
        row_delta = tl.sum(do_t.to(tl.float32) * ot.to(tl.float32), 1)
        tl.store(delta + row_stat, row_delta, mask=row_ok)
        row_lse = tl.load(lse + row_stat, mask=row_ok, other=0.0)
        k_head, v_head = k + b * skb + kvh * skh, v + b * svb + kvh * svh
        start, whole, part, end = _key_span(starts, anchors, b, A, blk0, P, BLOCK_N)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        if P > 1:  # as in the forward
            acc = _dq_tiles(qt, do_t, k_head, v_head, start, whole, end, row_start, row_end, row_lse, row_delta, acc,
                            sks, svs, d, qk_scale, P, BLOCK_N, True)
        acc = _dq_tiles(qt, do_t, k_head, v_head, whole, part, end, row_start, row_end, row_lse, row_delta, acc,
                        sks, svs, d, qk_scale, P, BLOCK_N, False)
        acc = _dq_tiles(qt, do_t, k_head, v_head, part, end, end, row_start, row_end, row_lse, row_delta, acc,
                        sks, svs, d, qk_scale, P, BLOCK_N, True)
        key_ok, own, seen = _own_key_tile(blk0, blk, row_ok, A, P, BS, BLOCK_B)
        kt, vt = _key_tile(k_head, v_head, L + own, key_ok, sks, svs, d)
        p, ds = _score_grads(qt, do_t, kt, vt, seen, row_lse, row_delta, qk_scale)
        acc += tl.dot(ds.to(kt.dtype), kt)
        tl.store(_rows(dq + b * sdqb + head * sdqh, pos, sdqs, d), (acc * sm_scale).to(dq.dtype.element_ty),
                 mask=row_ok[:, None])
        own_dk = tl.dot(tl.trans(ds.to(qt.dtype)), qt) * sm_scale
        own_dv = tl.dot(tl.trans(p.to(do_t.dtype)), do_t)
        tl.store(_rows(dk + b * sdkb + kvh * sdkh, L + own, sdks, d), own_dk.to(dk.dtype.element_ty),
                 mask=key_ok[:, None])
        tl.store(_rows(dv + b * sdvb + kvh * sdvh, L + own, sdvs, d), own_dv.to(dv.dtype.element_ty),
                 mask=key_ok[:, None])

    @triton.jit
    def _block_attention_bwd_context(q, k, v, dout, lse, delta, dk, dv, starts, anchors, first_block, end_block,
                                     sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sgb, sgh, sgs,
                                     sdkb, sdkh, sdks, sdvb, sdvh, sdvs,
                                     A, L, NKV, NT, sm_scale,
                                     P: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # Per tile of context keys: dk, dv over the blocks [first_block, end_block) that may see it,
        # P blocks at a time; which of their keys each sees is decided per (block, key) from start
        # and anchor.
        tile, bh = tl.program_id(0), tl.program_id(1)
        b, kvh = (bh // NKV).to(tl.int64), bh % NKV
        d = tl.arange(0, D)
        qk_scale = _base2(sm_scale)
        keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = keys < L
        kt, vt = _key_tile(k + b * skb + kvh * skh, v + b * svb + kvh * svh, keys, key_ok, sks, svs, d)
        dk_acc = tl.zeros((BLOCK_N, D), tl.float32)
        dv_acc = tl.zeros((BLOCK_N, D), tl.float32)
        lo, hi = tl.load(first_block + b * NT + tile), tl.load(end_block + b * NT + tile)
        for blk0 in range(lo, hi, P):
            row_ok, blk, head, pos, row_stat = _block_rows(blk0, hi, b, kvh, NKV, A, P, G, BS, BLOCK_M)
            qt = tl.load(_rows(q + b * sqb + head * sqh, pos, sqs, d), mask=row_ok[:, None], other=0.0)
            do_t = tl.load(_rows(dout + b * sgb + head * sgh, pos, sgs, d), mask=row_ok[:, None], other=0.0)
            row_lse = tl.load(lse + row_stat, mask=row_ok, other=0.0)
            row_delta = tl.load(delta + row_stat, mask=row_ok, other=0.0)
            row_start, row_end = _row_ranges(starts, anchors, b, A, blk0, blk, row_ok, P)
            seen = _sees(keys, row_start, row_end, P, True) & row_ok[None, :]
            pT = tl.exp2(tl.dot(kt, tl.trans(qt)) * qk_scale - row_lse[None, :])  # [keys, rows]
            pT = tl.where(seen, pT, 0.0)
            dv_acc += tl.dot(pT.to(do_t.dtype), do_t)
            dsT = pT * (tl.dot(vt, tl.trans(do_t)) - row_delta[None, :])
            dk_acc += tl.dot(dsT.to(qt.dtype), qt)
        tl.store(_rows(dk + b * sdkb + kvh * sdkh, keys, sdks, d), (dk_acc * sm_scale).to(dk.dtype.element_ty),
                 mask=key_ok[:, None])
        tl.store(_rows(dv + b * sdvb + kvh * sdvh, keys, sdvs, d), dv_acc.to(dv.dtype.element_ty), mask=key_ok[:, None])


def _block_attention_shapes(q, k, anchors, block_size):
    """(B, H, Q, D, blocks, KV heads, context length, query heads per KV head)."""
    B, H, Q, D = q.shape
    A, NKV = anchors.shape[1], k.shape[1]
    if Q != A * block_size or H % NKV or D < 16 or D & (D - 1):
        raise ValueError(f"block attention: q {tuple(q.shape)}, k {tuple(k.shape)}, {A} blocks of {block_size}")
    return B, H, Q, D, A, NKV, k.shape[2] - Q, H // NKV


def _program_rows(rows, G, block_size, D):
    """A kernel's row constants: as many whole blocks a program as fit `rows` (and MAX_ROWS), one
    at least."""
    P = max(1, min(rows, MAX_ROWS) // (G * block_size))
    return dict(P=P, G=G, BS=block_size, D=D, BLOCK_M=max(16, triton.next_power_of_2(P * G * block_size)))


def _own_keys(blocks, block_size):  # the blocks' own keys as one tile: tl.dot wants 16 or more
    return max(16, triton.next_power_of_2(blocks * block_size))


def _strides3(t):  # (batch, head, position); the last dim must be unit-stride
    return t.stride(0), t.stride(1), t.stride(2)


def _unit_last(*ts):
    return [t if t.stride(-1) == 1 else t.contiguous() for t in ts]


def key_tile_blocks(starts, anchors, seq_len, key_tile):
    """[2, B, tiles] int32: for each tile [t, t + key_tile) of the seq_len context keys, the first
    block and the end of the run of blocks that may see it: anchor > t (a suffix, anchors sorted)
    and start < t + key_tile (a prefix, starts sorted with them)."""
    tiles = torch.arange(-(-seq_len // key_tile), device=anchors.device, dtype=anchors.dtype) * key_tile
    tiles = tiles.expand(anchors.shape[0], -1).contiguous()
    return torch.stack([torch.searchsorted(anchors, tiles, right=True, out_int32=True),
                        torch.searchsorted(starts, tiles + key_tile, out_int32=True)])


@torch.library.custom_op("dflash::block_attention", mutates_args=())
def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor, anchors: torch.Tensor,
                     tile_blocks: torch.Tensor, block_size: int, key_tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = _unit_last(q, k, v)
    B, H, Q, D, A, NKV, L, G = _block_attention_shapes(q, k, anchors, block_size)
    c = BLOCK_ATTENTION_CONFIG
    out = q.new_empty(B, Q, H, D).transpose(1, 2)  # the layout o_proj reads: [B, Q, H * D]
    lse = torch.empty(B, H, Q, dtype=torch.float32, device=q.device)
    rows = _program_rows(c["fwd_rows"], G, block_size, D)
    _block_attention_fwd[(triton.cdiv(A, rows["P"]), B * NKV)](
        q, k, v, out, lse, starts, anchors, *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(out),
        A, L, NKV, D ** -0.5, **rows, BLOCK_N=c["fwd_keys"], BLOCK_B=_own_keys(rows["P"], block_size),
        num_warps=c["fwd_warps"], num_stages=c["fwd_stages"], **TRITON_OPTIONS)
    return out, lse


@block_attention.register_fake
def _(q, k, v, starts, anchors, tile_blocks, block_size, key_tile):
    B, H, Q, D = q.shape
    return q.new_empty(B, Q, H, D).transpose(1, 2), q.new_empty(B, H, Q, dtype=torch.float32)


@torch.library.custom_op("dflash::block_attention_backward", mutates_args=())
def _block_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, starts: torch.Tensor, anchors: torch.Tensor,
                              tile_blocks: torch.Tensor, block_size: int,
                              key_tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dout, q, k, v, out = _unit_last(dout, q, k, v, out)
    B, H, Q, D, A, NKV, L, G = _block_attention_shapes(q, k, anchors, block_size)
    c = BLOCK_ATTENTION_CONFIG
    dq, dk, dv = q.new_empty(B, Q, H, D).transpose(1, 2), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty_like(lse)
    rows = _program_rows(c["dq_rows"], G, block_size, D)
    _block_attention_bwd_block[(triton.cdiv(A, rows["P"]), B * NKV)](
        q, k, v, out, dout, lse, delta, dq, dk, dv, starts, anchors,
        *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(out), *_strides3(dout),
        *_strides3(dq), *_strides3(dk), *_strides3(dv), A, L, NKV, D ** -0.5,
        **rows, BLOCK_N=c["dq_keys"], BLOCK_B=_own_keys(rows["P"], block_size), num_warps=c["dq_warps"],
        num_stages=c["dq_stages"], **TRITON_OPTIONS)
    NT = tile_blocks.shape[-1]
    rows = _program_rows(c["dkdv_rows"], G, block_size, D)
    _block_attention_bwd_context[(NT, B * NKV)](
        q, k, v, dout, lse, delta, dk, dv, starts, anchors, tile_blocks[0], tile_blocks[1],
        *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(dout), *_strides3(dk), *_strides3(dv),
        A, L, NKV, NT, D ** -0.5, **rows, BLOCK_N=key_tile, num_warps=c["dkdv_warps"], num_stages=c["dkdv_stages"],
        **TRITON_OPTIONS)
    return dq, dk, dv


@_block_attention_backward.register_fake
def _(dout, q, k, v, out, lse, starts, anchors, tile_blocks, block_size, key_tile):
    B, H, Q, D = q.shape
    return q.new_empty(B, Q, H, D).transpose(1, 2), torch.empty_like(k), torch.empty_like(v)


def _block_attention_setup(ctx, inputs, output):
    q, k, v, starts, anchors, tile_blocks, ctx.block_size, ctx.key_tile = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], starts, anchors, tile_blocks)


def _block_attention_grads(ctx, grad_out, grad_lse):
    dq, dk, dv = _block_attention_backward(grad_out, *ctx.saved_tensors, ctx.block_size, ctx.key_tile)
    return dq, dk, dv, None, None, None, None, None


block_attention.register_autograd(_block_attention_grads, setup_context=_block_attention_setup)



CE_ROWS_BLOCK, CE_ROWS_WARPS = 2048, 8

if triton is not None:
    @triton.jit
    def _ce_rows_kernel(logits, labels, ce, correct, V, BLOCK: tl.constexpr, WITH_GRAD: tl.constexpr):
        # One program a row. Pass 1 keeps, per lane, a running max, the sum of exponentials under
        # it (one exp an element) and the first index of that max; the lanes are combined once, at
        # the end. Pass 2 overwrites the row with softmax - onehot(label).
        row = tl.program_id(0).to(tl.int64)
        x_row = logits + row * V
        label = tl.load(labels + row)
        lane_max = tl.full((BLOCK,), float("-inf"), tl.float32)
        lane_sum = tl.zeros((BLOCK,), tl.float32)
        lane_first = tl.zeros((BLOCK,), tl.int32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            above = x > lane_max  # strict: a lane keeps its first maximum
            e = tl.where(x == float("-inf"), 0.0, tl.exp(-tl.abs(x - lane_max)))  # masked lanes add nothing (no nan)
            lane_sum = tl.where(above, lane_sum * e + 1.0, lane_sum + e)
            lane_first = tl.where(above, cols, lane_first)
            lane_max = tl.maximum(lane_max, x)
        row_max = tl.max(lane_max, 0)
        lse = row_max + tl.log(tl.sum(lane_sum * tl.exp(lane_max - row_max), 0))  # an empty lane: 0 * exp(-inf)
        best = tl.min(tl.where(lane_max == row_max, lane_first, V), 0)  # the first index of the row's maximum
        tl.store(ce + row, lse - tl.load(x_row + label).to(tl.float32))
        tl.store(correct + row, best == label)
        if WITH_GRAD:
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                x = tl.load(x_row + cols, mask=cols < V, other=0.0).to(tl.float32)
                g = tl.exp(x - lse) - (cols == label).to(tl.float32)
                tl.store(x_row + cols, g.to(logits.dtype.element_ty), mask=cols < V)


def ce_rows(logits, labels, with_grad, block=None, num_warps=None):
    """(ce fp32, correct) of [N, V] logits by _ce_rows_kernel; with_grad overwrites logits with
    d ce / d logits = softmax - onehot(label)."""
    N, V = logits.shape
    ce = torch.empty(N, dtype=torch.float32, device=logits.device)
    correct = torch.empty(N, dtype=torch.bool, device=logits.device)
    _ce_rows_kernel[(N,)](logits, labels, ce, correct, V, BLOCK=block or CE_ROWS_BLOCK, WITH_GRAD=with_grad,
                          num_warps=num_warps or CE_ROWS_WARPS, **TRITON_OPTIONS)
    return ce, correct
