"""cflow's benchmarks: one module per question, each run from the repository root as

    python -m benchmarks.NAME [options]          # e.g. python -m benchmarks.decode --threads 1,2 --json

Every benchmark that writes --json writes the same record schema (benchmarks/common/record.py: engine, model,
quant, ISA path, threads, tok/s, bytes per token, the read bandwidth of the same run, CPU, command, commit, date,
and its own measurements under `extra`); `python -m benchmarks.compare A.json B.json` puts two runs side by
side, `--commits REV1 REV2 -- NAME [options]` runs one benchmark at two commits first. What the benchmarks share
(timing, the read bandwidth, the benchmark models, the peer engines, the records) is in benchmarks/common/.

Decode speed: decode (tok/s against the read bandwidth), peers (against llama.cpp, ONNX Runtime GenAI, PyTorch),
long_context, prefill (prompts and batches), pages (page-cache folio sizes), load (under another process's load),
serve (the HTTP server under concurrent clients), conformance (real GGUF files against llama.cpp).
Kernels and machine: bandwidth, matvec, gguf_types, attention, router, stream_work, kernel_asm, tune_threads,
jit_time, compile. Disk tier: expert_tier, read_ahead. The paper's claims: claims_schedule, claims_routes,
claims_prefetch, claims_cachegrind, analysis. Reliability: fuzz, soak. Training: architectures.
"""
