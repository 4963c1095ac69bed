"""The GPU generator's fast paths against its plain one, before a window's minutes go into data.

    python scripts/gpu_self_check.py cuda   # CUDA graphs + the Triton row attention against eager SDPA passes
    python scripts/gpu_self_check.py cpu    # the row attention in Triton's interpreter against SDPA (no graphs)

A seeded float32 target answers 24 jobs (two-turn ones, greedy and sampled) both ways; the answers must be equal.
Exit status 0 when they are. `scripts/gpu_data_run.sh` runs it on the GPU (and generates without the fast paths when
it fails) and on the CPU in its SMOKE=1 dry run, so the check itself is exercised before a window is spent on it.
"""
import os
import random
import sys

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the kernel runs on the CPU

import torch  # noqa: E402

from ddtree.bench.testing import random_target  # noqa: E402
from ddtree.train.batched import Job  # noqa: E402
from ddtree.train.static_batched import StaticBatchedDecoder  # noqa: E402

# the bare reference model on the device (no runtime: the CPU one would build its C++ kernels first)
target = random_target("llama", seed=3, dtype=torch.float32, device=DEVICE, init_scale=0.25, runtime=False)
rng = random.Random(0)
vocab = target.cfg.vocab_size
# Job(key, prompt ids, temperature, seed, follow-up ids): every third sampled, every second with a second turn
jobs = [Job(f"j{i}", [rng.randrange(6, vocab) for _ in range(rng.randint(1, 40))], 0.9 * (i % 3 == 0), i,
            [7, 8] if i % 2 else None) for i in range(24)]
graphs = DEVICE == "cuda"
runs = [{(a.job.key, a.turn): a.response_ids
         for a in StaticBatchedDecoder(target, 8, 160, 24, range(1, 6), span_step=16, graphs=fast and graphs,
                                       row_kernel=fast).run(jobs)}
        for fast in (False, True)]
equal = runs[0] == runs[1]
print(f"{DEVICE}: {len(runs[0])} answers, fast paths (graphs {graphs}, row attention) "
      f"{'equal to' if equal else 'DIFFER from'} the plain passes")
sys.exit(0 if equal else 1)
