"""Data preparation: records -> token ids and labels -> fixed-length rows on disk.

One module per step: `records` (read jsonl / parquet / datasets, and with `text_dir` a folder of
text files), `synthetic` (generated retrieval-with-citation task), `random_tokens` (benchmark ids),
`tokenize` (record -> ids and labels), `packing` (samples -> rows of max_seq_length), `store`
(atomic on-disk format and the training-side reader), `prepare` (the stage, with stats.json).
Importing this package loads nothing heavy; import the submodule you need.
"""

from longft.data.errors import DataError

__all__ = ["DataError"]
