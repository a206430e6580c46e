"""Compile the bundled model from Python and stream a story (what `cflow demo` does, by hand)."""

import cflow
from cflow.models.bundled import default_model_dir

m = cflow.compile(default_model_dir())  # checkpoint dir -> IR -> q4 tiles -> JIT step
print(m)
print("Once upon a time", end="", flush=True)
for piece in m.stream("Once upon a time", max_new_tokens=120, temperature=0.8, top_p=0.95, seed=1):
    print(piece, end="", flush=True)
print()
print(f"{m.bytes_per_token / 1e6:.2f} MB of weights per token, schedule of {m.schedule.n_stages} stages")
