"""A tiny random Hugging Face model and its tokenizer, built offline, for trying the trainer on CPU.

    python examples/tiny_models.py llama runs/tiny-llama     # 2 layers, width 32, GQA 4/2 heads
    python examples/tiny_models.py qwen2 runs/tiny-qwen2     # the same with q/k/v biases, tied embeddings

The tokenizer is character level (one id per character of the example prompts) and made with
``tokenizers`` alone, so nothing is downloaded; the weights are random, a function of ``--seed``.
The tests, the GPU check and the race against TRL build their models with these functions
(``sys.path`` gets this folder), so what a reader tries is what they test.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from gradnorm.models.hf import require_transformers


# Characters of the example prompts and their answers; anything else becomes <unk>.
TINY_CHARS = "0123456789+-*/=?.,:;!'()[]{}\\$% \nabcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
TINY_SPECIALS = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0..3
# A minimal chat template: "<s>user: ...\nassistant: "; real models ship their own.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_tiny_tokenizer():
    """A character-level PreTrainedTokenizerFast (one id per character), made without any download."""
    transformers = require_transformers()
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate([*TINY_SPECIALS, *TINY_CHARS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every character a token
    core.decoder = decoders.Fuse()  # join characters back without spaces
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


def _build_tiny(config_cls_name: str, out_dir: str | Path, seed: int, **overrides) -> Path:
    transformers = require_transformers()
    tok = build_tiny_tokenizer()
    kwargs = dict(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    config = getattr(transformers, config_cls_name)(**kwargs)
    torch.manual_seed(seed)  # the random weights are a function of the seed
    model = transformers.AutoModelForCausalLM.from_config(config)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


def build_tiny_llama(out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """A 2-layer, width-32 random Llama (GQA 4/2 heads) and its tokenizer in ``out_dir``."""
    return _build_tiny("LlamaConfig", out_dir, seed, **overrides)


def build_tiny_qwen2(out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """A 2-layer, width-32 random Qwen2 (q/k/v biases, tied embeddings as in the small Qwens)."""
    return _build_tiny("Qwen2Config", out_dir, seed, **{"tie_word_embeddings": True, **overrides})


BUILDERS = {"llama": build_tiny_llama, "qwen2": build_tiny_qwen2}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python examples/tiny_models.py", description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=sorted(BUILDERS), help="the architecture")
    parser.add_argument("out_dir", help="the directory to write (config, weights, tokenizer)")
    parser.add_argument("--seed", type=int, default=0, help="the random weights are a function of it")
    args = parser.parse_args(argv)
    print(BUILDERS[args.kind](args.out_dir, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
