"""Reward model (RLHF stage 1b): a Bradley-Terry pairwise model of human preferences.

The SFT model with a scalar head (`AutoModelForSequenceClassification`, num_labels=1) scores a whole
sequence at its last token (the EOS appended to every sequence). It is trained so that the chosen
completion of each pair scores above the rejected one (Ouyang et al. 2022, eq. 1; Bradley & Terry 1952):

    loss = −log σ(r(x, y_chosen) − r(x, y_rejected) − margin)

    python sft.py && python reward_model.py                          # built-in task: ~100 s, then ~80 s on 2 CPU cores
    python reward_model.py --model-name-or-path my-sft --dataset-name trl-lib/ultrafeedback_binarized

Datasets in TRL's preference format: `prompt`/`chosen`/`rejected`, or `chosen`/`rejected` with the
prompt inside each; an optional `margin` column.
"""
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import transformers
import tyro
from torch.utils.tensorboard import SummaryWriter


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment, part of the run name runs/<exp>__<seed>__<time>"""
    seed: int = 1
    """seed of python, torch and the built-in task's data"""
    cuda: bool = True
    """use CUDA when it is available (the CPU otherwise)"""
    model_name_or_path: str = "models/sft"
    """hub id or local directory of the model to start from (sft.py's output by default)"""
    dataset_name: str | None = None
    """hub id, local dataset directory, or a .json/.jsonl/.parquet file; None uses the built-in sort task"""
    dataset_split: str = "train"
    """split of --dataset-name to train on (its `test` split, if any, is the eval set)"""
    output_dir: str = "models/reward_model"
    """where the Hugging Face checkpoint is saved (written to a temporary directory, then renamed)"""

    max_steps: int = 600
    """optimizer steps (the data is cycled, reshuffled each pass)"""
    batch_size: int = 64
    """preference pairs per optimizer step"""
    lr: float = 1e-3
    """peak learning rate of AdamW"""
    warmup_steps: int = 50
    """linear warmup steps, then linear decay to 0"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this"""
    max_length: int = 64
    """sequences are truncated to this many tokens (the EOS is kept)"""
    center_rewards_coefficient: float | None = None
    """add this × mean((r_chosen + r_rejected)²) to keep rewards centered on 0 (Eisenstein et al. 2023)"""
    eval_every: int = 200
    """evaluate every this many steps (and at the end)"""
    eval_size: int = 512
    """held-out pairs (the built-in task's come from their own random stream)"""
    num_train_pairs: int = 50_000
    """size of the built-in task's training set"""


# ---------------------------------------------------------------------------------------------
# The built-in task: sort the digits. Gold reward known exactly. (Each LM script has its own copy;
# tests/test_lm_task.py checks the copies agree.)
# ---------------------------------------------------------------------------------------------
def levenshtein(a, b):
    """Edit distance: insertions, deletions and substitutions, each of cost 1."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def gold_score(completion, target):
    """1 − min(1, levenshtein(completion, target) / len(target)): 1 for the exact answer."""
    return 1.0 - min(1.0, levenshtein(completion, target) / len(target))


def make_prompt(rng):
    """`sort <n digits>:` with n uniform in [4, 8]; returns (prompt, target)."""
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(4, 8)))
    return f"sort {digits}:", "".join(sorted(digits))


def corrupt(rng, s, kinds=("swap", "drop", "insert", "replace")):
    """One random corruption of s; a swap exchanges two adjacent, unequal digits."""
    while True:
        kind, i = rng.choice(kinds), rng.randrange(len(s))
        if kind == "swap":
            pairs = [j for j in range(len(s) - 1) if s[j] != s[j + 1]]
            if pairs:
                j = rng.choice(pairs)
                return s[:j] + s[j + 1] + s[j] + s[j + 2 :]
            if kinds == ("swap",):
                return s  # all digits equal: nothing to swap
        elif kind == "drop":
            return s[:i] + s[i + 1 :]
        elif kind == "insert":
            return s[:i] + rng.choice("0123456789") + s[i:]
        elif kind == "replace":
            return s[:i] + rng.choice([d for d in "0123456789" if d != s[i]]) + s[i + 1 :]


def demonstration(rng, target):
    """The sloppy demonstrator: the target, or with probability 0.5 the target with one adjacent swap."""
    return target if rng.random() < 0.5 else corrupt(rng, target, ("swap",))


def candidate(rng, target):
    """A candidate for preference pairs: the target, or with probability 0.5 one or two corruptions."""
    if rng.random() < 0.5:
        return target
    for _ in range(rng.randint(1, 2)):
        target = corrupt(rng, target)
    return target


def preference_pair(rng):
    """Two candidates for one prompt with different gold scores: (prompt, chosen, rejected, target)."""
    prompt, target = make_prompt(rng)
    while True:
        a, b = candidate(rng, target), candidate(rng, target)
        if gold_score(a, target) != gold_score(b, target):
            return (prompt, a, b, target) if gold_score(a, target) > gold_score(b, target) else (prompt, b, a, target)


def task_rng(seed, split):
    """Train and eval data come from different random streams of the same seed."""
    return random.Random(f"sort-task/{seed}/{split}")


# ---------------------------------------------------------------------------------------------
# The math: pure functions, checked against hand-computed values in tests/test_sft_reward_model.py
# ---------------------------------------------------------------------------------------------
def bradley_terry_loss(rewards_chosen, rewards_rejected, margin=None, center_rewards_coefficient=None):
    """Pairwise loss of the Bradley-Terry model P(y_c ≻ y_r) = σ(r_c − r_r):

        L = mean( −log σ(r_c − r_r − m) )  [ + c · mean( (r_c + r_r)² ) ]

    The margin m (a `margin` column) asks for a larger gap where the preference is stronger; the
    centering term pins the free offset of the rewards near 0.
    """
    logits = rewards_chosen - rewards_rejected
    if margin is not None:
        logits = logits - margin
    loss = -F.logsigmoid(logits).mean()
    if center_rewards_coefficient:
        loss = loss + center_rewards_coefficient * ((rewards_chosen + rewards_rejected) ** 2).mean()
    return loss


def last_token_index(attention_mask):
    """Index of the last non-pad token of each row, under left or right padding:
    the largest position whose mask is 1 (for right padding: number of tokens − 1)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (positions * attention_mask).argmax(-1)


def get_rewards(model, input_ids, attention_mask):
    """The scalar head applied to the hidden state of each sequence's last non-pad token (its EOS).
    Position ids count real tokens only, so scores do not depend on padding."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    scores = model.score(hidden).squeeze(-1)  # one score per token
    return scores[torch.arange(len(scores), device=scores.device), last_token_index(attention_mask)]


# ---------------------------------------------------------------------------------------------
# Model and data
# ---------------------------------------------------------------------------------------------
def load_model_and_tokenizer(args, device):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = args.model_name_or_path
    if not os.path.isdir(path) and (path.startswith((".", "/", "~", "models/")) or path.count("/") > 1):
        hint = "run `python sft.py` first" if path == "models/sft" else "pass an existing directory or a hub id"
        sys.exit(f"error: model directory {path!r} does not exist; {hint}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    except (OSError, ValueError) as e:
        sys.exit(f"error: cannot load a model from {path!r}: {str(e).splitlines()[0]}")
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.to(device), tokenizer


def load_pairs(args):
    """(train, eval) lists of dicts with prompt (may be ''), chosen, rejected, and optionally margin / target."""
    if args.dataset_name is None:
        def pairs(split, n):
            rng = task_rng(args.seed, split)
            return [dict(zip(("prompt", "chosen", "rejected", "target"), preference_pair(rng))) for _ in range(n)]
        return pairs("train", args.num_train_pairs), pairs("eval", args.eval_size)
    import datasets

    datasets.disable_progress_bars()
    name = args.dataset_name
    try:
        if name.endswith((".json", ".jsonl", ".parquet")):
            if not os.path.isfile(name):
                sys.exit(f"error: dataset file {name!r} does not exist")
            data = datasets.load_dataset("parquet" if name.endswith(".parquet") else "json", data_files=name)
        elif os.path.isdir(name) and os.path.exists(os.path.join(name, "dataset_dict.json")):
            data = datasets.load_from_disk(name)
        else:
            data = datasets.load_dataset(name)
    except Exception as e:  # noqa: BLE001  any loading failure becomes one line
        sys.exit(f"error: cannot load dataset {name!r}: {str(e).splitlines()[0]}")
    columns = data[args.dataset_split].column_names
    if not {"chosen", "rejected"} <= set(columns):
        sys.exit(f"error: dataset {name!r} has columns {columns}; reward_model.py needs chosen and rejected "
                 "(and optionally prompt and margin)")
    rows = [dict(row, prompt=row.get("prompt") or "") for row in data[args.dataset_split]]
    if "test" in data:
        return rows, [dict(row, prompt=row.get("prompt") or "") for row in data["test"]][: args.eval_size]
    n_eval = min(args.eval_size, len(rows) // 10)
    return rows[n_eval:], rows[:n_eval]


def encode(tokenizer, prompt, completion, max_length):
    """prompt + completion + EOS, truncated to max_length with the EOS kept (the score is read there)."""
    ids = tokenizer(prompt + completion, add_special_tokens=False)["input_ids"][: max_length - 1]
    return ids + [tokenizer.eos_token_id]


def batch_tensors(sequences, pad_token_id, device):
    width = max(len(s) for s in sequences)
    input_ids = torch.tensor([s + [pad_token_id] * (width - len(s)) for s in sequences], device=device)
    attention_mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences], device=device)
    return input_ids, attention_mask


def save_atomically(model, tokenizer, args, output_dir):
    """Write to a temporary directory, then rename: a crash never leaves a half-written model."""
    tmp_dir = f"{output_dir.rstrip('/')}.tmp-{os.getpid()}"
    model.save_pretrained(tmp_dir)
    tokenizer.save_pretrained(tmp_dir)
    with open(os.path.join(tmp_dir, "training_args.json"), "w") as f:
        json.dump(vars(args), f, indent=2)
    if os.path.exists(output_dir):
        shutil.rmtree(output_dir)
    os.replace(tmp_dir, output_dir)


def main(args: Args):
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")

    train_pairs, eval_pairs = load_pairs(args)
    model, tokenizer = load_model_and_tokenizer(args, device)

    def encode_pairs(pairs):
        return [(encode(tokenizer, p["prompt"], p["chosen"], args.max_length),
                 encode(tokenizer, p["prompt"], p["rejected"], args.max_length), p.get("margin")) for p in pairs]

    train, evals = encode_pairs(train_pairs), encode_pairs(eval_pairs)

    def rewards_of(batch):
        """Chosen and rejected sequences in one forward pass: (r_chosen, r_rejected, margin or None)."""
        input_ids, attention_mask = batch_tensors([c for c, _, _ in batch] + [r for _, r, _ in batch],
                                                  tokenizer.pad_token_id, device)
        rewards = get_rewards(model, input_ids, attention_mask)
        margin = None if batch[0][2] is None else torch.tensor([m for _, _, m in batch], dtype=rewards.dtype, device=device)
        return rewards[: len(batch)], rewards[len(batch) :], margin

    run_name = f"{args.exp_name}__{args.seed}__{int(time.time())}"
    writer = SummaryWriter(f"runs/{run_name}")
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters, {len(train):,} training pairs")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(
        (step + 1) / args.warmup_steps, max(0.0, (args.max_steps - step) / (args.max_steps - args.warmup_steps))))

    def evaluate(step):
        model.eval()
        chosen, rejected, losses = [], [], []
        with torch.no_grad():
            for i in range(0, len(evals), 128):
                r_c, r_r, margin = rewards_of(evals[i : i + 128])
                losses.append(bradley_terry_loss(r_c, r_r, margin).item() * len(r_c))
                chosen.append(r_c), rejected.append(r_r)
        chosen, rejected = torch.cat(chosen), torch.cat(rejected)
        accuracy = (chosen > rejected).float().mean().item()
        writer.add_scalar("eval/loss", sum(losses) / len(evals), step)
        writer.add_scalar("eval/accuracy", accuracy, step)
        line = f"step {step}: eval/loss {sum(losses) / len(evals):.4f}, eval/accuracy {accuracy:.3f}"
        if args.dataset_name is None:
            # how well the learned reward tracks the gold one, over every held-out candidate
            gold = torch.tensor([gold_score(p[k], p["target"]) for k in ("chosen", "rejected") for p in eval_pairs])
            scores = torch.cat([chosen, rejected]).cpu()
            correlation = torch.corrcoef(torch.stack([scores, gold]))[0, 1].item()
            writer.add_scalar("eval/gold_correlation", correlation, step)
            line += f", eval/gold_correlation {correlation:.3f}"
        print(line)
        model.train()

    model.train()
    order, position = list(range(len(train))), len(train)
    start_time, model_time, tokens_seen = time.time(), 0.0, 0
    for step in range(1, args.max_steps + 1):
        if position + args.batch_size > len(order):
            random.shuffle(order)
            position = 0
        batch = [train[i] for i in order[position : position + args.batch_size]]
        position += args.batch_size

        tick = time.time()
        r_c, r_r, margin = rewards_of(batch)
        loss = bradley_terry_loss(r_c, r_r, margin, args.center_rewards_coefficient)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        model_time += time.time() - tick
        tokens_seen += sum(len(c) + len(r) for c, r, _ in batch)

        if step % 10 == 0:
            elapsed = time.time() - start_time
            writer.add_scalar("train/loss", loss.item(), step)
            writer.add_scalar("train/accuracy", (r_c > r_r).float().mean().item(), step)
            writer.add_scalar("train/reward_chosen", r_c.mean().item(), step)
            writer.add_scalar("train/reward_rejected", r_r.mean().item(), step)
            writer.add_scalar("train/margin", (r_c - r_r).mean().item(), step)
            writer.add_scalar("charts/learning_rate", scheduler.get_last_lr()[0], step)
            writer.add_scalar("charts/samples_per_second", step * args.batch_size / elapsed, step)
            writer.add_scalar("charts/tokens_per_second", tokens_seen / elapsed, step)
            writer.add_scalar("charts/model_time_fraction", model_time / elapsed, step)
        if step % args.eval_every == 0 or step == args.max_steps:
            evaluate(step)

    elapsed = time.time() - start_time
    print(f"{args.max_steps * args.batch_size / elapsed:.0f} pairs/s, {tokens_seen / elapsed:.0f} tokens/s, "
          f"{100 * model_time / elapsed:.0f}% of the time in forward/backward/optimizer, {elapsed:.0f} s in all")
    save_atomically(model, tokenizer, args, args.output_dir)
    print(f"saved to {args.output_dir}")
    writer.close()


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
