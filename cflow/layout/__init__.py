"""Byte layout: how weights are stored, below every stage that reads or writes them.

quant.py   weight dtypes and the GGUF-exact Q4_0/Q8_0 numerics (the NumPy oracle of every kernel)
blocks.py  the other GGUF block types kept as stored (K-quants, Q4_1/Q5_*, IQ4): fields, NumPy twin, group layout
tile.py    THE tile layout: the byte stream a mat-vec kernel reads, pack/unpack, fused streams
packed.py  packed tensors (form, parts, shapes, bytes) and the file layouts (stage- or layer-major)

Passes plan with it, codegen takes every offset from it, the runtime unpacks with it; it imports
nothing from cflow but errors, so the compile walk goes down into it and never back up.
"""

DEFAULT_TILE = (128, 256)  # rows x inputs of a tile: 18,432 B at Q4, L2-sized with its activations (numpy-free here)
# The weight types a compile takes (cflowc --quant) and a file's header names, numpy-free here too (--help stays
# light): quant.QUANT_TARGETS are the first four as DTypes; STORED keeps each weight at its source's (a GGUF's) type.
STORED = "stored"
QUANTS = ("q4", "q8", "f16", "f32", STORED)
