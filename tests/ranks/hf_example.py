"""A training script written the way the Hugging Face example scripts (``run_clm.py``) are, with nothing of
ACCO in it: ``HfArgumentParser`` over its own dataclass and ``TrainingArguments`` from the command line
(``--deepspeed ds_config.json``, ``--resume_from_checkpoint``, ``--local_rank`` from the ``deepspeed``
launcher), a model built from a transformers config (the tiny Llama of tests/ranks/llama.py), the
``Trainer``, then the examples' ``log_metrics`` / ``save_metrics`` / ``save_state``: ``trainer_state.json``
in ``--output_dir`` holds the logged losses and grad norms.

ACCO comes from the DeepSpeed config alone, which trains only when the ranks start through
``python -m acco_ds.run`` (tests/integrations/test_unmodified_scripts.py). Data: token ids counting up
from fixed random starts, no tokenizer, nothing downloaded.
"""

import logging
import sys
from dataclasses import dataclass, field

import torch
import transformers
from transformers import HfArgumentParser, Trainer, TrainingArguments, set_seed

from tests.ranks.llama import tiny_llama

logger = logging.getLogger(__name__)


@dataclass
class DataArguments:
    vocab_size: int = field(default=96, metadata={"help": "token ids are drawn from [0, vocab_size)"})
    seq_len: int = field(default=16, metadata={"help": "tokens per sample"})
    train_samples: int = field(default=64, metadata={"help": "samples in the training set"})


class CountingTokens(torch.utils.data.Dataset):
    """Sample i: the token ids counting up (modulo the vocabulary) from a start drawn with seed i, a sequence
    the model learns within a few steps; labels = input_ids (the model shifts them)."""

    def __init__(self, args: DataArguments):
        self.args = args

    def __len__(self):
        return self.args.train_samples

    def __getitem__(self, i):
        start = torch.randint(
            0, self.args.vocab_size, (1,), generator=torch.Generator().manual_seed(1000 + i)
        )
        ids = (start + torch.arange(self.args.seq_len)) % self.args.vocab_size
        return {"input_ids": ids, "labels": ids.clone()}


def main():
    parser = HfArgumentParser((DataArguments, TrainingArguments))
    data_args, training_args = parser.parse_args_into_dataclasses()

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    transformers.utils.logging.set_verbosity_warning()
    logger.warning(
        f"Process rank: {training_args.local_rank}, device: {training_args.device}, "
        f"distributed training: {training_args.parallel_mode.value == 'distributed'}"
    )

    set_seed(training_args.seed)
    model = tiny_llama(data_args.vocab_size, data_args.seq_len, kv_heads=2, tied=True)
    trainer = Trainer(model=model, args=training_args, train_dataset=CountingTokens(data_args))

    train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    metrics = train_result.metrics
    metrics["train_samples"] = len(trainer.train_dataset)
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()


if __name__ == "__main__":
    main()
