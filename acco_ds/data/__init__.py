"""The main job's data: the embedded standard-library corpus and deterministic byte batches."""

from acco_ds.data.batches import micro_batch, stream, val_windows
from acco_ds.data.corpus import VOCAB, Corpus, detokenize, load_corpus, tokenize

__all__ = ["VOCAB", "Corpus", "detokenize", "load_corpus", "micro_batch", "stream", "tokenize", "val_windows"]
