"""A tiny GPT pretraining corpus in Megatron's mmap indexed format, for Megatron-DeepSpeed's NullTokenizer (token ids
below 500, no tokenizer files): 400 documents of 20-200 tokens drawn from a Zipf-like law, which a small model learns
within 20 iterations. Run inside a Megatron-DeepSpeed checkout (it imports ``megatron.data.indexed_dataset``):

    python make_data.py OUT_PREFIX      # writes OUT_PREFIX_text_document.bin / .idx
"""
import sys

import numpy as np
import torch

from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder


def main() -> None:
    prefix = sys.argv[1] + "_text_document"
    rng = np.random.default_rng(0)
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(400):
        ids = np.minimum(rng.zipf(1.3, int(rng.integers(20, 200))), 499).astype(np.int64)
        builder.add_item(torch.from_numpy(ids))
        builder.end_document()
    builder.finalize(prefix + ".idx")


if __name__ == "__main__":
    main()
