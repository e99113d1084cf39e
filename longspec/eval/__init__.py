"""The evaluation harness (`python -m longspec.eval`): LongBench / math / local JSONL data, every decoding method
side by side in one run, results.json + report.md (the paper's Table 1 layout) + plots. docs/ALGORITHM.md §5."""
