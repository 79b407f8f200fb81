"""Tests of dflash_train/decoding.py: batched and speculative decoding equal transformers' own greedy decoding
(and sampling its distribution), the decode masks and caches, the replay of decoding over taus."""



import pytest
import torch

import dflash_model as dm
from dflash_train import decoding
from dflash_train import evaluation
from dflash_train import target_model
from conftest import make_drafter, tiny_target


class OracleDrafter:
    """Wraps a drafter's draft_logits so its first `right` slots are the target's true continuation
    (one row)."""

    def __init__(self, drafter, truth, prompt_len, right):
        self.drafter, self.truth, self.prompt_len, self.right = drafter, truth, prompt_len, right

    def __call__(self, ctx_kv, anchor_token, anchor_position, attend=dm.full_attend):
        logits = dm.DFlashDraftModel.draft_logits(self.drafter, ctx_kv, anchor_token, anchor_position, attend)
        for k in range(min(self.right, logits.shape[1])):
            i = int(torch.as_tensor(anchor_position).reshape(-1)[0]) + 1 + k - self.prompt_len
            if 0 <= i < len(self.truth):
                logits[0, k] = 0
                logits[0, k, self.truth[i]] = 1
        return logits


def hf_greedy(target, prompt, n, stop=None):
    out = target.generate(prompt, max_new_tokens=n, do_sample=False, eos_token_id=stop, pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()


@pytest.mark.parametrize("right", [0, 2, 3, 100])
def test_speculative_decoding_is_lossless(right):
    target = tiny_target()
    drafter = make_drafter(target, block_size=4)
    prompt = torch.randint(0, 299, (1, 7), generator=torch.Generator().manual_seed(3))
    truth = hf_greedy(target, prompt, 30)
    drafter.draft_logits = OracleDrafter(drafter, truth, prompt.shape[1], right)
    (out, acc), = decoding.speculative_generate(target, prompt.tolist(), 30, drafter=drafter, batch_size=1, graph=False)
    assert out == truth
    assert sum(acc) + 1 >= len(out)
    if right >= 3:  # every draft right: bs tokens per target forward
        assert acc[:-1] == [4] * (len(acc) - 1)
    elif right == 2:
        assert set(acc[:-1]) == {3}


def test_speculative_rows_that_finish_first_stay_inside_their_cache_slots():
    """A row that ends by length keeps its place while the other rows go on verifying blocks;
    with the longest prompt at a multiple of the slot granule (no padding to spare), its blocks
    must still fit the cache (this case ran out of bounds when a row held max_new + block slots)
    and every output is the target's greedy one. The counter target makes prompt lookup right
    along counting runs and wrong at their defects, so the rows gain at different rates."""
    import random
    from conftest import counter_target
    V, rnd = 128, random.Random(0)
    target = counter_target(V)
    prompts = []
    for r in range(3):
        p = [i % V for i in range(256 - 8 * r)]
        for _ in range(rnd.randint(1, 12)):
            p[rnd.randrange(len(p))] = rnd.randrange(V)
        prompts.append(p)
    prompts.append([rnd.randrange(V) for _ in range(200)])
    outs = decoding.speculative_generate(target, prompts, 48, (), block_size=16, batch_size=4, graph=False)
    assert [o for o, _ in outs] == [t for t, _ in decoding.generate(target, prompts, 48, (), 4, graph=False)]
    assert len({len(gains) for _, gains in outs}) > 1  # the rows took different numbers of steps


def test_speculative_decoding_stops_at_stop_token():
    target = tiny_target()
    drafter = make_drafter(target, block_size=4)
    prompt = torch.randint(0, 299, (1, 5), generator=torch.Generator().manual_seed(4))
    truth = hf_greedy(target, prompt, 20)
    stop = truth[6]
    (out, _), = decoding.speculative_generate(target, prompt.tolist(), 20, [stop], drafter=drafter, batch_size=1, graph=False)
    assert out == hf_greedy(target, prompt, 20, stop)
    assert out[-1] == stop and len(out) <= 7


def test_batched_decoding_equals_transformers_generate_and_per_row_speculation():
    """Rows of mixed lengths in one batch (left-padded, refilled batch by batch) decode exactly as
    transformers' greedy generate decodes each alone; batched speculation with a drafter and with
    prompt lookup gives the same outputs, and a row's accepted lengths do not depend on its batch."""
    for arch in ("qwen3", "llama"):
        target = tiny_target(arch=arch, dtype=torch.float32, init_std=0.15, vocab=128)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 17, 9, 30, 2)]
        greedy = decoding.generate(target, prompts, 20, [1], batch_size=3, graph=False)
        drafter = make_drafter(target, block_size=4)
        batched = decoding.speculative_generate(target, prompts, 20, [1], drafter=drafter, batch_size=3, graph=False)
        lookup = decoding.speculative_generate(target, prompts, 20, [1], block_size=4, batch_size=2, graph=False)
        for p, (tokens, reason), (spec, gains), (look, _) in zip(prompts, greedy, batched, lookup):
            assert tokens == hf_greedy(target, torch.tensor([p]), 20, 1) == spec == look
            assert reason == ("stop" if tokens[-1] == 1 else "length")
            (alone, alone_gains), = decoding.speculative_generate(target, [p], 20, [1], drafter=drafter, batch_size=1,
                                                            graph=False)
            assert alone == spec and alone_gains == gains


@pytest.mark.parametrize("attention", ["grouped", "flex"])
def test_finished_rows_are_refilled_and_decode_as_transformers_does(monkeypatch, attention):
    """Rows that stop early take the next prompts of their group while the others keep decoding
    (some rows refilled, all rows at once at the end): every output still equals transformers'
    greedy generate of that prompt alone. With flex attention every prompt shares one decoder,
    whatever its length."""
    target = tiny_target(arch="llama", dtype=torch.float32, init_std=0.15, vocab=128)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (int(n),), generator=g).tolist() for n in torch.randint(2, 40, (11,), generator=g)]
    free = [hf_greedy(target, torch.tensor([p]), 40) for p in prompts]
    # the stop id: a token that ends some replies early and others late or never
    stop = max(range(128), key=lambda t: len({min(f.index(t), 40) if t in f else 40 for f in free}))
    refills = []
    real = decoding.BatchDecoder.prefill
    monkeypatch.setattr(decoding.BatchDecoder, "prefill",
                        lambda self, ps, rows=None: refills.append(rows) or real(self, ps, rows))
    decoders = []
    real_init = decoding.BatchDecoder.__init__
    monkeypatch.setattr(decoding.BatchDecoder, "__init__", lambda self, *a, **k: decoders.append(1) or real_init(self, *a, **k))
    out = decoding.generate(target, prompts, 40, [stop], batch_size=4, graph=False, decode_attention=attention)
    assert [t for t, _ in out] == [hf_greedy(target, torch.tensor([p]), 40, stop) for p in prompts]
    assert any(r is not None and len(r) < 4 for r in refills), refills  # a partial refill happened
    ends = {len(t) for t, _ in out}
    assert len(ends) > 2, ends
    assert attention != "flex" or len(decoders) == 1, decoders


def test_decode_block_mask_is_the_rule_tile_by_tile():
    """decode_block_mask against the dense rule (row b's query i sees slots pad..pad + verified + i,
    none of a finished row): skipped tiles hold no visible slot, full tiles only visible ones, and
    the rule inside partial tiles gives the rest; rows spanning several tiles, the last one cut."""
    from torch.nn.attention.flex_attention import BlockMask
    g = torch.Generator().manual_seed(0)
    B, q, S, tile = 12, 3, 45, 4
    pad = torch.randint(0, 10, (B,), generator=g)
    verified = torch.randint(0, S - q - 10, (B,), generator=g)
    live = torch.rand(B, generator=g) > 0.25
    live[0] = False
    mask = decoding.decode_block_mask(pad, verified, live, q, S, tile=tile)
    slot, i = torch.arange(S), torch.arange(q)
    rule = (slot[None, None] >= pad[:, None, None]) & (slot[None, None] <= (pad + verified)[:, None, None] + i[None, :, None])
    rule &= live[:, None, None]
    seen = torch.zeros(B, q, S, dtype=torch.bool)
    for b in range(B):
        for t in mask.full_kv_indices[b, 0, 0, :mask.full_kv_num_blocks[b, 0, 0]].tolist():
            seen[b, :, t * tile:(t + 1) * tile] = True
        for t in mask.kv_indices[b, 0, 0, :mask.kv_num_blocks[b, 0, 0]].tolist():
            kv = torch.arange(t * tile, min((t + 1) * tile, S))
            seen[b, :, kv] = mask.mask_mod(torch.tensor(b), 0, i[:, None], kv[None, :])
    assert torch.equal(seen, rule)
    assert mask.kv_num_blocks[0].sum() + mask.full_kv_num_blocks[0].sum() == 0  # a finished row reads nothing
    assert (mask.full_kv_num_blocks > 0).any() and (mask.kv_num_blocks > 1).any()
    assert isinstance(mask, BlockMask)


def test_grouped_decoding_attention_equals_the_models_own(monkeypatch):
    """The decoder's grouped-query attention (the KV cache read once per KV head) gives the
    logits of transformers' own attention, at one token and at a block, rows of mixed lengths."""
    target = tiny_target(dtype=torch.float64, init_std=0.15, vocab=128)  # 4 query heads share 2 KV heads
    calls = []
    real = decoding.grouped_attention
    monkeypatch.setattr(decoding, "grouped_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    decoding._register_grouped_attention.cache_clear()
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    outs = []
    for attention in ("grouped", "model"):
        d = decoding.BatchDecoder(target, 3, 32, decode_attention=attention)
        first, _ = d.prefill(prompts)
        one, _ = d.step(first.argmax(-1)[:, None])
        d.advance(torch.ones(3, dtype=torch.long))
        block, _ = d.step(torch.randint(3, 128, (3, 4), generator=torch.Generator().manual_seed(0)))
        outs.append((first, one, block))
    assert calls and target.config._attn_implementation == "sdpa"  # used while decoding, restored after
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    decoding._register_grouped_attention.cache_clear()


def test_flex_decoding_attention_equals_grouped():
    """The decoder's flex steps (only the slots each row uses, tile by tile) give the grouped
    attention's logits, at one token and at a block, for rows of mixed lengths spanning several
    128-slot tiles; a row that is not live reads nothing and leaves the others' logits as they were."""
    target = tiny_target(dtype=torch.float32, init_std=0.15, vocab=128)  # 4 query heads share 2 KV heads
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (300, 20, 140, 129)]
    block = torch.randint(3, 128, (4, 5), generator=g)
    outs = []
    for attention in ("grouped", "flex"):
        d = decoding.BatchDecoder(target, 4, 512, decode_attention=attention)
        with torch.no_grad():  # as generate runs it (flex_attention has no backward on the CPU)
            first, _ = d.prefill(prompts)
            one, _ = d.step(first.argmax(-1)[:, None])
            d.advance(torch.ones(4, dtype=torch.long))
            blk, _ = d.step(block)
            d.live[2] = False
            without, _ = d.step(block)
        outs.append((first, one, blk, without))
    for a, b in zip(outs[0][:3], outs[1][:3]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    keep = torch.tensor([0, 1, 3])
    torch.testing.assert_close(outs[1][3][keep], outs[0][3][keep], rtol=1e-4, atol=1e-4)
    assert torch.isfinite(outs[1][3]).all()


def test_sampling_is_seeded_and_respects_top_p():
    target = tiny_target(dtype=torch.float32, init_std=0.15, vocab=128)
    prompts = [[5, 6, 7], [9, 10]]
    a = decoding.generate(target, prompts, 12, (), temperature=1.0, top_p=0.9, seed=3, graph=False)
    assert a == decoding.generate(target, prompts, 12, (), temperature=1.0, top_p=0.9, seed=3, graph=False)
    assert a != decoding.generate(target, prompts, 12, (), temperature=1.0, top_p=0.9, seed=4, graph=False)
    logits = torch.tensor([[0.0, 5.0, 4.9, -9.0]])
    picks = {int(decoding.pick_tokens(logits, 1.0, 0.5, torch.Generator().manual_seed(s))) for s in range(50)}
    assert picks == {1}  # token 1 alone holds over half the mass
    assert decoding.pick_tokens(logits).tolist() == [1]


def test_length_batches_keep_the_cache_within_its_budget():
    prompts = [[0] * n for n in (5, 300, 9, 70, 2, 33)]
    slots_of = lambda n: decoding.slots_for(n, 64)
    wide = decoding.length_batches(prompts, 4, slots_of, 1, float("inf"))
    assert [b[0] for b in wide] == [[4, 0, 2, 5], [3, 1]]  # by length
    assert [(b[1], b[2]) for b in wide] == [(4, 320), (4, 576)]
    # a budget of 1000 slot-rows: 4 x 320 does not fit, 2 x 320 does; 576 slots only one row at a time
    tight = decoding.length_batches(prompts, 4, slots_of, 1, 1000)
    assert [b[0] for b in tight] == [[4, 0], [2, 5], [3], [1]]
    assert sorted(i for b in tight for i in b[0]) == list(range(6))


def test_near_tie_tells_rounding_from_a_wrong_token():
    from conftest import counter_target
    target = counter_target(16)
    # the counter target's next token after 3 is 4, by a wide margin over 9
    assert evaluation.near_tie(target, [1, 2, 3], [4], [9], 0)[0] is False
    with torch.no_grad():
        target.lm_head.weight[9] = target.lm_head.weight[4]  # tokens 4 and 9 now score the same
    assert evaluation.near_tie(target, [1, 2, 3], [4], [9], 0) == (True, 0.0)


def test_near_tie_is_rounding_at_the_scale_of_the_rows_logits():
    """bf16: two small logits 0.03 apart in a row whose largest logit is 20 are within rounding
    (the hidden state's rounding moves every logit by up to a few units at that scale); 1.0 apart
    they are not."""
    import types

    class Fixed(torch.nn.Module):
        def __init__(self, row):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.row = row

        def forward(self, ids, logits_to_keep=1):
            return types.SimpleNamespace(logits=self.row[None, None].expand(1, ids.shape[1], -1))

    row = torch.zeros(8, dtype=torch.bfloat16)
    row[0], row[1], row[2] = 20.0, 0.5, 0.53
    assert evaluation.near_tie(Fixed(row), [5], [1], [2], 0)[0] is True
    row[2] = 1.5
    assert evaluation.near_tie(Fixed(row), [5], [1], [2], 0)[0] is False


def counter_drafter():
    """The counter target and a drafter trained briefly on it, so that its gains vary (1 to the
    block size, 6)."""
    from conftest import counter_target
    torch.manual_seed(0)
    V = 64
    target = counter_target(V)
    cfg = dm.make_drafter_config(target.config, mask_token_id=V - 1, num_draft_layers=1, block_size=6)
    drafter = dm.DFlashDraftModel(cfg).float().attach_target(target)
    opt = torch.optim.Adam([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(150):
        ids = (torch.randint(0, V, (4, 1), generator=g) + torch.arange(32)) % V
        with torch.no_grad(), target_model.collect_layer_outputs(target, drafter.target_layer_ids) as hidden:
            target(ids)
        loss, _ = drafter(torch.cat(hidden, -1), ids, torch.ones(4, 32), torch.zeros_like(ids),
                          torch.arange(32).expand(4, 32), torch.rand(4, 32, generator=g), num_anchors=8)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return target, drafter.eval()


def test_decoding_replayed_over_teacher_forced_taus_gives_the_measured_gains():
    """Train = serve for the drafter: the taus its training path computes on the target's greedy
    output, replayed as greedy decoding would visit them, give the gains that real speculative
    decoding (the inference path: KV cache, draft_logits) measured, block for block, but for the
    last block of each answer (its drafts past the end are unknown to the replay)."""
    target, drafter = counter_drafter()
    prompts = [[5, 6, 7], [20, 21], [40, 41, 42, 43]]
    measured = decoding.speculative_generate(target, prompts, 30, (), drafter=drafter, batch_size=2, graph=False)
    seen = set()
    for p, (out, gains) in zip(prompts, measured):
        _, replayed = evaluation.teacher_forced_gains(target, drafter, torch.tensor([p]), out)
        assert replayed[:-1] == gains[:-1] and replayed[-1] <= gains[-1], (replayed, gains)
        seen |= set(gains)
    assert len(seen) >= 3 and max(seen) == 6, seen  # gains of several sizes, some whole blocks


def test_validation_replay_over_a_packed_row_equals_the_evaluations_replay_per_answer():
    """The held-out 'decoding replayed' figure: on a packed row (four documents, prompts and a
    second user turn untrained, padding) the gains equal those the evaluation path replays for
    each answer alone, given everything before it in its document as the prompt (the test above
    ties that path to real decoding). num_anchors 7 leaves a part-filled last chunk."""
    target, drafter = counter_drafter()
    V = target.config.vocab_size
    greedy = lambda last, n: [(last + 1 + k) % V for k in range(n)]  # noqa: E731  (the counter's answers)
    # One counting sequence throughout, user turns and document starts included, so that a draft
    # running on past an answer's end (into the next turn or document) would be counted right
    # unless the loss mask and the document boundaries stop it.
    docs, last = [], 2  # (tokens, trained flags)
    # the last document starts inside an answer (the second piece of one split to fit a row)
    for turns in ([(4, 20)], [(2, 11), (3, 17)], [(5, 9)], [(0, 8)]):
        ids, trained = [], []
        for user, answer in turns:
            ids += greedy(last, user) + greedy(last + user, answer)
            trained += [0] * user + [1] * answer
            last = ids[-1]
        docs.append((ids, trained))
    L = sum(len(d) for d, _ in docs) + 5

    def packed_row(docs):
        row = {k: [] for k in ("input_ids", "loss_mask", "doc_ids", "position_ids")}
        for n, (ids, trained) in enumerate(docs):
            row["input_ids"] += ids; row["loss_mask"] += trained; row["doc_ids"] += [n] * len(ids)
            row["position_ids"] += list(range(len(ids)))
        pad = L - len(row["input_ids"])
        row["input_ids"] += [0] * pad; row["loss_mask"] += [0] * pad; row["doc_ids"] += [len(docs)] * pad
        row["position_ids"] += list(range(pad))
        return row

    def everywhere(rows):
        ids = torch.tensor([r["input_ids"] for r in rows])
        with torch.no_grad(), target_model.collect_layer_outputs(target, drafter.target_layer_ids) as hidden:
            target(ids)  # the counter target's layer outputs do not depend on the context: packing is exact
        packing = tuple(torch.tensor([r[k] for r in rows]) for k in ("loss_mask", "doc_ids", "position_ids"))
        packing = (packing[0].float(),) + packing[1:]
        return ids, torch.cat(hidden, -1), packing, evaluation.accepted_lengths_everywhere(drafter, torch.cat(hidden, -1), ids, *packing, 7)

    row, other = packed_row(docs), packed_row(docs[::-1])
    ids, hidden, packing, taus = everywhere([row])
    taus = taus[0]
    # rows batched together (as the validation batches them) each get what they get alone
    both = everywhere([row, other])[3]
    assert both[0].tolist() == taus.tolist() and both[1].tolist() == everywhere([other])[3][0].tolist()
    # slot by slot as accepted_lengths takes them = the training step's figures (every slot's logits)
    every = torch.arange(L)[None]
    _, correct, ok = drafter.block_predictions(hidden, ids, *packing, every, torch.ones_like(every).bool())
    assert taus.tolist() == (1 + (correct & ok).long().cumprod(-1).sum(-1))[0].tolist()
    # sampled: a target sure of the data's next token expects greedy's gains; one that gives it
    # probability 1/2 expects 1 + 1/2 + ... + (1/2)^(gain - 1) = 2 - (1/2)^(gain - 1)
    data_next = torch.cat([ids[:, 1:], ids[:, -1:]], 1)[..., None]
    for p, want in ((1.0, taus.double()), (0.5, 2 - 0.5 ** (taus.double() - 1))):
        expected = evaluation.accepted_lengths_everywhere(drafter, hidden, ids, *packing, 7,
                                                          distribution=(data_next, torch.full(data_next.shape, p)))
        torch.testing.assert_close(expected[0].double(), want)
    answers = evaluation.replayed_over_answers(lambda p, end: taus[p].item(), row["loss_mask"], row["doc_ids"])
    assert [first for _, first in answers] == [True, True, False, True, True]  # doc 1 has two answers
    packed = [g for gains, _ in answers for g in gains]
    alone = []
    for ids_doc, trained in docs:
        s = 0
        while s < len(ids_doc):
            if not trained[s]:
                s += 1
                continue
            e = s
            while e < len(ids_doc) and trained[e]:
                e += 1
            alone += evaluation.teacher_forced_gains(target, drafter, torch.tensor([ids_doc[:s]], dtype=torch.long), ids_doc[s:e])[1]
            s = e
    assert packed == alone, (packed, alone)
    answers = (20, 11, 17, 9, 8)  # each replay covers its answer: it stops at n - 1 or n tokens
    assert sum(n - 1 for n in answers) <= sum(packed) <= sum(answers) and len(set(packed)) >= 3, packed
    # two answers side by side in two documents are two replays, each with its first token given
    assert evaluation.replayed_over_answers(lambda p, end: 1, [1] * 6, [0, 0, 0, 1, 1, 1]) == [([1, 1], True), ([1, 1], True)]


def chi_square(a, b):
    """Pearson's statistic of homogeneity of two samples' counts (categories with fewer than 10
    draws in both pooled into one), and its degrees of freedom."""
    from collections import Counter
    ca, cb = Counter(a), Counter(b)
    rare = [k for k in set(ca) | set(cb) if ca[k] + cb[k] < 10]
    rows = [(ca[k], cb[k]) for k in set(ca) | set(cb) if k not in rare] + [(sum(ca[k] for k in rare),
                                                                            sum(cb[k] for k in rare))]
    rows = [r for r in rows if sum(r)]
    na, nb = len(a), len(b)
    stat = sum((x - na * (x + y) / (na + nb)) ** 2 / (na * (x + y) / (na + nb)) +
               (y - nb * (x + y) / (na + nb)) ** 2 / (nb * (x + y) / (na + nb)) for x, y in rows)
    return stat, len(rows) - 1


@torch.no_grad()
def test_speculative_sampling_is_distributed_as_the_target_samples(monkeypatch):
    """At a temperature the tokens speculative decoding keeps are the target's own samples: the
    marginal distribution of each generated position over many seeded rows equals plain sampling's
    (chi-square test of homogeneity at 0.1%), for the drafter and for prompt lookup. An
    acceptance rule that keeps every draft fails the same test."""
    torch.manual_seed(0)
    target = tiny_target(vocab=8, layers=4, hidden=32, dtype=torch.float32, init_std=0.6)
    drafter = make_drafter(target, block_size=4).float()
    prompt, n, new = [1, 2, 3, 1], 3000, 4
    plain = decoding.generate(target, [prompt] * n, new, batch_size=n, temperature=1.0, seed=1, graph=False)

    def sampled(**kw):
        return decoding.speculative_generate(target, [prompt] * n, new, batch_size=n, graph=False, temperature=1.0,
                                             seed=2, **kw)

    def worst(runs):
        stats = [chi_square([t[k] for t, _ in plain], [t[k] for t, _ in runs]) for k in range(1, new)]
        return max(stat / CHI2_999[df] for stat, df in stats)
    spec, lookup = sampled(drafter=drafter), sampled(drafter=None, block_size=4)
    assert worst(spec) < 1 and worst(lookup) < 1
    assert sum(len(g) for _, g in spec) < n * (new - 1)  # drafts were accepted: fewer steps than tokens
    real = decoding.verify_block

    def keep_every_draft(logits, draft, proposed, temperature=0.0, top_p=1.0, generator=None):
        m, _ = real(logits, draft, proposed, 0.0)
        return proposed, decoding.pick_tokens(logits[torch.arange(len(m)), proposed], temperature, top_p, generator)
    monkeypatch.setattr(decoding, "verify_block", keep_every_draft)
    assert worst(sampled(drafter=drafter)) > 1


# Upper 0.1% points of the chi-square distribution (a false alarm once in a thousand runs).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88, 10: 29.59,
            11: 31.26, 12: 32.91, 13: 34.53, 14: 36.12, 15: 37.70}
