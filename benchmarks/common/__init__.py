"""What the benchmarks share, one module per concern.

- record.py: the one record schema of every benchmark's --json output, the writer and the reader;
- timing.py: the CPU share other processes used meanwhile, quiet rounds, best-of decode timing;
- bandwidth.py: the machine's read bandwidth, the denominator of every decode figure;
- models.py: the benchmark models (fixed random weights of known geometries) and their compiled files;
- profile.py: where a decode step's time goes (per-stage cycle stamps);
- peers.py: llama.cpp and ONNX Runtime GenAI opened and timed the same way everywhere;
- memory.py: resident-set figures from /proc;
- process.py: a benchmark's worker in a fresh Python process.
"""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
OUT = os.path.join(ROOT, "out", "bench")  # compiled benchmark models, built once (not in git)
