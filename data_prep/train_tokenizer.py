"""Train the code target's byte-level BPE tokenizer on the stdlib corpus (issue 5).

    python -m data_prep.train_tokenizer --corpus DIR/train.jsonl --vocab-size 8192 --out TOKDIR

Byte-level BPE (HF ``tokenizers``) so every string round-trips exactly, saved as a transformers
``PreTrainedTokenizerFast`` with ``<s>`` / ``</s>`` / ``<pad>`` / ``<unk>`` and a minimal chat template. Encoding with
``add_special_tokens=True`` (the default) prepends ``<s>``, as the pretraining data does for every file.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from longspec.cli import ArgumentParser, run_cli
from longspec.ownership import claim_output_dir

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
SPECIAL_TOKENS = [BOS, EOS, PAD, UNK]  # ids 0..3 in this order

# A model with no chat tuning still needs a deterministic way to flatten messages (the eval's chat path calls
# apply_chat_template); plain role-tagged turns, generation prompt = the assistant tag.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '### ' + message['role'] + '\n' + message['content'] + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '### assistant\n' }}{% endif %}"
)


def iter_texts(jsonl: Path) -> Iterator[str]:
    with open(jsonl, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)["text"]


def train_tokenizer(corpus: Path, vocab_size: int, *, min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """Train byte-level BPE on the ``text`` field of ``corpus`` (jsonl) and wrap it for transformers."""
    if not corpus.is_file():
        raise FileNotFoundError(
            f"{corpus} not found: build it with `python -m data_prep.stdlib_corpus --out DIR`"
        )
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (bytes + specials), got {vocab_size}"
        )
    tok = Tokenizer(models.BPE(unk_token=UNK))
    # GPT-2 style splitting (letters / digits / punctuation / whitespace runs), no prefix space: the text is code,
    # and a leading space would break decode(encode(x)) == x.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: no input is ever unknown
        show_progress=False,
    )
    tok.train_from_iterator(iter_texts(corpus), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,  # would rewrite " ." etc. and break the round trip on code
        model_max_length=16384,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def round_trip_failures(tokenizer, texts: list[str]) -> list[int]:
    """Indices of ``texts`` for which ``decode(encode(x)) != x`` (empty list = lossless)."""
    bad = []
    for i, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if tokenizer.decode(ids) != text:
            bad.append(i)
    return bad


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(prog="python -m data_prep.train_tokenizer", description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, required=True, help="train.jsonl from data_prep.stdlib_corpus")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--min-frequency", type=int, default=2)
    p.add_argument("--out", type=Path, required=True, help="directory for save_pretrained")
    args = p.parse_args(argv)
    tokenizer = train_tokenizer(args.corpus, args.vocab_size, min_frequency=args.min_frequency)
    # Check the lossless round trip on a held-out file when there is one (it is what the eval feeds), else train.
    heldout = args.corpus.with_name("heldout.jsonl")
    sample = list(iter_texts(heldout if heldout.is_file() else args.corpus))[:50]
    if bad := round_trip_failures(tokenizer, sample):
        raise RuntimeError(f"decode(encode(x)) != x for {len(bad)} of {len(sample)} sample files")
    claim_output_dir(args.out, "tokenizer", what="--out")
    tokenizer.save_pretrained(args.out)
    n_bytes = sum(len(t.encode("utf-8")) for t in sample)
    n_tokens = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in sample)
    print(
        json.dumps(
            {
                "out": str(args.out),
                "vocab_size": len(tokenizer),
                "round_trip_files": len(sample),
                "bytes_per_token": round(n_bytes / max(n_tokens, 1), 3),
            }
        )
    )


if __name__ == "__main__":
    sys.exit(run_cli(main))  # user errors: one line, exit 2 (--debug: traceback)
