"""A small Hugging Face causal LM directory made here, for tests, benchmarks and trying `--lm hf:DIR` without
a download: a tokenizer trained on a text (GPT-2's byte-level BPE, or a Llama-style SentencePiece BPE with byte
fallback) and a GPT-2 or Llama model of the given size with random weights, saved by `save_pretrained`
(safetensors) beside the tokenizer.

    python scripts/make_hf_model.py --arch gpt2 --text ../shared/data/text/train.txt -o runs/hf-gpt2
    smallstate-lm rescore lattices/*.fst --lm hf:runs/hf-gpt2 ...
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path


def train_tokenizer(arch: str, lines, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if arch == "gpt2":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(lines, trainer)
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"]
                                  + [f"<0x{b:02X}>" for b in range(256)])
    tok.train_from_iterator(lines, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def make(out: Path, arch: str, text: Path, vocab_size: int = 1000, d: int = 64, layers: int = 2, heads: int = 4,
         positions: int = 256, lines: int | None = None, seed: int = 0) -> Path:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    with open(text) as f:
        corpus = [x.strip() for x in itertools.islice(f, lines) if x.strip()]
    tok = train_tokenizer(arch, corpus, vocab_size)
    torch.manual_seed(seed)
    if arch == "gpt2":
        cfg = GPT2Config(vocab_size=len(tok), n_positions=positions, n_embd=d, n_layer=layers, n_head=heads,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
        model = GPT2LMHeadModel(cfg)
    else:
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=d, intermediate_size=4 * d, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                          max_position_embeddings=positions, bos_token_id=tok.bos_token_id,
                          eos_token_id=tok.eos_token_id)
        model = LlamaForCausalLM(cfg)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2")
    ap.add_argument("--text", required=True, help="text to train the tokenizer on, one sentence per line")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--vocab-size", type=int, default=1000)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--positions", type=int, default=256)
    ap.add_argument("--lines", type=int, default=None, help="train the tokenizer on the first N lines only")
    a = ap.parse_args(argv)
    print(make(Path(a.out), a.arch, Path(a.text), a.vocab_size, a.d_model, a.layers, a.heads, a.positions,
               a.lines))


if __name__ == "__main__":
    main()
