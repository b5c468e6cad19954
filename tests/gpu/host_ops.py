"""Host side of a torch-profiler trace (docs/performance.md, session 12): the CPU ops and runtime calls of the
longest host spans, summed by name (inclusive: a nested span counts in its parents too), to find where a non-graphed
step's 45-70 ms of launch go. Usage: python tests/gpu/host_ops.py TRACE.json[.gz]"""
import gzip
import json
import sys
from collections import defaultdict

path = sys.argv[1]
with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
    ev = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
cpu = [e for e in ev if e.get("cat") in ("cpu_op", "python_function", "cuda_runtime", "user_annotation")]
kern = [e for e in ev if e.get("cat") == "kernel"]
print(f"{len(cpu)} host events, {len(kern)} kernels; kernel time {sum(e['dur'] for e in kern) / 1e3:.1f} ms")
tot, cnt = defaultdict(float), defaultdict(int)
for e in cpu:
    tot[(e["cat"], e["name"][:90])] += e["dur"]
    cnt[(e["cat"], e["name"][:90])] += 1
for (cat, name), d in sorted(tot.items(), key=lambda kv: -kv[1])[:45]:
    print(f"{d / 1e3:9.2f} ms {cnt[(cat, name)]:6d}x  {cat:16s} {name}")
