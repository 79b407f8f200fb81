"""Tests of dflash_train/data_stage.py: packing into fixed-shape batches, the held-out validation split, the
mask token."""
import json

import numpy as np
import pytest

from dflash_train import chat_data
from dflash_train import data_stage as ds


def corpus_of(ids):
    return chat_data.Corpus(np.asarray(ids, np.int32), np.ones(len(ids), np.uint8), np.asarray([0, len(ids)]), None)


def test_mask_token_qwen3_unused_embedding_row(real_tokenizer, tmp_path):
    tok = real_tokenizer("qwen3")
    assert ds.choose_mask_token_id(tok, 151936, corpus_of([1, 2]), None, str(tmp_path)) == 151669


def test_mask_token_llama3_reserved_never_a_stop_id(real_tokenizer, tmp_path):
    tok = real_tokenizer("llama3_1")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128008, 128009]}))
    mask = ds.choose_mask_token_id(tok, 128256, corpus_of([1, 2]), None, str(tmp_path))
    assert mask == 128002 and tok.convert_ids_to_tokens(mask) == "<|reserved_special_token_0|>"
    for stop in (128001, 128008, 128009, 128000, 128006):  # stop ids, bos, a template token
        with pytest.raises(chat_data.UsageError, match=f"--mask-token-id {stop} .* is used by"):
            ds.choose_mask_token_id(tok, 128256, corpus_of([1, 2]), stop, str(tmp_path))
    # a reserved token that appears in the data is passed over
    assert ds.choose_mask_token_id(tok, 128256, corpus_of([128002]), None, str(tmp_path)) == 128003


def test_mask_token_smollm2_shaped(tmp_path):
    """SmolLM2: every embedding row is a token and no token is 'reserved'; its code-repository
    specials are unused by chat text, while <|endoftext|>, <|im_start|>, <|im_end|> never qualify."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<reponame>", "<file_sep>"]
    vocab = {t: i for i, t in enumerate(specials + [chr(c) for c in range(32, 127)])}
    t = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    t.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    t.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>", unk_token="<|endoftext|>")
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    assert ds.choose_mask_token_id(tok, len(tok), corpus_of([10, 11]), None, str(tmp_path)) == 3
    with pytest.raises(chat_data.UsageError, match="--mask-token-id 1 "):
        ds.choose_mask_token_id(tok, len(tok), corpus_of([10]), 1, str(tmp_path))
    with pytest.raises(chat_data.UsageError, match="no unused special token"):
        ds.choose_mask_token_id(tok, len(tok), corpus_of([3, 4]), None, str(tmp_path))


def test_packing_deterministic_and_complete():
    lengths = [5, 9, 30, 2, 17, 8, 8, 25, 31, 1]
    a = ds.pack_epoch(lengths, 32, seed=1, epoch=0)
    assert a == ds.pack_epoch(lengths, 32, seed=1, epoch=0)
    assert a != ds.pack_epoch(lengths, 32, seed=1, epoch=1)
    assert sorted(d for r in a for d in r) == list(range(10))
    assert all(sum(lengths[d] for d in r) <= 32 for r in a)


def test_split_validation_is_disjoint_deterministic_and_sized():
    import numpy as np
    corpus = chat_data.Corpus(np.arange(30, dtype=np.int32), np.ones(30, np.uint8), np.arange(0, 31, 3), None)
    train, held = ds.split_validation(corpus, 0.2, seed=1)
    assert len(held) == 2 and len(train) == 8 and not set(train) & set(held)
    assert [a.tolist() for a in ds.split_validation(corpus, 0.2, seed=1)] == [train.tolist(), held.tolist()]
    sub = corpus.subset(held)
    assert [sub.doc(i)[0].tolist() for i in range(len(sub))] == [corpus.doc(d)[0].tolist() for d in held]
    assert len(ds.split_validation(corpus, 0.01, seed=1)[1]) == 0  # too few documents to hold any out
    # documents opening with the same prompt (tokens before the first trained one) stay together
    ids = np.array([7, 8, 1, 2] * 40 + [int(i) for i in range(100, 120)], dtype=np.int32)  # 40 copies, then 5 others
    mask = np.array([0, 0, 1, 1] * 45, dtype=np.uint8)
    corpus = chat_data.Corpus(ids, mask, np.arange(0, 181, 4), None)
    for seed in range(20):
        train, held = ds.split_validation(corpus, 0.1, seed)
        copies = set(range(40))
        assert not set(train) & set(held) and len(train) + len(held) == 45
        assert copies <= set(held) or not copies & set(held), seed  # all 40 copies on one side
        assert len(held) >= 4


def test_split_validation_keeps_its_prompts_when_the_data_is_regenerated():
    """Regenerated data has the same prompts with other answers, and so other document counts
    and indices: the held-out prompts stay the same (the figures of two runs compare)."""
    import numpy as np
    rng = np.random.default_rng(0)

    def corpus_of(docs):  # docs: (prompt tokens, answer tokens)
        ids = np.concatenate([np.concatenate([p, a]) for p, a in docs]).astype(np.int32)
        mask = np.concatenate([np.r_[np.zeros(len(p)), np.ones(len(a))] for p, a in docs]).astype(np.uint8)
        return chat_data.Corpus(ids, mask, np.cumsum([0] + [len(p) + len(a) for p, a in docs]), None)
    prompts = [rng.integers(10, 1000, 6) for _ in range(300)]
    first = [(p, rng.integers(10, 1000, rng.integers(3, 9))) for p in prompts]
    # regenerated: other answers, 6 conversations now split in two documents, 4 new ones at the front
    second = [(rng.integers(10, 1000, 6), rng.integers(10, 1000, 5)) for _ in range(4)]
    for i, p in enumerate(prompts):
        second += [(p, rng.integers(10, 1000, 4))] * (2 if i % 50 == 0 else 1)
    held = []
    for docs in (first, second):
        _, h = ds.split_validation(corpus_of(docs), 0.05, seed=3)
        held.append({docs[i][0].tobytes() for i in h})
    assert len(held[0]) >= 15 and len(held[0] ^ held[1]) <= 4  # a new prompt may take a place at the edge
