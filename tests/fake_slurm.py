"""A stand-in for SLURM's `sbatch`, `srun` and `scontrol` that runs a batch script here, as a real allocation of
several nodes would: `install(folder)` writes the three commands into `folder` (put it first on PATH).

- `sbatch SCRIPT` reads the script's `#SBATCH` lines (--nodes, --ntasks-per-node, --gpus-per-node, --job-name,
  --output with `%j`), sets the variables the batch step of such a job sees (SLURM_JOB_ID, SLURM_JOB_NODELIST in
  hostlist syntax, SLURM_NNODES, SLURM_NODEID=0, SLURM_PROCID=0, ...) and runs it with bash on "node 0", its
  output appended to the --output file. It waits for the job and exits with its code, as `sbatch --wait` does.
- `srun [OPTIONS] CMD...` starts CMD once per task of the allocation (`--ntasks-per-node` tasks on each node),
  each with that task's variables (SLURM_NODEID, SLURM_PROCID, SLURM_LOCALID, SLURMD_NODENAME, SLURM_STEP_*);
  with `--kill-on-bad-exit=1` the first task that fails stops the others. Exits with the first failure's code.
- `scontrol show hostnames LIST` expands a hostlist (`a,b`, `prefix[1-3,5]`) one name a line.

The nodes are loopback addresses (`127.0.0.[1-N]`: distinct host names that all reach this machine), so a
rendezvous on the first node works.
"""

from __future__ import annotations

import sys
from pathlib import Path

JOB_ID = "4242"

COMMON = r'''
import os, re, subprocess, sys


def expand(hostlist):
    """SLURM hostlist syntax: comma-separated names, each `prefix[1-3,7]` range expanded (zero padding kept)."""
    names = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", hostlist):
        m = re.fullmatch(r"(.*)\[(.*)\]", part)
        if not m:
            names.append(part)
            continue
        for item in m.group(2).split(","):
            lo, _, hi = item.partition("-")
            for i in range(int(lo), int(hi or lo) + 1):
                names.append(f"{m.group(1)}{str(i).zfill(len(lo))}")
    return names
'''

SBATCH = COMMON + r'''

def main():
    script = sys.argv[-1]
    opts = {}
    for line in open(script):
        m = re.match(r"#SBATCH\s+--([\w-]+)(?:=(.*))?", line.strip())
        if m:
            opts[m.group(1)] = (m.group(2) or "").strip("'\"")
    nodes, tasks = int(opts.get("nodes", "1")), int(opts.get("ntasks-per-node", "1"))
    hostlist = "127.0.0.[1-%d]" % nodes
    env = dict(os.environ, SLURM_JOB_ID=JOB_ID, SLURM_JOBID=JOB_ID, SLURM_JOB_NAME=opts.get("job-name", "job"),
               SLURM_JOB_NODELIST=hostlist, SLURM_NODELIST=hostlist, SLURM_NNODES=str(nodes),
               SLURM_JOB_NUM_NODES=str(nodes), SLURM_NTASKS=str(nodes * tasks), SLURM_NPROCS=str(nodes * tasks),
               SLURM_NTASKS_PER_NODE=str(tasks), SLURM_TASKS_PER_NODE=f"{tasks}(x{nodes})",
               SLURM_JOB_CPUS_PER_NODE=f"{os.cpu_count()}(x{nodes})", SLURM_CPUS_ON_NODE=str(os.cpu_count()),
               SLURM_GPUS_PER_NODE=opts.get("gpus-per-node", "0"), SLURM_NODEID="0", SLURM_PROCID="0",
               SLURM_LOCALID="0", SLURMD_NODENAME=expand(hostlist)[0], SLURM_SUBMIT_DIR=os.getcwd(),
               SLURM_SUBMIT_HOST=expand(hostlist)[0], SLURM_CLUSTER_NAME="fake")
    out = opts.get("output", f"slurm-{JOB_ID}.out").replace("%j", JOB_ID)
    print(f"Submitted batch job {JOB_ID}", flush=True)
    with open(out, "a") as log:
        code = subprocess.call(["bash", script], env=env, stdout=log, stderr=subprocess.STDOUT)
    if code:
        print(f"job {JOB_ID} failed with exit code {code}; its output is in {out}", file=sys.stderr)
    sys.exit(code)


main()
'''

SRUN = COMMON + r'''
import time


def main():
    args = sys.argv[1:]
    kill_on_bad_exit = False
    while args and args[0].startswith("-"):
        kill_on_bad_exit |= args[0] in ("--kill-on-bad-exit", "--kill-on-bad-exit=1", "-K")
        args = args[1:]
    hosts = expand(os.environ["SLURM_JOB_NODELIST"])[: int(os.environ["SLURM_NNODES"])]
    per_node = int(os.environ.get("SLURM_NTASKS_PER_NODE", "1"))
    procs = []
    for node, host in enumerate(hosts):
        for local in range(per_node):
            env = dict(os.environ, SLURM_NODEID=str(node), SLURM_PROCID=str(node * per_node + local),
                       SLURM_LOCALID=str(local), SLURMD_NODENAME=host, SLURM_STEP_ID="0", SLURM_STEPID="0",
                       SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"], SLURM_STEP_NUM_NODES=str(len(hosts)),
                       SLURM_STEP_NUM_TASKS=str(len(hosts) * per_node), SLURM_STEP_TASKS_PER_NODE=f"{per_node}(x{len(hosts)})")
            procs.append(subprocess.Popen(args, env=env))
    first_failure = 0
    while any(p.poll() is None for p in procs):
        failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
        if failed and kill_on_bad_exit:
            first_failure = first_failure or failed[0]
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)
    codes = [p.returncode for p in procs]
    sys.exit(first_failure or next((c for c in codes if c), 0))


main()
'''

SCONTROL = COMMON + r'''

if sys.argv[1:3] != ["show", "hostnames"]:
    sys.exit("fake scontrol: only `scontrol show hostnames LIST`")
print("\n".join(expand(sys.argv[3] if len(sys.argv) > 3 else os.environ["SLURM_JOB_NODELIST"])))
'''


def install(folder: Path) -> Path:
    """Write `sbatch`, `srun` and `scontrol` (run by this Python) into `folder`; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, body in (("sbatch", SBATCH), ("srun", SRUN), ("scontrol", SCONTROL)):
        path = folder / name
        path.write_text(f"#!{sys.executable}\nJOB_ID = {JOB_ID!r}\n{body}")
        path.chmod(0o755)
    return folder
