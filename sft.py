"""Supervised fine-tuning (RLHF stage 1a): next-token cross-entropy on the completion only.

By default, offline: a tiny GPT-2 built from a config learns the built-in `sort <digits>:` task from
a sloppy demonstrator (half its answers have one adjacent swap), so every later stage can be measured
against an exact gold reward. The same program fine-tunes a real model on a real dataset:

    python sft.py                                                    # built-in task, ~100 s on 2 CPU cores
    python sft.py --model-name-or-path Qwen/Qwen2.5-0.5B --dataset-name trl-lib/Capybara --lr 2e-5 --bf16
    python sft.py --dataset-name data.jsonl --model-name-or-path models/sft

Datasets in TRL's formats: `prompt`/`completion` as text or conversations (loss on the completion and
its stop token), `text` (loss on every token) or `messages` (chat template; loss on the assistant
turns). A checkpoint saved in bf16 or fp16 is trained in float32 (master weights); `--bf16` adds mixed
precision.
"""
import gc
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
import tyro
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel
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
    """sequences per optimizer step, over all ranks: each of N ranks (torchrun) takes batch_size / N of them"""
    gradient_accumulation_steps: int = 1
    """split each rank's share of a batch into this many micro-batches (the same update, less memory)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass (less memory, one more forward pass of compute)"""
    eval_batch_size: int = 128
    """examples or prompts per forward pass (and per generate call) in evaluation, on each rank"""
    lr: float = 3e-3
    """peak learning rate of AdamW (a pretrained model wants ~1e-5 to 2e-5; TRL: learning_rate)"""
    warmup_steps: int = 100
    """linear warmup steps (0: none), times a cosine decay to 0 over the whole run"""
    weight_decay: float = 0.01
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """clip the global gradient norm to this"""
    max_length: int = 64
    """longest sequence in tokens: longer prompt/completion and messages examples are dropped (and counted);
    `text` examples are cut to it"""
    bf16: bool = False
    """mixed precision: forward and backward autocast to bfloat16 (CUDA or CPU); weights and AdamW state stay float32"""
    fsdp: bool = False
    """under torchrun, shard the model, its gradients and AdamW state across the ranks (FSDP2) instead of a full
    copy on each (DDP): for models whose training state does not fit one device"""
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
# tests/test_copies.py checks the copies agree.)
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
# The loss: a pure function, checked against hand-computed values in tests/test_sft.py
# ---------------------------------------------------------------------------------------------
def sft_loss(logits, labels, num_items=None):
    """Cross-entropy of the next-token predictions on the labeled tokens (completion and its stop token;
    the prompt and the padding carry the label −100):

        L = −(1/N) Σ_{t: y_t ≠ −100} log p_θ(y_t | x_<t)

    N is the number of labeled tokens in the whole batch: pass it as `num_items` when the batch is
    split into micro-batches, so that every token weighs the same whatever micro-batch it is in.
    """
    shift_logits, shift_labels = logits[:, :-1], labels[:, 1:]
    nll = F.cross_entropy(shift_logits.reshape(-1, shift_logits.size(-1)).float(), shift_labels.reshape(-1),
                          ignore_index=-100, reduction="sum")
    return nll / (num_items if num_items is not None else (shift_labels != -100).sum())


# ---------------------------------------------------------------------------------------------
# Tokenization as the model expects it. The same text in sft.py, reward_model.py, rlhf_ppo.py, dpo.py
# and grpo.py (tests check the copies), so that the reward model scores exactly the token sequences SFT
# trained on and PPO, DPO and GRPO produce. Data rows are in TRL's formats: text, or conversations (lists of
# {"role", "content"} messages) rendered by the tokenizer's chat template.
# ---------------------------------------------------------------------------------------------
def render_chat(tokenizer, messages, add_generation_prompt=False):
    """Token ids of a conversation rendered by the tokenizer's chat template."""
    if tokenizer.chat_template is None:
        sys.exit("error: the data is conversational (lists of role/content messages) but the tokenizer has no "
                 "chat template; use a chat model's tokenizer, or text data")
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
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
    <|finetune_right_pad_id|>, reserved or unused tokens), else add <|pad|>; grow the embeddings only if
    the new id does not fit (to a multiple of 64), and never shrink a vocabulary padded for speed."""
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id not in stop_ids:
        return
    taken = set(stop_ids) | {tokenizer.bos_token_id, tokenizer.unk_token_id}
    unused = [t.content for i, t in sorted(tokenizer.added_tokens_decoder.items())
              if t.special and i not in taken and t.content not in (tokenizer.chat_template or "")]
    preferred = [c for c in unused if "pad" in c.lower()] + [c for c in unused if "reserved" in c or "unused" in c]
    tokenizer.add_special_tokens({"pad_token": preferred[0] if preferred else "<|pad|>"})
    for model in models:
        if len(tokenizer) > model.get_input_embeddings().num_embeddings:
            model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)


def tokenize(example, tokenizer, stop_ids):
    """(input_ids, labels) of one example, labels −100 where no loss is taken:
    prompt/completion (text or conversational): the loss on the completion and its stop token;
    text: on every token, EOS appended; messages: on each assistant turn up to its stop token."""
    if example.get("messages") is not None:
        messages, ids, labels, stopped = example["messages"], [], [], True
        for i, message in enumerate(messages):
            renders = [render_chat(tokenizer, messages[: i + 1])]
            if message["role"] == "assistant":  # the assistant header is prompt, not completion
                renders.insert(0, render_chat(tokenizer, messages[:i], add_generation_prompt=True))
            for full in renders:
                # Each render must extend the previous one. Templates that re-render earlier turns once later
                # ones exist (e.g. dropping past reasoning) break this, and the labels would be misplaced.
                if full[: len(ids)] != ids:
                    sys.exit("error: the chat template renders earlier turns differently once later turns exist (e.g. "
                             "it drops past reasoning), so assistant turns cannot be labeled; split each conversation "
                             "into prompt/completion rows, one per assistant turn")
                new, ids = full[len(ids) :], full
                if full is renders[-1] and message["role"] == "assistant":
                    ends = [j for j, t in enumerate(new) if t in stop_ids]
                    n, stopped = (ends[0] + 1, True) if ends else (len(new), False)
                    labels += new[:n] + [-100] * (len(new) - n)
                else:
                    labels += [-100] * len(new)
        if not stopped and messages[-1]["role"] == "assistant":  # a template with no end-of-turn token: EOS ends the reply
            ids, labels = ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]
        return ids, labels
    if example.get("prompt") is not None and example.get("completion") is not None:
        prompt_ids, completion_ids = tokenize_pair(tokenizer, example["prompt"], example["completion"], stop_ids)
        return prompt_ids + completion_ids, [-100] * len(prompt_ids) + completion_ids
    ids = encode_prompt(tokenizer, example["text"]) + [tokenizer.eos_token_id]
    return ids, list(ids)


# ---------------------------------------------------------------------------------------------
# Loading and training helpers, the same text in every LM script (tests check the copies)
# ---------------------------------------------------------------------------------------------
def load_rows(name, split, eval_size):
    """(train rows, eval rows) of a dataset: a hub id, a `save_to_disk` directory or a .json/.jsonl/.parquet
    file. The eval rows are its `test` split, or else the first rows of `split` (at most a tenth), held out."""
    import datasets

    datasets.disable_progress_bars()
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
    if split not in data:
        sys.exit(f"error: dataset {name!r} has the splits {list(data)}; pass one of them as --dataset-split")
    rows = list(data[split])
    if "test" in data and split != "test":
        return rows, list(data["test"])[:eval_size]
    n_eval = min(eval_size, len(rows) // 10)
    return rows[n_eval:], rows[:n_eval]


def get_lr(step, lr, warmup_steps, max_steps, decay):
    """Learning rate of optimizer step `step` = 0, 1, ...: `lr` × a linear warmup min(1, (step + 1) / warmup_steps)
    × a decay to 0 at `max_steps`: "linear", min(1, (max_steps − step) / (max_steps − warmup_steps)), flat through
    the warmup; or "cosine", ½(1 + cos(π · step / max_steps)), over the whole run."""
    warmup = min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    if decay == "linear":
        return lr * warmup * min(1.0, max(0.0, (max_steps - step) / max(1, max_steps - warmup_steps)))
    return lr * warmup * 0.5 * (1 + math.cos(math.pi * min(1.0, step / max_steps)))


def check_finite(step, **values):
    """Stop the run with one line, before anything is saved, when a loss or gradient norm is NaN or inf."""
    for name, value in values.items():
        value = float(torch.as_tensor(value).detach())
        if not math.isfinite(value):
            sys.exit(f"error: {name} is {value} at step {step}; stopped, nothing saved "
                     "(lower --lr; with a half-precision model, train without --bf16 to check)")


def save_atomically(model, tokenizer, args, output_dir):
    """Save a Hugging Face model (the one inside any DDP wrapper) so that a crash never leaves a half-written
    checkpoint: rank 0 writes to a temporary directory, then renames it. Every rank calls this: under FSDP
    they first gather the full weights together, and all wait for the write to finish."""
    state_dict = None
    if any(isinstance(module, FSDPModule) for module in model.modules()):
        state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        names = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
        state_dict = {k: v for k, v in state_dict.items() if k in names}  # a tied weight once, under its first name
    if not dist.is_initialized() or dist.get_rank() == 0:
        tmp_dir = f"{output_dir.rstrip('/')}.tmp-{os.getpid()}"
        model.save_pretrained(tmp_dir, state_dict=state_dict)
        tokenizer.save_pretrained(tmp_dir)
        with open(os.path.join(tmp_dir, "training_args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
        if os.path.exists(output_dir):
            shutil.rmtree(output_dir)
        os.replace(tmp_dir, output_dir)
    if dist.is_initialized():
        dist.barrier()


def collate(batch, pad_token_id):
    """Right-pad a list of (input_ids, labels): (input_ids, attention_mask, labels) tensors, labels −100 on padding."""
    width = max(len(ids) for ids, _ in batch)
    input_ids = torch.tensor([ids + [pad_token_id] * (width - len(ids)) for ids, _ in batch])
    attention_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in batch])
    labels = torch.tensor([labels + [-100] * (width - len(labels)) for _, labels in batch])
    return input_ids, attention_mask, labels


@torch.no_grad()
def sample(model, prompt_ids, pad_token_id, stop_ids, max_new_tokens, temperature=1.0, greedy=False):
    """Complete each prompt (lists of token ids, left-padded here) and cut each response after its first
    stop token. Returns (sequences, attention_mask, context_length, response_mask), response_mask 1 on
    response tokens up to and including the first stop token. Every sampling setting is explicit: the
    checkpoint's generation_config.json (repetition_penalty, min_new_tokens, top_k, ...) would otherwise
    fill the unset ones and sample from another distribution than the one whose log-probs are trained."""
    from transformers import GenerationConfig

    width = max(len(p) for p in prompt_ids)
    input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompt_ids], device=model.device)
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=model.device)
    model.generation_config = GenerationConfig(eos_token_id=stop_ids, pad_token_id=pad_token_id)
    config = GenerationConfig(do_sample=not greedy, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                              eos_token_id=stop_ids, pad_token_id=pad_token_id)
    # under torchrun every rank keeps stepping until all are done: a sharded model needs all ranks in each step
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                         synced_gpus=dist.is_initialized())
    responses = F.pad(out[:, width:], (0, max_new_tokens - (out.shape[1] - width)), value=pad_token_id)
    is_stop = torch.isin(responses, torch.tensor(stop_ids, device=responses.device))
    # 1 up to and including the first stop token: a token is valid while no stop token came strictly before it
    response_mask = ((is_stop.cumsum(1) - is_stop.long()) == 0).long()
    responses = responses.masked_fill(response_mask == 0, pad_token_id)
    return (torch.cat([input_ids, responses], 1), torch.cat([attention_mask, response_mask], 1), width, response_mask)


def decode(tokenizer, sequences, context_length, response_mask):
    """The responses as text, up to their stop token, special tokens dropped."""
    return [tokenizer.decode([t for t, m in zip(row, mask) if m], skip_special_tokens=True)
            for row, mask in zip(sequences[:, context_length:].tolist(), response_mask.tolist())]


# ---------------------------------------------------------------------------------------------
# Model, tokenizer, data
# ---------------------------------------------------------------------------------------------
def load_tokenizer(path, hint):
    """The tokenizer of a hub id or local directory. A local path that does not exist, or a checkpoint that
    cannot be read, is one line (`hint` says what to do about a missing directory)."""
    from transformers import AutoTokenizer

    if not os.path.isdir(path) and (path.startswith((".", "/", "~", "models/")) or path.count("/") > 1):
        sys.exit(f"error: model directory {path!r} does not exist; {hint}")
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        sys.exit(f"error: cannot load a tokenizer from {path!r}: {str(e).splitlines()[0]}")


def load_causal_lm(args, tokenizer, stop_ids, device):
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    if args.model_name_or_path is None:
        # 256 positions: room for longer prompts and responses in the later stages than --max-length here
        config = GPT2Config(vocab_size=len(tokenizer), n_positions=max(256, args.max_length), n_embd=args.n_embd,
                            n_layer=args.n_layer, n_head=args.n_head, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, bos_token_id=tokenizer.eos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        return GPT2LMHeadModel(config).to(device)
    try:
        # float32 master weights, whatever the checkpoint's dtype: in fp16 AdamW's eps underflows to 0, in
        # bf16 most small updates round away. --bf16 is the mixed-precision choice on top of this.
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
    except (OSError, ValueError) as e:
        sys.exit(f"error: cannot load a causal LM from {args.model_name_or_path!r}: {str(e).splitlines()[0]}")
    add_pad_token(tokenizer, stop_ids, model)
    model.config.pad_token_id = tokenizer.pad_token_id
    return model.to(device)


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
    train, evals = load_rows(args.dataset_name, args.dataset_split, args.eval_size)
    columns = sorted(train[0]) if train else []
    if not ({"prompt", "completion"} <= set(columns) or "text" in columns or "messages" in columns):
        sys.exit(f"error: dataset {args.dataset_name!r} has columns {columns}; sft.py accepts prompt+completion, "
                 "text, or messages")
    return train, evals


# ---------------------------------------------------------------------------------------------
# Many processes. `torchrun --nproc-per-node N X.py` starts one process (rank) per device; each takes
# its share of every batch, and the gradients are averaged. Under plain `python X.py` these helpers
# change nothing.
# ---------------------------------------------------------------------------------------------
def setup_distributed(cuda):
    """(rank, world_size, device). Under torchrun, which sets RANK, WORLD_SIZE and LOCAL_RANK, join the
    process group: NCCL with one GPU per process, or gloo on the CPU. Ranks other than 0 print nothing
    (their errors still reach stderr)."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() and cuda else "cpu")
    if torch.cuda.is_available() and cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    if dist.get_rank() != 0:
        sys.stdout = open(os.devnull, "w")
    return dist.get_rank(), dist.get_world_size(), device


def wrap_model(model, device, fsdp):
    """A trained model made data-parallel (the model itself in one process). Every rank first takes rank 0's
    weights: a model built from scratch, or a new scalar head, starts from other random values on each.
    Then DDP, a full copy per rank with the gradients averaged during the backward pass; or, with --fsdp,
    FSDP2: parameters, gradients and AdamW state sharded across the ranks, each transformer block gathered
    only while it computes. Build the optimizer after this (FSDP2 replaces the parameters)."""
    if not dist.is_initialized():
        return model
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)
    if not fsdp:
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    block_names = {name for module in model.modules() for name in getattr(module, "_no_split_modules", None) or []}
    for module in model.modules():
        if type(module).__name__ in block_names:
            fully_shard(module)
    return fully_shard(model)


def shard(items, rank, world_size):
    """This rank's share of an evaluation list, items[rank::world_size], padded with copies of items[0] to the
    same length on every rank, and a weight per entry (0 on the copies): a sharded model needs every rank in
    each forward pass, so every rank must run as many. Metrics are weighted sums, added up over the ranks."""
    mine = items[rank::world_size]
    padding = -(-len(items) // world_size) - len(mine)
    return mine + items[:1] * padding, [1] * len(mine) + [0] * padding


def all_reduce_sum(values, device):
    """Each number summed over the ranks (the numbers themselves in one process): per-rank sums and counts
    become global ones."""
    if not dist.is_initialized():
        return [float(v) for v in values]
    total = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return total.tolist()


class NoWriter:
    """Stands in for the SummaryWriter on ranks other than 0: only rank 0 writes TensorBoard logs."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def main(args: Args):
    rank, world_size, device = setup_distributed(args.cuda)
    if args.batch_size % (world_size * args.gradient_accumulation_steps):
        sys.exit(f"error: --batch-size {args.batch_size} does not split into {world_size} rank(s) × "
                 f"{args.gradient_accumulation_steps} micro-batches; make it a multiple of "
                 f"{world_size * args.gradient_accumulation_steps}")
    random.seed(args.seed)  # the data order: the same on every rank
    torch.manual_seed(args.seed + rank)  # sampling: a stream of its own on each rank
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    amp = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)  # noqa: E731

    # The tokenizer (fast, and it checks the model path), then the data, tokenized and checked before the model
    if args.model_name_or_path is None:
        from transformers import ByT5Tokenizer

        tokenizer = ByT5Tokenizer()  # a byte-level tokenizer needs no files; pad (0) differs from EOS (1)
    else:
        tokenizer = load_tokenizer(args.model_name_or_path, "pass an existing directory or a hub id")
    stop_ids = stop_token_ids(tokenizer)
    train_examples, eval_examples = load_examples(args)

    def tokenize_all(examples, split):
        """Examples that fit --max-length (a `text` example is cut to it); the others are dropped and counted."""
        kept, dropped = [], 0
        for ex in examples:
            ids, labels = tokenize(ex, tokenizer, stop_ids)
            if ex.get("text") is not None and ex.get("messages") is None and ex.get("completion") is None:
                ids, labels = ids[: args.max_length], labels[: args.max_length]
            if len(ids) > args.max_length or all(label == -100 for label in labels[1:]):
                dropped += 1
            else:
                kept.append((ids, labels))
        if dropped:
            print(f"{split}: dropped {dropped:,} of {len(examples):,} examples longer than --max-length {args.max_length} "
                  "or with nothing to learn")
        if not kept and split == "train":
            sys.exit(f"error: no training example fits --max-length {args.max_length} (see above); raise it")
        return kept

    train, evals = tokenize_all(train_examples, "train"), tokenize_all(eval_examples, "eval")
    builtin = args.dataset_name is None
    raw_model = load_causal_lm(args, tokenizer, stop_ids, device)  # the Hugging Face model: generate, save
    if args.gradient_checkpointing:
        raw_model.activation_checkpointing_enable({"use_reentrant": False})
    model = wrap_model(raw_model, device, args.fsdp)  # forward and backward passes

    run_name = f"{args.exp_name}__{args.seed}__{int(time.time())}"
    writer = SummaryWriter(f"runs/{run_name}") if rank == 0 else NoWriter()
    writer.add_text("hyperparameters", "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))
    print(f"{sum(p.numel() for p in raw_model.parameters()):,} parameters, {len(train):,} training examples")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    per_rank = args.batch_size // world_size
    micro_size = per_rank // args.gradient_accumulation_steps

    def evaluate(step):
        """Each rank evaluates its shard of the eval set; the sums are added up over the ranks."""
        model.eval()
        line = f"step {step}:"
        if evals:
            mine, weights = shard(evals, rank, world_size)
            mine = [(ids, labels if w else [-100] * len(labels)) for (ids, labels), w in zip(mine, weights)]
            total, count = 0.0, 0
            with torch.no_grad(), amp():
                for i in range(0, len(mine), args.eval_batch_size):
                    batch = mine[i : i + args.eval_batch_size]
                    input_ids, attention_mask, labels = (t.to(device) for t in collate(batch, tokenizer.pad_token_id))
                    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
                    total += sft_loss(logits, labels, num_items=1).item()  # the summed NLL of the batch
                    count += (labels[:, 1:] != -100).sum().item()
            total, count = all_reduce_sum([total, count], device)
            writer.add_scalar("eval/loss", total / count, step)
            line += f" eval/loss {total / count:.4f}"
        if builtin:
            mine, weights = shard(eval_examples, rank, world_size)
            prompts, targets = [ex["prompt"] for ex in mine], [ex["target"] for ex in mine]
            prompt_ids = [encode_prompt(tokenizer, p) for p in prompts]
            for name, greedy in (("", False), ("_greedy", True)):
                completions = []
                for i in range(0, len(prompt_ids), args.eval_batch_size):
                    with amp():
                        sequences, _, width, response_mask = sample(raw_model, prompt_ids[i : i + args.eval_batch_size],
                                                                    tokenizer.pad_token_id, stop_ids, args.max_new_tokens,
                                                                    greedy=greedy)
                    completions += decode(tokenizer, sequences, width, response_mask)
                if not greedy:
                    sampled = completions
                correct, score, n = all_reduce_sum([sum(w * (c == t) for c, t, w in zip(completions, targets, weights)),
                                                    sum(w * gold_score(c, t) for c, t, w in zip(completions, targets, weights)),
                                                    sum(weights)], device)
                accuracy, score = correct / n, score / n
                writer.add_scalar(f"eval/gold_accuracy{name}", accuracy, step)
                writer.add_scalar(f"eval/gold_score{name}", score, step)
                line += f", gold_accuracy{name} {accuracy:.3f}, gold_score{name} {score:.3f}"
            samples = "\n".join(f"    {p} {c!r} (target {t})" for p, c, t in zip(prompts[:8], sampled, targets))
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
        lr = get_lr(step - 1, args.lr, args.warmup_steps, args.max_steps, "cosine")
        for group in optimizer.param_groups:
            group["lr"] = lr

        tick, batch_loss = time.time(), 0.0
        for m in range(rank * per_rank, (rank + 1) * per_rank, micro_size):  # this rank's share, in micro-batches
            input_ids, attention_mask, labels = (t.to(device) for t in collate(batch[m : m + micro_size], tokenizer.pad_token_id))
            with amp():
                logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
            loss = sft_loss(logits, labels, num_items)
            # DDP and FSDP average the ranks' gradients; × world_size turns that into the sum over the whole batch
            (loss * world_size).backward()
            batch_loss += loss.item()
            tokens_seen += int(attention_mask.sum())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        check_finite(step, loss=batch_loss, grad_norm=grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model_time += time.time() - tick

        if step % 10 == 0:
            elapsed = time.time() - start_time
            batch_loss, all_tokens = all_reduce_sum([batch_loss, tokens_seen], device)
            writer.add_scalar("losses/loss", batch_loss, step)
            writer.add_scalar("train/grad_norm", float(grad_norm), step)
            writer.add_scalar("charts/learning_rate", lr, step)
            writer.add_scalar("charts/samples_per_second", step * args.batch_size / elapsed, step)
            writer.add_scalar("charts/tokens_per_second", all_tokens / elapsed, step)
            writer.add_scalar("charts/model_time_fraction", model_time / elapsed, step)
        if step % args.eval_every == 0 or step == args.max_steps:
            evaluate(step)

    elapsed = time.time() - start_time
    tokens_seen = all_reduce_sum([tokens_seen], device)[0]
    print(f"{args.max_steps * args.batch_size / elapsed:.0f} samples/s, {tokens_seen / elapsed:.0f} tokens/s, "
          f"{100 * model_time / elapsed:.0f}% of the time in forward/backward/optimizer, {elapsed:.0f} s in all")
    save_atomically(raw_model, tokenizer, args, args.output_dir)
    print(f"saved to {args.output_dir}")
    writer.close()


if __name__ == "__main__":
    try:
        main(tyro.cli(Args, description=__doc__))
    except SystemExit as e:  # under torchrun every rank stops on the same bad input: rank 0 alone says so
        if isinstance(e.code, str) and os.environ.get("RANK", "0") != "0":
            sys.exit(1)
        raise
    if dist.is_initialized():
        # Only now, with main's models freed: a DDP model that outlives the process group tears gloo down
        # while holding the GIL, which can deadlock with gloo's worker threads.
        gc.collect()
        dist.destroy_process_group()
