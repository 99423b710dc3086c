"""Load a tokenizer, or train a byte-level BPE offline when the run has none."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterable

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from anygpu.errors import rank

logger = logging.getLogger(__name__)

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def tokenizer_key(tokenizer: PreTrainedTokenizerBase) -> str:
    """Everything of a tokenizer that changes prepared data: its vocabulary and rules, the special tokens the data
    path inserts (EOS between texts and after completions, padding) and the chat template. The EOS token is set
    in tokenizer_config.json, not in tokenizer.json: a changed EOS must change the key (packing cache, resume)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    special = {
        name: (getattr(tokenizer, name, None), getattr(tokenizer, f"{name}_id", None))
        for name in ("eos_token", "bos_token", "pad_token")
    }
    return hashlib.sha256(json.dumps([vocab, special, tokenizer.chat_template], default=str).encode()).hexdigest()


def trained_tokenizer_dir(cache_dir: str, corpus_fingerprint: str, vocab_size: int) -> Path:
    return Path(cache_dir) / "tokenizers" / f"bpe-{vocab_size}-{corpus_fingerprint[:16]}"


def train_bpe(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A GPT-2 style byte-level BPE: any byte sequence round-trips, no unknown tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=PAD, model_max_length=1 << 30
    )


def load_or_train(
    name_or_path: str | None,
    texts: Callable[[], Iterable[str]],
    corpus_fingerprint: str,
    vocab_size: int,
    cache_dir: str,
    is_local_main: bool,
    trust_remote_code: bool = False,
) -> PreTrainedTokenizerBase:
    """The named tokenizer, else the cached BPE for this corpus, else a new one (trained by local rank 0).

    Callers run this inside `distributed.local_main_first`, so only one process per node trains.
    """
    if name_or_path:
        tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        return tok
    path = trained_tokenizer_dir(cache_dir, corpus_fingerprint, vocab_size)
    if not (path / "tokenizer.json").exists():
        if not is_local_main:
            raise RuntimeError(
                f"tokenizer cache {path} missing after local rank 0 built it (is the cache dir per-node?)"
            )
        logger.info("training a byte-level BPE tokenizer (vocab %d) on the training text…", vocab_size)
        tok = train_bpe(texts(), vocab_size)
        _save_atomically(tok, path)
    tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    if len(tok) < vocab_size and rank() == 0:
        # a small corpus runs out of merges: the model's vocabulary follows the tokenizer's real size
        print(
            f"note: the tokenizer trained on this text has {len(tok)} tokens, fewer than --vocab_size {vocab_size} "
            "asked (the text has no more merges to learn); the model's vocabulary follows the tokenizer.",
            flush=True,
        )
    return tok


def _save_atomically(tok: PreTrainedTokenizerBase, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    tok.save_pretrained(str(tmp))
    try:
        os.replace(tmp, path)
    except OSError:  # another node filled it first
        shutil.rmtree(tmp, ignore_errors=True)
