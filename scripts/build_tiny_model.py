#!/usr/bin/env python
"""Build tiny local models (random weights, own tokenizer) for tests and benchmarks, with no network.

The tokenizer is a byte-level BPE trained with `tokenizers` on the Python standard library's own .py files,
wrapped in transformers' PreTrainedTokenizerFast with <s>/</s>/<pad> and a small chat template, so that vLLM's
/v1/completions and /v1/chat/completions both work. The model is transformers' model class of the preset's
architecture with random weights from a fixed seed, saved with save_pretrained (safetensors, bfloat16) beside the
tokenizer and a generation_config.json.

Presets (KV bytes per token in bfloat16; float32 doubles them):
  tiny          Llama, 4 layers x 2 KV heads x head_dim 64 x (K,V): 2 KiB; the connector tests' model
  kv32k         Llama, 8 layers x 8 KV heads x head_dim 128 x (K,V): 32 KiB, a realistic KV size for benchmarks,
                with a narrow hidden size so that a prefill stays cheap on one CPU core
  qwen2         Qwen2, GQA 4:1 with qkv bias
  qwen3         Qwen3, q/k norm, GQA 2:1
  mistral       Mistral, every layer a 128-token sliding window
  gemma2        Gemma2, sliding and global layers, logit softcapping, head_dim 128, tied embeddings
  deepseek_mla  DeepSeek-V2 MLA: one 512 + 64 latent per token and layer (dense MLP in every layer)
  llama_sharp, deepseek_mla_sharp
                tiny and deepseek_mla with 5x larger random weights (sharper attention and logits), for
                benchmarks/check_mla_paths.py
  long          Llama with a 40,960-token context and 512 bytes of KV per token, for long prompts

Usage:
  scripts/build_tiny_model.py [--preset NAME|all] [--out-dir DIR] [--force] [--check]

The default output directory is .cache/models/<preset> under the repository root. The build is idempotent: a stamp
file (.build-stamp.json) records the script version and the configuration; when it matches, nothing is done.
--check loads the saved model with transformers and prints KV bytes per token, the parameter count, a greedy
5-token generation and the time of one prefill.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
import traceback
from pathlib import Path

# Bump when the output of this script changes for the same preset (tokenizer training, saving, file layout...).
SCRIPT_VERSION = 2

REPO_ROOT = Path(__file__).resolve().parent.parent
STAMP_NAME = ".build-stamp.json"

# Token ids 0, 1, 2 are the special tokens, in this order (Llama's bos=1, eos=2 convention).
PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = [PAD, BOS, EOS]

# A minimal chat template: "<s><|user|>\n...</s>\n<|assistant|>\n". vLLM renders it with add_special_tokens=False,
# so the template adds the bos token itself; generation stops at </s> (the eos token).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Tokenizer training corpus: the top-level .py files of the standard library, sorted (deterministic), capped.
CORPUS_MAX_BYTES = 8 * 1024 * 1024

# Each preset: an architecture (transformers' config and model classes), a seed, a vocabulary size and the config's
# fields. Tiny random-weight models of the layouts users serve: separate K and V (Llama), GQA with qkv bias (Qwen2),
# q/k norm (Qwen3), sliding window (Mistral), alternating sliding/global layers with softcapping and tied
# embeddings (Gemma2), DeepSeek-style MLA (one latent per token and layer), and a long-context Llama.
ARCHITECTURES = {  # name -> (config class, model class) in transformers
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
}

COMMON_LLAMA = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "initializer_range": 0.02,
}
SMALL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096}

PRESETS: dict[str, dict] = {
    "tiny": {"arch": "llama", "seed": 1234, "vocab_size": 6000, "model": {**COMMON_LLAMA, **SMALL}},
    "kv32k": {
        "arch": "llama",
        "seed": 1234,
        "vocab_size": 8000,
        "model": {
            **COMMON_LLAMA,
            "hidden_size": 512,
            "intermediate_size": 1024,
            "num_hidden_layers": 8,
            "num_attention_heads": 8,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 8192,
        },
    },
    "qwen2": {"arch": "qwen2", "seed": 1234, "vocab_size": 6000,  # GQA 4:1, qkv bias (Qwen2's default)
              "model": {**SMALL, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512,
                        "rms_norm_eps": 1e-6, "tie_word_embeddings": False}},
    "qwen3": {"arch": "qwen3", "seed": 1234, "vocab_size": 6000,  # q/k norm, GQA 2:1
              "model": {**SMALL, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}},
    "mistral": {"arch": "mistral", "seed": 1234, "vocab_size": 6000,  # every layer a 128-token sliding window
                "model": {**SMALL, "sliding_window": 128, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}},
    "gemma2": {"arch": "gemma2", "seed": 1234, "vocab_size": 6000,  # sliding/global layers, softcapping, tied
               "model": {**SMALL, "head_dim": 128, "query_pre_attn_scalar": 128, "sliding_window": 128,
                         "tie_word_embeddings": True, "attn_logit_softcapping": 50.0,
                         "final_logit_softcapping": 30.0}},
    "deepseek_mla": {"arch": "deepseek_v2", "seed": 1234, "vocab_size": 6000,  # MLA: a 512+64 latent per token
                     "model": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
                               "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None,
                               "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                               "v_head_dim": 128, "first_k_dense_replace": 4, "moe_intermediate_size": 256,
                               "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
                               "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
                               "tie_word_embeddings": False}},
    # Diagnostics (benchmarks/check_mla_paths.py): sharper random weights make numerical disagreements visible
    "llama_sharp": {"arch": "llama", "seed": 1234, "vocab_size": 6000,
                    "model": {**COMMON_LLAMA, **SMALL, "initializer_range": 0.1}},
    "deepseek_mla_sharp": {"arch": "deepseek_v2", "seed": 1234, "vocab_size": 6000, "model": {}},
    "long": {"arch": "llama", "seed": 1234, "vocab_size": 6000,  # 40k context, 1 KiB of float32 KV per token
             "model": {**COMMON_LLAMA, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
                       "max_position_embeddings": 40960}},
}


PRESETS["deepseek_mla_sharp"]["model"] = {**PRESETS["deepseek_mla"]["model"], "initializer_range": 0.1}


class BuildError(Exception):
    pass


def log(msg: str) -> None:
    print(f"[build_tiny_model] {msg}", flush=True)


def preset_config(name: str) -> dict:
    """Everything that determines the output of a build, as one JSON-able dict (hashed into the stamp)."""
    p = PRESETS[name]
    return {
        "preset": name,
        "script_version": SCRIPT_VERSION,
        "seed": p["seed"],
        "vocab_size": p["vocab_size"],
        "special_tokens": SPECIAL_TOKENS,
        "chat_template": CHAT_TEMPLATE,
        "corpus_max_bytes": CORPUS_MAX_BYTES,
        "arch": p["arch"],
        "model": p["model"],
        "torch_dtype": "bfloat16",
    }


def config_digest(cfg: dict) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]


def kv_bytes_per_token(model: dict, dtype_bytes: int = 2) -> int:
    """Bytes of KV one token takes in every layer: MLA caches one latent (kv_lora_rank + rope dims), others K and V."""
    if model.get("kv_lora_rank"):
        return model["num_hidden_layers"] * (model["kv_lora_rank"] + model["qk_rope_head_dim"]) * dtype_bytes
    head_dim = model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"]
    return model["num_hidden_layers"] * model["num_key_value_heads"] * head_dim * 2 * dtype_bytes


def read_stamp(model_dir: Path) -> dict | None:
    try:
        return json.loads((model_dir / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None


def corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))
    if not files:
        raise BuildError(f"no .py files found in the standard library directory {stdlib} to train the tokenizer on")
    chosen, total = [], 0
    for f in files:
        size = f.stat().st_size
        if total + size > CORPUS_MAX_BYTES:
            break
        chosen.append(f)
        total += size
    return chosen


def train_tokenizer(cfg: dict):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    files = corpus_files()
    t0 = time.perf_counter()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg["vocab_size"],
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    if (tok.token_to_id(PAD), bos_id, eos_id) != (0, 1, 2):
        raise BuildError("special tokens did not get ids 0, 1, 2")
    # Like Llama: encode() prepends <s>; byte-level offsets are not trimmed.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    log(f"  tokenizer: byte-level BPE, vocab {tok.get_vocab_size()}, trained on {len(files)} stdlib files "
        f"({sum(len(t) for t in texts) / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f} s")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        model_max_length=cfg["model"]["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )


def build(name: str, out_dir: Path, force: bool) -> None:
    cfg = preset_config(name)
    digest = config_digest(cfg)
    stamp = read_stamp(out_dir)
    if not force and stamp and stamp.get("digest") == digest:
        log(f"{name}: {out_dir} is up to date (script version {SCRIPT_VERSION}, config {digest}); nothing to do")
        return
    if out_dir.exists() and not out_dir.is_dir():
        raise BuildError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()) and stamp is None and not force:
        raise BuildError(f"{out_dir} exists, is not empty and was not built by this script; "
                         "remove it, choose another --out-dir, or pass --force")
    reason = "forced" if force and stamp else ("config changed" if stamp else "not built yet")
    log(f"{name}: building into {out_dir} ({reason}; config {digest})")
    t_start = time.perf_counter()

    import torch
    import transformers
    from transformers import GenerationConfig

    tokenizer = train_tokenizer(cfg)
    vocab_size = len(tokenizer)
    fields = cfg["model"]
    config_name, model_name = ARCHITECTURES[cfg["arch"]]
    config = getattr(transformers, config_name)(
        vocab_size=vocab_size,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **fields,
    )
    torch.manual_seed(cfg["seed"])
    t0 = time.perf_counter()
    model = getattr(transformers, model_name)(config).to(torch.bfloat16).eval()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"  model: {model_name}, {n_params / 1e6:.1f} M parameters, {fields['num_hidden_layers']} layers, "
        f"hidden {fields['hidden_size']}, {fields['num_attention_heads']} heads, KV {kv_bytes_per_token(fields)} "
        "bytes/token in bf16 "
        f"(random init, seed {cfg['seed']}, {time.perf_counter() - t0:.1f} s)")
    generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )

    # Write into a sibling temporary directory, then swap it in: an interrupted build leaves no half-written model.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / STAMP_NAME).write_text(json.dumps({
            "built_by": "scripts/build_tiny_model.py",
            "script_version": SCRIPT_VERSION,
            "digest": digest,
            "config": cfg,
            "num_parameters": n_params,
            "kv_bytes_per_token_bf16": kv_bytes_per_token(fields),
        }, indent=2, sort_keys=True) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    size = sum(f.stat().st_size for f in out_dir.iterdir() if f.is_file())
    log(f"{name}: wrote {out_dir} ({size / 2**20:.1f} MiB: {', '.join(sorted(f.name for f in out_dir.iterdir()))}) "
        f"in {time.perf_counter() - t_start:.1f} s")


def check(name: str, model_dir: Path) -> None:
    """Load the saved model and tokenizer with transformers (Auto classes, as vLLM does) and exercise them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not (model_dir / "config.json").exists():
        raise BuildError(f"{model_dir} holds no model (config.json missing): build it first")
    log(f"{name}: checking {model_dir}")
    torch.set_num_threads(1)  # benchmarks share a small machine: one core, like one pinned vLLM instance
    config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    fields = config.to_dict()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"  {type(model).__name__} + {type(tokenizer).__name__} (vocab {len(tokenizer)}), "
        f"{n_params:,} parameters, dtype {next(model.parameters()).dtype}")
    log(f"  KV cache: {kv_bytes_per_token(fields)} bytes/token in bf16 ({kv_bytes_per_token(fields) / 1024:g} KiB), "
        f"{kv_bytes_per_token(fields, 4)} in float32")

    text = "def fibonacci(n):\n    return"
    ids = tokenizer(text, return_tensors="pt").input_ids
    if ids[0, 0].item() != tokenizer.bos_token_id:
        raise BuildError("the tokenizer does not prepend <s>")
    if tokenizer.decode(ids[0], skip_special_tokens=True) != text:
        raise BuildError("the tokenizer does not round-trip text")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    log(f"  chat template renders {chat!r}")
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    log(f"  greedy 5 tokens after {text!r}: ids {new} -> {tokenizer.decode(new)!r}")

    n = min(1024, config.max_position_embeddings)
    prompt = torch.randint(3, len(tokenizer), (1, n), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(prompt[:, :32])  # warm-up
        t0 = time.perf_counter()
        model(prompt, logits_to_keep=1)  # logits of the last position only, as vLLM computes them
        dt = time.perf_counter() - t0
    log(f"  one {n}-token prefill with transformers (bf16, 1 thread): {dt * 1000:.0f} ms")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Presets: " + ", ".join(
                                     f"{n} ({kv_bytes_per_token(preset_config(n)['model'])} KV bytes/token)"
                                     for n in PRESETS))
    ap.add_argument("--preset", choices=[*PRESETS, "all"], default="all", help="which model to build (default: all)")
    ap.add_argument("--out-dir", type=Path,
                    help="output directory (default: .cache/models/<preset> under the repo root); "
                         "with --preset all, the parent of one directory per preset")
    ap.add_argument("--force", action="store_true", help="rebuild even if the stamp says the model is up to date")
    ap.add_argument("--check", action="store_true",
                    help="after building, load the model with transformers and print KV bytes/token, the parameter "
                         "count, a greedy 5-token generation and one prefill time")
    args = ap.parse_args(argv)

    names = list(PRESETS) if args.preset == "all" else [args.preset]
    try:
        for name in names:
            if args.out_dir is None:
                out = REPO_ROOT / ".cache" / "models" / name
            elif args.preset == "all":
                out = args.out_dir / name
            else:
                out = args.out_dir
            out = out.resolve()
            build(name, out, args.force)
            if args.check:
                check(name, out)
    except BuildError as e:
        print(f"[build_tiny_model] error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # any failure ends with a clear message (after the traceback) and a non-zero status
        traceback.print_exc()
        print(f"[build_tiny_model] error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
