"""Same seed, same results: run every script briefly from a repo checkout and fingerprint what it computed (the
check of docs/tests.md that a change computes what the commit before did).

A refactor that claims to change no computation is checked by running this on the commit before and after
and comparing the two files. Each script runs in a fresh folder with fixed seeds on the CPU, one thread; the
LM chain is sft -> reward_model -> rlhf_ppo, dpo, grpo on the tiny checkpoints it makes, and rlhf_ppo and
grpo run again under torchrun on 2 gloo ranks (DDP, then FSDP2). The fingerprint of a run is every logged
scalar except the wall-clock ones (speeds, time fractions) and the SHA-256 of every saved weight file
(of a .pt, of its members: the zip holds write times).

    python tools/same_results.py . /tmp/after.json
    git worktree add /tmp/before <commit> && python tools/same_results.py /tmp/before /tmp/before.json
    python tools/same_results.py --compare /tmp/before.json /tmp/after.json
    python tools/same_results.py --compare --dropped rollout/ /tmp/before.json /tmp/after.json  # tags moved away

--flags SCRIPT='...' replaces one run's flags (a flag renamed between the two commits). The LM scripts run from
ROOT/scale/ where a checkout has it (the full programs; before the split, aee7bdc and earlier, they were the
top-level files), so that a checkout with scale/ is compared with one without program for program.
--top-level runs the top-level LM files instead (the one-device references: one process, no gradient
accumulation), to check that a change to them computes what the commit before did:

    python tools/same_results.py --top-level . /tmp/after_top.json
"""
import argparse
import glob
import hashlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import zipfile

TINY = "--n-layer 1 --n-embd 32 --n-head 2"
GRPO = "--num-iterations 3 --batch-size 16 --num-generations 4 --mini-batch-size 8 --ppo-epochs 2 --eval-every 2 --eval-size 16"
RUNS = {  # name: (script, flags, ranks)
    "ppo_clip": ("ppo_clip.py", "--total-timesteps 4096 --save-model --eval-episodes 2", 1),
    "ppo_kl": ("ppo_kl.py", "--total-timesteps 4096 --save-model --eval-episodes 2", 1),
    "ppo_continuous": ("ppo_continuous.py", "--env-id Pendulum-v1 --total-timesteps 4096 --save-model --eval-episodes 2", 1),
    "sft": ("sft.py", f"{TINY} --max-steps 40 --eval-every 20 --num-train-examples 2000 --eval-size 32", 1),
    "reward_model": ("reward_model.py", "--max-steps 20 --eval-every 10 --num-train-pairs 1000 --eval-size 32", 1),
    "rlhf_ppo": ("rlhf_ppo.py", "--num-iterations 3 --batch-size 16 --mini-batch-size 8 --ppo-epochs 2 "
                 "--gradient-accumulation-steps 2 --eval-every 2 --eval-size 16", 1),
    "dpo": ("dpo.py", "--max-steps 20 --eval-every 10 --num-train-pairs 400 --eval-size 16", 1),
    "grpo": ("grpo.py", "--num-iterations 3 --batch-size 16 --num-generations 4 --mini-batch-size 8 --ppo-epochs 2 "
             "--eval-every 2 --eval-size 16", 1),
    # the reference's variants and options off their defaults (both tiers have them)
    "grpo_rloo_cispo": ("grpo.py", f"{GRPO} --advantage rloo --loss-type cispo --epsilon-high 5 --mask-truncated-completions "
                        "--soft-overlong-cache 4 --dynamic-sampling --max-sampling-rounds 2 --eval-num-samples 2 "
                        "--log-completions-every 1 --reward-fn gold --reward-weights 0.5 1", 1),
    "grpo_gspo": ("grpo.py", f"{GRPO} --advantage reinforce_pp_baseline --loss-type dapo --importance-sampling-level sequence "
                  "--epsilon 3e-4 --epsilon-high 4e-4 --beta 0 --temperature 0.8", 1),
    "grpo_dr_grpo": ("grpo.py", f"{GRPO} --scale-rewards none --loss-type dr_grpo --epsilon-high 0.28 --no-anneal-lr", 1),
    "grpo_reinforce_pp": ("grpo.py", f"{GRPO} --advantage reinforce_pp --missing-eos-penalty -2 --response-length 7", 1),
    "rlhf_ppo_options": ("rlhf_ppo.py", "--num-iterations 3 --batch-size 16 --mini-batch-size 8 --ppo-epochs 2 "
                         "--eval-every 2 --eval-size 16 --kl-target 1.0 --kl-horizon 20 --cliprange 0.1 "
                         "--cliprange-value 0.1 --vf-coef 0.3 --gamma 0.95 --lam 0.9 --missing-eos-penalty -2 "
                         "--temperature 0.8 --reward-fn gold --reward-weights 0.5 1 --eval-num-samples 2 "
                         "--log-completions-every 1", 1),
    "rlhf_ppo_2ranks": ("rlhf_ppo.py", "--num-iterations 2 --batch-size 16 --mini-batch-size 8 --eval-every 1 "
                        "--eval-size 10", 2),
    "grpo_2ranks_fsdp": ("grpo.py", "--num-iterations 2 --batch-size 16 --num-generations 4 --mini-batch-size 8 "
                         "--eval-every 1 --eval-size 10 --fsdp", 2),
}
TOP_LEVEL_FLAGS = {"rlhf_ppo": "--num-iterations 3 --batch-size 16 --mini-batch-size 8 --ppo-epochs 2 --eval-every 2 "
                              "--eval-size 16"}  # with --top-level: the runs' flags the reference does not have
WALL_CLOCK = ("SPS", "per_second", "time_fraction")


def fingerprint(run_dir, weight_files):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(run_dir, size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]
               if not any(word in tag for word in WALL_CLOCK)}
    weights = {os.path.basename(path) if path.endswith(".pt") else  # in runs/<run name with the time>/
               os.path.basename(os.path.dirname(path)) + "/" + os.path.basename(path): file_hash(path)
               for path in sorted(weight_files)}
    return {"scalars": scalars, "weights": weights}


def file_hash(path):
    """SHA-256 of a file's bytes; of a torch.save zip, of its members' bytes (the zip itself holds write times)."""
    digest = hashlib.sha256()
    if path.endswith(".pt"):
        with zipfile.ZipFile(path) as archive:
            for name in sorted(archive.namelist()):
                digest.update(name.encode() + archive.read(name))
    else:
        digest.update(open(path, "rb").read())
    return digest.hexdigest()


def run_all(root, out, overrides, top_level=False):
    root = os.path.abspath(root)
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    models = tempfile.mkdtemp(prefix="same_results_models_")  # sft's and reward_model's checkpoints, for the rest
    result = {}
    for name, (script, flags, ranks) in RUNS.items():
        if top_level and ranks > 1:
            continue  # the top-level LM files are one process
        argv = shlex.split(overrides.get(name, TOP_LEVEL_FLAGS.get(name, flags) if top_level else flags))
        if script in ("rlhf_ppo.py", "grpo.py"):
            argv += ["--model-name-or-path", f"{models}/models/sft",
                     "--reward-model-path", f"{models}/models/reward_model"]
        if script == "dpo.py":
            argv += ["--model-name-or-path", f"{models}/models/sft",
                     "--reward-model-path", f"{models}/models/reward_model"]
        cwd = models if script in ("sft.py", "reward_model.py") else tempfile.mkdtemp(prefix=f"same_results_{name}_")
        launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", "29533"]
                    if ranks > 1 else [sys.executable])
        path = os.path.join(root, "scale", script)
        path = path if os.path.exists(path) and not top_level else os.path.join(root, script)
        proc = subprocess.run(launcher + [path, *argv], cwd=cwd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"{name} failed:\n{proc.stderr[-3000:]}")
        (run_dir,) = glob.glob(os.path.join(cwd, "runs", "*"))
        saved = glob.glob(os.path.join(run_dir, "*.pt")) + glob.glob(os.path.join(cwd, "models", "*", "*.safetensors"))
        if cwd == models:  # sft's and reward_model's checkpoints stay for the later runs; their logs move aside
            saved = [p for p in saved if f"/{script[:-3]}/" in p]
        result[name] = fingerprint(run_dir, saved)
        if cwd == models:
            os.rename(run_dir, os.path.join(cwd, f"log_{name}"))
        print(f"{name}: {len(result[name]['scalars'])} tags, {len(result[name]['weights'])} weight files", flush=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)


def compare(a_path, b_path, dropped=()):
    """Whether the runs of two fingerprint files computed the same: every tag and weight file equal. A tag whose name
    starts with one of `dropped` and that only the first logs (a feature the change moved to scale/) is said, not
    counted as a difference."""
    a, b = json.load(open(a_path)), json.load(open(b_path))
    same = True
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name}: only in {'the first' if name in a else 'the second'}")
            same = False
            continue
        gone = sorted(tag for tag in set(a[name]["scalars"]) - set(b[name]["scalars"]) if tag.startswith(tuple(dropped)))
        diffs = [tag for tag in set(a[name]["scalars"]) | set(b[name]["scalars"])
                 if a[name]["scalars"].get(tag) != b[name]["scalars"].get(tag) and tag not in gone]
        weights = a[name]["weights"] == b[name]["weights"]
        print(f"{name}: {len(a[name]['scalars'])} tags, {'all equal' if not diffs else 'differ: ' + ', '.join(sorted(diffs))}; "
              f"{len(a[name]['weights'])} weight files {'bitwise equal' if weights else 'DIFFER'}"
              + (f"; no longer logged: {', '.join(gone)}" if gone else ""))
        same &= not diffs and weights
    print("same results" if same else "DIFFERENT results")
    return same


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs=2, help="ROOT OUT.json, or with --compare two fingerprint files")
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--top-level", action="store_true", help="run the top-level LM files, not scale/'s")
    parser.add_argument("--flags", action="append", default=[], help="NAME='flags' to replace one run's flags")
    parser.add_argument("--dropped", action="append", default=[], help="with --compare: a tag prefix that the second "
                        "may no longer log (a feature moved away, e.g. rollout/), said but not a difference")
    args = parser.parse_args()
    if args.compare:
        sys.exit(0 if compare(*args.paths, args.dropped) else 1)
    run_all(*args.paths, dict(item.split("=", 1) for item in args.flags), args.top_level)
