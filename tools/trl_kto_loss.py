"""kto.py against TRL 1.16's KTOTrainer on identical inputs (docs/kto.md). It runs in TRL's own virtual environment
(docs/scaling.md says how to make it), never in this repo's:

    TRL_PYTHON tools/trl_kto_loss.py

A tiny random Qwen2 policy and another as the reference (so that the log-ratios and the KL are not 0), TRL's
tokenizer-free inputs: 8 unpaired rows (5 desirable, 3 undesirable) of unequal lengths, one batch of 8. For each case
(loss type kto and apo_zero_unpaired; β 0.1 and 0.5; weights (1, 1) and (1.5, 0.8); the models swapped, so that the
KL estimate is clamped at 0 in one case and not in another): TRL's `KTOTrainer._compute_loss` on TRL's own batch
(its collator, its mismatched KL completions) against kto.py's completion_logprobs, kl_estimate and kto_loss on
the same tensors: the loss, its gradient with respect to every policy weight, the KL estimate and the logged rewards
and log-probs (TRL's kl, rewards/chosen, rewards/rejected, rewards/margins, logps/chosen, logps/rejected). Then the
data: kto.py's tokenization of each row (tokenize_pair) and its mismatched pairs against TRL's prompt_ids,
completion_ids and KL_completion_ids, and kto.py's weight_advice against TRL's warning on 1:4 data. Prints each case;
exits 1 if a number differs by more than 1e-5 (relative) or a token does."""
import logging
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import datasets  # noqa: E402
from lm_models import make_tokenizer  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from trl import KTOConfig, KTOTrainer  # noqa: E402

import kto  # noqa: E402

ROWS = [("sort 3141:", "1134", True), ("sort 92:", "29", True), ("sort 653589:", "355689", True),
        ("sort 27:", "72", False), ("sort 1618033:", "0113368", True), ("sort 44:", "44", True),
        ("sort 5772156:", "1255677", False), ("sort 8:", "", False)]


def model(seed, tokenizer):
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    return Qwen2ForCausalLM(config).float()


def trainer(policy, ref, tokenizer, rows, out, **options):
    dataset = datasets.Dataset.from_list([{"prompt": p, "completion": c, "label": y} for p, c, y in rows])
    config = KTOConfig(out, per_device_train_batch_size=8, report_to=[], use_cpu=True, bf16=False,
                       dataset_num_proc=None, **options)
    return KTOTrainer(model=policy, ref_model=ref, args=config, train_dataset=dataset, processing_class=tokenizer)


def relative(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()


def main():
    datasets.disable_progress_bars()
    logging.getLogger("trl.trainer.kto_trainer").setLevel(logging.ERROR)  # its warning on these 5:3 rows
    tokenizer, worst, cases = make_tokenizer("pad_is_eos"), 0.0, 0
    out = tempfile.mkdtemp()
    for loss_type in ("kto", "apo_zero_unpaired"):
        for beta, weights, swap in ((0.1, (1.0, 1.0), False), (0.5, (1.5, 0.8), False), (0.5, (1.5, 0.8), True)):
            policy, ref = model(1, tokenizer), model(2, tokenizer)
            if swap:
                policy, ref = ref, policy
            t = trainer(policy, ref, tokenizer, ROWS, out, loss_type=loss_type, beta=beta, desirable_weight=weights[0],
                        undesirable_weight=weights[1])
            if loss_type == "kto":
                data = t.train_dataset  # with the mismatched completions (apo_zero_unpaired has none)
            batch = next(iter(t.get_train_dataloader()))
            t.model.train()
            theirs = t._compute_loss(t.model, batch, False)
            theirs.backward()
            their_grads = [p.grad.clone() for p in t.model.parameters()]
            t.model.zero_grad()
            metrics = {k: v[-1] for k, v in t._metrics["train"].items()}

            def logps_of(m, prefix="", batch=batch):
                labels = batch[f"{prefix}input_ids"].masked_fill(batch[f"{prefix}completion_mask"] == 0, -100)
                return kto.completion_logprobs(m, batch[f"{prefix}input_ids"], batch[f"{prefix}attention_mask"], labels)

            desirable = batch["label"].bool()
            with torch.no_grad():
                ref_logps = logps_of(t.ref_model)
                kl = (kto.kl_estimate(logps_of(t.model, "KL_"), logps_of(t.ref_model, "KL_")) if loss_type == "kto"
                      else torch.zeros(()))
            logps = logps_of(t.model)
            ours, rewards = kto.kto_loss(logps, ref_logps, desirable, kl, beta, *weights, loss_type)
            ours.backward()
            our_grads = [p.grad for p in t.model.parameters()]
            logged = {"kl": kl, "rewards/chosen": rewards[desirable].mean(), "rewards/rejected": rewards[~desirable].mean(),
                      "rewards/margins": rewards[desirable].mean() - rewards[~desirable].mean(),
                      "logps/chosen": logps[desirable].mean(), "logps/rejected": logps[~desirable].mean()}
            diffs = {"loss": relative(ours.item(), theirs.item()),
                     "gradient": max(relative(a, b) for a, b in zip(our_grads, their_grads))}
            for name, value in logged.items():  # a KL clamped at 0 compares absolutely
                diffs[name] = abs(value.item() - metrics[name]) if metrics[name] == 0 else relative(value.item(), metrics[name])
            worst, cases = max(worst, *diffs.values()), cases + 1
            print(f"{loss_type} β {beta} λ {weights}{' swapped' if swap else ''}: loss {ours.item():.7f} (TRL "
                  f"{theirs.item():.7f}), kl {kl.item():.5f} (TRL {metrics['kl']:.5f}); largest relative difference "
                  + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    # the data: kto.py's tokens of each row, and of its mismatched pairs, against TRL's dataset
    stop_ids = kto.stop_token_ids(tokenizer)
    examples = [(*kto.tokenize_pair(tokenizer, p, c, stop_ids), y, None) for p, c, y in ROWS]
    same = sum([p, c] == [a, b] for (p, c, _, _), a, b in zip(examples, data["prompt_ids"], data["completion_ids"]))
    rotated = [c for _, c in kto.mismatched_pairs(examples)] == data["KL_completion_ids"]
    print(f"tokens: {same} of {len(ROWS)} rows the same prompt and completion ids; mismatched completions the same: "
          f"{rotated}")
    # TRL's warning on 1:4 data (8 desirable, 2 undesirable) against weight_advice's ranges
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("trl.trainer.kto_trainer").setLevel(logging.WARNING)
    logging.getLogger("trl.trainer.kto_trainer").addHandler(handler)
    unbalanced = [(p, c, True) for p, c, _ in ROWS] + [(p, c, False) for p, c, _ in ROWS[:2]]
    trainer(model(1, tokenizer), model(2, tokenizer), tokenizer, unbalanced, out)
    ours = kto.weight_advice(8, 2, 1.0, 1.0)
    theirs = " ".join(r.getMessage() for r in records)
    advice = "[0.25, 0.33]" in ours and "[3.01, 4.0]" in ours and "[0.25, 0.33]" in theirs and "[3.01, 4.0]" in theirs
    print(f"weight advice on 8:2: the same ranges: {advice} ({ours})")
    print(f"{cases} loss cases, largest relative difference {worst:.1e}")
    sys.exit(0 if worst < 1e-5 and same == len(ROWS) and rotated and advice else 1)


if __name__ == "__main__":
    main()
