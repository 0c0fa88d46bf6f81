"""Direct Preference Optimization: RLHF's objective without a reward model or sampling during training.

Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is Secretly a Reward Model".
The KL-constrained reward maximization of RLHF has the closed-form optimum π*(y|x) ∝ π_ref(y|x) exp(r(x,y)/β),
so r(x,y) = β log π(y|x)/π_ref(y|x) + β log Z(x); put into the Bradley-Terry model, Z cancels and the
policy is fit to preference pairs directly (eq. 7):

    L_DPO = −log σ( β [ (log π − log π_ref)(y_w|x) − (log π − log π_ref)(y_l|x) ] )

    python sft.py && python dpo.py                                   # built-in task, CPU
    python dpo.py --loss-type ipo --beta 0.5
    python dpo.py --model-name-or-path my-sft --dataset-name trl-lib/ultrafeedback_binarized
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
    """the policy's start and the frozen reference (sft.py's output by default)"""
    reward_model_path: str | None = "models/reward_model"
    """a reward model used only to report eval/score (skipped when None or missing)"""
    dataset_name: str | None = None
    """hub id, local dataset directory, or .json/.jsonl/.parquet file in TRL's preference format; None: built-in task"""
    dataset_split: str = "train"
    """split of --dataset-name to train on (its `test` split, if any, is the eval set)"""
    output_dir: str = "models/dpo"
    """where the trained policy is saved as a Hugging Face checkpoint (atomically)"""

    loss_type: str = "sigmoid"
    """sigmoid (DPO), ipo (Azar et al. 2023) or hinge (SLiC, Zhao et al. 2023)"""
    beta: float = 0.5
    """β: the strength of the implicit KL constraint to the reference"""
    label_smoothing: float = 0.0
    """conservative DPO: the probability that a preference label is flipped (sigmoid loss only)"""
    max_steps: int = 300
    """optimizer steps (the data is cycled, reshuffled each pass)"""
    batch_size: int = 64
    """preference pairs per optimizer step"""
    lr: float = 1e-4
    """peak learning rate of AdamW"""
    warmup_steps: int = 30
    """linear warmup steps, then linear decay to 0"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this"""
    max_length: int = 64
    """prompt + completion are truncated to this many tokens (the EOS is kept)"""
    num_train_pairs: int = 20_000
    """size of the built-in task's training set"""
    eval_every: int = 100
    """evaluate every this many steps (and before the first and after the last)"""
    eval_size: int = 512
    """eval prompts / pairs (the built-in task's come from their own random stream)"""
    response_length: int = 12
    """new tokens sampled per completion in evaluation"""
    temperature: float = 1.0
    """sampling temperature in evaluation (1: the trained policy itself)"""


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
# The math: pure functions, checked against hand-computed values in tests/test_rlhf_ppo_dpo.py
# ---------------------------------------------------------------------------------------------
def dpo_loss(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps, beta,
             loss_type="sigmoid", label_smoothing=0.0):
    """Preference losses on h = (log π − log π_ref)(y_w) − (log π − log π_ref)(y_l), log-probs summed over
    the completion tokens:

        sigmoid   −(1 − ε) log σ(β h) − ε log σ(−β h)      (DPO eq. 7; ε > 0: conservative DPO)
        ipo       (h − 1/(2β))²                           (IPO, Azar et al. 2023, eq. 17)
        hinge     max(0, 1 − β h)                         (SLiC, Zhao et al. 2023)

    Returns (loss, chosen_rewards, rejected_rewards): the implicit rewards β (log π − log π_ref) (eq. 5)."""
    chosen_logratios = policy_chosen_logps - ref_chosen_logps
    rejected_logratios = policy_rejected_logps - ref_rejected_logps
    h = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    else:
        raise ValueError(f"unknown loss type {loss_type!r}")
    return losses.mean(), beta * chosen_logratios.detach(), beta * rejected_logratios.detach()


def sequence_logps(model, input_ids, attention_mask, labels):
    """Σ_t log π(y_t | x, y_<t) over the completion tokens (labels ≠ −100), one value per sequence."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits[:, :-1]
    labels = labels[:, 1:]
    mask = labels != -100
    logps = torch.gather(F.log_softmax(logits.float(), -1), 2, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (logps * mask).sum(-1)


# ---------------------------------------------------------------------------------------------
# Models, data, and the evaluation shared in spirit (and tags) with rlhf_ppo.py
# ---------------------------------------------------------------------------------------------
def load_models(args, device):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    path = args.model_name_or_path
    if not os.path.isdir(path) and (path.startswith((".", "/", "~", "models/")) or path.count("/") > 1):
        hint = "run `python sft.py` first" if path == "models/sft" else "pass an existing directory or a hub id"
        sys.exit(f"error: model directory {path!r} does not exist; {hint}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        policy = AutoModelForCausalLM.from_pretrained(path).to(device)
        ref = AutoModelForCausalLM.from_pretrained(path).to(device).eval().requires_grad_(False)
        reward = None
        if args.reward_model_path and os.path.isdir(args.reward_model_path):
            reward = AutoModelForSequenceClassification.from_pretrained(args.reward_model_path, num_labels=1)
            reward = reward.to(device).eval().requires_grad_(False)
    except (OSError, ValueError) as e:
        sys.exit(f"error: cannot load the models: {str(e).splitlines()[0]}")
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
        policy.resize_token_embeddings(len(tokenizer))
        ref.resize_token_embeddings(len(tokenizer))
    for model in (policy, ref):
        model.config.pad_token_id = tokenizer.pad_token_id
        for module in model.modules():  # dropout off: the log-prob ratios must be deterministic
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    return tokenizer, policy, ref, reward


def load_pairs(args):
    """(train pairs, eval pairs, eval prompts, eval targets or None); a pair is a dict with prompt,
    chosen, rejected. On the built-in task the eval pairs are reward_model.py's and the eval prompts
    are those of sft.py and rlhf_ppo.py, so the sampled evaluations of all three compare directly."""
    if args.dataset_name is None:
        def pairs(split, n):
            rng = task_rng(args.seed, split)
            return [dict(zip(("prompt", "chosen", "rejected", "target"), preference_pair(rng))) for _ in range(n)]
        rng = task_rng(args.seed, "eval")
        prompts = [make_prompt(rng) for _ in range(args.eval_size)]
        return pairs("train", args.num_train_pairs), pairs("eval", args.eval_size), [p for p, _ in prompts], [t for _, t in prompts]
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
        sys.exit(f"error: dataset {name!r} has columns {columns}; dpo.py needs chosen and rejected (and optionally prompt)")
    def with_prompt(row):
        """Implicit-prompt pairs: the common prefix of chosen and rejected is the prompt (as TRL does)."""
        if row.get("prompt"):
            return row
        prompt = os.path.commonprefix([row["chosen"], row["rejected"]])
        return dict(row, prompt=prompt, chosen=row["chosen"][len(prompt) :], rejected=row["rejected"][len(prompt) :])

    rows = [with_prompt(row) for row in data[args.dataset_split]]
    evals = [with_prompt(row) for row in data["test"]] if "test" in data else rows[: min(args.eval_size, len(rows) // 10)]
    if "test" not in data:
        rows = rows[len(evals) :]
    evals = evals[: args.eval_size]
    prompts = [p["prompt"] for p in evals if p["prompt"]]  # sampling needs a non-empty prompt
    return rows, evals, prompts, None


def tokenize(tokenizer, prompt, completion, max_length):
    """(input_ids, labels): prompt + completion + EOS, labels −100 on the prompt; the EOS is kept."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    ids = (prompt_ids + completion_ids)[: max_length - 1] + [tokenizer.eos_token_id]
    labels = ([-100] * len(prompt_ids) + completion_ids)[: max_length - 1] + [tokenizer.eos_token_id]
    return ids, labels


def collate(sequences, pad_token_id, device):
    """Right-pad a list of (input_ids, labels)."""
    width = max(len(ids) for ids, _ in sequences)
    input_ids = torch.tensor([ids + [pad_token_id] * (width - len(ids)) for ids, _ in sequences], device=device)
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in sequences], device=device)
    attention_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in sequences], device=device)
    return input_ids, attention_mask, labels


@torch.no_grad()
def sample(policy, tokenizer, prompts, args, device):
    """Left-padded prompts → (sequences, attention_mask, context_length, response_mask), each response
    cut after its first EOS."""
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, add_special_tokens=False, padding=True, return_tensors="pt").to(device)
    out = policy.generate(**batch, do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0,
                          max_new_tokens=args.response_length, pad_token_id=tokenizer.pad_token_id,
                          eos_token_id=tokenizer.eos_token_id)
    tokenizer.padding_side = "right"
    context_length = batch["input_ids"].shape[1]
    responses = F.pad(out[:, context_length:], (0, args.response_length - out.shape[1] + context_length),
                      value=tokenizer.pad_token_id)
    is_eos = responses == tokenizer.eos_token_id
    response_mask = ((is_eos.cumsum(1) - is_eos.long()) == 0).long()
    responses = responses.masked_fill(response_mask == 0, tokenizer.pad_token_id)
    return (torch.cat([batch["input_ids"], responses], 1), torch.cat([batch["attention_mask"], response_mask], 1),
            context_length, response_mask)


@torch.no_grad()
def response_logps(model, sequences, attention_mask, context_length, temperature):
    """Σ_t log π(a_t | s_t) over each sampled response's valid tokens."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits[:, context_length - 1 : -1] / temperature
    logps = torch.gather(F.log_softmax(logits.float(), -1), 2, sequences[:, context_length:].unsqueeze(-1)).squeeze(-1)
    return (logps * attention_mask[:, context_length:]).sum(1)


@torch.no_grad()
def reward_scores(reward, sequences, attention_mask):
    """The reward model's score at each sequence's last non-pad token."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    hidden = reward.base_model(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
    last = attention_mask.shape[1] - 1 - attention_mask.flip(1).argmax(1)
    return reward.score(hidden).squeeze(-1)[torch.arange(len(sequences)), last]


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
    if args.loss_type not in ("sigmoid", "ipo", "hinge"):
        sys.exit(f"error: --loss-type {args.loss_type!r}: choose sigmoid, ipo or hinge")
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")

    train_pairs, eval_pairs, eval_prompts, eval_targets = load_pairs(args)
    tokenizer, policy, ref, reward = load_models(args, device)
    tokenizer.padding_side = "right"
    encode = lambda pairs: [(tokenize(tokenizer, p["prompt"], p["chosen"], args.max_length),  # noqa: E731
                             tokenize(tokenizer, p["prompt"], p["rejected"], args.max_length)) for p in pairs]
    train, evals = encode(train_pairs), encode(eval_pairs)

    def logps_of(model, batch):
        """Summed log-probs of the chosen and the rejected completions, in one forward pass."""
        input_ids, attention_mask, labels = collate([c for c, _ in batch] + [r for _, r in batch], tokenizer.pad_token_id, device)
        logps = sequence_logps(model, input_ids, attention_mask, labels)
        return logps[: len(batch)], logps[len(batch) :]

    # The reference never changes: its log-probs are computed once, before training
    with torch.no_grad():
        ref_logps = [logps_of(ref, train[i : i + 256]) for i in range(0, len(train), 256)]
        ref_chosen, ref_rejected = torch.cat([c for c, _ in ref_logps]), torch.cat([r for _, r in ref_logps])

    run_name = f"{args.exp_name}__{args.seed}__{int(time.time())}"
    writer = SummaryWriter(f"runs/{run_name}")
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(
        (step + 1) / args.warmup_steps, max(0.0, (args.max_steps - step) / (args.max_steps - args.warmup_steps))))

    def evaluate(step):
        policy.eval()
        with torch.no_grad():  # the preference metrics on held-out pairs
            chosen, rejected = logps_of(policy, evals)
            ref_c, ref_r = logps_of(ref, evals)
            loss, r_c, r_r = dpo_loss(chosen, rejected, ref_c, ref_r, args.beta, args.loss_type, args.label_smoothing)
        writer.add_scalar("eval/loss", loss.item(), step)
        writer.add_scalar("eval/rewards_accuracy", (r_c > r_r).float().mean().item(), step)
        if not eval_prompts:
            print(f"step {step}: eval/loss {loss.item():.4f} (no prompts to sample from)")
            policy.train()
            return
        # the same sampled evaluation as rlhf_ppo.py: completions at temperature 1 on the eval prompts
        sequences, attention_mask, context_length, _ = sample(policy, tokenizer, eval_prompts, args, device)
        kl = (response_logps(policy, sequences, attention_mask, context_length, args.temperature)
              - response_logps(ref, sequences, attention_mask, context_length, args.temperature)).mean().item()
        writer.add_scalar("eval/kl", kl, step)
        line = f"step {step}: eval/loss {loss.item():.4f}, eval/kl {kl:.3f}"
        if reward is not None:
            score = reward_scores(reward, sequences, attention_mask).mean().item()
            writer.add_scalar("eval/score", score, step)
            line += f", eval/score {score:.3f}"
        completions = []
        for row in sequences[:, context_length:].tolist():
            row = row[: row.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in row else row
            completions.append(tokenizer.decode(row, skip_special_tokens=True))
        if eval_targets is not None:
            accuracy = sum(c == t for c, t in zip(completions, eval_targets)) / len(eval_targets)
            gold = sum(gold_score(c, t) for c, t in zip(completions, eval_targets)) / len(eval_targets)
            writer.add_scalar("eval/gold_accuracy", accuracy, step)
            writer.add_scalar("eval/gold_score", gold, step)
            line += f", eval/gold_accuracy {accuracy:.3f}, eval/gold_score {gold:.3f}"
        writer.add_text("eval/samples", "\n".join(f"    {p} {c!r}" for p, c in zip(eval_prompts[:8], completions)), step)
        print(line)
        policy.train()

    evaluate(0)
    policy.train()
    order, position = list(range(len(train))), len(train)
    start_time = time.time()
    for step in range(1, args.max_steps + 1):
        if position + args.batch_size > len(order):
            random.shuffle(order)
            position = 0
        idx = order[position : position + args.batch_size]
        position += args.batch_size
        chosen, rejected = logps_of(policy, [train[i] for i in idx])
        loss, r_c, r_r = dpo_loss(chosen, rejected, ref_chosen[idx], ref_rejected[idx], args.beta, args.loss_type,
                                  args.label_smoothing)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
        optimizer.step()
        scheduler.step()

        if step % 10 == 0:
            logs = {"losses/loss": loss.item(), "rewards/chosen": r_c.mean(), "rewards/rejected": r_r.mean(),
                    "rewards/accuracies": (r_c > r_r).float().mean(), "rewards/margins": (r_c - r_r).mean(),
                    "logps/chosen": chosen.detach().mean(), "logps/rejected": rejected.detach().mean(),
                    "charts/learning_rate": scheduler.get_last_lr()[0],
                    "charts/samples_per_second": step * args.batch_size / (time.time() - start_time)}
            for tag, value in logs.items():
                writer.add_scalar(tag, float(value), step)
        if step % args.eval_every == 0 or step == args.max_steps:
            evaluate(step)

    save_atomically(policy, tokenizer, args, args.output_dir)
    print(f"saved to {args.output_dir} after {time.time() - start_time:.0f} s")
    writer.close()


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
