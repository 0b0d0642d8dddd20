"""`hf-blockwise generate` and [`generate_corpus`]: a whole corpus through a seq2seq model, exact, resumable, sharded.

```
read_sources(input, column, split)               -> list[str]    text file, JSONL column, or a 🤗 datasets dataset
chunks_of_shard(num_lines, chunk_size, shard)    -> the chunks this process decodes (chunk c -> process c % P)
for each chunk not yet in the output:
    plan_batches(lengths, batch_size, budget)    -> longest first, at most batch_size rows and budget source tokens
                                                    (blank sources are not decoded: their output is blank)
    decode_batch(...)                            -> model.generate through the loop with the drafter: texts, stats
    ResumableOutput.append(chunk's lines)        -> appended in input order, flushed and synced, then the progress
                                                    file (atomic) records the new end of the output
merge_shards (process 0, when every shard is done) -> OUTPUT in input order
```

Why chunks: lines are sorted by length only within a chunk of `chunk_size` consecutive lines, so the output can be
written in input order as each chunk finishes, and a batch depends only on its chunk and the settings, never on
where an earlier run stopped. A resumed run decodes exactly the batches an uninterrupted one would, so its output is
the same byte for byte: the progress file (`OUTPUT.progress.json`) says how many bytes of the output are complete
chunks; on restart the output is cut back to that length and decoding resumes at the next chunk. The progress file
also records the run's settings (local paths resolved, and the checkpoint's `generation_config`, which sets the length
unless the call does), and an output written by another run, or by something else, is refused; an output that is the
input or a model file is refused before anything loads (`paths.py`).

Data parallel: under `accelerate launch`, process p of P decodes chunks p, p + P, ... into its own shard file (each
resumable on its own); when all are done, process 0 interleaves the shards' chunks back into input order.
"""

from hf_blockwise.corpus.job import DRAFTERS, CorpusReport, generate_corpus
from hf_blockwise.corpus.output import CorpusSettings
from hf_blockwise.corpus.planning import plan_batches
from hf_blockwise.corpus.ray_data import CorpusPredictor
from hf_blockwise.corpus.sources import read_sources

__all__ = [
    "DRAFTERS",
    "CorpusPredictor",
    "CorpusReport",
    "CorpusSettings",
    "generate_corpus",
    "plan_batches",
    "read_sources",
]
