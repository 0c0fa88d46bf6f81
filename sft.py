"""Supervised fine-tuning (RLHF stage 1a): next-token cross-entropy on the completion only.

By default, offline: a tiny GPT-2 built from a config learns the built-in `sort <digits>:` task from
a sloppy demonstrator (half its answers have one adjacent swap), so every later stage can be measured
against an exact gold reward. The same program fine-tunes a real model on a real dataset:

    python sft.py                                                    # built-in task, ~100 s on 2 CPU cores
    python sft.py --model-name-or-path Qwen/Qwen2.5-0.5B --dataset-name trl-lib/Capybara --lr 2e-5
    python sft.py --dataset-name data.jsonl --model-name-or-path models/sft

Datasets in TRL's formats: `prompt`/`completion` (loss on the completion), `text` (loss on every
token) or `messages` (chat template; loss on the assistant turns).
"""
import json
import math
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
    model_name_or_path: str | None = None
    """hub id or local directory of a causal LM to fine-tune; None builds the tiny GPT-2 below from scratch"""
    dataset_name: str | None = None
    """hub id, local dataset directory, or a .json/.jsonl/.parquet file; None uses the built-in sort task"""
    dataset_split: str = "train"
    """split of --dataset-name to train on (its `test` split, if any, is the eval set)"""
    output_dir: str = "models/sft"
    """where the Hugging Face checkpoint is saved (written to a temporary directory, then renamed)"""

    max_steps: int = 1500
    """optimizer steps (the data is cycled, reshuffled each pass)"""
    batch_size: int = 64
    """sequences per optimizer step"""
    gradient_accumulation_steps: int = 1
    """split each batch into this many micro-batches (same result, less memory)"""
    lr: float = 3e-3
    """peak learning rate of AdamW"""
    warmup_steps: int = 100
    """linear warmup steps, then cosine decay to 0"""
    weight_decay: float = 0.01
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this"""
    max_length: int = 64
    """sequences are truncated to this many tokens"""
    eval_every: int = 500
    """evaluate every this many steps (and at the end)"""
    eval_size: int = 512
    """eval prompts / examples (the built-in task's eval set comes from its own random stream)"""
    max_new_tokens: int = 12
    """tokens sampled per completion in evaluation"""
    num_train_examples: int = 100_000
    """size of the built-in task's training set"""

    n_layer: int = 3
    """tiny model (when no --model-name-or-path): transformer blocks"""
    n_embd: int = 128
    """tiny model: width"""
    n_head: int = 4
    """tiny model: attention heads"""


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
# The loss: a pure function, checked against hand-computed values in tests/test_sft_reward_model.py
# ---------------------------------------------------------------------------------------------
def sft_loss(logits, labels, num_items=None):
    """Cross-entropy of the next-token predictions on the labeled tokens (completion and EOS; the
    prompt and the padding carry the label −100):

        L = −(1/N) Σ_{t: y_t ≠ −100} log p_θ(y_t | x_<t)

    N is the number of labeled tokens in the whole batch: pass it as `num_items` when the batch is
    split into micro-batches, so that every token weighs the same whatever micro-batch it is in.
    """
    shift_logits, shift_labels = logits[:, :-1], labels[:, 1:]
    nll = F.cross_entropy(shift_logits.reshape(-1, shift_logits.size(-1)).float(), shift_labels.reshape(-1),
                          ignore_index=-100, reduction="sum")
    return nll / (num_items if num_items is not None else (shift_labels != -100).sum())


# ---------------------------------------------------------------------------------------------
# Model, tokenizer, data
# ---------------------------------------------------------------------------------------------
def load_model_and_tokenizer(args, device):
    from transformers import AutoModelForCausalLM, AutoTokenizer, ByT5Tokenizer, GPT2Config, GPT2LMHeadModel

    if args.model_name_or_path is None:
        # A byte-level tokenizer needs no files; pad (0) differs from EOS (1)
        tokenizer = ByT5Tokenizer()
        config = GPT2Config(vocab_size=len(tokenizer), n_positions=args.max_length, n_embd=args.n_embd,
                            n_layer=args.n_layer, n_head=args.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, bos_token_id=tokenizer.eos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        return GPT2LMHeadModel(config).to(device), tokenizer
    path = args.model_name_or_path
    if not os.path.isdir(path) and (path.startswith((".", "/", "~", "models/")) or path.count("/") > 1):
        sys.exit(f"error: model directory {path!r} does not exist; pass an existing directory or a hub id")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path)
    except (OSError, ValueError) as e:
        sys.exit(f"error: cannot load a causal LM from {path!r}: {str(e).splitlines()[0]}")
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        # a pad distinct from EOS, so that masking padding never masks the EOS the model must learn
        tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.to(device), tokenizer


def load_examples(args):
    """(train, eval) lists of examples in one of TRL's formats: dicts with prompt/completion, text, or messages."""
    if args.dataset_name is None:
        rng = task_rng(args.seed, "train")
        train = []
        for _ in range(args.num_train_examples):
            prompt, target = make_prompt(rng)
            train.append({"prompt": prompt, "completion": demonstration(rng, target)})
        rng = task_rng(args.seed, "eval")
        evals = []
        for _ in range(args.eval_size):
            prompt, target = make_prompt(rng)
            evals.append({"prompt": prompt, "completion": demonstration(rng, target), "target": target})
        return train, evals
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
    if not ({"prompt", "completion"} <= set(columns) or "text" in columns or "messages" in columns):
        sys.exit(f"error: dataset {name!r} has columns {columns}; sft.py accepts prompt+completion, text, or messages")
    train = list(data[args.dataset_split])
    if "test" in data:
        return train, list(data["test"])[: args.eval_size]
    n_eval = min(args.eval_size, len(train) // 10)
    return train[n_eval:], train[:n_eval]


def tokenize(example, tokenizer, max_length):
    """(input_ids, labels) with labels −100 where no loss is taken; EOS ends the sequence."""
    eos = [tokenizer.eos_token_id]
    if "messages" in example and example["messages"] is not None:
        if tokenizer.chat_template is None:
            sys.exit("error: the dataset has `messages` but the tokenizer has no chat template")
        def render(turns, **kwargs):
            ids = tokenizer.apply_chat_template(turns, tokenize=True, **kwargs)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in transformers 5

        messages, ids, labels = example["messages"], [], []
        for i, message in enumerate(messages):
            if message["role"] == "assistant":  # the assistant header is prompt, not completion
                ids = render(messages[:i], add_generation_prompt=True)
                labels += [-100] * (len(ids) - len(labels))
            # the tokens this turn adds to the rendered conversation; loss only on assistant turns
            full = render(messages[: i + 1])
            new = full[len(ids) :]
            labels += new if message["role"] == "assistant" else [-100] * len(new)
            ids = full
    elif "prompt" in example and example.get("completion") is not None:
        prompt = tokenizer(example["prompt"], add_special_tokens=False)["input_ids"]
        completion = tokenizer(example["completion"], add_special_tokens=False)["input_ids"] + eos
        ids, labels = prompt + completion, [-100] * len(prompt) + completion
    else:
        ids = tokenizer(example["text"], add_special_tokens=False)["input_ids"] + eos
        labels = list(ids)
    return ids[:max_length], labels[:max_length]


def collate(batch, pad_token_id):
    """Right-pad a list of (input_ids, labels) into tensors."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.tensor([ids + [pad_token_id] * (width - len(ids)) for ids, _ in batch])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
    attention_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
    return input_ids, labels, attention_mask


@torch.no_grad()
def generate(model, tokenizer, prompts, max_new_tokens, temperature=1.0, greedy=False, batch_size=256):
    """Complete each prompt (left-padded; generate derives position ids from the attention mask)
    and return the completions as text, cut at the first EOS."""
    tokenizer.padding_side = "left"
    completions = []
    for i in range(0, len(prompts), batch_size):
        batch = tokenizer(prompts[i : i + batch_size], add_special_tokens=False, padding=True, return_tensors="pt")
        batch = {k: v.to(model.device) for k, v in batch.items()}
        sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        out = model.generate(**batch, **sampling, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        for row in out[:, batch["input_ids"].shape[1] :].tolist():
            row = row[: row.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in row else row
            completions.append(tokenizer.decode(row, skip_special_tokens=True))
    tokenizer.padding_side = "right"
    return completions


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
    if args.batch_size % args.gradient_accumulation_steps:
        sys.exit(f"error: --batch-size {args.batch_size} does not split into {args.gradient_accumulation_steps} micro-batches")
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")

    train_examples, eval_examples = load_examples(args)
    model, tokenizer = load_model_and_tokenizer(args, device)
    train = [tokenize(ex, tokenizer, args.max_length) for ex in train_examples]
    evals = [tokenize(ex, tokenizer, args.max_length) for ex in eval_examples]
    builtin = args.dataset_name is None

    run_name = f"{args.exp_name}__{args.seed}__{int(time.time())}"
    writer = SummaryWriter(f"runs/{run_name}")
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters, {len(train):,} training examples")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    schedule = lambda step: min(1.0, (step + 1) / args.warmup_steps) * 0.5 * (  # noqa: E731
        1 + math.cos(math.pi * min(1.0, step / args.max_steps)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    micro_size = args.batch_size // args.gradient_accumulation_steps

    def evaluate(step):
        model.eval()
        with torch.no_grad():
            total, count = 0.0, 0
            for i in range(0, len(evals), 128):
                input_ids, labels, attention_mask = (t.to(device) for t in collate(evals[i : i + 128], tokenizer.pad_token_id))
                n = (labels[:, 1:] != -100).sum()
                total += sft_loss(model(input_ids=input_ids, attention_mask=attention_mask).logits, labels, n).item() * n.item()
                count += n.item()
        writer.add_scalar("eval/loss", total / count, step)
        line = f"step {step}: eval/loss {total / count:.4f}"
        if builtin:
            prompts, targets = [ex["prompt"] for ex in eval_examples], [ex["target"] for ex in eval_examples]
            for name, completions in (("", generate(model, tokenizer, prompts, args.max_new_tokens)),
                                      ("_greedy", generate(model, tokenizer, prompts, args.max_new_tokens, greedy=True))):
                accuracy = sum(c == t for c, t in zip(completions, targets)) / len(targets)
                score = sum(gold_score(c, t) for c, t in zip(completions, targets)) / len(targets)
                writer.add_scalar(f"eval/gold_accuracy{name}", accuracy, step)
                writer.add_scalar(f"eval/gold_score{name}", score, step)
                line += f", gold_accuracy{name} {accuracy:.3f}, gold_score{name} {score:.3f}"
            samples = "\n".join(f"    {p} {c!r} (target {t})" for p, c, t in zip(prompts[:8], completions, targets))
            writer.add_text("eval/samples", samples, step)
        print(line)
        model.train()

    model.train()
    order, position = list(range(len(train))), len(train)
    start_time, model_time, tokens_seen = time.time(), 0.0, 0
    for step in range(1, args.max_steps + 1):
        if position + args.batch_size > len(order):  # a new pass over the data, reshuffled
            random.shuffle(order)
            position = 0
        batch = [train[i] for i in order[position : position + args.batch_size]]
        position += args.batch_size
        num_items = sum(sum(label != -100 for label in labels[1:]) for _, labels in batch)

        tick, batch_loss = time.time(), 0.0
        for m in range(0, args.batch_size, micro_size):
            input_ids, labels, attention_mask = (t.to(device) for t in collate(batch[m : m + micro_size], tokenizer.pad_token_id))
            loss = sft_loss(model(input_ids=input_ids, attention_mask=attention_mask).logits, labels, num_items)
            loss.backward()
            batch_loss += loss.item()
            tokens_seen += int(attention_mask.sum())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        model_time += time.time() - tick

        if step % 10 == 0:
            elapsed = time.time() - start_time
            writer.add_scalar("train/loss", batch_loss, step)
            writer.add_scalar("train/grad_norm", grad_norm.item(), step)
            writer.add_scalar("charts/learning_rate", scheduler.get_last_lr()[0], step)
            writer.add_scalar("charts/samples_per_second", step * args.batch_size / elapsed, step)
            writer.add_scalar("charts/tokens_per_second", tokens_seen / elapsed, step)
            writer.add_scalar("charts/model_time_fraction", model_time / elapsed, step)
        if step % args.eval_every == 0 or step == args.max_steps:
            evaluate(step)

    elapsed = time.time() - start_time
    print(f"{args.max_steps * args.batch_size / elapsed:.0f} samples/s, {tokens_seen / elapsed:.0f} tokens/s, "
          f"{100 * model_time / elapsed:.0f}% of the time in forward/backward/optimizer, {elapsed:.0f} s in all")
    save_atomically(model, tokenizer, args, args.output_dir)
    print(f"saved to {args.output_dir}")
    writer.close()


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
