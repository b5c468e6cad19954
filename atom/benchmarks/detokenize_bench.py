"""Host time of incremental detokenization, per step of N running requests: the native
stream (``tokenizers.decoders.DecodeStream``, what a fast tokenizer gets) against the Python
window scheme (what a slow tokenizer gets), on the same random token ids.

    python -m atom.benchmarks.detokenize_bench [--model PATH] [--rows 256] [--steps 200] [--output-json F]

The default model's tokenizer (SmolLM2) unless ``--model`` names another.
"""

from __future__ import annotations

import argparse
import random
import time

from atom.benchmarks.model_configs import report
from atom.engine.arg_utils import load_tokenizer
from atom.engine.output_processor import IncrementalDetokenizer


def ms_per_step(tokenizer, rows: int, steps: int, stream: bool) -> float:
    rng = random.Random(0)
    detoks = [IncrementalDetokenizer(tokenizer, [rng.randrange(len(tokenizer)) for _ in range(8)]) for _ in range(rows)]
    for d in detoks:
        d.stream = d.stream if stream else None
    ids = [[rng.randrange(len(tokenizer)) for _ in range(rows)] for _ in range(steps)]
    start = time.perf_counter()
    for step in ids:
        for d, token in zip(detoks, step):
            d.add([token])
    return (time.perf_counter() - start) * 1000 / steps


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model dir (default: atom's default model)")
    p.add_argument("--rows", type=int, default=256, help="running requests, one new token each a step")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    if args.model is None:
        from atom.model_loader.default_model import default_model_path

        args.model = default_model_path()
    tokenizer = load_tokenizer(args.model)
    native, window = (ms_per_step(tokenizer, args.rows, args.steps, s) for s in (True, False))
    result = dict(model=args.model, rows=args.rows, native_ms=round(native, 3), window_ms=round(window, 3))
    columns = {"rows": args.rows, "native stream ms/step": f"{native:.3f}", "Python window ms/step": f"{window:.3f}",
               "speed-up": f"{window / native:.1f}x"}
    return report(columns, result, args.output_json)


if __name__ == "__main__":
    main()
