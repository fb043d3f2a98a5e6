"""Training data: tokenizers, image decode, readers and random-access indexes for tar shards /
JSONL / text, M6 tasks, the synthetic task, the weighted resumable sampler and the rank/worker-
sharded loader. Needs only m6.config (rank and world size are passed in as ints)."""
