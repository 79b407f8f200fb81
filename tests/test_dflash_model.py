"""Tests of dflash_model.py: the drafter's attention rule, training forward, loss, LM head and checkpoint
format, each against a reference written out here."""
import json
import math
import os
import re
import stat

import pytest
import torch
from safetensors import safe_open

import dflash_model as dm
from dflash_train import helpers
from dflash_train import target_model
from dflash_train import target_stage as ts
from conftest import make_drafter, tiny_gemma3, counter_target, tiny_target


@pytest.fixture(autouse=True)
def float64_default():
    """Exact comparisons in this file: tiny models and inputs in float64."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def target_features(target, ids, layer_ids):
    with target_model.collect_layer_outputs(target, layer_ids) as hidden:
        target(ids[None])
    return torch.cat(hidden, -1)[0]


def packed_row(target, drafter, doc_lens, pad, seed=0):
    """One packed row of several documents: ids, doc ids, positions and target features, each
    document's features computed on its own (what the pipeline's target stage must produce)."""
    g = torch.Generator().manual_seed(seed)
    ids, docs, pos, hidden = [], [], [], []
    for d, n in enumerate(doc_lens):
        t = torch.randint(0, target.config.vocab_size - 1, (n,), generator=g)
        ids.append(t); docs.append(torch.full((n,), d)); pos.append(torch.arange(n))
        hidden.append(target_features(target, t, drafter.target_layer_ids))
    ids.append(torch.zeros(pad, dtype=torch.long)); docs.append(torch.full((pad,), -1))
    pos.append(torch.zeros(pad, dtype=torch.long)); hidden.append(torch.zeros(pad, hidden[0].shape[1]))
    return torch.cat(ids)[None], torch.cat(docs)[None], torch.cat(pos)[None], torch.cat(hidden)[None]


def test_default_target_layer_ids():
    assert dm.default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert dm.default_target_layer_ids(36, 1) == [18]


def test_attention_rule_matches_brute_force():
    torch.manual_seed(0)
    L, bs, A = 40, 4, 9
    doc = torch.tensor([0] * 13 + [1] * 17 + [2] * 6 + [-1] * 4)[None].repeat(2, 1)
    doc[1] = torch.tensor([0] * 30 + [1] * 10)
    # random anchors with repeats-free overlap, including ones whose blocks run past the end
    anchors = torch.stack([torch.sort(torch.randperm(L)[:A]).values for _ in range(2)])
    anchors[:, -1] = L - 2
    mask = dm.dense_block_mask(anchors, doc, bs)[:, 0]
    for b in range(2):
        for i in range(A):
            a = int(anchors[b, i])
            for s in range(bs):
                q = i * bs + s
                for j in range(L + A * bs):
                    if j < L:
                        want = j < a and int(doc[b, j]) == int(doc[b, a])
                    else:
                        want = (j - L) // bs == i
                    assert bool(mask[b, q, j]) == want, (b, i, s, j)


BLOCK_MASK_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                     "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


@pytest.mark.parametrize("B,L,A,bs,tile", [(2, 3072, 512, 16, 128), (1, 1000, 100, 16, 128), (2, 128, 16, 4, 128),
                                           (2, 700, 37, 10, 128), (1, 300, 20, 7, 128), (2, 3072, 512, 16, (128, 64)),
                                           (2, 700, 37, 10, (64, 128))])
def test_flex_block_mask_equals_create_block_mask(B, L, A, bs, tile):
    # Shapes where query/key lengths are and are not multiples of the tile, blocks that do not
    # divide it, several documents and padding (-1), full and partial tiles; square tiles and not.
    from torch.nn.attention.flex_attention import create_block_mask
    g = torch.Generator().manual_seed(L)
    doc = torch.zeros(B, L, dtype=torch.long)
    for r in range(B):
        cuts = sorted(torch.randint(1, L, (3,), generator=g).tolist())
        for i, (s, e) in enumerate(zip([0] + cuts, cuts + [L])):
            doc[r, s:e] = i
        doc[r, -3:] = -1
    anchors = torch.sort(torch.rand(B, L, generator=g).topk(A, dim=1).indices, dim=1).values
    starts = dm.context_starts(anchors, doc)
    mask_mod = dm.block_mask_mod(starts, anchors, L, bs)
    want = create_block_mask(mask_mod, B, None, A * bs, L + A * bs, device="cpu", BLOCK_SIZE=tile)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as in the training step: counts must stay exact
        got = dm.flex_block_mask(starts, anchors, L, bs, mask_mod, tile)
    assert (got.seq_lengths, got.BLOCK_SIZE) == (want.seq_lengths, want.BLOCK_SIZE)
    for f in BLOCK_MASK_FIELDS:  # values, and the layout flex's Triton kernels assume (contiguous)
        assert torch.equal(getattr(got, f), getattr(want, f)), f
        assert getattr(got, f).stride() == getattr(want, f).stride(), f
    assert got.mask_mod is mask_mod
    if B == 2 and L == 128:  # traced as in the compiled step (fullgraph): the same tensors
        build = torch.compile(lambda a, d: [getattr(dm.flex_block_mask(dm.context_starts(a, d), a, L, bs, mask_mod), f)
                                            for f in BLOCK_MASK_FIELDS], fullgraph=True, dynamic=False)
        for f, t in zip(BLOCK_MASK_FIELDS, build(anchors, doc)):
            assert torch.equal(t, getattr(want, f)) and t.stride() == getattr(want, f).stride(), f


def test_block_mask_trace_does_not_grow_with_rows():
    # Traced into the compiled step, the mask must be the same graph at 2 rows and at 32: a
    # per-row Python loop unrolled there made the compile time grow with the rows.
    node_counts = []

    def count_nodes(gm, example_inputs):
        node_counts.append(len(gm.graph.nodes))
        return gm.forward
    for B in (2, 32):
        anchors = torch.sort(torch.rand(B, 300).topk(20, dim=1).indices, dim=1).values
        doc = torch.zeros(B, 300, dtype=torch.long)
        torch.compile(lambda a, d: dm.flex_block_mask(dm.context_starts(a, d), a, 300, 4, None).kv_indices, backend=count_nodes,
                      fullgraph=True, dynamic=False)(anchors, doc)
    assert node_counts[0] == node_counts[1], node_counts


def test_flex_backward_options_only_where_measured(monkeypatch):
    # Hopper at head_dim 64 and 128 (measured faster, bitwise the same: tests/test_gpu.py); else
    # inductor's defaults (an untested config could fail to compile or run slower).
    cuda, capability = torch.device("cuda", 0), {"value": (9, 0)}
    monkeypatch.setattr(helpers, "cuda_capability", lambda device: capability["value"])
    assert dm.flex_kernel_options(cuda, 64) == dm.flex_kernel_options(cuda, 128) == dm.SM90_FLEX_BACKWARD
    assert dm.flex_kernel_options(cuda, 96) is None
    assert dm.flex_kernel_options(torch.device("cpu"), 64) is None
    capability["value"] = (8, 0)
    assert dm.flex_kernel_options(cuda, 64) is None and dm.flex_kernel_options(cuda, 128) is None


def test_flex_attention_path_equals_dense_path():
    # The GPU training path (flex_attention over flex_block_mask) against the CPU one (SDPA with
    # the dense mask), forward only: flex_attention has no backward on CPU. Lengths off the
    # 128 tile, full and partial tiles, three documents, blocks running past the row's end.
    torch.manual_seed(0)
    B, L, A, bs, H, KV, D = 2, 600, 64, 4, 4, 2, 32
    doc = torch.zeros(B, L, dtype=torch.long)  # row 0: one document (it has full tiles)
    doc[1, 400:] = 1
    doc[1, 550:] = 2
    anchors = torch.stack([torch.sort(torch.randperm(L - 1)[:A]).values for _ in range(B)])
    anchors[:, -1] = L - 2
    assert dm.flex_block_mask(dm.context_starts(anchors, doc), anchors, L, bs, None).full_kv_num_blocks.sum() > 0
    f32 = torch.float32  # flex_attention on CPU takes no float64
    q = torch.randn(B, A * bs, H, D, dtype=f32).transpose(1, 2)  # the layout DraftAttention hands over
    k, v = torch.randn(2, B, KV, L + A * bs, D, dtype=f32)
    flex = dm.flex_attend(anchors, doc, bs)(q, k, v)
    dense = helpers.sdpa_attend(dm.dense_block_mask(anchors, doc, bs))(q, k, v)
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_training_forward_matches_inference(arch):
    """The logits the training forward gives a block at anchor a equal those the inference path
    gives when drafting at a after the target processed tokens < a (catches context leaks)."""
    target = tiny_target(arch)
    drafter = make_drafter(target)
    ids, doc, pos, hidden = packed_row(target, drafter, [11, 17, 9], pad=3)
    starts = {0: 0, 1: 11, 2: 28}
    anchors = torch.tensor([[3, 10, 12, 20, 27, 29, 35]])  # several docs; blocks cross doc ends
    train_logits = drafter.block_hidden(hidden, ids, doc, pos, anchors) @ drafter.lm_head_weight.t()
    for i, a in enumerate(anchors[0].tolist()):
        d = int(doc[0, a]); p = a - starts[d]
        prefix = ids[0, starts[d]:a]
        f = target_features(target, prefix, drafter.target_layer_ids)[None]
        ctx_kv = drafter.context_kv(f, torch.arange(p)[None])
        infer = drafter.draft_logits(ctx_kv, ids[0, a], p)
        torch.testing.assert_close(train_logits[0, i], infer[0], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("layers", [1, 3])
def test_block_hidden_equals_every_slot_through_every_layer(layers):
    """draft_hidden's first layer projects each distinct row once (the anchors' rows, one mask row
    for all blocks) and its last carries only slots 1.. past the attention: the same hidden
    states and parameter gradients as every slot of every block run through every layer."""
    target = tiny_target()
    drafter = make_drafter(target, layers=layers)
    ids, doc, pos, hidden = packed_row(target, drafter, [11, 17, 9], pad=3)
    anchors = torch.tensor([[3, 10, 12, 20, 27, 29, 35]])
    B, A, bs = 1, anchors.shape[1], drafter.block_size
    block_ids = torch.full((B, A, bs), drafter.mask_token_id)
    block_ids[:, :, 0] = ids.gather(1, anchors)
    block_pos = (pos.gather(1, anchors)[:, :, None] + torch.arange(bs)).view(B, A * bs)
    attend = helpers.sdpa_attend(dm.dense_block_mask(anchors, doc, bs))
    x = drafter.embed_tokens(block_ids.view(B, A * bs))
    cos, sin = drafter.rotary_emb(x, block_pos)
    for layer, (k, v) in zip(drafter.layers, drafter.context_kv(hidden, pos)):
        x = layer(x, cos, sin, k, v, attend)
    want = drafter.norm(x).view(B, A, bs, -1)[:, :, 1:]
    got = drafter.block_hidden(hidden, ids, doc, pos, anchors)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(0))
    params = list(drafter.parameters())
    torch.testing.assert_close(torch.autograd.grad((got * weights).sum(), params),
                               torch.autograd.grad((want * weights).sum(), params), rtol=1e-10, atol=1e-12)


def fp32_drafter_and_row():
    """An fp32 drafter and the forward's inputs for one packed row of three documents."""
    torch.set_default_dtype(torch.float32)
    target = tiny_target(dtype=torch.float32)
    drafter = make_drafter(target).float()
    ids, doc, pos, hidden = packed_row(target, drafter, [11, 17, 9], pad=3)
    return drafter, (hidden, ids, torch.ones_like(ids, dtype=torch.float32), doc, pos,
                     torch.rand(ids.shape, generator=torch.Generator().manual_seed(3)))


def test_bf16_matmul_weights_give_the_fp32_drafters_step_under_autocast():
    """The CUDA training step passes bf16 copies of the matmul weights (train_dflash_pipeline's
    FlatAdamW keeps them) and autocast does the rest: loss and gradients must be the fp32
    drafter's under autocast, bit for bit (the residual stream's dtype is autocast's in both, not
    read off a weight)."""
    drafter, inputs = fp32_drafter_and_row()
    params = dict(drafter.named_parameters())
    linear = {f"{name}.weight" for name, m in drafter.named_modules() if isinstance(m, torch.nn.Linear)}
    copies = {k: (p.to(torch.bfloat16) if k in linear else p) for k, p in params.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, _ = drafter(*inputs, num_anchors=7)
        got, _ = torch.func.functional_call(drafter, copies, inputs, dict(num_anchors=7))
    assert torch.equal(got, want), (got, want)
    grads = torch.autograd.grad(got, [copies[k] for k in params])
    for (k, p), g, w in zip(params.items(), grads, torch.autograd.grad(want, list(params.values()))):
        assert torch.equal(g.float(), w), k


def test_the_residual_stream_takes_autocasts_dtype():
    """Train = serve: under autocast (the GPU step) the residual stream, into and out of every
    layer, is bf16, as a server runs the drafter; without autocast (CPU training) it is fp32."""
    drafter, inputs = fp32_drafter_and_row()
    seen = []
    for layer in drafter.layers:
        layer.register_forward_hook(lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
    drafter(*inputs, num_anchors=7)
    assert seen and set(seen) == {(torch.float32, torch.float32)}
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        drafter(*inputs, num_anchors=7)
    assert len(seen) == len(drafter.layers) and set(seen) == {(torch.bfloat16, torch.bfloat16)}


def test_context_leak_would_be_caught():
    """Sanity of the test above: letting a block see its anchor's own hidden state changes logits."""
    target = tiny_target()
    drafter = make_drafter(target)
    ids, doc, pos, hidden = packed_row(target, drafter, [20], pad=0)
    a = 10
    f_ok = target_features(target, ids[0, :a], drafter.target_layer_ids)[None]
    f_leak = target_features(target, ids[0, :a + 1], drafter.target_layer_ids)[None]
    ok = drafter.draft_logits(drafter.context_kv(f_ok, torch.arange(a)[None]), ids[0, a], a)
    leak = drafter.draft_logits(drafter.context_kv(f_leak, torch.arange(a + 1)[None]), ids[0, a], a)
    assert not torch.allclose(ok, leak)


def test_loss_weights_and_normalisation_by_hand():
    target = tiny_target()
    drafter = make_drafter(target, block_size=4)
    ids, doc, pos, hidden = packed_row(target, drafter, [8, 6], pad=2)
    L = ids.shape[1]
    loss_mask = torch.ones(1, L); loss_mask[0, :3] = 0; loss_mask[0, 12] = 0; loss_mask[0, 14:] = 0
    noise = torch.zeros(1, L); noise[0, 5] = 0.9; noise[0, 10] = 0.8; noise[0, 6] = 0.7
    gamma = 2.0
    loss, stats = drafter(hidden, ids, loss_mask, doc, pos, noise, num_anchors=3, gamma=gamma, ce_chunk_size=5)
    anchors = torch.tensor([[5, 6, 10]])
    logits = (drafter.block_hidden(hidden, ids, doc, pos, anchors) @ drafter.lm_head_weight.t())[0]  # [3, slots 1..3, V]
    num = den = 0.0
    for i, a in enumerate([5, 6, 10]):
        for k in range(1, 4):
            t = a + k
            # same row, same document, loss mask set
            if t >= L or doc[0, t] != doc[0, a] or loss_mask[0, t] == 0:
                continue
            w = math.exp(-(k - 1) / gamma)
            ce = -torch.log_softmax(logits[i, k - 1], -1)[ids[0, t]]
            num += w * ce.item(); den += w
    assert den > 0
    assert abs(loss.item() - num / den) < 1e-9
    # anchor 10 (doc 1: 8..13) sees labels 11 (ok), 12 (masked), 13 (ok); anchor 5: 6, 7 then doc ends
    assert float(stats[2]) == 3  # three valid blocks


def test_too_few_valid_positions_get_zero_weight():
    target = tiny_target()
    drafter = make_drafter(target)
    ids, doc, pos, hidden = packed_row(target, drafter, [6], pad=10)
    mask = (doc >= 0).double()
    loss, stats = drafter(hidden, ids, mask, doc, pos, torch.rand(1, 16), num_anchors=12)
    assert torch.isfinite(loss)
    assert float(stats[2]) == 5  # positions 0..4 are the only valid anchors


def test_chunked_head_matches_full_and_grads():
    torch.manual_seed(0)
    h = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(50, 16)
    lab = torch.randint(0, 50, (37,))
    ce, correct = dm.lm_head_ce(h, w, lab, 8)
    ref = torch.nn.functional.cross_entropy(h @ w.t(), lab, reduction="none")
    torch.testing.assert_close(ce, ref)
    assert torch.equal(correct, (h @ w.t()).argmax(-1) == lab)
    g = torch.randn(37)
    (gh,) = torch.autograd.grad((ce * g).sum(), h)
    (gref,) = torch.autograd.grad((ref * g).sum(), h)
    torch.testing.assert_close(gh, gref)
    # Without a gradient (evaluation) the same values come out, and no gradient is computed.
    ce_eval, correct_eval = dm.lm_head_ce(h.detach(), w, lab, 8, False)
    torch.testing.assert_close(ce_eval, ref)
    assert torch.equal(correct_eval, correct)


def test_head_reads_hidden_in_the_weight_dtype(monkeypatch):
    # The op gets the final norm's output (fp32 in a step) already in the head's bf16, as its
    # matmul reads it: the same ce as casting it inside, and the gradient back in the input's dtype.
    torch.manual_seed(0)
    h = torch.randn(37, 16, requires_grad=True)
    w = torch.randn(50, 16).to(torch.bfloat16)
    lab = torch.randint(0, 50, (37,))
    seen, op = [], dm._lm_head_ce
    monkeypatch.setattr(dm, "_lm_head_ce", lambda hidden, *rest: seen.append(hidden.dtype) or op(hidden, *rest))
    ce, _ = dm.lm_head_ce(h, w, lab, 8)
    assert seen == [torch.bfloat16]
    ref = torch.nn.functional.cross_entropy((h.to(torch.bfloat16) @ w.t()).float(), lab, reduction="none")
    torch.testing.assert_close(ce, ref)
    (gh,) = torch.autograd.grad(ce.sum(), h)
    (gref,) = torch.autograd.grad(ref.sum(), h)
    assert gh.dtype == h.dtype
    torch.testing.assert_close(gh, gref, rtol=2e-2, atol=2e-2)  # a bf16 matmul's rounding


def test_compiled_head_chunk_matches_eager_and_writes_no_fp32_vocabulary_buffer():
    # Compiled (--compile's LM-head chunk), the softmax gradient is fused into the reductions'
    # kernel and written once in bf16; a scatter there made it an fp32 N x V buffer plus a cast.
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    torch.manual_seed(0)
    N, D, V = 64, 32, 1000
    h = torch.randn(N, D, dtype=torch.bfloat16)
    w = (torch.randn(V, D) * 0.2).to(torch.bfloat16)
    lab = torch.randint(0, V, (N,))
    want = dm._head_ce_chunk(h, w, lab, True)
    got, code = run_and_get_code(torch.compile(dm._head_ce_chunk, dynamic=False), h, w, lab, True)
    torch.testing.assert_close(got[0], want[0])
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[2], want[2])
    vocab_buffers = re.findall(rf"\(\({N}, {V}\), \({V}, 1\), torch\.(\w+)\)", "\n".join(code))
    assert vocab_buffers and "float32" not in vocab_buffers, vocab_buffers


# --- distillation: KL from the target's top-k distribution ----------------------------------

def distribution_case(N=9, D=8, V=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(N, D, generator=g), torch.randn(V, D, generator=g)
    target = (torch.randn(N, V, generator=g) * 2).softmax(-1)
    return h, w, torch.randint(0, V, (N,), generator=g), target


@pytest.mark.parametrize("kl_weight", [1.0, 0.3])
def test_kl_with_the_whole_vocabulary_is_the_exact_kl_and_its_gradient(kl_weight):
    h, w, lab, p = distribution_case()
    ids = p.argsort(-1, descending=True)  # top-k = the vocabulary: no rest bucket
    h = h.requires_grad_()
    loss, correct = dm.lm_head_ce(h, w, lab, 4, True, (ids, p.gather(1, ids)), kl_weight)
    log_q = (h @ w.t()).log_softmax(-1)
    ref = (1 - kl_weight) * -log_q.gather(1, lab[:, None])[:, 0] + kl_weight * (p * (p.log() - log_q)).sum(-1)
    torch.testing.assert_close(loss, ref)
    assert torch.equal(correct, log_q.argmax(-1) == lab)
    g = torch.randn(len(lab))
    torch.testing.assert_close(torch.autograd.grad((loss * g).sum(), h)[0], torch.autograd.grad((ref * g).sum(), h)[0])


def test_kl_of_a_top_k_is_over_the_k_tokens_and_one_bucket_for_the_rest():
    h, w, lab, p = distribution_case()
    ids = p.topk(5, -1).indices
    pk = p.gather(1, ids)
    h = h.requires_grad_()
    loss, _ = dm.lm_head_ce(h, w, lab, 4, True, (ids, pk), 1.0)
    q = (h @ w.t()).softmax(-1)
    qk, rest, q_rest = q.gather(1, ids), 1 - pk.sum(-1), 1 - q.gather(1, ids).sum(-1)
    ref = (pk * (pk / qk).log()).sum(-1) + rest * (rest / q_rest).log()  # written out by hand
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(torch.autograd.grad(loss.sum(), h)[0], torch.autograd.grad(ref.sum(), h)[0])


def test_kl_to_a_one_hot_distribution_is_the_cross_entropy():
    h, w, lab, _ = distribution_case()
    one_hot = (lab[:, None], torch.ones(len(lab), 1))
    for weight in (1.0, 0.5):
        got = dm._head_distill_chunk(h, w, lab, *one_hot, weight, True)
        want = dm._head_ce_chunk(h, w, lab, True)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


def test_compiled_distillation_chunk_matches_eager():
    torch._dynamo.reset()
    h, w, lab, p = distribution_case(N=32, V=200)
    top = p.topk(16, -1)
    args = (h.float(), w.float(), lab, top.indices, top.values.float(), 0.5, True)
    for a, b in zip(torch.compile(dm._head_distill_chunk, dynamic=False)(*args), dm._head_distill_chunk(*args)):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


def test_training_with_kl_lowers_the_kl_to_the_target():
    # A drafter trained on one batch's target distribution (the target stage's top-k at T=1) with
    # --loss kl: the KL to it falls well below where it starts.
    target = tiny_target(vocab=64, init_std=0.3)
    drafter = make_drafter(target).train()
    replica = ts.TargetReplica(target, drafter.target_layer_ids, torch.device("cpu"),
                               distillation=dict(top_k=16, temperature=1.0, kl_weight=1.0))
    g = torch.Generator().manual_seed(0)
    R, L = 2, 40
    ids = torch.randint(0, 63, (R, L), generator=g)
    batch = {"input_ids": ids, "position_ids": torch.arange(L).repeat(R, 1), "doc_ids": torch.zeros(R, L).long()}
    out = replica.outputs(batch)
    inputs = (out["target_hidden"], ids, torch.ones(R, L), batch["doc_ids"], batch["position_ids"],
              torch.rand(R, L, generator=g), out["target_top_ids"], out["target_top_probs"])
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        loss, _ = drafter(*inputs, num_anchors=8, kl_weight=1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::10]


def test_save_load_round_trip(tmp_path):
    target = tiny_target()
    drafter = make_drafter(target)
    drafter.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                "vocab_size", "rope_theta", "rms_norm_eps", "block_size", "num_target_layers", "layer_types"):
        assert key in cfg, key
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["num_hidden_layers"] == 2 and cfg["layer_types"] == ["full_attention"] * 2
    assert cfg["dflash_config"] == {"mask_token_id": 299, "target_layer_ids": drafter.target_layer_ids}
    # vLLM builds before its layer-offset fix read only this field, as hidden_states indices
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in drafter.target_layer_ids]
    assert cfg["rope_theta"] == dm.rope_fields(target.config)[0]
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert not any("embed" in n or "lm_head" in n for n in names)
    expected = {"norm.weight", "fc.weight", "hidden_norm.weight"}
    for i in range(2):
        expected |= {f"layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        expected |= {f"layers.{i}.self_attn.{p}_norm.weight" for p in "qk"}
        expected |= {f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
        expected |= {f"layers.{i}.{p}_layernorm.weight" for p in ("input", "post_attention")}
    assert names == expected
    loaded = dm.DFlashDraftModel.from_pretrained(tmp_path, dtype=torch.float64).attach_target(target)
    ids, doc, pos, hidden = packed_row(target, drafter, [12], pad=0)
    anchors = torch.tensor([[2, 7]])
    torch.testing.assert_close(loaded.block_hidden(hidden, ids, doc, pos, anchors),
                               drafter.block_hidden(hidden, ids, doc, pos, anchors))


def test_rope_scaling_written_top_level(tmp_path):
    target = tiny_target("llama")
    target.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    cfg = dm.make_drafter_config(target.config, mask_token_id=1, num_draft_layers=1, block_size=4)
    d = dm.serving_config_dict(cfg)
    assert d["rope_theta"] == 5e5 and d["rope_scaling"]["rope_type"] == "linear"


def test_training_step_compiles_fullgraph_and_its_trace_does_not_grow_with_chunks():
    # The LM-head loss is one opaque op in the trace: unrolled, its chunk loop made the compile
    # time grow with the chunk count. Compiled, the step gives the eager loss and gradients.
    target = tiny_target(dtype=torch.float32)
    drafter = make_drafter(target).float().train()
    ids, doc, pos, hidden = packed_row(target, drafter, [20, 12], pad=0)
    hidden, mask, noise = hidden.detach().float(), torch.ones(1, 32), torch.rand(1, 32)

    def loss_and_grads(step, chunk):
        drafter.zero_grad()
        loss, stats = step(hidden, ids, mask, doc, pos, noise, num_anchors=8, ce_chunk_size=chunk)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in drafter.parameters()]

    node_counts = []

    def count_nodes(gm, example_inputs):  # subgraphs too: an autograd.Function is traced into one
        node_counts.append(sum(len(m.graph.nodes) for m in gm.modules() if isinstance(m, torch.fx.GraphModule)))
        return gm.forward
    for chunk in (3, 1000):  # 19 chunks, 1 chunk
        torch._dynamo.reset()
        want_loss, want_grads = loss_and_grads(drafter, chunk)
        loss, grads = loss_and_grads(torch.compile(drafter, fullgraph=True, backend=count_nodes), chunk)
        torch.testing.assert_close(loss, want_loss)
        torch.testing.assert_close(grads, want_grads)
    assert node_counts[0] == node_counts[1], node_counts


def test_compiled_step_computes_rope_cos_sin_once_per_position():
    # Fused into its consumers, RoPE's cos/sin were computed once per head in the forward and
    # again in the backward's kernels (12 calls of cos in this step's output code, 8 of them in
    # the backward). Through dm.computed_once: at most one per call site (context, block), in the
    # forward, and the loss and gradients stay eager's.
    from torch._inductor.utils import run_and_get_code
    torch._dynamo.reset()
    target = tiny_target(dtype=torch.float32)
    drafter = make_drafter(target).float().train()
    ids, doc, pos, hidden = packed_row(target, drafter, [20, 12], pad=0)
    hidden, mask, noise = hidden.detach().float(), torch.ones(1, 32), torch.rand(1, 32)

    def loss_and_grads(step):
        drafter.zero_grad()
        loss, _ = step(hidden, ids, mask, doc, pos, noise, num_anchors=8)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in drafter.parameters()]
    want = loss_and_grads(drafter)
    got, code = run_and_get_code(loss_and_grads, torch.compile(drafter, fullgraph=True, dynamic=False))
    torch.testing.assert_close(got, want)
    cos_calls = [len(re.findall(r"\.cos\(\)|std::cos\(|math\.cos\(", c)) for c in code]
    assert "_forward']" in code[0] and cos_calls[0] <= 2 and sum(cos_calls[1:]) == 0, cos_calls  # then the backward's


def test_flex_training_forward_compiles_fullgraph_and_matches_sdpa():
    # The GPU step's attention path traced whole as in --compile (flex_block_mask and
    # flex_attention inside the model), forward only: flex_attention has no backward on CPU.
    torch._dynamo.reset()
    target = tiny_target(dtype=torch.float32)
    drafter = make_drafter(target).float().eval()
    ids, doc, pos, hidden = packed_row(target, drafter, [150, 90], pad=10)
    hidden, L = hidden.float(), ids.shape[1]
    mask, noise = (doc >= 0).float(), torch.rand(1, L, dtype=torch.float32)
    with torch.no_grad():
        want, _ = drafter(hidden, ids, mask, doc, pos, noise, num_anchors=40, attention="sdpa")
        step = torch.compile(drafter, fullgraph=True)
        got, _ = step(hidden, ids, mask, doc, pos, noise, num_anchors=40, attention="flex")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_drafter_file_is_readable_as_open_would_make_it(tmp_path):
    drafter = dm.DFlashDraftModel(dm.make_drafter_config(counter_target().config, mask_token_id=5,
                                                         num_draft_layers=1, block_size=4))
    drafter.save_pretrained(tmp_path / "d")
    mode = stat.S_IMODE(os.stat(tmp_path / "d" / "model.safetensors").st_mode)
    assert mode == 0o666 & ~helpers.process_umask() and mode & stat.S_IRGRP


def test_gemma_drafter_embeds_through_the_scaled_embedding():
    import dflash_model as dm
    target = tiny_gemma3()
    cfg = dm.make_drafter_config(target.config, mask_token_id=127, num_draft_layers=1, block_size=4)
    drafter = dm.DFlashDraftModel(cfg).attach_target(target)
    ids = torch.tensor([[5, 127, 127, 127]])
    scaled = target.get_input_embeddings()(ids)
    plain = torch.nn.functional.embedding(ids, target.get_input_embeddings().weight)
    assert torch.allclose(scaled, plain * 64 ** 0.5)
    assert torch.equal(drafter.embed_tokens(ids), scaled)
    assert "embed_tokens.weight" not in drafter.state_dict()
