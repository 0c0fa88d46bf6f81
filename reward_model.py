"""Reward model (RLHF stage 1b): a Bradley-Terry pairwise model of human preferences.

The SFT model with a scalar head (`AutoModelForSequenceClassification`, num_labels=1) scores a whole
sequence at its last token (the stop token that ends every completion). It is trained so that the
chosen completion of each pair scores above the rejected one (Ouyang et al. 2022, eq. 1; Bradley &
Terry 1952):

    loss = −log σ(r(x, y_chosen) − r(x, y_rejected) − margin)

    python sft.py && python reward_model.py                          # built-in task: ~100 s, then ~80 s on 2 CPU cores
    python reward_model.py --model-name-or-path my-sft --dataset-name trl-lib/ultrafeedback_binarized --lr 1e-5

Datasets in TRL's preference formats, text or conversational: `prompt`/`chosen`/`rejected`, or
`chosen`/`rejected` with the prompt inside each; an optional `margin` column. Dropout is off, as in TRL.

This is the one-device reference. scale/reward_model.py computes the same thing and adds what larger runs
need: torchrun (DDP, FSDP2), LoRA, gradient accumulation and checkpointing, checkpoints that resume exactly.
"""
import datetime
import json
import math
import os
import random
import shutil
import socket
import sys
import time
import urllib.parse
from dataclasses import dataclass
from typing import Annotated

import torch
import torch.nn.functional as F
import transformers
import tyro
from torch.utils.tensorboard import SummaryWriter


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment, part of the run name runs/<exp>__<seed>__<time> (run_name)"""
    seed: int = 1
    """seed of python, torch and the built-in task's data"""
    cuda: bool = True
    """use CUDA when it is available (the CPU otherwise)"""
    threads: int | None = None
    """torch CPU threads (default: OMP_NUM_THREADS where set, else one fewer than the cores, at least 1: a thread
    that waits for a core stalls the others at every step, so leaving a core free keeps a run's speed on a busy
    machine; README's quickstart has the figures)"""
    progress: bool = True
    """on a terminal, a line every ~10 s: the steps done, their rate, the time left (--no-progress: none)"""
    model_name_or_path: str = "models/sft"
    """hub id or local directory of the model to start from (sft.py's output by default)"""
    dataset_name: str | None = None
    """hub id, local dataset directory, or a .json/.jsonl/.parquet file; None uses the built-in sort task"""
    dataset_config: str | None = None
    """config name of a hub dataset that has several (gsm8k: main)"""
    dataset_split: str = "train"
    """split of --dataset-name to train on (its `test` split, if any, is the eval set)"""
    output_dir: str = "models/reward_model"
    """where the Hugging Face checkpoint is saved (written to a temporary directory, then renamed)"""
    save_dtype: str | None = None
    """dtype of the saved weights (float32, bfloat16, float16); None: that of --model-name-or-path"""

    max_steps: int = 600
    """optimizer steps (the data is cycled, reshuffled each pass)"""
    batch_size: int = 64
    """preference pairs per optimizer step"""
    lr: float = 1e-3
    """peak learning rate of AdamW (a pretrained model wants ~1e-5; TRL: learning_rate)"""
    warmup_steps: Annotated[int | None, tyro.conf.DisallowNone] = None
    """linear warmup steps (0: none), then linear decay to 0 (default: 50, or a tenth of --max-steps where that is
    fewer)"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this"""
    max_length: Annotated[int | None, tyro.conf.DisallowNone] = None
    """longest prompt + completion in tokens: pairs with a longer side are dropped (and counted) (default: 64 on the
    built-in task, TRL's 1024 on a dataset)"""
    bf16: Annotated[bool | None, tyro.conf.DisallowNone] = None
    """(default: on with CUDA, off on the CPU) mixed precision: compute in bfloat16 (autocast), weights and AdamW
    state float32; the scalar head computes in float32"""
    center_rewards_coefficient: float | None = None
    """add this × mean((r_chosen + r_rejected)²) to keep rewards centered on 0 (Eisenstein et al. 2023)"""
    eval_every: int = 200
    """evaluate every this many steps (and at the end)"""
    eval_size: int = 512
    """held-out pairs, 0 for no evaluation (the built-in task's come from their own random stream)"""
    num_train_pairs: int = 50_000
    """size of the built-in task's training set"""


# ---------------------------------------------------------------------------------------------
# The math: a pure function, checked against hand-computed values in tests/test_reward_model.py
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


def check_args(args):
    """Every flag checked before any work: one line that says what to change."""
    settle_warmup(args, 50, "linear")  # --warmup-steps, where not given
    settle_lengths(args, {"max_length": (64, 1024)})  # where not given
    if args.threads is not None and args.threads < 1:
        sys.exit(f"error: --threads {args.threads}: it must be at least 1 (leave it out for the default)")
    # the least each count can be (--eval-size 0: no evaluation); below it a run would crash deep inside (a
    # modulo by zero, an empty batch) or train nothing
    for name, least in {"max_steps": 1, "batch_size": 1, "warmup_steps": 0, "eval_every": 1, "eval_size": 0,
                        "num_train_pairs": 1}.items():
        if getattr(args, name) < least:
            sys.exit(f"error: --{name.replace('_', '-')} {getattr(args, name)}: it must be at least {least}")
    # the real numbers, finite and in range (a gradient clip of 0 trains nothing; below 0, the wrong way)
    for name, rule in {"lr": ">= 0", "weight_decay": ">= 0", "max_grad_norm": "> 0",
                       "center_rewards_coefficient": ">= 0"}.items():
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and (value > 0 or rule == ">= 0" and value == 0)):
            sys.exit(f"error: --{name.replace('_', '-')} {value}: it must be a finite number {rule}")


def main(args: Args):
    settle_defaults(args)  # --bf16, where not given
    check_args(args)
    note_overwrite(args.output_dir)
    torch.set_num_threads(cpu_threads(args.threads))
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    random.seed(args.seed)  # the data order
    torch.manual_seed(args.seed)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    amp = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)  # noqa: E731

    # The tokenizer (fast, and it checks the model path) and the data come before the model
    hint = "run `python sft.py` first" if args.model_name_or_path == "models/sft" else "pass an existing directory or a hub id"
    tokenizer = load_tokenizer(args.model_name_or_path, hint)
    stop_ids = stop_token_ids(tokenizer)
    save_dtype = save_dtype_of(args, args.model_name_or_path)
    train_rows, eval_rows = load_data(args, preference_row, args.num_train_pairs,
                                      [("prompt", "chosen", "rejected"), ("chosen", "rejected")],
                                      "needs chosen and rejected (and optionally prompt and margin)")
    has_margin = any(row.get("margin") is not None for row in train_rows + eval_rows)
    # (chosen sequence, rejected sequence, margin, row): prompt + completion each, and 0 where a row has no margin
    train, evals = ([(p + c, p + r, float(row.get("margin") or 0.0), row) for p, c, r, row in
                     tokenize_pairs(tokenizer, rows, stop_ids, args.max_length, split)]
                    for rows, split in ((train_rows, "train"), (eval_rows, "eval")))
    model = load_no_dropout(args.model_name_or_path, "score")
    prepare_models(tokenizer, stop_ids, [model])
    model = model.to(device)
    writer = SummaryWriter(run_name(args))
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters, {len(train):,} training pairs")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    def pair_rewards(batch):
        """Chosen and rejected sequences in one forward pass: (r_chosen, r_rejected, margin or None)."""
        sequences = [c for c, _, _, _ in batch] + [r for _, r, _, _ in batch]
        # collate's labels go unused: a reward model scores each sequence's last token
        input_ids, attention_mask, _ = (t.to(device)
                                        for t in collate([(s, s) for s in sequences], tokenizer.pad_token_id))
        with amp():
            rewards = sequence_rewards(model, input_ids, attention_mask)
        margin = torch.tensor([m for _, _, m, _ in batch], device=device) if has_margin else None
        return rewards[: len(batch)], rewards[len(batch) :], margin

    model.train()
    order, position = list(range(len(train))), len(train)
    start_time, model_time, tokens_seen = time.time(), 0.0, 0
    progress = Progress(args.max_steps, "steps", args.progress)
    for step in range(1, args.max_steps + 1):
        if position + args.batch_size > len(order):  # a new pass over the data, reshuffled
            random.shuffle(order)
            position = 0
        batch = [train[i] for i in order[position : position + args.batch_size]]
        position += args.batch_size
        lr = get_lr(step - 1, args.lr, args.warmup_steps, args.max_steps, "linear")
        optimizer.param_groups[0]["lr"] = lr

        # ---- update: the chosen completion's reward above the rejected one's ----------------------
        tick = time.time()
        r_c, r_r, margin = pair_rewards(batch)
        loss = bradley_terry_loss(r_c, r_r, margin, args.center_rewards_coefficient)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        check_finite(step, loss=loss, grad_norm=grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model_time += time.time() - tick
        tokens_seen += sum(len(c) + len(r) for c, r, _, _ in batch)

        # ---- log and evaluate -----------------------------------------------------------------------
        if step % 10 == 0:
            elapsed = time.time() - start_time
            writer.add_scalar("losses/loss", loss.item(), step)
            writer.add_scalar("train/grad_norm", float(grad_norm), step)
            chosen, rejected = r_c.sum().item(), r_r.sum().item()
            writer.add_scalar("train/accuracy", (r_c > r_r).sum().item() / len(batch), step)
            writer.add_scalar("train/reward_chosen", chosen / len(batch), step)
            writer.add_scalar("train/reward_rejected", rejected / len(batch), step)
            writer.add_scalar("train/margin", (chosen - rejected) / len(batch), step)
            writer.add_scalar("charts/learning_rate", lr, step)
            writer.add_scalar("charts/samples_per_second", step * args.batch_size / elapsed, step)
            writer.add_scalar("charts/tokens_per_second", tokens_seen / elapsed, step)
            writer.add_scalar("charts/model_time_fraction", model_time / elapsed, step)
        progress(step)
        if (step % args.eval_every == 0 or step == args.max_steps) and evals:
            evaluate(model, pair_rewards, evals, args, writer, step)

    save_model(model, tokenizer, args, args.output_dir, save_dtype)
    print(f"saved to {args.output_dir}")
    writer.close()


@torch.no_grad()
def evaluate(model, pair_rewards, evals, args, writer, step):
    """The loss and accuracy on held-out pairs; on the built-in task also how well the learned reward tracks the
    gold one over every held-out candidate (Pearson's r), which an accuracy on pairs cannot show."""
    model.eval()
    chosen, rejected, margins = [], [], []
    for i in range(0, len(evals), args.batch_size):
        r_c, r_r, margin = pair_rewards(evals[i : i + args.batch_size])
        chosen.append(r_c), rejected.append(r_r), margins.append(margin)
    chosen, rejected = torch.cat(chosen), torch.cat(rejected)
    margin = torch.cat(margins) if margins[0] is not None else None
    loss, accuracy = bradley_terry_loss(chosen, rejected, margin).item(), (chosen > rejected).float().mean().item()
    writer.add_scalar("eval/loss", loss, step)
    writer.add_scalar("eval/accuracy", accuracy, step)
    line = f"step {step}: eval/loss {loss:.4f}, eval/accuracy {accuracy:.3f}"
    if args.dataset_name is None:
        x = torch.cat([chosen, rejected]).double().cpu()
        y = torch.tensor([gold_score(row[k], row["target"]) for k in ("chosen", "rejected") for *_, row in evals]).double()
        correlation = torch.corrcoef(torch.stack([x, y]))[0, 1].item()
        writer.add_scalar("eval/gold_correlation", correlation, step)
        line += f", eval/gold_correlation {correlation:.3f}"
    print(line)
    model.train()


# =============================================================================================
# Plumbing: the built-in task, tokenization, data and model loading, forward passes, saving. Each
# definition below is pasted from the scripts that share it, one text in all of them
# (tests/test_copies.py checks each), and this file holds only those its main reaches. A reader learning
# the algorithm can stop here.
# =============================================================================================


# ---------------------------------------------------------------------------------------------
# The built-in task: sort the digits. The gold reward is known exactly, so every stage is measured
# against it: SFT learns from a sloppy demonstrator, the reward model from noisy preference pairs.
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


def candidate(rng, target):
    """A candidate for preference pairs: the target, or with probability 0.5 one or two corruptions."""
    if rng.random() < 0.5:
        return target
    for _ in range(rng.randint(1, 2)):
        target = corrupt(rng, target)
    return target


def preference_row(rng):
    """A row of the reward model's and DPO's data: two candidates for one prompt with different gold scores,
    the better one chosen."""
    prompt, target = make_prompt(rng)
    while True:
        a, b = candidate(rng, target), candidate(rng, target)
        if gold_score(a, target) != gold_score(b, target):
            chosen, rejected = (a, b) if gold_score(a, target) > gold_score(b, target) else (b, a)
            return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "target": target}


def task_rows(seed, split, n, task_row):
    """n rows of the built-in task in TRL's formats, each made by `task_row` (demonstration_row, preference_row
    or prompt_row) with its `target`. Train and eval rows come from different random streams of the same seed."""
    rng = random.Random(f"sort-task/{seed}/{split}")
    return [task_row(rng) for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# Tokenization as the model expects it, one text for every script, so that the reward model scores
# exactly the token sequences SFT trained on and PPO, DPO and GRPO produce. Data rows are in TRL's
# formats: text, or conversations (lists of {"role", "content"} messages) rendered by the chat template.
# ---------------------------------------------------------------------------------------------
def render_chat(tokenizer, messages, add_generation_prompt=False, tools=None):
    """Token ids of a conversation rendered by the tokenizer's chat template, with the JSON schemas of `tools`
    (a row's `tools` column, TRL's) where there are any."""
    if tokenizer.chat_template is None:
        sys.exit("error: the data is conversational (lists of role/content messages) but the tokenizer has no "
                 "chat template; use a chat model's tokenizer, or text data")
    ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in transformers 5


def encode_prompt(tokenizer, prompt):
    """A prompt's token ids: a conversation through the chat template, ending with the assistant's header;
    a text with BOS first where the tokenizer prepends one (Llama, Mistral, Gemma), and never the EOS that
    T5-style tokenizers append as their special token."""
    if isinstance(prompt, list):
        return render_chat(tokenizer, prompt, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    if bos is not None and tokenizer("")["input_ids"][:1] == [bos] and ids[:1] != [bos]:
        ids = [bos] + ids
    return ids


def stop_token_ids(tokenizer):
    """The tokens that end a completion: EOS, and the chat template's end-of-turn token when it is another
    one (ChatML's <|im_end|>, Llama 3's <|eot_id|>). One set for the SFT labels, sampling, the response
    mask, the reward model's scoring position and the missing-EOS penalty."""
    if tokenizer.eos_token_id is None:
        sys.exit("error: the tokenizer has no EOS token, so completions cannot end; set tokenizer.eos_token and save it")
    stops = [tokenizer.eos_token_id]
    if tokenizer.chat_template is not None:
        turn = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
        try:
            full = render_chat(tokenizer, turn)
            header = render_chat(tokenizer, turn[:1], add_generation_prompt=True)
        except Exception:  # noqa: BLE001  a template that cannot render this probe: EOS alone
            return stops
        special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        end_of_turn = next((t for t in full[len(header) :] if t in special), None)
        if end_of_turn is not None and end_of_turn not in stops:
            stops.append(end_of_turn)
    return stops


def tokenize_pair(tokenizer, prompt, completion, stop_ids):
    """(prompt_ids, completion_ids), the completion ending with a stop token. A text completion is
    tokenized on its own, EOS appended. A conversational one (assistant messages after a conversational
    prompt) is what the chat template adds to the prompt's rendering, up to and including its first stop
    token: what a template writes after it (a newline) is never sampled, so it is not trained on either."""
    prompt_ids = encode_prompt(tokenizer, prompt)
    if not isinstance(completion, list):
        return prompt_ids, tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    full = render_chat(tokenizer, prompt + completion)
    if full[: len(prompt_ids)] != prompt_ids:
        sys.exit("error: the chat template renders a conversation's start differently once a reply follows, so "
                 "prompt and completion tokens cannot be told apart; use text prompt/completion data")
    completion_ids = full[len(prompt_ids) :]
    ends = [i for i, t in enumerate(completion_ids) if t in stop_ids]
    return prompt_ids, completion_ids[: ends[0] + 1] if ends else completion_ids + [tokenizer.eos_token_id]


def add_pad_token(tokenizer, stop_ids, *models):
    """Make sure the tokenizer has a pad token that is no stop token, so that masking padding never masks
    an EOS the model must learn. Reuse an unused special token where the tokenizer has one (Llama 3's
    <|finetune_right_pad_id|>, reserved or unused tokens), else add <|pad|>. Grow the embeddings only where
    an id does not fit (to a multiple of 64), never shrink a vocabulary padded for speed, and give the new
    rows the mean of the old ones: the same in every model, so that a policy and its reference stay equal
    (transformers' default draws them at random, differently in each)."""
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id in stop_ids:
        taken = set(stop_ids) | {tokenizer.bos_token_id, tokenizer.unk_token_id}
        unused = [t.content for i, t in sorted(tokenizer.added_tokens_decoder.items())
                  if t.special and i not in taken and t.content not in (tokenizer.chat_template or "")]
        preferred = [c for c in unused if "pad" in c.lower()] + [c for c in unused if "reserved" in c or "unused" in c]
        tokenizer.add_special_tokens({"pad_token": preferred[0] if preferred else "<|pad|>"})
    needed = max(len(tokenizer), tokenizer.pad_token_id + 1)  # an added token's id can lie past len(tokenizer)
    for model in models:
        rows = model.get_input_embeddings().num_embeddings
        if needed > rows:
            model.resize_token_embeddings(needed, pad_to_multiple_of=64, mean_resizing=False)
            with torch.no_grad():
                for embedding in {model.get_input_embeddings(), model.get_output_embeddings()} - {None}:
                    embedding.weight[rows:] = embedding.weight[:rows].mean(0)


def tokenize_preference(tokenizer, row, stop_ids):
    """(prompt_ids, chosen_ids, rejected_ids) of a preference row in any of TRL's formats: explicit
    (`prompt`, `chosen`, `rejected`) or implicit (`chosen` and `rejected` each include the prompt), text or
    conversational. An implicit prompt is what the two share at the start, as in TRL: whole messages of
    a conversation, whole tokens of a text (so a word is never split and keeps its leading space)."""
    prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
    if not prompt and isinstance(chosen, list):
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    elif not prompt:
        c, r = encode_prompt(tokenizer, chosen), encode_prompt(tokenizer, rejected)
        n = len(os.path.commonprefix([c, r]))
        return c[:n], c[n:] + [tokenizer.eos_token_id], r[n:] + [tokenizer.eos_token_id]
    prompt_ids, chosen_ids = tokenize_pair(tokenizer, prompt, chosen, stop_ids)
    return prompt_ids, chosen_ids, tokenize_pair(tokenizer, prompt, rejected, stop_ids)[1]


def tokenize_pairs(tokenizer, rows, stop_ids, max_length, split):
    """[(prompt_ids, chosen_ids, rejected_ids, row)] of the preference rows that fit `max_length`: a pair whose
    longer side does not fit, or whose sides are the same tokens, is dropped (and counted) rather than cut, so
    no fake EOS and no zero-gradient pair is trained on."""
    kept, too_long, same, lengths = [], 0, 0, []
    for row in rows:
        prompt_ids, chosen_ids, rejected_ids = tokenize_preference(tokenizer, row, stop_ids)
        lengths.append(len(prompt_ids) + max(len(chosen_ids), len(rejected_ids)))
        if lengths[-1] > max_length:
            too_long += 1
        elif chosen_ids == rejected_ids:
            same += 1
        else:
            kept.append((prompt_ids, chosen_ids, rejected_ids, row))
    if too_long or same:
        print(f"{split}: dropped {too_long:,} of {len(rows):,} pairs longer than --max-length {max_length} (the "
              f"longest: {max(lengths):,} tokens), {same:,} whose chosen and rejected are the same tokens")
    if not kept and split == "train" and too_long:
        sys.exit(f"error: no training pair fits --max-length {max_length}: they have {min(lengths):,} to "
                 f"{max(lengths):,} tokens; raise --max-length (TRL's default: 1024)")
    if not kept and split == "train":
        sys.exit("error: no training pair is left (see above); check the data")
    return kept


# ---------------------------------------------------------------------------------------------
# Data and models
# ---------------------------------------------------------------------------------------------
def first_line(e):
    """An exception's message as one line, for a one-line error: its first line, or the exception's type when
    the message is empty."""
    return (str(e).splitlines() or [type(e).__name__])[0]


def offline_unless_the_hub_answers(name):
    """Before hub id `name` is fetched: when the hub does not answer within 3 s, this process works offline, as
    HF_HUB_OFFLINE=1 makes it (what the local cache holds loads; what it lacks fails at once, not after half a
    minute of retries). Returns what the error line of a failed load adds: the way out, when offline."""
    import huggingface_hub.constants as hub

    proxy = any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"))
    if not hub.HF_HUB_OFFLINE and not proxy:  # behind a proxy the hub is not reached directly
        url = urllib.parse.urlparse(hub.ENDPOINT)
        try:
            socket.create_connection((url.hostname, url.port or 443), timeout=3).close()
        except OSError:
            import datasets.config

            hub.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    return (f"; offline (the hub does not answer, or HF_HUB_OFFLINE=1) only the local cache is read, and it lacks "
            f"{name!r}: pass a local directory, or download it where there is a network" if hub.HF_HUB_OFFLINE else "")


def load_rows(name, config, split):
    """(the rows of `split`, the rows of a `test` split or None, place) of a dataset: a .jsonl or .json file
    (read here, so that an error names its line), a .parquet file, a `save_to_disk` directory or a hub id
    (with its config name, if it has several: gsm8k "main"). `place(i, split)` names row i in an error line."""
    import datasets

    datasets.disable_progress_bars()
    if name.endswith((".json", ".jsonl")) and os.path.isfile(name):
        data, lines = read_json_rows(name)
        place = lambda i, split: f"{name}, line {lines[i]}" if lines else f"{name}, row {i + 1}"  # noqa: E731
    else:
        offline = ""
        try:
            if name.endswith((".json", ".jsonl", ".parquet")):  # a missing file: "Unable to find ..."
                data = datasets.load_dataset("parquet" if name.endswith(".parquet") else "json", data_files=name)
            elif os.path.isdir(name) and os.path.exists(os.path.join(name, "dataset_dict.json")):
                data = datasets.load_from_disk(name)
            else:
                offline = offline_unless_the_hub_answers(name)
                data = datasets.load_dataset(name, config)
        except Exception as e:  # noqa: BLE001  any loading failure becomes one line
            sys.exit(f"error: cannot load dataset {name!r}: {first_line(e).rstrip('.')}{offline}")
        place = lambda i, split: f"dataset {name!r}, split {split!r}, row {i + 1}"  # noqa: E731
    if split not in data:
        sys.exit(f"error: dataset {name!r} has the splits {list(data)}; pass one of them as --dataset-split")
    rows = list(data[split])
    if not rows:
        sys.exit(f"error: split {split!r} of dataset {name!r} has no rows")
    return rows, list(data["test"]) if "test" in data and split != "test" else None, place


def read_json_rows(path):
    """({"train": rows}, the .jsonl line of each row or None) of a .jsonl file, or of a .json file holding a list
    of rows or an object of columns; every row has every column, None where it has none (as datasets reads
    them). An empty file, or a line that is not JSON or not an object, is one line naming the file and line."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    rows, lines, number = [], [], 0  # number: the .jsonl line read last
    try:
        if path.endswith(".jsonl"):
            for number, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    rows.append(json.loads(line))
                    lines.append(number)
                    if not isinstance(rows[-1], dict):
                        sys.exit(f"error: {path}, line {number}: a JSON {type(rows[-1]).__name__}, not an object")
        else:
            rows, lines = json.loads(text), None
            if isinstance(rows, dict) and all(isinstance(column, list) for column in rows.values()):
                rows = [dict(zip(rows, values)) for values in zip(*rows.values())]  # an object of columns
            if not isinstance(rows, list) or not all(isinstance(row, dict) for row in rows):
                sys.exit(f"error: {path} holds neither a list of rows (JSON objects) nor an object of columns")
    except json.JSONDecodeError as e:
        sys.exit(f"error: {path}, line {number or e.lineno}: not JSON ({e.msg}, column {e.colno})")
    if not rows:
        sys.exit(f"error: {path} has no rows")
    columns = dict.fromkeys(column for row in rows for column in row)
    return {"train": [{column: row.get(column) for column in columns} for row in rows]}, lines


def row_problem(row, columns):
    """What is wrong with a row's `columns`, in words, or None: a field missing or null, empty, or neither text
    nor a conversation (a list of {"role", "content"} messages with a known role), or text in one field and a
    conversation in another. `text` must be text, `messages` a conversation and `label` true or false (KTO's)."""
    kinds, roles = {}, ("system", "developer", "user", "assistant", "tool")
    for column in columns:
        value = row.get(column)
        if value is None:
            return f"no `{column}` (missing or null)"
        if column == "label" and isinstance(value, bool):  # KTO's unpaired format: a thumbs up or down
            continue
        if isinstance(value, str) and column not in ("messages", "label"):
            kinds[column] = "text"
        elif isinstance(value, list) and column not in ("text", "label"):
            for j, message in enumerate(value, 1):
                if not isinstance(message, dict):
                    return f"`{column}`, message {j} is a {type(message).__name__}, not a {{role, content}} object"
                if message.get("role") not in roles:
                    return f"`{column}`, message {j}: {message.get('role')!r} is not a role ({', '.join(roles)})"
                if not isinstance(message.get("content"), str) and "tool_calls" not in message:
                    return f"`{column}`, message {j}: its `content` is not text"
            kinds[column] = "a conversation"
        else:
            kind = {"text": "text", "messages": "a list of messages", "label": "true or false"}.get(
                column, "text or a list of messages")
            name = {"int": "a number", "float": "a number", "dict": "an object", "str": "text"}.get(type(value).__name__)
            return f"`{column}` is {name or 'a ' + type(value).__name__}" + f" ({value})" * (name == "a number") + \
                f", not {kind}"
        if not value:
            return f"`{column}` is empty"
    if len(set(kinds.values())) > 1:
        return " but ".join(f"`{column}` is {kind}" for column, kind in kinds.items()) + "; a row is all one kind"
    return None


def load_data(args, task_row, num_train, accepts, needs):
    """(train rows, eval rows): the built-in task's rows (`task_row` makes one) when no --dataset-name is given,
    else the dataset's, each checked (row_problem) in the first set of columns in `accepts` the dataset has all
    of (`needs` says so in words). The eval rows are its `test` split, or else --eval-size rows of the split (a
    tenth at most) drawn at random with --seed and held out: a sorted file's first rows are not like the rest."""
    if args.dataset_name is None:
        return task_rows(args.seed, "train", num_train, task_row), task_rows(args.seed, "eval", args.eval_size, task_row)
    rows, test, place = load_rows(args.dataset_name, args.dataset_config, args.dataset_split)
    columns = next((accepted for accepted in accepts if set(rows[0]) >= set(accepted)), None)
    if columns is None:
        sys.exit(f"error: dataset {args.dataset_name!r} has columns {sorted(rows[0])}; {os.path.basename(__file__)} "
                 f"{needs}")
    for split, part in ((args.dataset_split, rows), ("test", (test or [])[: args.eval_size])):
        for i, row in enumerate(part):
            if problem := row_problem(row, columns):
                sys.exit(f"error: {place(i, split)}: {problem} ({os.path.basename(__file__)} {needs})")
    if test is not None:
        return rows, test[: args.eval_size]
    held_out = random.Random(args.seed).sample(range(len(rows)), min(args.eval_size, len(rows) // 10))
    return [rows[i] for i in sorted(set(range(len(rows))) - set(held_out))], [rows[i] for i in held_out]


def load_tokenizer(path, hint):
    """The tokenizer of a hub id or local directory. A local path that does not exist, or a checkpoint that
    cannot be read, is one line (`hint` says what to do about a missing directory)."""
    from transformers import AutoTokenizer

    if not os.path.isdir(path) and (path.startswith((".", "/", "~", "models/")) or path.count("/") > 1):
        sys.exit(f"error: model directory {path!r} does not exist; {hint}")
    offline = "" if os.path.isdir(path) else offline_unless_the_hub_answers(path)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        sys.exit(f"error: cannot load a tokenizer from {path!r}: {first_line(e).rstrip('.')}{offline}")


def load_no_dropout(path, head):
    """A checkpoint with every dropout off, for models whose log-probs, values and scores must not be random
    (Llama's and Qwen2's attention dropout is no nn.Dropout but a number each layer reads from the config): a
    causal LM (head "lm") or one with a scalar head (head "score": a sequence classifier with one label, its head
    new when the checkpoint has none). Its weights in float32 whatever they were saved in: AdamW needs float32
    master weights (in fp16 its eps underflows to 0, in bf16 most small updates round away); --bf16 is the
    mixed-precision choice on top."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    try:
        config = AutoConfig.from_pretrained(path, **({"num_labels": 1} if head == "score" else {}))
        for key, value in list(vars(config).items()):
            if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
                setattr(config, key, 0.0)
        model_class = AutoModelForCausalLM if head == "lm" else AutoModelForSequenceClassification
        return model_class.from_pretrained(path, config=config, dtype=torch.float32)
    except (OSError, ValueError) as e:
        sys.exit(f"error: cannot load a model from {path!r}: {first_line(e)}")


def prepare_models(tokenizer, stop_ids, models, frozen=()):
    """Give the tokenizer a pad token (growing the models' embeddings if it needs a new id) and tell every
    model its id; the `frozen` ones among them go to eval mode without gradients. The models stay where they are
    (the CPU): the caller puts them on the device."""
    add_pad_token(tokenizer, stop_ids, *models)
    for model in models:
        model.config.pad_token_id = tokenizer.pad_token_id
    for model in frozen:
        model.eval().requires_grad_(False)


def save_dtype_of(args, path):
    """The dtype a trained model is saved in: --save-dtype, or else that of the checkpoint at `path` (float32
    for a model built from scratch), so that a bf16 checkpoint comes back in bf16, not twice its size."""
    from transformers import AutoConfig

    if args.save_dtype is not None:
        if args.save_dtype not in ("float32", "bfloat16", "float16"):
            sys.exit(f"error: --save-dtype {args.save_dtype!r}: choose float32, bfloat16 or float16")
        return getattr(torch, args.save_dtype)
    dtype = AutoConfig.from_pretrained(path).dtype if path is not None else None
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype or torch.float32


# ---------------------------------------------------------------------------------------------
# Forward passes and sampling
# ---------------------------------------------------------------------------------------------
def collate(batch, pad_token_id):
    """Right-pad a list of (input_ids, labels): (input_ids, attention_mask, labels) tensors, labels −100 on padding."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.tensor([ids + [pad_token_id] * (width - len(ids)) for ids, _ in batch])
    attention_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
    labels = torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in batch])
    return input_ids, attention_mask, labels


def position_ids_of(attention_mask):
    """Positions count real tokens only, so left padding does not shift them."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def last_token_index(attention_mask):
    """Index of the last non-pad token of each row, under left or right padding: the largest position
    whose mask is 1 (for right padding, the number of tokens − 1)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (positions * attention_mask).argmax(-1)


def scalar_head(model, input_ids, attention_mask):
    """A sequence classifier's scalar head on every position, [batch, length], computed in float32 (a value or a
    reward is one number: it gets float32's precision, not bfloat16's 3 digits)."""
    # use_cache=False: a pass that does not sample keeps no KV cache (transformers makes one by default)
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids_of(attention_mask), use_cache=False).last_hidden_state
    head = model.score
    with torch.autocast(hidden.device.type, enabled=False):
        return F.linear(hidden.float(), head.weight.float(), None if head.bias is None else head.bias.float()).squeeze(-1)


def sequence_rewards(model, input_ids, attention_mask):
    """One reward per sequence: the scalar head at the sequence's last token (the stop token)."""
    scores = scalar_head(model, input_ids, attention_mask)
    return scores[torch.arange(len(scores), device=scores.device), last_token_index(attention_mask)]


# ---------------------------------------------------------------------------------------------
# Training and saving
# ---------------------------------------------------------------------------------------------
def settle_lengths(args, lengths):
    """The length flags not given (None), before the argument checks: {flag: (on the built-in task, on a
    dataset)}; a dataset's is TRL's default, or None where settle_room later measures it on the data and the model."""
    for name, (task, data) in lengths.items():
        if getattr(args, name) is None:
            setattr(args, name, task if args.dataset_name is None else data)


def run_name(args):
    """runs/<exp>__<seed>__<time>, with the last part of --output-dir after <exp> where it is given and not <exp>: the
    runs of one script that train different models tell apart in TensorBoard (runs/sft__reverse-sft__1__<time>)."""
    output = os.path.basename(os.path.normpath(args.output_dir))
    given = f"__{output}" if args.output_dir != Args.output_dir and output != args.exp_name else ""
    return f"runs/{args.exp_name}{given}__{args.seed}__{int(time.time())}"


def settle_defaults(args):
    """The defaults that depend on the machine, settled before the argument checks (and logged as settled): --bf16
    on where CUDA has bfloat16, as in TRL's configs; on the CPU float32 is faster."""
    if args.bf16 is None:
        args.bf16 = args.cuda and torch.cuda.is_available() and torch.cuda.is_bf16_supported()


def get_lr(step, lr, warmup_steps, max_steps, decay):
    """Learning rate of optimizer step `step` = 0, 1, ...: `lr` × a linear warmup min(1, (step + 1) / warmup_steps)
    × a decay to 0 at `max_steps`: "linear", min(1, (max_steps − step) / (max_steps − warmup_steps)), flat through
    the warmup; or "cosine", ½(1 + cos(π · step / max_steps)), over the whole run."""
    warmup = min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    if decay == "linear":
        return lr * warmup * min(1.0, max(0.0, (max_steps - step) / max(1, max_steps - warmup_steps)))
    return lr * warmup * 0.5 * (1 + math.cos(math.pi * min(1.0, step / max_steps)))


def settle_warmup(args, default, decay):
    """--warmup-steps where not given: `default`, or a tenth of --max-steps where that is fewer. Given, it must end
    before the run does: a run that never leaves its warmup never trains at --lr (one line, before any work)."""
    if args.warmup_steps is None:
        args.warmup_steps = max(0, min(default, args.max_steps // 10))
    elif args.warmup_steps >= args.max_steps >= 1:
        peak = max(get_lr(step, 1.0, args.warmup_steps, args.max_steps, decay) for step in range(args.max_steps))
        sys.exit(f"error: --warmup-steps {args.warmup_steps} ≥ --max-steps {args.max_steps}: the run would end in its "
                 f"warmup, the learning rate at most {peak:.0%} of --lr; lower --warmup-steps or raise --max-steps")


class Progress:
    """A line every ~10 s on a terminal: the steps done of `total`, their rate, the time left at that rate, and a
    note (the RL scripts: their recent return). Silent where stdout is not a terminal (a log file, CI) or with
    --no-progress, so that a log holds the run's own lines only. `done`: the steps a resumed run starts from."""

    def __init__(self, total, unit, on, done=0, every=10.0):
        self.total, self.unit, self.first, self.every = total, unit, done, every
        self.on, self.start = on and sys.stdout.isatty(), time.time()
        self.last = self.start

    def __call__(self, done, note=""):
        now = time.time()
        if self.on and now - self.last >= self.every and done > self.first:
            rate = (done - self.first) / (now - self.start)
            left = datetime.timedelta(seconds=round((self.total - done) / rate))
            speed = f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}"
            print(f"{done:,}/{self.total:,} {self.unit} ({done / self.total:.0%}), {speed} {self.unit}/s, {left} left"
                  + f", {note}" * bool(note))
            self.last = now


def check_finite(step, **values):
    """Stop the run with one line, before anything is saved, when a loss or gradient norm is NaN or inf."""
    for name, tensor in values.items():
        value = float(torch.as_tensor(tensor).detach())
        if not math.isfinite(value):
            sys.exit(f"error: {name} is {value} at step {step}; stopped, nothing saved "
                     "(lower --lr; with a half-precision model, train without --bf16 to check)")


def save_model(model, tokenizer, args, output_dir, dtype):
    """Save a Hugging Face model, its weights in `dtype` (save_dtype_of), with its tokenizer and the flags
    (training_args.json): written to a temporary directory, then renamed, so that a crash never leaves a
    half-written checkpoint."""
    tmp_dir = f"{output_dir.rstrip('/')}.tmp-{os.getpid()}"
    try:
        model.to(dtype).save_pretrained(tmp_dir)  # config.json says the dtype; a tied weight is saved once
        tokenizer.save_pretrained(tmp_dir)
        with open(os.path.join(tmp_dir, "training_args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
        shutil.rmtree(output_dir, ignore_errors=True)
        os.replace(tmp_dir, output_dir)
    except OSError as e:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        sys.exit(f"error: cannot write the checkpoint to {output_dir!r}: {e}; nothing was saved")


def note_overwrite(output_dir):
    """One line before any work when --output-dir already holds a model: this run replaces it when it ends, and
    a later stage reads that directory, so the run says so rather than replace another run's model silently."""
    if os.environ.get("RANK", "0") != "0" or not any(os.path.exists(os.path.join(output_dir, name))
                                                      for name in ("config.json", "adapter_config.json")):
        return
    saved = time.strftime("%Y-%m-%d %H:%M", time.localtime(os.path.getmtime(output_dir)))
    try:
        with open(os.path.join(output_dir, "training_args.json")) as f:
            flags = json.load(f)
        length = next((f" --{k.replace('_', '-')} {flags[k]}" for k in ("max_steps", "num_iterations") if k in flags),
                      "")
        by = f" by a run of {flags.get('exp_name', '?')}{length}"
    except (OSError, ValueError):
        by = ""
    print(f"note: --output-dir {output_dir} holds a model saved {saved}{by}; this run replaces it when it ends")


def cpu_threads(threads):
    """--threads, or by default OMP_NUM_THREADS where it is set (torchrun sets 1 per rank), else one fewer than the
    cores this process may run on, at least 1."""
    if threads:
        return threads
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return int(os.environ["OMP_NUM_THREADS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores - 1)


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
