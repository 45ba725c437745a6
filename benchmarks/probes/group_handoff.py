"""What a split worker group's handoff adds per prompt: the ranks telling
each other where they put their KV shards (workers/group/handoff_shards.py
gather_parts: two all_gathers of a few KB), and rank 0 reading them (a
worker alone gathers nothing).

    python benchmarks/probes/group_handoff.py [--layers 32] [--prompts 200] [--ranks 2]

Runs `--ranks` processes of a group as `tandem serve` starts them (ring on
127.0.0.1 on the CPU or a Mac's GPU; NCCL on MLX's CUDA backend, a GPU a rank).
Each rank gathers the part a `--layers`-layer model's handoff names
(keys and values per layer), `--prompts` times, and rank 0 prints the
median and p90 milliseconds per prompt, and the bytes gathered.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

RANK = """
import json, sys, time
from protos.messages import ArenaSlice, KVShard
from workers.group.handoff_shards import gather_parts, read_part
from protos.group_plan import RankSpec
from workers.group.ranks import join_group

rank, size, hostfile, layers, prompts = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]),
                                         int(sys.argv[5]))
group = join_group(RankSpec("probe", rank, size, hostfile), deadline_s=60)
part = KVShard("tandem-arena-0", 1000 + rank, [[ArenaSlice(i * 8192, 4096, "bfloat16", [1, 4, 512, 128]),
                                                 ArenaSlice(i * 8192 + 4096, 4096, "bfloat16", [1, 4, 512, 128])]
                                                for i in range(layers)])
times = []
for i in range(prompts + 10):
    t0 = time.perf_counter()
    parts = [read_part(p) for p in gather_parts(group, part)]
    if i >= 10:  # the first gathers set the ring up
        times.append((time.perf_counter() - t0) * 1000)
assert [p.allocation for p in parts] == [1000 + r for r in range(size)]
from protos import codec
print(json.dumps({"ms": times, "bytes": len(codec.encode(part)[0])}), flush=True)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    from deploy.group_plan import rank_environment, write_hostfile

    with tempfile.TemporaryDirectory() as tmp:
        hostfile = os.path.join(tmp, "probe.hosts.json")
        write_hostfile(hostfile, args.ranks)
        procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(args.ranks), hostfile, str(args.layers),
                                   str(args.prompts)], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, **rank_environment(r, os.environ)})
                 for r in range(args.ranks)]
        outs = [p.communicate(timeout=300)[0] for p in procs]
    if any(p.returncode for p in procs):
        print("a rank failed", file=sys.stderr)
        return 1
    r0 = json.loads(outs[0].strip().splitlines()[-1])
    ms = sorted(r0["ms"])
    print(f"{args.ranks} ranks, {args.layers} layers: a part is {r0['bytes']} bytes; gathering every rank's part "
          f"takes {statistics.median(ms):.3f} ms a prompt (median), p90 {ms[int(0.9 * len(ms))]:.3f} ms "
          f"({len(ms)} prompts, {time.strftime('%Y-%m-%d')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
