"""A tiny Llama-architecture model folder for server tests: config + a real BPE tokenizer.

No weights are written: the servers start with ``--load-format dummy``, which fills them with
vLLM's seeded random values, so two servers on the same folder run identical weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _training_text(limit_bytes: int = 3_000_000):
    """Source files of the standard library: plenty of varied text, always present offline."""
    root = Path(json.__file__).resolve().parent.parent
    used = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(errors="ignore")
        used += len(text)
        yield text
        if used > limit_bytes:
            return


def make_tiny_llama(out_dir: str | Path, *, layers: int = 2, hidden: int = 256, heads: int = 4,
                    kv_heads: int = 2, head_dim: int = 64, vocab: int = 4096) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_text(), trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "model_max_length": 32768,
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:",
    }))
    (out / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": tok.get_vocab_size(),
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "max_position_embeddings": 32768, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "float32",
    }, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return out


if __name__ == "__main__":
    print(make_tiny_llama(sys.argv[1]))
